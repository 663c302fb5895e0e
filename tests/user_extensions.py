"""A user's own file, as docs/architecture.md's walkthroughs write it: a reward shaping and an engine,
registered here, then `esft train` with them from the same script:

    python tests/user_extensions.py train --engine counting --reward-shaping sign ...
"""

from __future__ import annotations

import sys

import numpy as np

from esft.engines.registry import EngineSpec, register_engine
from esft.engines.transformers_engine import TransformersEngine
from esft.es.fitness import Fitness
from esft.es.shaping import register_shaping
from esft.es.shaping.base import Shaping


def sign(fitness: Fitness) -> np.ndarray:
    """+1 for a member above the median fitness, -1 below, 0 at it."""
    return np.sign(fitness.member - np.median(fitness.member))


register_shaping(Shaping("sign", sign, "+1 above the median fitness, -1 below"))


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
