"""An iteration's fitness as data: the members × prompts reward matrix and which prompts each member
was scored on. Member fitness, the failed-sample policy (--failed-samples) and every reward shaping
(esft.es.shaping) read this one type; nothing else assumes that members saw the same prompts.

    fitness = Fitness.of(matrix, prompts, failure_reward=0.0, failed_samples="omit")
    fitness.member          # each member's fitness: the mean of its row's usable scores
    fitness.shared_prompts  # True when every member was scored on the same prompts, in the same order

`matrix[i, j]` is member i's reward on its j-th sample, NaN where the sample has no usable score (no
function scored it, or, under "omit", a reward function failed on it); `prompts[i, j]` is the prompt
that sample answered (an index into the iteration's batch). Pure numpy: no model, no rewards module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FAILED_SAMPLES = {
    "omit": "left out of its member's mean and of its prompt's column; a member with no sample left gets the "
            "others' mean fitness, so z-scoring gives it 0 (the default)",
    "fill": "counts --failure-reward, as TRL counts a failed reward",
}
"""--failed-samples: what a sample a reward function failed on counts in the update (measured in
benchmarks/failure_policy.py). The loop marks such a sample NaN in the matrix under "omit" and keeps
its failure reward under "fill"; what a member with no usable sample gets is Fitness.of's rule."""


def finite_mean(values: Sequence[float]) -> float:
    """The mean of a non-empty list, also of finite rewards near the float limit (1e308 each), which
    overflow a plain sum: those are scaled first. Summed left to right, as Python's sum does."""
    mean = sum(values) / len(values)
    return mean if math.isfinite(mean) else sum(v / len(values) for v in values)


@dataclass(frozen=True)
class Fitness:
    """One iteration's scores (module docstring). Build it with `Fitness.of` (a matrix and its prompts)
    or `Fitness.of_members` (only each member's fitness is known: no shaping that needs prompts)."""

    matrix: np.ndarray
    """members × samples, float64; NaN = no usable score."""
    prompts: np.ndarray | None
    """members × samples, int64: the prompt of each entry; None when unknown (Fitness.of_members)."""
    member: np.ndarray
    """Each member's fitness, float64 (Fitness.of's rule)."""

    @classmethod
    def of(cls, matrix, prompts, failure_reward: float = 0.0, failed_samples: str = "omit") -> Fitness:
        """Fitness from a members × samples matrix (NaN: no usable score) and the prompt of each entry.
        A member's fitness is the mean of its row's usable scores. A member with none: under "omit",
        the mean of the other members' fitness (neutral under z-scoring: it neither pulls nor pushes);
        under "fill", or when no member has any, `failure_reward` (as a batch nobody scored gets)."""
        if failed_samples not in FAILED_SAMPLES:
            raise ValueError(f"failed_samples must be one of {', '.join(FAILED_SAMPLES)}, got {failed_samples!r}")
        values = np.asarray(matrix, dtype=np.float64)
        where = np.asarray(prompts, dtype=np.int64)
        if values.ndim != 2 or where.shape != values.shape:
            raise ValueError(f"a reward matrix (members × samples) and its prompts of the same shape are needed, got "
                             f"{values.shape} and {where.shape}")
        means = [finite_mean(kept) if (kept := [float(v) for v in row if not math.isnan(v)]) else None for row in values]
        known = [mean for mean in means if mean is not None]
        empty = finite_mean(known) if failed_samples == "omit" and known else float(failure_reward)
        return cls(values, where, np.array([empty if mean is None else mean for mean in means], dtype=np.float64))

    @classmethod
    def of_members(cls, rewards: Sequence[float]) -> Fitness:
        """Only each member's fitness (one value per member, no prompts): for callers that score members
        themselves. Shapings that need shared prompts refuse it."""
        values = np.asarray(rewards, dtype=np.float64).reshape(-1)
        return cls(values.reshape(-1, 1).copy(), None, values)

    def __len__(self) -> int:
        return len(self.member)

    @property
    def shared_prompts(self) -> bool:
        """Whether every member was scored on the same prompts in the same order (the columns of the
        matrix are then prompts)."""
        return self.prompts is not None and bool((self.prompts == self.prompts[:1]).all())


def same_prompts(members: int, prompts: int) -> np.ndarray:
    """The prompts of an iteration in which every member is scored on the batch's `prompts` prompts."""
    return np.broadcast_to(np.arange(prompts, dtype=np.int64), (members, prompts))
