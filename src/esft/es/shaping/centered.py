"""centered: the members' fitness minus its mean, not divided by its spread (ES-FRONTIER's centred
fitness): the step shrinks as the members' rewards draw together, where z-scores would keep it at
full size on a spread of noise."""

from __future__ import annotations

import numpy as np

from esft.es.shaping.base import Shaping
from esft.es.fitness import Fitness


def centered(fitness: Fitness) -> np.ndarray:
    rewards = fitness.member
    return rewards - rewards.mean()


SHAPING = Shaping("centered", centered, "the members' fitness minus its mean (no division by the spread)",
                  needs_finite_spread=True)
