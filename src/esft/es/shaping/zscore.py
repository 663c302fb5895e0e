"""zscore, the paper's shaping: (R - mean) / (std + 1e-8) of the members' fitness, population std."""

from __future__ import annotations

import numpy as np

from esft.es.shaping.base import Shaping
from esft.es.fitness import Fitness


def zscore(fitness: Fitness) -> np.ndarray:
    rewards = fitness.member
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


SHAPING = Shaping("zscore", zscore, "z-scores of the members' fitness (the paper)", needs_finite_spread=True)
