"""per_prompt: z-scores prompt by prompt, then averaged per member; the ES analogue of GRPO's group
baseline: a prompt that is easy or hard for everyone no longer dominates the ranking.

Each column of the reward matrix (one prompt; every member scored on the same prompts) becomes
(R - mean) / (std + 1e-8) over its present entries (NaN = no usable score, left out; population std); a
column where every present member scored the same, or fewer than two are present, gives 0; NaN entries
count 0. A member's value is the mean of its row over all prompts."""

from __future__ import annotations

import numpy as np

from esft.es.shaping.base import Shaping
from esft.es.fitness import Fitness


def per_prompt_zscore(fitness: Fitness) -> np.ndarray:
    matrix = fitness.matrix
    present = ~np.isnan(matrix)
    count = present.sum(axis=0)
    filled = np.where(present, matrix, 0.0)
    mean = filled.sum(axis=0) / np.maximum(count, 1)
    std = np.sqrt(np.where(present, (matrix - mean) ** 2, 0.0).sum(axis=0) / np.maximum(count, 1))
    highest = np.where(present, matrix, -np.inf).max(axis=0)
    lowest = np.where(present, matrix, np.inf).min(axis=0)
    constant = (count < 2) | (highest == lowest)  # exactly: a mean of equal values need not equal them
    z = np.where(present & ~constant, (matrix - mean) / (std + 1e-8), 0.0)
    return z.mean(axis=1)


SHAPING = Shaping("per_prompt", per_prompt_zscore, "z-scores prompt by prompt, averaged per member "
                          "(GRPO's group baseline)", needs_shared_prompts=True, needs_finite_spread=True)
