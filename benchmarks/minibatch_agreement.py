"""Do a row's greedy tokens depend on which rows share its generate call? (issue 15)

Population batching splits an iteration's prompts into mini-batches of prompts × all members. This
script generates the demo's first iterations (embedded model, demo preset noise, N = 30, 32 prompts,
64 tokens) batched with several mini-batch sizes and member by member, and prints how many tokens
differ from the sequential path. Without the padding column TransformersEngine now puts on every row,
a mini-batch whose prompts had equal lengths ran without padding, took another attention kernel, and
some rows' tokens changed (mini-batch 4 against 8 or 17). With --noise iid the batched path is
full-rank population batching (each member's own weights, members in groups of 16 at 32 prompts).

    OMP_NUM_THREADS=1 python benchmarks/minibatch_agreement.py --iterations 3 --sizes 4,8,17
    OMP_NUM_THREADS=1 python benchmarks/minibatch_agreement.py --iterations 3 --sizes 4,8,32 --noise iid
"""

from __future__ import annotations

import argparse

import torch

from esft.es.strategies.base import ESState
from esft.es.strategies.paper import STRATEGY as PAPER
from esft.es.batches import prompt_batch
from esft.settings.config import embedded_model_path
from esft.engines.population import generate_population
from esft.engines.transformers_engine import TransformersEngine
from esft.tasks.countdown_task import make_countdown_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--sizes", default="4,8,17", help="mini-batch sizes (prompts per call), comma-separated")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--noise", default="lowrank", choices=["lowrank", "iid"], help="the demo preset's, or the paper's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = TransformersEngine.from_pretrained(str(embedded_model_path()), device="cpu", noise=args.noise, rank=1,
                                                max_tokens=64)
    task = make_countdown_task(seed=0)
    differing_total = 0
    for iteration in range(args.iterations):
        prompts = prompt_batch(task.train_dataset, 0, args.prompts, iteration).prompts
        seeds = PAPER.ask(ESState(0, iteration), args.population)
        sequential = []
        for seed in seeds:
            engine.perturb(seed, 1e-3)
            sequential.append(engine.generate(prompts).token_ids)
            engine.restore()
        for size in (int(s) for s in args.sizes.split(",")):
            batched = generate_population(engine, prompts, seeds, 1e-3, mini_batch_size=size)
            differing = sum(a != b for generation, expected in zip(batched, sequential)
                            for a, b in zip(generation.token_ids, expected))
            differing_total += differing
            print(f"iteration {iteration}: mini-batch {size}: {differing} of {len(seeds) * len(prompts)} rows differ "
                  "from the sequential path")
    print(f"rows differing in all: {differing_total}")


if __name__ == "__main__":
    main()
