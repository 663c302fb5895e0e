"""`esft train` with glibc's own malloc behaviour vs the settings it makes at start (esft.allocator).

Rounds alternate three sides, each a whole `esft train` subprocess on the embedded model (the demo
preset unless --train-args says otherwise, --iterations 6, 20 held-out problems); a side's figure is the
median of `perf/iteration_s` in its metrics.jsonl and its peak RSS, and each ratio is the median over
rounds of (side / esft train's), printed with its spread and the load. The other sides are set through
MALLOC_*_ environment variables, which esft reads as the user's choice and leaves alone:
  glibc's own     MALLOC_ARENA_MAX at glibc's default (8 per core): every threshold dynamic
  mmap > 32 MiB   what esft set until 2026-11-26: blocks above 32 MiB mmap'd, no trimming, 256 MiB top pad
  esft train      heap only: no block mmap'd, no trimming, 256 MiB top pad

    python benchmarks/allocator_speed.py --rounds 3
    python benchmarks/allocator_speed.py --rounds 3 --train-args "--noise iid"   # ESConfig's full-rank noise
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import cpu_description, format_ratio, load_average, ratio_summary  # noqa: E402

from esft import allocator  # noqa: E402

ESFT = [sys.executable, "-m", "esft.cli"]


SIDES = {
    "glibc's own": {"MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1))},
    # esft's own trim threshold and top pad, so the two sides differ only in what is mmap'd
    "mmap > 32 MiB": {"MALLOC_MMAP_THRESHOLD_": str(32 * allocator.MIB),
                      **{name: str(value) for name, value in allocator.SETTINGS.items() if name != "MALLOC_MMAP_MAX_"}},
    "esft train": {},
}


def seconds_per_iteration(extra_env: dict[str, str], iterations: int, train_args: list[str]):
    """One `esft train`: (median seconds per iteration from its metrics, wall seconds, and the child's
    resource usage: its peak RSS, page faults and kernel seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra_env
    with tempfile.TemporaryDirectory(prefix="esft-alloc-") as out:
        start = time.perf_counter()
        with open(Path(out) / "stderr.txt", "w+") as stderr:
            command = subprocess.Popen([*ESFT, "train", "--iterations", str(iterations), "--eval-size", "20",
                                        "--logging", "none", "--output-dir", str(Path(out) / "run"), *train_args],
                                       env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(command.pid, 0)  # this child's own peak RSS
            command.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - start
            if command.returncode != 0:
                stderr.seek(0)
                raise SystemExit(f"esft train failed (exit {command.returncode}):\n{stderr.read()[-2000:]}")
        rows = [json.loads(line) for path in Path(out).rglob("metrics.jsonl") for line in path.read_text().splitlines()]
    per_iteration = [row["perf/iteration_s"] for row in rows if "perf/iteration_s" in row]
    if not per_iteration:
        raise SystemExit("esft train wrote no perf/iteration_s: nothing to compare")
    return statistics.median(per_iteration), wall, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the ratio: their median)")
    parser.add_argument("--iterations", type=int, default=6, help="ES iterations per esft train run")
    parser.add_argument("--train-args", default="", help="more `esft train` arguments, e.g. \"--noise iid\"")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in SIDES}
    for round_index in range(args.rounds):
        for name, env in SIDES.items():
            per_iteration, wall, usage = seconds_per_iteration(env, args.iterations, shlex.split(args.train_args))
            seconds[name].append(per_iteration)
            print(f"round {round_index + 1}: {name}: {per_iteration:.2f} s per iteration, {wall:.1f} s wall, "
                  f"peak RSS {usage.ru_maxrss / 1024:,.0f} MiB, {usage.ru_minflt:,} page faults, "
                  f"{usage.ru_stime:.1f} s in the kernel", flush=True)
    print()
    for name in list(SIDES)[:-1]:
        ratio = ratio_summary([a / b for a, b in zip(seconds[name], seconds["esft train"])])
        print(f"{name} / esft train's settings, s per iteration: {format_ratio(ratio)}")
    print(f"{load_average()}; {cpu_description()}, {os.cpu_count()} cores; esft train {args.train_args or '(demo preset)'}")


if __name__ == "__main__":
    main()
