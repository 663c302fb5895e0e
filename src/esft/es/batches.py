"""The prompt batch of an iteration: a function of (seed, iteration) alone, so a resumed run, every
Ray actor and every engine see exactly the same rows; with --prompt-candidates K > 1, B rows of K·B candidates
chosen by the unperturbed model's rewards on them (--prompt-choice: PROMPT_CHOICES; a function of (seed, iteration)
and the weights, which a resumed run restores bitwise; Ray actors are sent such rows)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PromptBatch:
    """An iteration's rows. Executors that run elsewhere (Ray actors) send only `iteration` when the rows are
    prompt_batch's, rebuilt there from the actor's own copy of the train set, and the rows themselves otherwise."""

    iteration: int
    rows: list[dict[str, Any]]

    @property
    def prompts(self) -> list[str]:
        return [row["prompt"] for row in self.rows]

    def part(self, prompts: range) -> PromptBatch:
        """The rows at `prompts` (a group's slice, esft.es.groups), of the same iteration; itself when that is all."""
        if prompts == range(len(self.rows)):
            return self
        return PromptBatch(self.iteration, self.rows[prompts.start : prompts.stop])

    def pick(self, indices: Sequence[int]) -> PromptBatch:
        """The rows at `indices` (a PROMPT_CHOICES choice), of the same iteration."""
        return PromptBatch(self.iteration, [self.rows[i] for i in indices])


def prompt_batch(data: Sequence[dict[str, Any]], seed: int, size: int, iteration: int) -> PromptBatch:
    """Consecutive slices of per-epoch shuffles of the train set (seeded by (seed, epoch))."""
    rows = []
    for position in range(iteration * size, (iteration + 1) * size):
        epoch, offset = divmod(position, len(data))
        order = np.random.default_rng([seed, 1, epoch]).permutation(len(data))
        rows.append(data[order[offset]])
    return PromptBatch(iteration, rows)


def lowest_scored(rewards: Sequence[float | None], size: int) -> list[int]:
    """The indices of the `size` lowest rewards (the unperturbed model's on --prompt-candidates' candidates), in
    ascending index order; ties go to the earlier candidate, and unscored ones (None: no reward function scored
    them) come last.

    Why: once the model answers most prompts right, a batch of two prompts is often two it already answers, where
    the members' rewards differ only by the answers their perturbations break; prompts it misses are where a
    member's perturbation can find the right answer (DAPO's dynamic sampling, done on the one unperturbed model)."""
    return sorted(_ranked(range(len(rewards)), rewards, highest_first=False)[:size])


def extremes(rewards: Sequence[float | None], size: int) -> list[int]:
    """Half the batch (rounded up) the lowest rewards, as lowest_scored, the rest the highest of the other
    candidates (ties to the earlier candidate, unscored ones last), in ascending index order.

    Why: where the model misses most prompts, the members' perturbations rarely find a right answer to one it
    misses, and a batch of only those often ties every member (no update); on a prompt it answers right the
    members that break the answer score lower, so a batch holding one always carries a signal."""
    low = lowest_scored(rewards, -(-size // 2))
    rest = _ranked([i for i in range(len(rewards)) if i not in low], rewards, highest_first=True)
    return sorted(low + rest[: size - len(low)])


def _ranked(indices: Sequence[int], rewards: Sequence[float | None], highest_first: bool) -> list[int]:
    """`indices` ordered by reward (ties to the earlier candidate), unscored ones (None) last either way."""
    sign = -1.0 if highest_first else 1.0
    return sorted(indices, key=lambda i: (rewards[i] is None, sign * (rewards[i] or 0.0), i))


PROMPT_CHOICES = {"lowest": lowest_scored, "extremes": extremes}
"""--prompt-choice: which B of --prompt-candidates' K·B candidates are the batch, from the unperturbed model's
rewards on them (greedy)."""


def rollout_seed(seed: int, iteration: int) -> int:
    """The seed of an iteration's sampled rollouts (--rollout-temperature > 0): a function of (seed, iteration)
    alone, like the batch, so a resumed run and every Ray actor sample alike; each prompt's noise is then drawn
    from it and the prompt's text (esft.engines.base.prompt_noise_seed)."""
    return int(np.random.default_rng([seed, 2, iteration]).integers(2**62))
