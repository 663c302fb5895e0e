"""Which rows a run uses, and how many evaluation rows it also trains on.

- `--train-rows START:STOP` / `--eval-rows START:STOP`: a Python slice of the training rows / of
  every eval split (0-based, STOP excluded, either end may be left out or negative), so one data
  file can hold both sets, as the paper's countdown.json does (rows 0-199 train, 200-2199 eval).
- `--eval-size N`: at most the first N rows of every eval split (after --eval-rows), for data files
  too (a generated Countdown eval set is generated at that size).
- The overlap: per eval split, how many of its rows have a prompt that is also a training prompt
  (`train_eval_overlap`, said in one line before training and recorded in every checkpoint's
  trainer_state.json), so a result measured on training problems never passes unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from esft.tasks.base import PROMPT_SOURCE, Task, TaskError

ROWS_PATTERN = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*$")


def parse_rows(spec: str) -> slice:
    """"0:200" -> slice(0, 200); ValueError unless spec is START:STOP with optional integer ends."""
    match = ROWS_PATTERN.match(spec)
    if match is None:
        raise ValueError(f"expected START:STOP such as 0:200, 200: or :-100, got {spec!r}")
    start, stop = (int(value) if value is not None else None for value in match.groups())
    return slice(start, stop)


def _take(rows: list[dict[str, Any]], spec: str | None, limit: int | None, flag: str, where: str) -> list[dict[str, Any]]:
    if spec is not None:
        chosen = rows[parse_rows(spec)]
        if not chosen:
            raise TaskError(f"{flag} {spec!r} selects no row of {where}, which has {len(rows)} rows (0-based, STOP "
                            "excluded)")
        rows = chosen
    return rows[:limit] if limit is not None else rows


def select_rows(task: Task, train_rows: str | None = None, eval_rows: str | None = None,
                eval_size: int | None = None) -> Task:
    """The task with --train-rows, --eval-rows and --eval-size applied, and its train_eval_overlap
    in metadata."""
    train = _take(list(task.train_dataset), train_rows, None, "--train-rows", task.where()) if task.train_dataset else []
    evals = {split: _take(list(rows), eval_rows, eval_size, "--eval-rows", task.where(split))
             for split, rows in task.eval_datasets.items()}
    task = dataclasses.replace(task, train_dataset=train, eval_datasets=evals, metadata=dict(task.metadata))
    task.metadata["train_eval_overlap"] = train_eval_overlap(task)
    return task


def _prompt_key(row: dict[str, Any]) -> str:
    return json.dumps(row.get(PROMPT_SOURCE, row.get("prompt")), sort_keys=True, default=str)


def train_eval_overlap(task: Task) -> dict[str, int]:
    """{eval split: how many of its rows have a prompt that is also a training prompt}."""
    train = {_prompt_key(row) for row in task.train_dataset}
    return {split: sum(_prompt_key(row) in train for row in rows) for split, rows in task.eval_datasets.items()}


def overlap_line(task: Task) -> str | None:
    """The one line said before training (None without training or eval data); it starts with "warning: "
    when eval prompts are training prompts (the CLI repeats it then in its final summary)."""
    if not task.train_dataset or not task.eval_datasets:
        return None
    overlap = task.metadata.get("train_eval_overlap") or train_eval_overlap(task)
    counts = ", ".join(f"{split} {overlap.get(split, 0)} of {len(rows)}" for split, rows in task.eval_datasets.items())
    line = f"eval rows whose prompt is also a training prompt: {counts}"
    if any(overlap.values()):
        line = (f"warning: {line} (those results measure training problems; --train-rows START:STOP and --eval-rows "
                "START:STOP take slices of a data file)")
    return line


def with_prompts(rows: Any, column: str | None, template: str | None, where: str) -> Any:
    """Rows with `prompt` taken from `column` (--prompt-column) or built by `template`
    (--prompt-template, str.format over the row's columns; a literal \\n in it is a newline); rows
    as they are when neither is given. Rows that are not mappings are left for check_rows to name."""
    if column is None and template is None:
        return rows
    template = template.replace("\\n", "\n") if template is not None else None
    result = []
    for index, row in enumerate(rows):
        if not hasattr(row, "keys"):
            result.append(row)
            continue
        row = dict(row)
        if column is not None:
            if column not in row:
                raise TaskError(f"{where} row {index}: --prompt-column {column!r} is not one of its columns "
                                f"{sorted(row)}")
            row["prompt"] = row[column]
        else:
            try:
                row["prompt"] = template.format(**row)
            except (KeyError, IndexError, ValueError) as error:
                raise TaskError(f"{where} row {index}: --prompt-template {template!r} cannot be filled "
                                f"({type(error).__name__}: {error}); its columns are {sorted(row)} (write a literal "
                                "brace as {{ or }})") from None
        result.append(row)
    return result
