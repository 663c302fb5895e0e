"""The rules for what a reward function returns, and one call of it on a batch.

A reward function returns one value per completion: a number, or None ("no score for this sample").
Everything else is a failure of that sample: NaN/inf, a non-number, a raised exception; a return
value that is not a sequence of the right length fails the batch call, which is then retried sample
by sample, so one bad completion costs only its own score. `call_reward` runs in a sandbox worker
(esft.rewards.sandbox) or in-process (trusted built-ins, --no-reward-sandbox) alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from esft.rewards.conventions import TRL, awaited, call_per_sample
from esft.rewards.usercode import describe, resolve, user_traceback

TRUSTED_ATTRIBUTE = "__esft_trusted__"


def trusted_reward(func):
    """Mark a built-in reward function as trusted: it runs in-process, outside the sandbox."""
    setattr(func, TRUSTED_ATTRIBUTE, True)
    return func


class RewardCall(NamedTuple):
    """The outcome of one reward function on one batch of n completions."""

    values: list[float | None]
    """n values; None = no score, or failed (see `errors`)."""
    errors: dict[int, str]
    """{sample index: what went wrong} for the failed samples."""
    batch_error: str | None
    """Why the batch call failed, when it did (each sample was then retried alone)."""
    traceback: str = ""
    """The first failure's traceback lines in the user's code."""
    logged: dict[str, list[float]] | None = None
    """What the function passed to TRL's `log_metric` (name -> values), if it was given it."""
    extras: dict[str, list[Any]] | None = None
    """What it passed to TRL's `log_extra` (column -> per-sample values)."""
    labels: list[str | None] | None = None
    """Per sample, the label an ES-at-Scale reward returned with its reward."""


def clean_values(raw: Any, n: int) -> tuple[list[float | None], dict[int, str]]:
    """A reward function's return value as n floats/None plus {index: error} for non-numbers and
    NaN/inf (failures). Raises ValueError when it is not a sequence of n values."""
    if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__") or not hasattr(raw, "__iter__"):
        raise ValueError(f"returned {_short(raw)} ({type(raw).__name__}); expected a list of {n} floats or None")
    if len(raw) != n:
        raise ValueError(f"returned {len(raw)} values for {n} completion{'s' if n != 1 else ''}")
    values: list[float | None] = []
    errors: dict[int, str] = {}
    for index, value in enumerate(raw):
        if value is None:
            values.append(None)
            continue
        number = None
        if not isinstance(value, (str, bytes)) and type(value).__name__ not in ("bool", "bool_"):  # True is no reward of 1.0
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                number = None
        if number is None:
            hint = "; return a float such as 1.0 or 0.0" if type(value).__name__ in ("bool", "bool_") else ""
            errors[index] = f"returned {_short(value)} ({type(value).__name__}), not a number{hint}"
        elif number != number or number in (float("inf"), float("-inf")):
            errors[index] = f"returned {number}"
            number = None
        values.append(number)
    return values, errors


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def call_reward(func: Any, kwargs: dict[str, list], n: int, options: dict[str, Any] | None = None) -> RewardCall:
    """Run a reward function (a callable or an esft.rewards.usercode Shipped) on a batch: `func(**kwargs)`,
    every kwarg a list of n items. A failed batch call is retried sample by sample. `options`
    (esft.rewards.runner): "convention" (esft.rewards.conventions; per-sample conventions get
    "target", the target column), "trainer_state", and "hooks": which of TRL's log_metric /
    log_extra the function takes (what it logs comes back in the RewardCall)."""
    func = resolve(func)
    options = options or {}
    logged: dict[str, list[float]] = {}
    extras: dict[str, list[Any]] = {}
    fixed: dict[str, Any] = {}
    hooks = options.get("hooks", ())
    if "trainer_state" in hooks:
        fixed["trainer_state"] = options.get("trainer_state")
    if "log_metric" in hooks:
        fixed["log_metric"] = lambda name, value: logged.setdefault(str(name), []).append(float(value))
    if "log_extra" in hooks:
        fixed["log_extra"] = lambda column, values: extras.setdefault(str(column), []).extend(values)
    convention = options.get("convention", TRL)

    def invoke(batch: dict[str, list]) -> tuple[Any, list[Any] | None]:
        if convention == TRL:
            return awaited(func(**batch, **fixed)), None
        return call_per_sample(func, convention, batch, options.get("target"))

    def done(values, errors, batch_error, detail="", labels=None) -> RewardCall:
        has_labels = labels is not None and any(label is not None for label in labels)
        return RewardCall(values, errors, batch_error, detail, logged if "log_metric" in hooks else None,
                          extras if "log_extra" in hooks else None, labels if has_labels else None)

    try:
        raw, labels = invoke(kwargs)
        values, errors = clean_values(raw, n)
        return done(values, errors, None, labels=labels)
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - user code may raise anything
        batch_error, detail = describe(error), user_traceback(error)
    if n == 1:
        return done([None], {0: batch_error}, batch_error, detail)
    values: list[float | None] = []
    labels: list[Any] = []
    errors: dict[int, str] = {}
    extras.clear()  # the batch call's columns would not line up with the samples
    for index in range(n):
        label = None
        try:
            raw, one_label = invoke({k: v[index : index + 1] for k, v in kwargs.items()})
            (value,), one_error = clean_values(raw, 1)
            label = one_label[0] if one_label else None
            if one_error:
                errors[index] = one_error[0]
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001
            value, errors[index] = None, describe(error)
            detail = detail or user_traceback(error)
        values.append(value)
        labels.append(label)
    return done(values, errors, batch_error, detail, labels)
