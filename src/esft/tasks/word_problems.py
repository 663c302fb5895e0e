"""Word problems: one-step addition and subtraction stories ("Mia has 7 apples. She buys 5 more. How many apples
does she have now?"), numbers up to 20, graded on the last number of the answer.

A third task for small pretrained instruct models, unlike the products of `arithmetic` and `times-table`: the
model must read a story to find the operation, and the numbers are small, so SmolLM2-135M-Instruct solves part of
it as it is (docs/benchmarks.md gives its baseline) and members' rewards differ. Graded by the arithmetic reward
(`bare`, `correct`, `wrong`, `no_number`).

The split is by number pair and fixed, the same for every seed: a fifth of the (a, b) pairs are held out in every
story, so no held-out pair is ever trained on in any story; the training rows are the other pairs' stories.
"""

from __future__ import annotations

import random
from typing import Any

from esft.tasks.arithmetic import product_task
from esft.tasks.base import Task

NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max")
THINGS = ("apples", "stickers", "marbles", "books", "pencils", "cookies")
STORIES = (  # (story, sign of b): answer = a + sign·b; a > b, so every answer is positive
    ("{name} has {a} {things}. {name} gets {b} more. How many {things} does {name} have now?", 1),
    ("{name} had {a} {things} and gave {b} of them away. How many {things} does {name} have left?", -1),
    ("There are {a} {things} in a box. Someone puts in {b} more. How many {things} are in the box now?", 1),
    ("A shelf holds {a} {things}. {b} of them are taken away. How many {things} are still on the shelf?", -1),
    ("{name} has {a} {things}; {b} of them are red and the rest are blue. How many blue {things} does {name} have?", -1),
    ("{name} has {a} {things} and a friend has {b}. How many {things} do they have together?", 1),
)
ASK = " Answer with just the number."
NUMBERS = range(2, 21)
HELDOUT_SHARE = 5
"""One pair in HELDOUT_SHARE is held out."""
SPLIT_SEED = 20261206
"""Fixed: the held-out pairs are the same whatever --seed, and never trained on."""


def all_problems() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, heldout) rows: every pair a > b of NUMBERS in every story, names and things drawn with SPLIT_SEED;
    pairs shuffled once with SPLIT_SEED and one in HELDOUT_SHARE held out."""
    draw = random.Random(SPLIT_SEED)
    pairs = [(a, b) for a in NUMBERS for b in range(1, a)]
    draw.shuffle(pairs)
    held = len(pairs) // HELDOUT_SHARE

    def rows(chosen):
        out = []
        for a, b in chosen:
            for story, sign in STORIES:
                question = story.format(name=draw.choice(NAMES), things=draw.choice(THINGS), a=a, b=b) + ASK
                out.append({"prompt": f"Question: {question}\nAnswer:", "question": question, "a": a, "b": b,
                            "target": str(a + sign * b)})
        return out

    heldout, train = rows(pairs[:held]), rows(pairs[held:])
    draw.shuffle(heldout)  # so a smaller --eval-size still spans every story
    return train, heldout


def chat_form(row: dict[str, Any]) -> list[dict[str, str]]:
    """--prompt-format chat: the question in a user turn."""
    return [{"role": "user", "content": row["question"]}]


def make_word_problems_task(*, train_data=None, eval_data=None, seed: int = 0, train_size: int = 1000,
                            eval_size: int = 500, **_: Any) -> Task:
    """The generated problems: up to `train_size` training rows in an order drawn from `seed`, and the first
    `eval_size` held-out rows (at most all of them: 38 pairs × 6 stories = 228)."""
    train, heldout = all_problems()
    return product_task("word-problems", train, heldout, chat_form, given_data=(train_data, eval_data), seed=seed,
                        train_size=train_size, eval_size=eval_size)
