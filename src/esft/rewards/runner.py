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
that function's value for the sample(s) `failure_reward` (default 0), counted in `errors`/`timeouts`
and listed in `failed_samples` (ES leaves them out of a member's fitness unless --failed-samples fill:
esft.loop.member_fitness).
User functions run in sandbox worker processes (esft.rewards.sandbox, shipped by esft.rewards.usercode); trusted
built-ins run in-process. A round of scoring in which a function failed on every sample is what
`failing_everywhere` finds; the trainer then stops with a RewardError (README: the reward sandbox).
"""

from __future__ import annotations

import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from esft.es.fitness import finite_mean
from esft.rewards.conventions import TRL, TRL_EXTRAS, RewardTrainerState, convention_of, target_column
from esft.rewards.values import TRUSTED_ATTRIBUTE, RewardCall, call_reward, trusted_reward
from esft.rewards.sandbox import Outcome, WorkerPool
from esft.rewards.usercode import ByReference, NotShippable, describe, ship

logger = logging.getLogger("esft")

# TRL's reward signature: f(prompts, completions, completion_ids, **columns) -> list[float | None];
# None = no score.
RewardFunc = Callable[..., Sequence[float | None]]
PROVIDED_ARGUMENTS = ("prompts", "completions", "completion_ids") + TRL_EXTRAS
"""What every reward call provides besides the data's columns."""
PROMPT_SOURCE = "_prompt_source"
"""Row key holding a chat prompt's original messages once `prompt` holds the rendered text (reward
functions receive the original, as in TRL; it is never passed as a column)."""
FAILURE_KINDS = {"error": "raised an exception", "invalid": "returned something other than numbers",
                 "timeout": "timed out", "crash": "killed its worker process",
                 "service": "got no scores from its reward service",
                 "overflow": "gave rewards too large to average or shape in float64"}
SERVICE_ERROR = "RewardServiceError"
"""esft.rewards.remote's exception (named, not imported: the runner stays apart from the HTTP client)."""


def reward_name(func: RewardFunc) -> str:
    """The name used in metrics (`rewards/<name>/mean`), as TRL names reward functions."""
    func = getattr(func, "func", func)  # functools.partial
    return getattr(func, "__name__", type(func).__name__)


@dataclass
class Failure:
    """The first failure of one function in a batch: kind (a FAILURE_KINDS key), message, traceback."""

    kind: str
    message: str
    traceback: str = ""


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
    failed: dict[str, int] = field(default_factory=dict)
    """Failed samples per function."""
    failed_samples: dict[str, list[int]] = field(default_factory=dict)
    """Per function, the indices of the samples it failed on (their value is the failure reward)."""
    first_failure: dict[str, Failure] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)
    """Values reward functions passed to TRL's log_metric, by name (esft.rewards.conventions)."""
    extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sample columns reward functions passed to TRL's log_extra."""
    labels: dict[str, list[str | None]] = field(default_factory=dict)
    """Per function returning (label, reward) pairs (ES-at-Scale's convention): each sample's label."""

    def mean(self) -> float:
        """Mean over scored samples, failed ones counting the failure reward (--failed-samples fill;
        esft.loop.member_fitness leaves them out by default); the failure reward when no sample
        was scored (so one member cannot poison the population's statistics)."""
        values = [v for v in self.total if v is not None]
        return finite_mean(values) if values else self.failure_reward


def failing_everywhere(batches: Sequence[Scores]) -> dict[str, Failure]:
    """{function: its first failure} for every function that failed on every sample of `batches`
    (one round of scoring: an iteration's members, or an evaluation)."""
    if not batches or not any(scores.total for scores in batches):
        return {}
    found = {}
    for name in batches[0].per_function:
        samples = sum(len(scores.total) for scores in batches)
        if sum(scores.failed.get(name, 0) for scores in batches) == samples:
            found[name] = next(scores.first_failure[name] for scores in batches if name in scores.first_failure)
    return found


