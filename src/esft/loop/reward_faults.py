"""What a run does when rewards cannot train it (README "Reliability"): a reward function that fails
on every sample of an iteration stops it, unless --reward-skip-failing names that function; rewards
too large to average or shape (1e308 each) stop it with the same one-line rule. And what a failed
sample counts in the update is esft.es.fitness's FAILED_SAMPLES policy, applied in esft.loop.member_fitness."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from esft.es.shaping import REWARD_SHAPING
from esft.settings.rules import split_list
from esft.console import say
from esft.rewards.runner import Failure, RewardError, Scores, failing_everywhere
from esft.tasks.base import TaskError


def skip_failing(reward_skip_failing: str | None, names: Sequence[str]) -> set[str]:
    """The reward functions --reward-skip-failing names (a name that is none of the run's reward
    functions is an error before the model loads: a typo would silently leave the rule on)."""
    wanted = split_list(reward_skip_failing)
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise TaskError(f"--reward-skip-failing: no reward function named {', '.join(unknown)}; this run's reward "
                        f"functions: {', '.join(names)}")
    return set(wanted)


def stop_if_unshapeable(rewards: Sequence[float], shaping: str, batches: Sequence[Scores], when: str,
                        consequence) -> None:
    """RewardError (one line, exit 2) when the members' rewards, or their spread that a shaping such as
    --reward-shaping zscore divides by (Shaping.needs_finite_spread), are not finite numbers in float64
    (finite rewards near 1e308 overflow there); `consequence()` writes the checkpoint and says how to go on."""
    values = np.asarray(rewards, dtype=np.float64)
    with np.errstate(all="ignore"):
        spread = (values.std() if REWARD_SHAPING[shaping].needs_finite_spread and np.all(np.isfinite(values))
                  else 0.0)
    if np.all(np.isfinite(values)) and np.isfinite(spread):
        return
    largest: dict[str, float] = {}
    for scores in batches:
        for name, values_of in scores.per_function.items():
            present = [abs(v) for v in values_of if v is not None]
            largest[name] = max([largest.get(name, 0.0), *present])
    name = max(largest, key=largest.get) if largest else "(combined)"
    failure = Failure("overflow", f"members' rewards from {min(rewards):.3g} to {max(rewards):.3g}; its largest "
                      f"value {largest.get(name, float('nan')):.3g}: scale the rewards down")
    raise RewardError(name, failure, when, consequence())


def count_failures(totals: dict[str, dict[str, Any]], names: Sequence[str], batches: Sequence[Scores]) -> None:
    """Add an iteration's failures (`batches`: its Scores) to the run's `totals` per reward function:
    failed and scored samples, and the first failure (failure_summary reports them)."""
    for name in names:
        total = totals.setdefault(name, {"failed": 0, "samples": 0, "first": None})
        total["samples"] += sum(len(scores.total) for scores in batches)
        total["failed"] += sum(scores.failed.get(name, 0) for scores in batches)
        found = next((scores.first_failure[name] for scores in batches if name in scores.first_failure), None)
        total["first"] = total["first"] or found


def stop_if_unscorable(batches: Sequence[Scores], names: Sequence[str], skip: set[str], when: str,
                       checkpoint: Callable[[], str]) -> None:
    """RewardError when a reward function failed on every sample of an iteration (`batches`: its scores;
    `names`: every reward function's): training on the other rewards alone would change the objective.
    No update is applied; `checkpoint()` writes the weights from before the iteration (unless the run
    is at its very start) and says how to go on. Functions in `skip` (--reward-skip-failing) are left
    out of the iteration's rewards instead, said on one line."""
    failing = failing_everywhere(batches)
    skipped = {name: failure for name, failure in failing.items() if name in skip}
    if len(failing) > len(skipped) or (failing and len(failing) == len(names)):
        name, failure = next((n, f) for n, f in failing.items() if n not in skipped or len(skipped) == len(failing))
        raise RewardError(name, failure, when, checkpoint())
    for name, failure in skipped.items():
        say(f"esft: {when}: reward function {name} failed on every sample ({failure.message}); trained on the other "
            f"rewards (--reward-skip-failing {name})")


def failure_summary(failure_totals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Reward failure counts of a train() call, per function and in all (also printed: a run never ends
    silent about them). `failure_totals`: per function, failed and scored samples and the first failure."""
    summary: dict[str, Any] = {}
    for name, total in failure_totals.items():
        if total["failed"]:
            summary[f"rewards/{name}/failures_total"] = total["failed"]
            first = total["first"]
            say(f"esft: reward function {name} failed on {total['failed']} of {total['samples']} samples"
                + (f" (first: {first.message})" if first else ""))
    if summary:
        summary["reward/failures_total"] = sum(summary.values())
    return summary
