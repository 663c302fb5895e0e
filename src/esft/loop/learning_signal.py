"""Whether an ES iteration could move the weights, and if not, why (issue 50).

ES moves the weights only when members' rewards differ: when every member ties, z-scores (and
ranks) are all zero and so is the update. Two causes look alike in the rewards and need different
fixes, and the members' completions tell them apart:

- every member wrote the same completions: σ is too small to change this model's greedy output
  (a model whose weights are large, e.g. most pretrained models at the paper's σ = 1e-3);
- completions differ but every one scored the same: the reward gives no signal on this data (all 0
  on a task the model cannot do yet, a reward that ignores what changed).

`LearningWatch` says the cause once, counts later ties, and says at the end of a run whether the
weights moved at all. Completions are compared by a stable digest (esft.engines.base.fingerprint),
taken where the text is (a Ray actor), so no text crosses processes for it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from esft.console import say

SIGMA_HINT = "a larger --sigma (esft sigma-scan measures one for this model and task)"


def distinct_per_prompt(fingerprints: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] | None = None
                        ) -> list[int]:
    """For each prompt of the batch, how many different completions the members that answered it wrote.
    `fingerprints`: one sequence per member; `prompts`: the batch index each of them answered (members ×
    samples, esft.es.groups.prompts_of_members), by default every member on the whole batch, in its order."""
    if prompts is None:
        return [len(set(column)) for column in zip(*fingerprints, strict=True)]
    seen: dict[int, set[int]] = {}
    for row, where in zip(fingerprints, prompts, strict=True):
        for fingerprint, prompt in zip(row, where, strict=True):
            seen.setdefault(int(prompt), set()).add(fingerprint)
    return [len(seen[prompt]) for prompt in sorted(seen)]


def pairs_differ(rewards: Sequence[float]) -> float:
    """Under a mirrored strategy (--strategy antithetic: members [s, ~s, ...]): the fraction of ±σ pairs whose
    two rewards differ (a pair that ties adds nothing to the update)."""
    pairs = list(zip(rewards[0::2], rewards[1::2]))
    return sum(a != b for a, b in pairs) / len(pairs)


@dataclass
class IterationSignal:
    """What one iteration's population shows about learning."""

    tied: bool
    """Every update coefficient is zero: the weights do not move by this iteration's rewards."""
    distinct: list[int]
    """distinct_per_prompt of the members' completions."""
    reward: float
    """The members' mean reward (all equal when tied by their rewards)."""
    rewards_differ: bool = False
    """The members' rewards differ, yet every coefficient is zero: the strategy or the shaping gave them no
    weight (a strategy or shaping of the user's that zeroes members)."""

    @property
    def identical(self) -> bool:
        """Every member wrote the same completion on every prompt."""
        return all(count == 1 for count in self.distinct)

    def cause(self, sigma: float) -> str:
        """Why a tied iteration does not move the weights, in words (with what to try)."""
        if self.rewards_differ:
            return ("the members' rewards differ, but --strategy and --reward-shaping gave every member a zero "
                    "coefficient")
        if self.identical:
            return (f"every member wrote the same completions on all {len(self.distinct)} prompts: σ = {sigma:g} is too "
                    f"small to change this model's output; try {SIGMA_HINT}")
        differ = sum(count > 1 for count in self.distinct)
        return (f"members' completions differ on {differ} of {len(self.distinct)} prompts, but the reward scored every "
                f"member {self.reward:.4g}: it gives no signal on this data (check it on these completions, or use "
                "easier data)")


def iteration_signal(rewards: Sequence[float], coefficients: Sequence[float],
                     fingerprints: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] | None = None
                     ) -> IterationSignal:
    return IterationSignal(tied=not any(coefficients), distinct=distinct_per_prompt(fingerprints, prompts),
                           reward=float(sum(rewards) / len(rewards)), rewards_differ=min(rewards) != max(rewards))


class LearningWatch:
    """Over one train() call: each iteration's signal metrics; the first tied iteration said with its
    cause, later ones only counted (`count`, the progress bar's `tied`); at the end, whether the weights
    moved from `start` (the master's checksum when train() began; None: not watched, e.g. GRPO)."""

    def __init__(self, start: str | None = None) -> None:
        self.start = start
        self.count = 0
        self.iterations = 0
        self.first: str | None = None

    def observe(self, iteration: int, rewards: Sequence[float], coefficients: Sequence[float],
                fingerprints: Sequence[Sequence[int]], sigma: float, mirrored: bool,
                update_ratio: float | None, update_survival: float | None = None,
                prompts: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
        """The iteration row's es/distinct_completions, es/tied, es/update_ratio and es/update_survival (where the
        engine measures them) and, under a mirrored strategy, es/pairs_differ; says the first tie (`iteration`: 1-based).
        `prompts`: which prompt each fingerprint answered (distinct_per_prompt; --prompt-groups)."""
        signal = iteration_signal(rewards, coefficients, fingerprints, prompts)
        self.iterations += 1
        if signal.tied:
            self.count += 1
            if self.first is None:
                self.first = signal.cause(sigma)
                tie = "no member has weight" if signal.rewards_differ else (f"all {len(rewards)} members tied (reward "
                                                                            f"{signal.reward:.4g})")
                say(f"esft: warning: iteration {iteration}: {tie}, so the update is zero: {self.first}. Further tied "
                    "iterations are counted (progress bar: tied=)")
        row = {"es/distinct_completions": sum(signal.distinct) / len(signal.distinct), "es/tied": float(signal.tied)}
        if mirrored:
            row["es/pairs_differ"] = pairs_differ(rewards)
        if update_ratio is not None:
            row["es/update_ratio"] = update_ratio
        if update_survival is not None:
            row["es/update_survival"] = update_survival
        return row

    def moved(self, checksum: str | None) -> bool | None:
        """Whether the master with `checksum` differs from the one train() began with (None: unknown)."""
        return None if self.start is None or checksum is None else checksum != self.start

    def finish(self, checksum: str | None) -> dict[str, float]:
        """After the loop: a warning line when the weights never moved (or some iterations tied), and
        train()'s es/weights_moved and es/tied_iterations ({} when nothing was watched)."""
        moved = self.moved(checksum)
        if moved is None or not self.iterations:
            return {}
        if not moved:
            because = f"; the cause: {self.first}" if self.first else ""
            print(f"esft: warning: the weights never moved: {self.count} of {self.iterations} iterations tied{because}",
                  file=sys.stderr)
        elif self.count:
            print(f"esft: warning: {self.count} of {self.iterations} iterations tied (no update in those): {self.first}",
                  file=sys.stderr)
        return {"es/weights_moved": float(moved), "es/tied_iterations": float(self.count)}

    def record(self, checksum: str | None) -> dict[str, object]:
        """What trainer_state.json keeps of it (its `learning`)."""
        return {"tied_iterations": self.count, "iterations": self.iterations, "weights_moved": self.moved(checksum),
                "first_cause": self.first}
