"""Arithmetic: "What is 47 * 6?", two-digit times one-digit numbers, graded on the last number of the answer.

A task sized for small pretrained instruct models, where Countdown is out of reach: SmolLM2-135M-Instruct
answers 18.0% of the held-out problems right in its chat format within 16 tokens (16.5% with the raw prompt),
failing by arithmetic or by explaining past the token limit, so members' rewards differ and ES has a signal. Its 720 problems are split once, the same for every
seed: 200 held out (`heldout`), 520 for training. The reward labels each completion (counted per label as
`rewards/arithmetic_reward/labels/<label>`), so a gain can be told apart as format or correctness:
`bare` (the answer and nothing else), `correct` (the right last number, with other text), `wrong`, `no_number`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from esft.tasks.base import Task, TaskError, trusted_reward

FACTORS = (range(10, 100), range(2, 10))
HELDOUT = 200
SPLIT_SEED = 20261128
"""Fixed: the held-out problems are the same whatever --seed, and never trained on."""
QUESTION = "What is {a} * {b}? Answer with just the number."
RAW = "Question: What is {a} * {b}?\nAnswer:"
_NUMBER = re.compile(r"-?\d+")


def all_problems() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, heldout) rows: every product of FACTORS, shuffled once with SPLIT_SEED."""
    pairs = [(a, b) for a in FACTORS[0] for b in FACTORS[1]]
    random.Random(SPLIT_SEED).shuffle(pairs)
    rows = [{"prompt": RAW.format(a=a, b=b), "a": a, "b": b, "target": str(a * b)} for a, b in pairs]
    return rows[HELDOUT:], rows[:HELDOUT]


def chat_form(row: dict[str, Any]) -> list[dict[str, str]]:
    """--prompt-format chat: the question in a user turn."""
    return [{"role": "user", "content": QUESTION.format(a=row["a"], b=row["b"])}]


def final_answer(model_output: str) -> str | None:
    """The last number of the completion (what the reward grades and RandOpt's members vote on), or None."""
    numbers = _NUMBER.findall(model_output.replace(",", ""))
    return numbers[-1] if numbers else None


@trusted_reward
def arithmetic_reward(model_output: str, target: str, fast: bool = False) -> tuple[str, float]:
    """1.0 when the last number of the completion is the product, else 0.0; labelled bare, correct, wrong
    or no_number."""
    numbers = _NUMBER.findall(model_output.replace(",", ""))
    if not numbers:
        return "no_number", 0.0
    if numbers[-1] != target:
        return "wrong", 0.0
    return ("bare" if model_output.strip() == target else "correct"), 1.0


def make_arithmetic_task(*, train_data=None, eval_data=None, seed: int = 0, train_size: int = 1000,
                         eval_size: int = 500, **_: Any) -> Task:
    """The generated problems: up to `train_size` training rows in an order drawn from `seed`, and the
    first `eval_size` (at most 200) held-out rows."""
    train, heldout = all_problems()
    return product_task("arithmetic", train, heldout, chat_form, given_data=(train_data, eval_data), seed=seed,
                        train_size=train_size, eval_size=eval_size)


def product_task(name: str, train: list[dict[str, Any]], heldout: list[dict[str, Any]],
                 chat_form: Any, *, given_data: tuple, seed: int, train_size: int, eval_size: int) -> Task:
    """A task of generated products graded by arithmetic_reward (arithmetic, times-table): up to `train_size`
    training rows in an order drawn from `seed`, the first `eval_size` held-out rows."""
    if any(data is not None for data in given_data):
        raise TaskError(f"--task {name} generates its own problems; for your own data use --reward-funcs "
                        "with --train-data/--eval-data")
    train = list(train)
    random.Random(seed).shuffle(train)
    return Task(
        name=name,
        train_dataset=train[:train_size],
        eval_datasets={"heldout": heldout[:eval_size]} if eval_size else {},
        reward_funcs=[arithmetic_reward],
        accuracy_func=arithmetic_reward,
        chat_form=chat_form,
        answer=final_answer,  # the number the reward grades: what RandOpt's members vote on
        metadata={"train_where": f"{name} training problems", "eval_where": f"{name} held-out problems"},
    )
