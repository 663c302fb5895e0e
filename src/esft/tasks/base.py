"""What a task is: datasets of rows with a `prompt` column, and reward functions with TRL's signature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# TRL's reward signature: f(prompts, completions, completion_ids, **columns) -> list[float | None];
# None = no score.
RewardFunc = Callable[..., Sequence[float | None]]
PROVIDED_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every reward call provides besides the data's columns."""

PROMPT_SOURCE = "_prompt_source"
"""Row key holding a chat prompt's original messages once `prompt` holds the rendered text (reward
functions receive the original, as in TRL; it is never passed as a column)."""
TRUSTED_ATTRIBUTE = "__esft_trusted__"


def trusted_reward(func):
    """Mark a built-in reward function as trusted: it runs in-process, outside the sandbox."""
    setattr(func, TRUSTED_ATTRIBUTE, True)
    return func


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
    prompt_template: str | None = None
    """Optional `str.format` template building each row's `prompt` from its columns, e.g.
    "Q: {question}\nA:" (used for rows without a `prompt` column)."""
    report_kl: bool = False
    """Evaluation also reports KL(fine-tuned || base) per generated token (`eval/<split>/kl`)."""
