"""rank: centered ranks of the members' fitness in [-0.5, 0.5], ties sharing their mean rank (OpenAI-ES)."""

from __future__ import annotations

import numpy as np

from esft.es.shaping.base import Shaping
from esft.es.fitness import Fitness


def centered_rank(fitness: Fitness) -> np.ndarray:
    rewards = fitness.member
    n = len(rewards)
    order = np.argsort(rewards, kind="stable")
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.arange(n, dtype=np.float64)
    for value in np.unique(rewards):  # ties: equal rewards must get equal weight
        tied = rewards == value
        ranks[tied] = ranks[tied].mean()
    return ranks / (n - 1) - 0.5 if n > 1 else np.zeros(n)


SHAPING = Shaping("rank", centered_rank, "centered ranks in [-0.5, 0.5] (OpenAI-ES)")
