"""`esft train` with glibc's own malloc behaviour vs the fixed thresholds it sets at start (esft.allocator).

Rounds alternate the two sides, each a whole `esft train` subprocess on the embedded model (the demo
preset, --iterations 6, 20 held-out problems); a side's figure is the median of `perf/iteration_s` in
its metrics.jsonl, and the ratio is the median over rounds of (glibc's own / fixed), printed with its
spread and the load. "glibc's own" sets MALLOC_ARENA_MAX to glibc's default (8 per core), which esft
reads as the user's choice and so leaves every threshold at glibc's dynamic defaults.

    python benchmarks/allocator_speed.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import cpu_description, format_ratio, load_average, ratio_summary  # noqa: E402

ESFT = [sys.executable, "-m", "esft.cli"]


def seconds_per_iteration(extra_env: dict[str, str], iterations: int) -> tuple[float, float]:
    """One `esft train`: (median seconds per iteration from its metrics, wall seconds of the command)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra_env
    with tempfile.TemporaryDirectory(prefix="esft-alloc-") as out:
        start = time.perf_counter()
        subprocess.run([*ESFT, "train", "--iterations", str(iterations), "--eval-size", "20", "--logging", "none",
                        "--output-dir", out], env=env, check=True, capture_output=True)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for path in Path(out).rglob("metrics.jsonl") for line in path.read_text().splitlines()]
    per_iteration = [row["perf/iteration_s"] for row in rows if "perf/iteration_s" in row]
    if not per_iteration:
        raise SystemExit("esft train wrote no perf/iteration_s: nothing to compare")
    return statistics.median(per_iteration), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the ratio: their median)")
    parser.add_argument("--iterations", type=int, default=6, help="ES iterations per esft train run")
    args = parser.parse_args()
    sides = {"glibc's own": {"MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1))}, "fixed (esft train)": {}}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name, env in sides.items():
            per_iteration, wall = seconds_per_iteration(env, args.iterations)
            seconds[name].append(per_iteration)
            print(f"round {round_index + 1}: {name}: {per_iteration:.2f} s per iteration, {wall:.1f} s wall")
    own, fixed = seconds.values()
    ratio = ratio_summary([a / b for a, b in zip(own, fixed)])
    print(f"\nglibc's own / fixed thresholds, s per iteration: {format_ratio(ratio)}; {load_average()}; "
          f"{cpu_description()}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
