"""The prompt batch of an iteration: a function of (seed, iteration) alone, so a resumed run, every
Ray actor and every engine see exactly the same rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PromptBatch:
    """An iteration's rows. Executors that run elsewhere (Ray actors) send only `iteration` and
    rebuild the rows with prompt_batch from their own copy of the train set."""

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


def prompt_batch(data: Sequence[dict[str, Any]], seed: int, size: int, iteration: int) -> PromptBatch:
    """Consecutive slices of per-epoch shuffles of the train set (seeded by (seed, epoch))."""
    rows = []
    for position in range(iteration * size, (iteration + 1) * size):
        epoch, offset = divmod(position, len(data))
        order = np.random.default_rng([seed, 1, epoch]).permutation(len(data))
        rows.append(data[order[offset]])
    return PromptBatch(iteration, rows)


def rollout_seed(seed: int, iteration: int) -> int:
    """The seed of an iteration's sampled rollouts (--rollout-temperature > 0): a function of (seed, iteration)
    alone, like the batch, so a resumed run and every Ray actor sample alike; each prompt's noise is then drawn
    from it and the prompt's text (esft.engines.base.prompt_noise_seed)."""
    return int(np.random.default_rng([seed, 2, iteration]).integers(2**62))