class RewardError(RuntimeError):
    """A reward function could not score anything: the run stops instead of training on noise."""

    def __init__(self, name: str, failure: Failure, when: str, consequence: str = ""):
        self.function, self.failure, self.when = name, failure, when
        self.headline = (f"reward function {name} {FAILURE_KINDS.get(failure.kind, failure.kind)} on every sample of "
                         f"{when} ({failure.message})" + (f"; {consequence}" if consequence else ""))
        super().__init__(self.headline + (f"\n{failure.traceback}" if failure.traceback else ""))


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
    """Built-in rewards marked with trusted_reward run in-process."""
    return bool(getattr(func, TRUSTED_ATTRIBUTE, False))


def _in_process(func: RewardFunc, kwargs: dict[str, Any], n: int, options: dict[str, Any]) -> Outcome:
    try:
        return Outcome("ok", call_reward(func, kwargs, n, options))
    except Exception as error:  # noqa: BLE001 - MemoryError and friends from user code
        return Outcome("error", message=describe(error))


_CALL_REWARD = ByReference("esft.rewards.values", "call_reward")


@dataclass(frozen=True)
class SandboxSettings:
    """How reward functions are run and what a failure scores: ESConfig's fields of these names
    (esft.settings.fields, where each is documented)."""

    failure_reward: float = 0.0
    reward_sandbox: bool = True
    reward_timeout: float = 10.0
    reward_memory_mb: int = 4096
    reward_workers: int = 2
    target_column: str | None = None


def reward_runners(task: Any, settings: SandboxSettings) -> tuple[RewardRunner, RewardRunner | None]:
    """The reward runner (and accuracy runner, if the task has an accuracy function) of a task
    (reward_funcs, reward_weights, accuracy_func) with these sandbox settings.
    The trainer and every Ray actor score through these."""
    options = dict(failure_reward=settings.failure_reward, sandbox=settings.reward_sandbox,
                   timeout=settings.reward_timeout, memory_mb=settings.reward_memory_mb, workers=settings.reward_workers,
                   target_column=settings.target_column)
    rewards = RewardRunner(task.reward_funcs, task.reward_weights, **options)
    if task.accuracy_func is None:
        return rewards, None
    if task.reward_funcs == [task.accuracy_func] and task.reward_weights in (None, [1.0]):
        return rewards, rewards  # the reward is the accuracy: score once
    return rewards, RewardRunner([task.accuracy_func], **options)


