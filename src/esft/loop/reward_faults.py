"""What a run does when rewards cannot train it (README "Reliability"): a reward function that fails
on every sample of an iteration stops it, unless --reward-skip-failing names that function; rewards
too large to average or shape (1e308 each) stop it with the same one-line rule. And what a failed
sample counts in the update (--failed-samples, measured in benchmarks/failure_policy.py): by default
nothing, it is left out of its member's mean and of its prompt's column."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from esft.settings.rules import split_list
from esft.console import say
from esft.rewards.runner import Failure, RewardError, Scores, failing_everywhere, finite_mean
from esft.tasks.base import TaskError


def skip_failing(args: Any, names: Sequence[str]) -> set[str]:
    """The reward functions --reward-skip-failing names (a name that is none of the run's reward
    functions is an error before the model loads: a typo would silently leave the rule on)."""
    wanted = split_list(getattr(args, "reward_skip_failing", None))
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise TaskError(f"--reward-skip-failing: no reward function named {', '.join(unknown)}; this run's reward "
                        f"functions: {', '.join(names)}")
    return set(wanted)


def stop_if_unshapeable(rewards: Sequence[float], shaping: str, batches: Sequence[Scores], when: str,
                        consequence) -> None:
    """RewardError (one line, exit 2) when the members' rewards, or their spread that --reward-shaping
    zscore divides by, are not finite numbers in float64 (finite rewards near 1e308 overflow there);
    `consequence()` writes the checkpoint and says how to go on."""
    values = np.asarray(rewards, dtype=np.float64)
    with np.errstate(all="ignore"):
        spread = values.std() if shaping in ("zscore", "per_prompt") and np.all(np.isfinite(values)) else 0.0
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


FAILED_SAMPLES = ("omit", "fill")
"""--failed-samples: what a sample a reward function failed on counts in the update. omit: nothing
(left out of its member's mean and its prompt's column); fill: --failure-reward."""


def reward_matrix(batches: Sequence[Scores], failed: str = "omit") -> np.ndarray:
    """The members × prompts matrix of an iteration's rewards (`batches`: one Scores per member, all
    on the same prompts) that --reward-shaping per_prompt z-scores column by column. NaN marks an
    entry left out of its prompt's column: a sample no function scored (None), or, with `failed`
    "omit", one a reward function failed on (its value is the failure reward, not a score; with
    "fill" it stays that value). A function that failed on every sample of the iteration (the run
    goes on only under --reward-skip-failing) is not held against any sample: it adds the same
    failure reward to every entry."""
    everywhere = set(failing_everywhere(batches))
    matrix = np.full((len(batches), max((len(scores.total) for scores in batches), default=0)), np.nan)
    for row, scores in zip(matrix, batches):
        failed_here = set() if failed == "fill" else {i for name, samples in scores.failed_samples.items()
                                                      if name not in everywhere for i in samples}
        for i, value in enumerate(scores.total):
            if value is not None and i not in failed_here:
                row[i] = value
    return matrix


def member_rewards(batches: Sequence[Scores], failed: str = "omit") -> list[float]:
    """Each member's fitness, the mean reward of its batch (`batches`: one Scores per member, on the
    same prompts). "fill": failed samples count the failure reward (Scores.mean). "omit": they are left
    out, as in reward_matrix; a member left with no sample gets the mean of the others' fitness, so
    that z-scoring gives it 0 and it neither pulls nor pushes the update (a timed-out reward call
    fails a member's whole batch). Without failures both are Scores.mean, to the bit."""
    if failed == "fill":
        return [scores.mean() for scores in batches]
    means = [finite_mean(kept) if (kept := [float(v) for v in row if not np.isnan(v)]) else None
             for row in reward_matrix(batches, "omit")]
    known = [mean for mean in means if mean is not None]
    if not known:  # nothing scored anywhere (all None): the failure reward, as Scores.mean gives
        return [scores.mean() for scores in batches]
    neutral = finite_mean(known)
    return [neutral if mean is None else mean for mean in means]
