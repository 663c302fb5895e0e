"""raw: the members' fitness as it is (no shaping)."""

from __future__ import annotations

import numpy as np

from esft.es.shaping.base import Shaping
from esft.es.fitness import Fitness


def raw(fitness: Fitness) -> np.ndarray:
    return fitness.member.copy()


SHAPING = Shaping("raw", raw, "the members' fitness as it is")
