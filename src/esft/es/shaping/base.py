"""What a reward shaping is (esft.es.shaping lists them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from esft.es.fitness import Fitness


@dataclass(frozen=True)
class Shaping:
    """One reward shaping: its --reward-shaping name, the function, and what it needs of the rewards."""

    name: str
    shape: Callable[[Fitness], np.ndarray]
    summary: str
    """One line for --help and the docs."""
    needs_shared_prompts: bool = False
    """It compares members prompt by prompt: refused (ValueError) unless every member was scored on the
    same prompts (Fitness.shared_prompts), never an average over different prompts."""
    needs_prompts: bool = False
    """It reads which prompt each entry answered (Fitness.prompts): refused (ValueError) for a fitness that
    holds only each member's value (Fitness.of_members); members may have been scored on different prompts."""
    needs_finite_spread: bool = False
    """It takes differences of the members' fitness (or divides by their spread), so rewards whose
    spread overflows float64 cannot be shaped (esft.loop.reward_faults.stop_if_unshapeable stops the run
    with one line)."""

    def __call__(self, fitness: Fitness) -> np.ndarray:
        if self.needs_shared_prompts and not fitness.shared_prompts:
            raise ValueError(f"{self.name} shaping compares members prompt by prompt: it needs every member scored on "
                             "the same prompts (a reward matrix with its prompts), which this fitness does not have")
        if self.needs_prompts and fitness.prompts is None:
            raise ValueError(f"{self.name} shaping compares members prompt by prompt: it needs the reward matrix and "
                             "the prompt of each entry, which this fitness (each member's value only) does not have")
        return self.shape(fitness)
