"""What a task is: datasets of rows with a `prompt` column, and reward functions with TRL's signature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# TRL's reward signature: f(prompts, completions, **columns) -> list[float | None]; None = no score.
RewardFunc = Callable[..., Sequence[float | None]]


class TaskError(ValueError):
    """A task, dataset file or dataset row is unusable; the message says where and how to fix it."""


@dataclass
class Task:
    """Datasets plus reward functions. Rows are dicts with a `prompt` string and any other columns;
    every other column is passed to the reward functions as a keyword argument (a list per batch)."""

    name: str
    train_dataset: list[dict[str, Any]]
    eval_datasets: dict[str, list[dict[str, Any]]]
    reward_funcs: list[RewardFunc]
    reward_weights: list[float] | None = None
    accuracy_func: RewardFunc | None = None
    """Optional 0/1 correctness per completion, reported as `eval/<split>/accuracy`."""
    metadata: dict[str, Any] = field(default_factory=dict)