class RewardRunner:
    """Scores batches with reward functions: untrusted ones in a sandbox WorkerPool (one call per
    function per batch, with `timeout`; shipped by reference or by value, esft.rewards.usercode.ship),
    trusted ones in-process, as is everything with sandbox=False. A callable that cannot be pickled
    at all also runs in-process, said in one warning. Each kind of failure of each function is
    logged once."""

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
        target_column: str | None = None,
    ):
        self.funcs = list(reward_funcs)
        self.conventions = [convention_of(func) for func in self.funcs]
        self.target_column = target_column
        self.trainer_state: RewardTrainerState | None = None
        """What reward functions get as TRL's `trainer_state` (the trainer sets it before scoring)."""
        self.weights = list(weights) if weights is not None else [1.0] * len(self.funcs)
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.funcs)} reward functions")
        self.names = [reward_name(func) for func in self.funcs]
        self.failure_reward = failure_reward
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.workers = workers
        self.accepted = [accepted_kwargs(func) for func in self.funcs]
        self.shipped: list[Any] = []
        """Per function: how it reaches the sandbox (esft.rewards.usercode Shipped), None = runs in-process."""
        for func, name in zip(self.funcs, self.names):
            shipped = None
            if sandbox and not is_trusted(func):
                try:
                    shipped = ship(func)
                except NotShippable as why:
                    logger.warning("reward function %s runs in-process, without timeout or crash protection: it cannot "
                                   "be pickled for a worker process (%s)", name, why)
            self.shipped.append(shipped)
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
        jobs, slots, in_process = [], [], []
        target = target_column(arguments, self.target_column)
        for i, (func, shipped, accepted) in enumerate(zip(self.funcs, self.shipped, self.accepted)):
            convention = self.conventions[i]
            if convention != TRL:  # called per sample with its text and target (esft.rewards.conventions)
                kwargs, hooks = arguments, ()
            else:
                kwargs = arguments if accepted is None else {k: v for k, v in arguments.items() if k in accepted}
                hooks = tuple(name for name in TRL_EXTRAS if accepted is None or name in accepted)
            options = {"convention": convention, "target": target, "hooks": hooks, "trainer_state": self.trainer_state}
            if shipped is None and inspect.iscoroutinefunction(func):
                in_process.append((i, kwargs, options))  # async: awaited together below, as TRL gathers them
            elif shipped is None:
                results[i] = _in_process(func, kwargs, n, options)
            else:
                jobs.append((_CALL_REWARD, (shipped, kwargs, n, options), {}))
                slots.append(i)
        if len(in_process) == 1:
            i, kwargs, options = in_process[0]
            results[i] = _in_process(self.funcs[i], kwargs, n, options)
        elif in_process:  # each in a thread of its own, with its own event loop: concurrently
            with ThreadPoolExecutor(len(in_process)) as pool:
                futures = [(i, pool.submit(_in_process, self.funcs[i], kwargs, n, options)) for i, kwargs, options in in_process]
                for i, future in futures:
                    results[i] = future.result()
        if jobs:
            if self.pool is None:
                self.pool = WorkerPool(self.workers, self.memory_mb)
            for i, outcome in zip(slots, self.pool.run(jobs, self.timeout)):
                results[i] = outcome
        scores = Scores(total=[None] * n, failure_reward=self.failure_reward)
        for name, weight, outcome in zip(self.names, self.weights, results):
            values, errors, failure = self._values(name, outcome, n)
            if outcome.ok:
                self._collect(scores, name, RewardCall(*outcome.value))
            cleaned = [self.failure_reward if i in errors else value for i, value in enumerate(values)]
            if outcome.kind == "timeout":
                scores.timeouts += len(errors)
            else:
                scores.errors += len(errors)
            scores.failed[name] = len(errors)
            scores.failed_samples[name] = sorted(errors)
            if failure is not None:
                scores.first_failure[name] = failure
            scores.per_function[name] = cleaned
            for i, value in enumerate(cleaned):
                if value is not None:
                    scores.total[i] = (scores.total[i] or 0.0) + weight * value
        scores.failures = scores.errors + scores.timeouts
        return scores

    @staticmethod
    def _collect(scores: Scores, name: str, call: RewardCall) -> None:
        """What a call logged (TRL's log_metric, log_extra) and its labels, into the batch's Scores."""
        for metric, values in (call.logged or {}).items():
            scores.logged.setdefault(metric, []).extend(values)
        scores.extras.update(call.extras or {})
        if call.labels is not None:
            scores.labels[name] = call.labels

    def _values(self, name: str, outcome: Outcome, n: int) -> tuple[list[float | None], dict[int, str], Failure | None]:
        """One function's values, failed samples and first failure, logging each kind once."""
        printed = "".join(f"\n    {line}" for line in outcome.output.strip().splitlines()[-20:])
        detail = lambda text: (text + "\n" if text else "") + "  what it printed last:" + printed if printed else text  # noqa: E731
        if not outcome.ok:
            kind = {"timeout": "timeout", "crash": "crash"}.get(outcome.kind, "error")
            self._log_once(name, "timeout" if kind == "timeout" else "error", outcome.message)
            return [None] * n, dict.fromkeys(range(n), outcome.message), Failure(kind, outcome.message, detail(outcome.traceback))
        call = RewardCall(*outcome.value)
        failure = None
        if call.errors:
            # the batch call's own error names the real lengths ("returned 0 values for 4 completions")
            message = call.batch_error or next(iter(call.errors.values()))
            kind = "service" if message.startswith(SERVICE_ERROR + ":") else "error" if call.traceback else "invalid"
            failure = Failure(kind, message.removeprefix(SERVICE_ERROR + ": "), detail(call.traceback))
            self._log_once(name, "error", message)
        elif call.batch_error:
            self._log_once(name, "batch failure", f"the batch call failed ({call.batch_error}) but every "
                           "sample alone succeeded; it is retried sample by sample each time")
        return call.values, call.errors, failure

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
