"""Reward functions as other projects write them, called as they expect (detected by signature):

- TRL (the default): `f(prompts, completions, **columns) -> list[float | None]`, one call per batch.
  Also given, as TRL gives them: `trainer_state` (global_step = updates done so far, max_steps =
  --iterations), `log_metric(name, value)` (a scalar, averaged over the iteration's calls and logged
  as `name`, TRL's key; `eval/<split>/<name>` during evaluation) and `log_extra(column, values)` (a
  column of per-sample values, written into the evaluation's per-sample records).
- ES-at-Scale and the paper's scripts: `reward(model_output, target, fast=False) -> (label, reward)`
  (any function whose only required parameters are two positional ones): called per completion
  with its text and the row's target column (--target-column); a returned (label, reward) pair has
  its label counted per kind (`rewards/<fn>/labels/<label>`), a bare number is the reward.
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)` (detected by the
  names solution_str and ground_truth): per completion, with the row's `data_source` and
  `extra_info` columns (None if absent) and the target column as ground_truth (a verl
  `reward_model` column {"ground_truth": ...} is unwrapped); a returned dict gives its "score".

`async def` functions of every convention are awaited (each call in its own event loop; several
functions run at once in the sandbox's worker processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from dataclasses import dataclass
from typing import Any

TRL, ES_AT_SCALE, VERL = "trl", "es-at-scale", "verl"
TARGET_COLUMNS = ("target", "answer", "ground_truth", "solution")
"""The target column of a per-sample reward when --target-column is not given: the first the data has."""
TRL_EXTRAS = ("trainer_state", "log_metric", "log_extra")
"""The keyword arguments TRL passes to every reward function besides the data's columns."""


@dataclass(frozen=True)
class RewardTrainerState:
    """What a reward function's `trainer_state` holds (TRL passes transformers' TrainerState)."""

    global_step: int
    """Updates (ES iterations, GRPO optimizer steps) done so far."""
    max_steps: int
    """--iterations."""


def convention_of(func: Any) -> str:
    """TRL, ES_AT_SCALE or VERL, from `func`'s signature (TRL when it cannot be read)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return TRL
    names = {p.name for p in params}
    if "completions" in names or any(p.kind is p.VAR_KEYWORD for p in params):
        return TRL
    if {"solution_str", "ground_truth"} <= names:
        return VERL
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind is not p.VAR_POSITIONAL]
    if len(required) == 2 and all(p.kind in positional for p in required) and params[:2] == required:
        return ES_AT_SCALE
    return TRL


def target_column(columns: Any, chosen: str | None) -> str | None:
    """The column a per-sample reward gets as its target: `chosen`, else the first of TARGET_COLUMNS
    in `columns` (None if there is none)."""
    if chosen is not None:
        return chosen if chosen in columns else None
    return next((name for name in TARGET_COLUMNS if name in columns), None)


def awaited(result: Any) -> Any:
    """The value of an awaitable (an `async def` reward's call), else `result` itself; run in a
    thread of its own when this thread already runs an event loop (a notebook's)."""
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def _text(completion: Any) -> str:
    """A completion as text: chat completions [{"role": "assistant", "content": ...}] give their content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return completion


def call_per_sample(func: Any, convention: str, kwargs: dict[str, list], target: str | None) -> tuple[list[Any], list[Any]]:
    """Call an ES-at-Scale or verl function once per completion: (rewards, labels)."""
    completions = [_text(c) for c in kwargs["completions"]]
    targets = kwargs.get(target, [None] * len(completions)) if target else [None] * len(completions)
    values, labels = [], []
    for i, completion in enumerate(completions):
        if convention == VERL:
            truth = targets[i]
            if target == "reward_model" and isinstance(truth, dict):
                truth = truth.get("ground_truth")
            extra = kwargs.get("extra_info", [None] * len(completions))[i]
            source = kwargs.get("data_source", [None] * len(completions))[i]
            result = awaited(func(data_source=source, solution_str=completion, ground_truth=truth, extra_info=extra))
            if isinstance(result, dict):
                result = result.get("score")
            label = None
        else:
            result = awaited(func(completion, targets[i]))
            label = None
            if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], str):
                label, result = result
        values.append(result)
        labels.append(label)
    return values, labels
