"""Conciseness (the paper's second task): answer a short question as briefly as the reference answer.

The prompt is the raw question (no chat template); reward = -|len(completion.strip()) - len(answer)|
in characters, so 0 is best. Evaluation also reports KL(fine-tuned || base) per generated token
(`eval/<split>/kl`, k3 estimator), which tells whether brevity came at the price of drifting away
from the base model. The question/answer pairs below are our own, written in the paper's spirit:
a few for training, eight held out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from esft.tasks.base import Task, TaskError, completion_text, trusted_reward

TRAIN_PAIRS = [
    ("Which planet is known as the Red Planet?", "Mars"),
    ("How many days are there in a leap year?", "366"),
    ("What is frozen water called?", "Ice"),
]
EVAL_PAIRS = [
    ("What is the chemical symbol for sodium?", "Na"),
    ("Which animal is known as the king of the jungle?", "The lion"),
    ("How many sides does a hexagon have?", "Six"),
    ("What is the largest desert in the world?", "Antarctica"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("What is 12 multiplied by 12?", "144"),
    ("Which language has the most native speakers?", "Mandarin Chinese"),
    ("What do bees make?", "Honey"),
]


def rows_of(pairs: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"prompt": question, "answer": answer} for question, answer in pairs]


def question_in_a_user_turn(row: dict[str, Any]) -> list[dict[str, str]]:
    """--prompt-format chat: the question as the user's turn."""
    return [{"role": "user", "content": row["prompt"]}]


@trusted_reward
def conciseness_reward(prompts: Sequence, completions: Sequence, answer: Sequence[str], **kwargs) -> list[float]:
    """-|len(completion.strip()) - len(answer)| in characters (the paper's reward; 0 is best)."""
    return [float(-abs(len(completion_text(c).strip()) - len(str(a)))) for c, a in zip(completions, answer, strict=True)]


def _rows_from(source: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """User data: rows with `prompt` (or `question`) and `answer`."""
    from esft.tasks.loading import load_splits

    splits = load_splits(source)
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            if "prompt" not in row and "question" in row:
                row["prompt"] = row["question"]
            if "answer" not in row:
                raise TaskError(f"{source} (split {split!r}) row {index}: conciseness rows need an 'answer' column, "
                                f"got {sorted(row)}")
    return splits


def make_conciseness_task(*, train_data=None, eval_data=None, **_: Any) -> Task:
    """Our built-in pairs, or `train_data`/`eval_data` with question (or prompt) and answer columns."""
    from esft.tasks.loading import train_split

    train = train_split(_rows_from(train_data), train_data)[1] if train_data is not None else rows_of(TRAIN_PAIRS)
    evals = _rows_from(eval_data) if eval_data is not None else {"heldout": rows_of(EVAL_PAIRS)}
    return Task(
        name="conciseness",
        train_dataset=train,
        eval_datasets=evals,
        reward_funcs=[conciseness_reward],
        report_kl=True,
        chat_form=question_in_a_user_turn,
        metadata={"train_where": str(train_data or "conciseness train pairs"),
                  "eval_where": str(eval_data or "conciseness eval pairs")},
    )
