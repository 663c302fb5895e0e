"""Countdown problems: a seeded generator of solvable problems, and loaders for the reference formats.

Every row has `prompt` (the paper's raw prompt), `numbers` (list of int), `target` (str, as the
reference stores it) and `solution` (one expression that reaches the target).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from esft.files import DATA_LIMIT, read_regular_text
from esft.tasks.base import TaskError
from esft.tasks.countdown import format_target, make_prompt

EXHAUSTED_AFTER = 50_000
"""Draws in a row without a new distinct problem after which generation stops (about 2 s here): the split's
problem space is then all but exhausted, and asking for more would otherwise run for hours."""
HELD_OUT_BUCKETS = 10  # 1 bucket in 10 of the problem space is reserved for held-out evaluation


@dataclass(frozen=True)
class Difficulty:
    """Knobs of the procedural generator."""

    num_numbers: tuple[int, int] = (3, 3)
    """Smallest and largest count of numbers in a problem."""
    min_number: int = 1
    """Smallest number drawn."""
    max_number: int = 20
    """Largest number drawn."""
    operators: str = "+-"
    """Operators the hidden solution may use, a subset of "+-*/"."""
    max_target: int = 100
    """Targets are integers in [1, max_target]."""

    def __post_init__(self) -> None:
        low, high = self.num_numbers
        if not 1 <= low <= high:
            raise ValueError(f"num_numbers must be (low, high) with 1 <= low <= high, got {self.num_numbers}")
        if not 0 <= self.min_number <= self.max_number:
            raise ValueError(f"need 0 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
        if not self.operators or set(self.operators) - set("+-*/"):
            raise ValueError(f"operators must be a non-empty subset of '+-*/', got {self.operators!r}")
        if self.max_target < 1:
            raise ValueError(f"max_target must be at least 1, got {self.max_target}")


DIFFICULTIES = {
    "easy": Difficulty(),
    "medium": Difficulty(num_numbers=(3, 4), max_number=50, operators="+-*", max_target=200),
    "paper": Difficulty(num_numbers=(3, 4), max_number=99, operators="+-*/", max_target=1000),
}


def get_difficulty(difficulty: Difficulty | str) -> Difficulty:
    """A Difficulty, looked up by name in DIFFICULTIES if given as a string."""
    if isinstance(difficulty, Difficulty):
        return difficulty
    try:
        return DIFFICULTIES[difficulty]
    except (KeyError, TypeError):
        raise TaskError(
            f"unknown Countdown difficulty {difficulty!r}; choose one of {', '.join(DIFFICULTIES)}"
        ) from None


def problem_bucket(numbers, target) -> int:
    """A stable hash bucket of the problem (order of numbers ignored)."""
    key = f"{sorted(int(n) for n in numbers)}|{format_target(target)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % HELD_OUT_BUCKETS


def is_held_out(numbers, target) -> bool:
    """True for the slice of problem space that training data never contains."""
    return problem_bucket(numbers, target) == 0


def make_row(numbers, target, solution: str | None = None, **extra) -> dict:
    """One dataset row in the project's Countdown format."""
    return {
        "prompt": make_prompt(numbers, target),
        "numbers": [int(n) for n in numbers],
        "target": format_target(target),
        "solution": solution,
        **extra,
    }


def _random_expression(rng: random.Random, numbers: list[int], operators: str) -> tuple[str, Fraction]:
    """Combine all numbers in a random order and bracketing; returns (text, exact value)."""
    items = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(items)
    while len(items) > 1:
        i = rng.randrange(len(items) - 1)
        (left_text, left), (right_text, right) = items[i], items[i + 1]
        op = rng.choice(operators)
        if op == "/" and right == 0:
            op = "+"
        if op == "+":
            value = left + right
        elif op == "-":
            value = left - right
        elif op == "*":
            value = left * right
        else:
            value = left / right
        items[i : i + 2] = [(f"({left_text} {op} {right_text})", value)]
    text, value = items[0]
    return text, value


def generate_problems(
    count: int,
    seed: int,
    difficulty: Difficulty | str = "easy",
    split: str | None = None,
    max_attempts_per_problem: int = 1000,
) -> list[dict]:
    """`count` distinct solvable problems, reproducible from `seed`.

    split="train" keeps only problems outside the held-out slice, split="eval" only those inside it,
    None keeps both; so training and evaluation data made with any seeds never share a problem.
    """
    difficulty = get_difficulty(difficulty)
    if split not in (None, "train", "eval"):
        raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
    rng = random.Random(seed)
    rows, seen = [], set()
    attempts = misses = 0
    while len(rows) < count:
        attempts += 1
        misses += 1
        # the second rule stops within seconds once the split's distinct problems are (nearly) all drawn
        if attempts > max_attempts_per_problem * max(count, 1) or misses > EXHAUSTED_AFTER:
            raise TaskError(
                f"could not generate {count} distinct {split or 'any'}-split problems at this difficulty: "
                f"{len(rows)} were found and the last {misses - 1:,} draws gave no new one (few more distinct problems "
                "exist); ask for fewer problems (--train-size, --eval-size) or use a harder --difficulty"
            )
        size = rng.randint(*difficulty.num_numbers)
        numbers = [rng.randint(difficulty.min_number, difficulty.max_number) for _ in range(size)]
        solution, value = _random_expression(rng, numbers, difficulty.operators)
        if value.denominator != 1 or not 1 <= value <= difficulty.max_target:
            continue
        target = int(value)
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        if split is not None and is_held_out(numbers, target) != (split == "eval"):
            continue
        seen.add(key)
        misses = 0
        rows.append(make_row(numbers, target, solution[1:-1] if solution.startswith("(") else solution))
    return rows


