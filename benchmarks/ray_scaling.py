"""Ray executor scaling: the same ES configuration with 1 and then 2 workers, in one run.

Prints the mean seconds per ES iteration (evaluate N members + update + checksum check), and of
that the member evaluation, for each worker count, and the ratio t(1 worker) / t(2 workers)
(2.0 = perfect scaling). Model: a ~3M-parameter Llama built from a config (no download),
transformers engine, 1 CPU per actor. First, a control without Ray: the same matmul work in 1 and
in 2 concurrent processes, which tells how much of a second core the machine really has free
(shared machines often do not).

    python benchmarks/ray_scaling.py [--population 8] [--batch 16] [--tokens 32] [--iterations 3] [--engine transformers|vllm]
                                     [--population-batching]   (low-rank noise, each actor batches its share)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _matmuls(_: int) -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    started = time.perf_counter()
    for _ in range(2000):
        a @ a
    return time.perf_counter() - started


def cpu_parallelism() -> float:
    """Control without Ray: the same fixed work in 1 process, then in 2 processes at once; returns
    the throughput ratio (2.0 when two cores are really free, ~1.0 when other load takes one)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_matmuls, [0, 1])  # warm-up (imports)
        alone = pool.apply(_matmuls, (0,))
        started = time.perf_counter()
        pool.map(_matmuls, [0, 1])
        together = time.perf_counter() - started
    return 2 * alone / together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--population-batching", action="store_true",
                        help="--noise lowrank --rank 1 --population-batching (transformers engine)")
    args = parser.parse_args()

    import ray

    from esft.es.strategies.base import ESState
    from esft.es.strategies.paper import STRATEGY as PAPER
    from esft.settings.config import ESConfig
    from esft.executors import ExecutorSettings
    from esft.executors.ray_executor import RayExecutor
    from esft.tasks.base import Task
    from esft.es.batches import prompt_batch
    from tiny_model import build_tiny_model
    from toy_task import byte_reward, toy_rows

    print(json.dumps({"control_cpu_parallelism": round(cpu_parallelism(), 2)}), flush=True)
    ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=4)
        task = Task("toy", toy_rows(200), {}, [byte_reward])
        for workers in args.workers:
            config = ESConfig(model=str(path), executor="ray", workers=workers, engine=args.engine, device="cpu",
                              population_size=args.population, batch_size=args.batch, max_tokens=args.tokens,
                              sigma=1e-3, reward_sandbox=False, logging="none", progress=False, max_model_len=512,
                              **(dict(noise="lowrank", rank=1, population_batching=True) if args.population_batching else {}))
            executor = RayExecutor(ExecutorSettings.of(config), task, str(path))
            elapsed, evaluating = [], []
            for iteration in range(args.iterations + 1):
                started = time.perf_counter()
                state = ESState(0, iteration)
                seeds = PAPER.ask(state, args.population)
                members = executor.evaluate_population(seeds, prompt_batch(task.train_dataset, 0, args.batch, iteration),
                                                        config.sigma)
                evaluated = time.perf_counter() - started
                _, coefficients = PAPER.tell(state, [m.reward for m in members], config.alpha)
                executor.update(seeds, coefficients)
                if iteration:  # the first one warms up
                    elapsed.append(time.perf_counter() - started)
                    evaluating.append(evaluated)
            times[workers] = sum(elapsed) / len(elapsed)
            print(json.dumps({"workers": workers, "s_per_iteration": round(times[workers], 3),
                              "s_evaluating_members": round(sum(evaluating) / len(evaluating), 3),
                              "members_per_actor": [slot.members for slot in executor.slots]}), flush=True)
            executor.close()
    ray.shutdown()
    if 1 in times and 2 in times:
        print(f"iteration time ratio t(1 worker)/t(2 workers) = {times[1] / times[2]:.2f}")


if __name__ == "__main__":
    main()
