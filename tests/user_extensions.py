"""A user's own file, as docs/architecture.md's walkthroughs write it: a reward shaping, a strategy and an
engine, registered here, then `esft train` with them from the same script:

    python tests/user_extensions.py train --engine counting --reward-shaping sign --strategy elite ...
"""

from __future__ import annotations

import sys

import numpy as np

from esft.engines.registry import EngineSpec, register_engine
from esft.engines.transformers_engine import TransformersEngine
from esft.es.fitness import Fitness
from esft.es.shaping import register_shaping
from esft.es.shaping.base import Shaping
from esft.es.strategies import register_strategy
from esft.es.strategies.base import Strategy


def sign(fitness: Fitness) -> np.ndarray:
    """+1 for a member above the mean fitness, -1 below, 0 at it."""
    return np.sign(fitness.member - fitness.member.mean())


register_shaping(Shaping("sign", sign, "+1 above the mean fitness, -1 below"))


class Elite(Strategy):
    """The paper's seeds and coefficients, but only the better half of the members (by fitness; ties: the
    earlier member) moves the weights, in fewer noise draws."""

    name = "elite"
    summary = "the paper's rule, the update over the better half of the members only"

    def tell(self, state, fitness, alpha, shaping="zscore"):
        state, coefficients = super().tell(state, fitness, alpha, shaping)
        member = np.asarray(fitness.member if isinstance(fitness, Fitness) else fitness)
        kept = set(np.argsort(-member, kind="stable")[: len(member) // 2].tolist())
        if state.iteration == 1:
            print(f"elite strategy: members {sorted(kept)} of {len(member)} move the weights", file=sys.stderr)
        return state, [c if i in kept else 0.0 for i, c in enumerate(coefficients)]

    def update_terms(self, member_seeds, coefficients):
        seeds, coefficients = super().update_terms(member_seeds, coefficients)
        return [s for s, c in zip(seeds, coefficients) if c], [c for c in coefficients if c]


register_strategy(Elite())


class CountingEngine(TransformersEngine):
    """esft's transformers engine, counting its generate calls (and saying so at the first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def generate(self, prompts, mini_batch_size=None, sampling=None):
        self.calls += 1
        if self.calls == 1:
            print("counting engine: first generate call", file=sys.stderr)
        return super().generate(prompts, mini_batch_size, sampling)


def load(args, path, options):
    return CountingEngine.from_pretrained(path, dtype=args.dtype, device=args.device, rank=args.rank, **options)


register_engine(EngineSpec("counting", "esft's transformers engine, counting its generate calls", load,
                           batches_lowrank=False, batches_fullrank=False))

if __name__ == "__main__":
    from esft.cli import main

    sys.exit(main())
