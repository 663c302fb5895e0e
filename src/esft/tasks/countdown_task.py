"""The Countdown Task: generated or user-given problems, scored with the paper's reward."""

from __future__ import annotations

import os
from typing import Any

from esft.tasks.base import Task, TaskError
from esft.tasks.countdown import chat_prompt, countdown_accuracy, countdown_reward, final_answer
from esft.tasks.countdown_data import (
    Difficulty,
    generate_problems,
    get_difficulty,
    load_countdown_data,
)


def _train_split(splits: dict[str, list[dict[str, Any]]], path: str | os.PathLike) -> list[dict[str, Any]]:
    """The one split of a training path, or its "train" split if it has several."""
    if len(splits) == 1:
        return next(iter(splits.values()))
    if "train" in splits:
        return splits["train"]
    raise TaskError(
        f"{path}: has splits {', '.join(sorted(splits))} and none is named 'train'; "
        "pass a path with a single split, or name the training split 'train'"
    )


def _problem_key(row: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    return tuple(sorted(row["numbers"])), row["target"]


def make_countdown_task(
    *,
    train_data: str | os.PathLike | None = None,
    eval_data: str | os.PathLike | None = None,
    seed: int = 0,
    difficulty: Difficulty | str = "easy",
    train_size: int = 1000,
    eval_size: int = 500,
) -> Task:
    """Countdown with rows from `train_data` / `eval_data` paths (JSON list or save_to_disk dir),
    else generated: `train_size` training problems and a "heldout" split of `eval_size` problems
    from the slice of problem space that generated training data never contains."""
    level = get_difficulty(difficulty)  # validated even when both paths are given: a typo is a typo
    if train_data is not None:
        train_rows = _train_split(load_countdown_data(train_data), train_data)
    else:
        if train_size < 1:
            raise TaskError(f"train_size must be at least 1, got {train_size}")
        train_rows = generate_problems(train_size, seed, level, split="train")
    if eval_data is not None:
        eval_splits = load_countdown_data(eval_data)
    else:
        if eval_size < 0:
            raise TaskError(f"eval_size must be at least 0, got {eval_size}")
        # seed + 1: the eval stream should not mirror the training stream's random choices.
        eval_splits = (
            {"heldout": generate_problems(eval_size, seed + 1, level, split="eval")} if eval_size else {}
        )
    # User-given files may share problems between train and eval; record it so results can be judged.
    train_keys = {_problem_key(row) for row in train_rows}
    overlap = {
        name: sum(_problem_key(row) in train_keys for row in rows) for name, rows in eval_splits.items()
    }
    return Task(
        name="countdown",
        train_dataset=train_rows,
        eval_datasets=eval_splits,
        reward_funcs=[countdown_reward],
        accuracy_func=countdown_accuracy,
        chat_form=chat_prompt,
        answer=final_answer,
        metadata={
            "difficulty": difficulty if isinstance(difficulty, str) else repr(level),
            "seed": seed,
            "train_source": os.fspath(train_data) if train_data is not None else "generated",
            "eval_source": os.fspath(eval_data) if eval_data is not None else "generated",
            "train_eval_overlap": overlap,
        },
    )
