"""Scoring completions with TRL-style reward functions: f(prompts, completions, **columns).

Functions are called as TRL calls them: `f(prompts=..., completions=..., completion_ids=...,
**columns)`, keywords only (a function without **kwargs receives just the arguments it names);
`completion_ids` are the generated token ids of each completion, up to and including its EOS, when
the caller has them. For chat-message prompts, `prompts` holds the original messages and each
completion is `[{"role": "assistant", "content": ...}]`.

Several functions are combined as a weighted sum per sample. A function's `None` for a sample means
"no score here": that function is left out of the sample's sum, and a sample no function scored is
left out of the member's mean; a member none of whose samples was scored gets `failure_reward`.
Failures are not scores: NaN/inf, a non-number, an exception, a timeout or a crashed worker give
that function's value for the sample(s) `failure_reward` (default 0), counted in `errors`/`timeouts`.
User functions run in sandbox worker processes (esft.sandbox); trusted built-ins run in-process.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from esft.sandbox import FuncRef, Outcome, WorkerPool, call_reward, describe, func_ref
from esft.tasks.base import PROMPT_SOURCE, TRUSTED_ATTRIBUTE, RewardFunc

logger = logging.getLogger("esft")


def reward_name(func: RewardFunc) -> str:
    """The name used in metrics (`rewards/<name>/mean`), as TRL names reward functions."""
    func = getattr(func, "func", func)  # functools.partial
    return getattr(func, "__name__", type(func).__name__)


@dataclass
class Scores:
    """Per-sample rewards of one batch of completions."""

    total: list[float | None]
    """Weighted sum per sample; None where no function scored the sample."""
    per_function: dict[str, list[float | None]] = field(default_factory=dict)
    failures: int = 0
    """(function, sample) values replaced by the failure reward: errors + timeouts."""
    errors: int = 0
    """Failures from exceptions, crashed workers, non-numbers and NaN/inf."""
    timeouts: int = 0
    """Failures from calls that passed the reward timeout."""
    failure_reward: float = 0.0

    def mean(self) -> float:
        """Mean over scored samples; the failure reward when no sample was scored (so one member
        cannot poison the population's statistics)."""
        values = [v for v in self.total if v is not None]
        return sum(values) / len(values) if values else self.failure_reward


def columns_of(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every column but `prompt`, as lists: what reward functions receive as keyword arguments."""
    names = list(dict.fromkeys(name for row in rows for name in row if name not in ("prompt", PROMPT_SOURCE)))
    return {name: [row.get(name) for row in rows] for name in names}


def score(
    reward_funcs: Sequence[RewardFunc],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[str],
    weights: Sequence[float] | None = None,
    failure_reward: float = 0.0,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> Scores:
    """Run every reward function on the batch in-process and combine them."""
    runner = RewardRunner(reward_funcs, weights, failure_reward=failure_reward, sandbox=False)
    return runner.score(rows, completions, completion_ids)


def mean_of(values: Sequence[float | None]) -> float | None:
    """Mean of the non-None values, None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def accepted_kwargs(func: RewardFunc) -> set[str] | None:
    """Keyword arguments `func` takes: None if it takes any (**kwargs or no inspectable signature)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def is_trusted(func: RewardFunc) -> bool:
    """Built-in rewards marked with esft.tasks.base.trusted_reward run in-process."""
    return bool(getattr(func, TRUSTED_ATTRIBUTE, False))


_CALL_REWARD = FuncRef("esft.sandbox", "call_reward")


class RewardRunner:
    """Scores batches with reward functions: untrusted ones in a sandbox WorkerPool (one call per
    function per batch, with `timeout`), trusted ones and unsendable ones (lambdas, closures:
    warned about once) in-process. Each kind of failure of each function is logged once."""

    def __init__(
        self,
        reward_funcs: Sequence[RewardFunc],
        weights: Sequence[float] | None = None,
        *,
        failure_reward: float = 0.0,
        sandbox: bool = True,
        timeout: float = 10.0,
        memory_mb: int = 0,
        workers: int = 2,
    ):
        self.funcs = list(reward_funcs)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.funcs)
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.funcs)} reward functions")
        self.names = [reward_name(func) for func in self.funcs]
        self.failure_reward = failure_reward
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.workers = workers
        self.accepted = [accepted_kwargs(func) for func in self.funcs]
        self.refs: list[Any] = []
        for func, name in zip(self.funcs, self.names):
            ref = func_ref(func) if sandbox and not is_trusted(func) else None
            if sandbox and not is_trusted(func) and ref is None:
                logger.warning("reward function %s cannot be sent to a worker process (a lambda or closure?): "
                               "it runs in-process, without timeout or crash protection", name)
            self.refs.append(ref)
        self.pool: WorkerPool | None = None
        self._logged: set[tuple[str, str]] = set()

    def score(self, rows: Sequence[dict[str, Any]], completions: Sequence[str],
              completion_ids: Sequence[Sequence[int]] | None = None) -> Scores:
        """Per-sample weighted sums of every function's rewards for these rows' completions
        (`completion_ids`, their token ids, are passed on as TRL passes them)."""
        n = len(rows)
        prompts = [row.get(PROMPT_SOURCE, row["prompt"]) for row in rows]
        texts = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c for p, c in zip(prompts, completions, strict=True)]
        arguments = {"prompts": prompts, "completions": texts, **columns_of(rows)}
        if completion_ids is not None:  # the generated ids win over a dataset column of that name
            arguments["completion_ids"] = [list(ids) for ids in completion_ids]
        results: list[Any] = [None] * len(self.funcs)
        jobs, slots = [], []
        for i, (func, ref, accepted) in enumerate(zip(self.funcs, self.refs, self.accepted)):
            kwargs = arguments if accepted is None else {k: v for k, v in arguments.items() if k in accepted}
            if ref is None:
                try:
                    results[i] = Outcome("ok", call_reward(func, kwargs, n))
                except Exception as error:  # noqa: BLE001 - MemoryError and friends from user code
                    results[i] = Outcome("error", message=describe(error))
            else:
                jobs.append((_CALL_REWARD, (ref, kwargs, n), {}))
                slots.append(i)
        if jobs:
            if self.pool is None:
                self.pool = WorkerPool(self.workers, self.memory_mb)
            for i, outcome in zip(slots, self.pool.run(jobs, self.timeout)):
                results[i] = outcome
        scores = Scores(total=[None] * n, failure_reward=self.failure_reward)
        for name, weight, outcome in zip(self.names, self.weights, results):
            if outcome.ok:
                values, errors, batch_error = outcome.value
                for message in list(errors.values())[:1]:
                    self._log_once(name, "error", message)
                if batch_error and not errors:
                    self._log_once(name, "batch failure", f"the batch call failed ({batch_error}) but every "
                                   "sample alone succeeded; it is retried sample by sample each time")
            else:
                values, errors = [None] * n, dict.fromkeys(range(n), outcome.message)
                self._log_once(name, "timeout" if outcome.kind == "timeout" else "error", outcome.message)
            cleaned = [self.failure_reward if i in errors else value for i, value in enumerate(values)]
            if outcome.kind == "timeout":
                scores.timeouts += len(errors)
            else:
                scores.errors += len(errors)
            scores.per_function[name] = cleaned
            for i, value in enumerate(cleaned):
                if value is not None:
                    scores.total[i] = (scores.total[i] or 0.0) + weight * value
        scores.failures = scores.errors + scores.timeouts
        return scores

    def _log_once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) in self._logged:
            return
        self._logged.add((name, kind))
        if kind == "batch failure":
            logger.warning("reward function %s: %s", name, message)
            return
        counter = "reward/timeouts" if kind == "timeout" else "reward/errors"
        logger.warning("reward function %s: %s; those samples get the failure reward %g (further %ss of %s are "
                       "only counted, in %s)", name, message, self.failure_reward, kind, name, counter)

    def close(self) -> None:
        """Stop the sandbox workers (a later score() starts new ones)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


# Reward services over HTTP (esft.remote_reward), importable as esft.rewards.remote_reward.
from esft.remote_reward import RemoteReward, RewardServiceError, remote_reward  # noqa: E402
