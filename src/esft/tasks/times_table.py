"""Times table: "What is 7 times 8?", products of 2..12 asked in five phrasings, graded on the last number.

A task a small pretrained instruct model knows but fails on form: SmolLM2-135M-Instruct gets 14.9–45.5% of the
121 products right per phrasing within 16 tokens in its chat format (2026-11-29, greedy), mostly because it
starts an explanation ("To find 5 times 9, we can use the formula ...") that the token limit cuts before the
number, while the products it does state are mostly right. So a gain here is mostly the model learning to answer
at once; the reward's labels (`bare`, `correct`, `wrong`, `no_number`, as in the arithmetic task) tell that
apart from correctness.

The split is by pair and fixed, the same for every seed: 40 of the 121 pairs (a, b) are held out in all five
phrasings (200 `heldout` problems), so no held-out product is ever trained on, in any phrasing; the 405 problems
of the other 81 pairs are for training.
"""

from __future__ import annotations

import random
from typing import Any

from esft.tasks.arithmetic import product_task
from esft.tasks.base import Task

FACTORS = range(2, 13)
PHRASINGS = (
    "What is {a} times {b}?",
    "What is {a} × {b}? Answer with just the number.",
    "Multiply {a} by {b}.",
    "What is the product of {a} and {b}?",
    "Calculate {a} * {b}.",
)
HELDOUT_PAIRS = 40
SPLIT_SEED = 20261129
"""Fixed: the held-out pairs are the same whatever --seed, and never trained on."""


def all_problems() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, heldout) rows: every pair of FACTORS in every phrasing; pairs shuffled once with SPLIT_SEED and
    the first HELDOUT_PAIRS held out."""
    pairs = [(a, b) for a in FACTORS for b in FACTORS]
    random.Random(SPLIT_SEED).shuffle(pairs)

    def rows(chosen):
        return [{"prompt": f"Question: {q.format(a=a, b=b)}\nAnswer:", "question": q.format(a=a, b=b), "a": a, "b": b,
                 "target": str(a * b)} for a, b in chosen for q in PHRASINGS]

    return rows(pairs[HELDOUT_PAIRS:]), rows(pairs[:HELDOUT_PAIRS])


def chat_form(row: dict[str, Any]) -> list[dict[str, str]]:
    """--prompt-format chat: the question in a user turn."""
    return [{"role": "user", "content": row["question"]}]


def make_times_table_task(*, train_data=None, eval_data=None, seed: int = 0, train_size: int = 1000,
                          eval_size: int = 500, **_: Any) -> Task:
    """The generated problems: up to `train_size` training rows in an order drawn from `seed`, and `eval_size`
    (at most 200) held-out rows, drawn evenly over the phrasings (the held-out rows are in a fixed shuffled order)."""
    train, heldout = all_problems()
    random.Random(SPLIT_SEED).shuffle(heldout)  # so a smaller --eval-size still spans every phrasing and many pairs
    return product_task("times-table", train, heldout, chat_form, given_data=(train_data, eval_data), seed=seed,
                        train_size=train_size, eval_size=eval_size)