# ---------------------------------------------------------------------------------------------
# Loaders for the reference formats: a JSON list of rows, or a Hugging Face `save_to_disk` dir.

_ROW_HINT = (
    "each row needs `numbers`, a list of integers such as [44, 19, 35], and `target`, a number or "
    'a numeric string such as 98, "98" or "-15.7272"'
)
_JSON_TYPES = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def _normalize_target(target: Any) -> str | None:
    """The target as the reference stores it (a string), or None if it is not a finite number."""
    if isinstance(target, bool):  # bool is an int in Python, but `true` is no target
        return None
    if isinstance(target, str):
        text = target.strip()
        try:
            value = float(text)
        except ValueError:
            return None
    elif isinstance(target, Real):
        try:
            value = float(target)
        except OverflowError:
            return None
        text = format_target(target)
    else:
        return None
    return text if math.isfinite(value) else None


def normalize_row(row: Any, index: int, source: str) -> dict[str, Any]:
    """Check one loaded row and return it with `prompt` (from make_prompt), int `numbers` and str
    `target`; other columns (id, context, solution, ...) are kept. Raises TaskError naming
    `source`, the row index and the column."""
    where = f"{source}: row {index}"
    if not isinstance(row, Mapping):
        kind = _JSON_TYPES.get(type(row), type(row).__name__)
        raise TaskError(f"{where}: expected an object with `numbers` and `target`, got a {kind}; {_ROW_HINT}")
    for column in ("numbers", "target"):
        if row.get(column) is None:
            raise TaskError(f"{where}, column {column!r}: missing; {_ROW_HINT}")
    numbers = row["numbers"]
    if (
        not isinstance(numbers, Sequence)
        or isinstance(numbers, str)
        or not numbers
        or not all(isinstance(n, Integral) and not isinstance(n, bool) for n in numbers)
    ):
        raise TaskError(
            f"{where}, column 'numbers': expected a non-empty list of integers, got {numbers!r}; {_ROW_HINT}"
        )
    target = _normalize_target(row["target"])
    if target is None:
        raise TaskError(
            f"{where}, column 'target': expected a finite number, got {row['target']!r}; {_ROW_HINT}"
        )
    numbers = [int(n) for n in numbers]
    # The prompt is always rebuilt so that it matches what the reward checks; the reference's own
    # `context` column equals make_prompt's output and is kept as it is.
    return {**row, "prompt": make_prompt(numbers, target), "numbers": numbers, "target": target}


def _normalize_rows(rows: Sequence[Any], source: str) -> list[dict[str, Any]]:
    if not rows:
        raise TaskError(f"{source}: contains no rows; {_ROW_HINT}")
    return [normalize_row(row, index, source) for index, row in enumerate(rows)]


def load_countdown_json(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a JSON file holding a list of Countdown rows (the reference `countdown.json`)."""
    path = Path(path)
    try:
        text = read_regular_text(path, DATA_LIMIT, follow_links=True)
    except OSError as error:
        raise TaskError(f"{path}: cannot read Countdown data ({error.strerror}); pass a readable JSON file") from None
    except UnicodeDecodeError as error:
        raise TaskError(f"{path}: cannot read Countdown data (not UTF-8 at byte {error.start}); pass a JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TaskError(
            f"{path}: not valid JSON ({error}); expected a JSON list of rows like "
            '[{"numbers": [44, 19, 35], "target": "98"}]'
        ) from None
    if not isinstance(data, list):
        kind = _JSON_TYPES.get(type(data), "null")
        raise TaskError(f"{path}: expected a JSON list of rows, got a JSON {kind}; {_ROW_HINT}")
    return _normalize_rows(data, str(path))


def load_countdown_dataset_dict(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """Splits of a Hugging Face `save_to_disk` directory: every split of a DatasetDict (one eval
    benchmark each), or {"<dirname>": rows} for a single Dataset."""
    path = Path(path)
    if not path.is_dir():
        raise TaskError(f"{path}: not a directory; pass a directory written by Dataset(Dict).save_to_disk")
    import datasets  # imported here: slow to import, and only directories need it

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 - any failure means the same thing to the user
        raise TaskError(
            f"{path}: cannot load as a Hugging Face dataset ({error}); pass a directory written by "
            "Dataset.save_to_disk or DatasetDict.save_to_disk"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = {name: loaded[name].to_list() for name in loaded}
    else:
        splits = {path.resolve().name: loaded.to_list()}
    if not splits:
        raise TaskError(f"{path}: the DatasetDict has no splits")
    return {name: _normalize_rows(rows, f"{path} (split {name!r})") for name, rows in splits.items()}


def load_countdown_data(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """Splits of a Countdown data path: a directory via load_countdown_dataset_dict, a JSON file
    as {"<file stem>": rows}."""
    path = Path(path)
    if path.is_dir():
        return load_countdown_dataset_dict(path)
    if not path.exists():
        raise TaskError(
            f"{path}: no such file or directory; pass a JSON list of rows or a save_to_disk directory"
        )
    return {path.stem: load_countdown_json(path)}
