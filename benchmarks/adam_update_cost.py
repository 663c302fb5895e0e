"""The cost of --optimizer adam in the ES update (issue 22): seconds per `engine.update` (one iteration's
update, N members), sgd vs adam, with low-rank noise (sgd: one in-place addmm per matrix; adam: the
same matmul into a dense scratch, then Adam's elementwise step) and with full-rank noise (both
regenerate every member's noise; adam adds the elementwise step). Median of --repeats updates each,
after one warm-up; the machine's load average is printed with the figures.

    OMP_NUM_THREADS=1 python benchmarks/adam_update_cost.py --model embedded --model 30m --population 30 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from throughput_tools import build_model  # noqa: E402

ADAM = dict(kind="adam", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def seconds_per_update(model, tokenizer, noise: str, optimizer: dict | None, population: int, repeats: int) -> float:
    from esft.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model, tokenizer, noise=noise, rank=1, optimizer=optimizer)
    seeds = list(range(1000, 1000 + population))
    coefficients = [((-1) ** i) * 1e-4 for i in range(population)]
    engine.update(seeds, coefficients, learning_rate=1e-4)  # warm-up (adam: its state is allocated here)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.update(seeds, coefficients, learning_rate=1e-4)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="embedded, 30m or a directory (repeatable)")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--noise", action="append", default=None, help="lowrank and/or iid (default both)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model or ["embedded", "30m"]:
            model, tokenizer, description = build_model(name, Path(tmp))
            trainable = sum(p.numel() for p in model.parameters())
            print(f"{name}: {description}, {trainable / 1e6:.2f}M parameters (adam state {8 * trainable / 2**20:.1f} MiB)")
            for noise in args.noise or ["lowrank", "iid"]:
                sgd = seconds_per_update(model, tokenizer, noise, None, args.population, args.repeats)
                adam = seconds_per_update(model, tokenizer, noise, ADAM, args.population, args.repeats)
                print(f"  {noise:8s} N={args.population}: sgd {sgd * 1e3:8.1f} ms  adam {adam * 1e3:8.1f} ms  "
                      f"(+{(adam - sgd) * 1e3:.1f} ms, x{adam / sgd:.2f})", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
