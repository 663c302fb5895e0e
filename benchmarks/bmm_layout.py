"""Layouts and copies the population hooks depend on, side by side on one thread (issues 15 and 23).

Three tables, milliseconds per call (best of 5 rounds) and the ratio:
  full-rank  `torch.bmm(x, W.transpose(1, 2))` on a stack W of (N, out, in) weights against `torch.bmm(x, Wt)`
             with the same weights stored (N, in, out): why full-rank batching stores each Linear's member
             weights as (N, in, out); a decoding step's shapes (N members × 32 rows each).
  strides    the low-rank product x_m·B_m at rank 1 (left factor (N, 1, in) against the rows transposed) with
             the strides `.contiguous()` leaves on a transposed (N, in, 1) factor, (in, 1, 1), against a fresh
             tensor's (in, in, 1) (esft.engines.shared_product.standard_strides): the same values, another
             kernel; at a decoding step's and a prefill's rows per member.
  gathers    copying the rows still running after a drop: indexing with a tensor (`t[rows]`) against
             `index_select`, for a member's factor per row (population hooks) and for a decoding cache's live
             positions (esft.engines.decoding: the whole buffer indexed against its live part selected into a
             new buffer).

    OMP_NUM_THREADS=1 python benchmarks/bmm_layout.py
"""

from __future__ import annotations

import argparse
import time

import torch


def best_ms(function, repeats: int = 20, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            function()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e3


def row(label: str, slow: float, fast: float) -> None:
    print(f"| {label} | {slow:.3f} | {fast:.3f} | {slow / fast:.2f}× |")


def full_rank(args) -> None:
    print("\n| weight (out × in) | bmm with W.transpose(1, 2) ms | bmm with (N, in, out) storage ms | ratio |")
    print("| --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        out_features, in_features = map(int, shape.split("x"))
        weights = torch.randn(args.members, out_features, in_features)
        stored = weights.transpose(1, 2).contiguous()
        x = torch.randn(args.members, args.rows, in_features)
        assert torch.allclose(torch.bmm(x, weights.transpose(1, 2)), torch.bmm(x, stored), atol=1e-5)
        row(f"{out_features} × {in_features}", best_ms(lambda: torch.bmm(x, weights.transpose(1, 2))),
            best_ms(lambda: torch.bmm(x, stored)))


def strides(args) -> None:
    print("\n| rank-1 product: rows per member × in | strides (in, 1, 1) ms | strides (in, in, 1) ms | ratio |")
    print("| --- | --- | --- | --- |")
    for rows in (args.rows, 800):
        for in_features in (128, 512):
            factor = torch.randn(args.population, in_features, 1).transpose(1, 2).contiguous()  # strides (in, 1, 1)
            fresh = factor.clone(memory_format=torch.contiguous_format)  # strides (in, in, 1)
            assert factor.stride() != fresh.stride() and torch.equal(factor, fresh)
            x = torch.randn(args.population, rows, in_features).transpose(1, 2)
            repeats = 20 if rows < 100 else 3
            row(f"{rows} × {in_features}", best_ms(lambda: torch.bmm(factor, x), repeats),
                best_ms(lambda: torch.bmm(fresh, x), repeats))


def gathers(args) -> None:
    print("\n| copy of the running rows | indexing ms | index_select ms | ratio |")
    print("| --- | --- | --- | --- |")
    calls = args.population * args.rows
    generator = torch.Generator().manual_seed(0)
    for kept in (calls * 11 // 20, calls // 7):
        rows = torch.sort(torch.randperm(calls, generator=generator)[:kept])[0]
        members = torch.div(rows, args.rows, rounding_mode="floor")
        for width in (128, 512):
            factor = torch.randn(args.population, 1, width)
            row(f"factor per row: {kept} rows × {width}", best_ms(lambda: factor[members]),
                best_ms(lambda: factor.index_select(0, members)))
        cache = torch.randn(calls, 89, 4, 32)  # the demo's cache: prompt 25 + 64 new tokens, 4 heads × 32
        for live in (50, 88):
            def select_live():
                kept_rows = cache.new_empty((len(rows),) + tuple(cache.shape[1:]))
                return torch.index_select(cache[:, :live], 0, rows, out=kept_rows[:, :live])

            row(f"cache: {kept} of {calls} rows, {live} of 89 positions live", best_ms(lambda: cache[rows], 3),
                best_ms(select_live, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=16, help="members of the full-rank table")
    parser.add_argument("--population", type=int, default=30, help="members of the strides and gathers tables")
    parser.add_argument("--rows", type=int, default=32, help="rows per member at a decoding step")
    parser.add_argument("--shapes", default="512x128,128x512,128x128", help="out x in of each weight (full-rank)")
    parser.add_argument("--tables", default="full-rank,strides,gathers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tables = {"full-rank": full_rank, "strides": strides, "gathers": gathers}
    for name in args.tables.split(","):
        tables[name](args)


if __name__ == "__main__":
    main()
