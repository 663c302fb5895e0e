"""Seconds per ES iteration, full-parameter ES against LoRA-ES, one member at a time and population-
batched, side by side in one process (issue 11). Whole `esft train` runs (benchmarks/lora_es.py) give
the accuracy; their wall times swing with the shared machine's load, so the speed comparison is made
here: the four paths alternate round by round on the same prompts and member seeds, and each
iteration (evaluate the population on Countdown, shape, update) is timed on this process's CPU clock
with one torch thread (barely disturbed by other jobs) and on the wall clock.

    OMP_NUM_THREADS=1 python benchmarks/lora_speed.py --rounds 3                  # forced 64-token completions
    OMP_NUM_THREADS=1 python benchmarks/lora_speed.py --rounds 3 --natural-lengths  # completions end at EOS
    OMP_NUM_THREADS=1 python benchmarks/lora_speed.py --model 30m --batch 16 --max-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import build_model, scratch_directory  # noqa: E402

PATHS = {  # label: (LoRA?, noise, population batching)
    "full, sequential iid": (False, "iid", False),
    "full, batched lowrank r=1": (False, "lowrank", True),
    "LoRA r=4, sequential iid": (True, "iid", False),
    "LoRA r=4, batched iid": (True, "iid", True),
}


def build(lora: bool, args):
    from esft.settings.config import ESConfig
    from esft.engines.lora import lora_engine
    from esft.engines.transformers_engine import TransformersEngine

    model, tokenizer, _ = build_model(args.model, scratch_directory("esft-lora-speed-"))
    options = {"trainable": None, "noise": "iid", "max_tokens": args.max_tokens, "mini_batch_size": None}
    if lora:
        return lora_engine(ESConfig(lora_r=4, device="cpu"), model, tokenizer, options)
    return TransformersEngine(model, tokenizer, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="embedded, 30m (benchmarks/throughput_tools.py) or a directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batched-mini-batch-size", type=int, default=8, help="prompts per batched call (× population rows)")
    parser.add_argument("--sigma-full", type=float, default=1e-3, help="σ of full-parameter ES (the demo's)")
    parser.add_argument("--sigma-lora", type=float, default=3e-3, help="σ of LoRA-ES (the best of the sweep)")
    parser.add_argument("--natural-lengths", action="store_true", help="completions end at EOS (default: forced to --max-tokens)")
    args = parser.parse_args()

    import torch

    from esft.es.strategies.base import ESState
    from esft.es.strategies.paper import STRATEGY as PAPER
    from esft.es.batches import prompt_batch
    from esft.executors import LocalExecutor
    from esft.rewards.runner import RewardRunner
    from esft.tasks.countdown_task import make_countdown_task

    torch.set_num_threads(1)
    task = make_countdown_task(seed=0, difficulty="easy")
    rewards = RewardRunner(task.reward_funcs, task.reward_weights, sandbox=False)
    batch = prompt_batch(task.train_dataset, 0, args.batch, 0)
    engines = {lora: build(lora, args) for lora in (False, True)}
    for engine in engines.values():
        if not args.natural_lengths:
            engine.min_new_tokens = args.max_tokens  # benchmark only: every completion is max_tokens long
        engine.generate(batch.prompts[:1])  # warm-up
    results: dict[str, list[tuple[float, float, int]]] = {label: [] for label in PATHS}
    for round_index in range(args.rounds):
        for label, (lora, noise, batched) in PATHS.items():
            engine = engines[lora]
            engine.noise, engine.mini_batch_size = noise, args.batched_mini_batch_size if batched else None
            sigma = args.sigma_lora if lora else args.sigma_full
            executor = LocalExecutor(engine, rewards.score, population_batching=batched, overlap_rewards=False)
            state = ESState(0, round_index)
            wall, cpu = time.perf_counter(), time.process_time()
            seeds = PAPER.ask(state, args.population)
            members = executor.evaluate_population(seeds, batch, sigma)
            _, coefficients = PAPER.tell(state, [m.reward for m in members], sigma / 2)
            executor.update(seeds, coefficients)
            results[label].append((time.process_time() - cpu, time.perf_counter() - wall, sum(m.num_tokens for m in members)))
    lengths = "natural lengths" if args.natural_lengths else f"forced {args.max_tokens}-token completions"
    print(f"{args.model} model, N = {args.population} × {args.batch} prompts, {lengths}, σ = {args.sigma_full} (full) / {args.sigma_lora} (LoRA); "
          f"batched: {args.batched_mini_batch_size} prompts × N rows per call; sequential: {args.batch} rows per call; "
          f"median of {args.rounds} alternating rounds")
    print("| path | CPU s / iteration | wall s / iteration | tokens / iteration | tokens per CPU-s |")
    print("| --- | --- | --- | --- | --- |")
    for label, rows in results.items():
        cpu, wall, tokens = (statistics.median(column) for column in zip(*rows))
        print(f"| {label} | {cpu:.2f} | {wall:.2f} | {tokens:.0f} | {tokens / cpu:.0f} |")


if __name__ == "__main__":
    main()
