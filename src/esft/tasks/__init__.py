"""Tasks: datasets plus reward functions, looked up by name."""

from __future__ import annotations

import os
from collections.abc import Callable

from esft.tasks.arithmetic import make_arithmetic_task
from esft.tasks.base import Task, TaskError
from esft.tasks.conciseness import make_conciseness_task
from esft.tasks.countdown_task import make_countdown_task
from esft.tasks.math_task import make_math_task
from esft.tasks.times_table import make_times_table_task
from esft.tasks.word_problems import make_word_problems_task

TASKS: dict[str, Callable[..., Task]] = {
    "countdown": make_countdown_task,
    "conciseness": make_conciseness_task,
    "math": make_math_task,
    "arithmetic": make_arithmetic_task,
    "times-table": make_times_table_task,
    "word-problems": make_word_problems_task,
}


def load_task(
    name: str,
    *,
    train_data: str | os.PathLike | None = None,
    eval_data: str | os.PathLike | None = None,
    seed: int = 0,
    difficulty: str = "easy",
    train_size: int = 1000,
    eval_size: int = 500,
) -> Task:
    """The task registered as `name`, built with the given data paths or generator settings."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None
    return factory(
        train_data=train_data,
        eval_data=eval_data,
        seed=seed,
        difficulty=difficulty,
        train_size=train_size,
        eval_size=eval_size,
    )


__all__ = ["TASKS", "Task", "TaskError", "load_task", "make_countdown_task"]
