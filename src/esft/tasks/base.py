"""What a task is: datasets of rows with a `prompt` column, and reward functions with TRL's signature."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from esft.rewards.runner import PROMPT_SOURCE, PROVIDED_ARGUMENTS, TRUSTED_ATTRIBUTE, RewardFunc, trusted_reward

__all__ = ["PROMPT_SOURCE", "PROVIDED_ARGUMENTS", "TRUSTED_ATTRIBUTE", "RewardFunc", "Task", "TaskError", "completion_text",
           "trusted_reward"]


def completion_text(completion: Any) -> str:
    """A completion as text: under chat prompts TRL's convention passes [{"role": "assistant", "content": ...}]."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


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
    answer: Callable[[str], Hashable | None] | None = None
    """The final answer a completion gives (None: it gives none), for --algorithm randopt's majority vote
    of its kept members; a task without it is evaluated on its best member alone."""
    chat_form: Callable[[dict[str, Any]], list[dict[str, str]]] | None = None
    """A built-in task's row as chat messages (--prompt-format chat): the question in a user turn, and a
    final assistant message where the reply starts with fixed words (it is continued, not restarted)."""

    def where(self, split: str | None = None) -> str:
        """Where the rows of the train set (split None) or of an eval split came from, for messages."""
        if split is None:
            return self.metadata.get("train_where", "train_dataset")
        return self.metadata.get("eval_labels", {}).get(split, f"{self.metadata.get('eval_where', 'eval_dataset')}[{split!r}]")
