"""Scoring completions with TRL-style reward functions: f(prompts, completions, **columns).

Several functions are combined as a weighted sum per sample. A function's `None` for a sample means
"no score here": that function is left out of the sample's sum, and a sample no function scored is
left out of the member's mean. NaN/inf are failures, not scores: they count as `failure_reward`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from esft.tasks.base import RewardFunc


def reward_name(func: RewardFunc) -> str:
    """The name used in metrics (`rewards/<name>/mean`), as TRL names reward functions."""
    return getattr(func, "__name__", type(func).__name__)


@dataclass
class Scores:
    """Per-sample rewards of one batch of completions."""

    total: list[float | None]
    """Weighted sum per sample; None where no function scored the sample."""
    per_function: dict[str, list[float | None]] = field(default_factory=dict)
    failures: int = 0

    def mean(self) -> float:
        """Mean over scored samples; 0.0 when no sample was scored (so one member cannot poison the
        population's statistics)."""
        values = [v for v in self.total if v is not None]
        return sum(values) / len(values) if values else 0.0


def columns_of(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every column but `prompt`, as lists: what reward functions receive as keyword arguments."""
    names = [name for name in rows[0] if name != "prompt"] if rows else []
    return {name: [row.get(name) for row in rows] for name in names}


def score(
    reward_funcs: Sequence[RewardFunc],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[str],
    weights: Sequence[float] | None = None,
    failure_reward: float = 0.0,
) -> Scores:
    """Run every reward function on the batch and combine them."""
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    prompts = [row["prompt"] for row in rows]
    columns = columns_of(rows)
    result = Scores(total=[None] * len(rows))
    for func, weight in zip(reward_funcs, weights, strict=True):
        values = list(func(prompts, list(completions), **columns))
        if len(values) != len(rows):
            raise ValueError(f"reward function {reward_name(func)} returned {len(values)} values for {len(rows)} completions")
        cleaned: list[float | None] = []
        for value in values:
            if value is None:
                cleaned.append(None)
                continue
            number = float(value)
            if not math.isfinite(number):
                result.failures += 1
                number = failure_reward
            cleaned.append(number)
        result.per_function[reward_name(func)] = cleaned
        for i, value in enumerate(cleaned):
            if value is not None:
                result.total[i] = (result.total[i] or 0.0) + weight * value
    return result


def mean_of(values: Sequence[float | None]) -> float | None:
    """Mean of the non-None values, None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
