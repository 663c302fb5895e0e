"""Why full-rank population batching stores each Linear's member weights as (N, in, out) (issue 15).

`torch.bmm(x, W.transpose(1, 2))` on a stack W of (N, out, in) weights against `torch.bmm(x, Wt)` with
the same weights stored (N, in, out), side by side on one thread: a decoding step's shapes (N members ×
32 rows each) for the embedded model's projections. Prints milliseconds per product (best of 5
rounds) and the ratio.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--shapes", default="512x128,128x512,128x128", help="out x in of each weight")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"| weight (out × in) | bmm with W.transpose(1, 2) ms | bmm with (N, in, out) storage ms | ratio |")
    print("| --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        out_features, in_features = map(int, shape.split("x"))
        weights = torch.randn(args.members, out_features, in_features)
        stored = weights.transpose(1, 2).contiguous()
        x = torch.randn(args.members, args.rows, in_features)
        assert torch.allclose(torch.bmm(x, weights.transpose(1, 2)), torch.bmm(x, stored), atol=1e-5)
        view = best_ms(lambda: torch.bmm(x, weights.transpose(1, 2)))
        contiguous = best_ms(lambda: torch.bmm(x, stored))
        print(f"| {out_features} × {in_features} | {view:.3f} | {contiguous:.3f} | {view / contiguous:.2f}× |")


if __name__ == "__main__":
    main()
