"""Executors run population members on engines. Here: the in-process one (one engine, one member at
a time). Every executor answers the same three calls, so the trainer never knows where weights live."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from esft.engines.transformers_engine import Generation, Sampling
from esft.rewards import Scores

Scorer = Callable[[Sequence[dict[str, Any]], Sequence[str]], Scores]


@dataclass
class MemberResult:
    """What one perturbed member scored on the iteration's prompt batch."""

    seed: int
    reward: float
    """Mean reward over the batch: the member's fitness (maximized)."""
    scores: Scores
    num_tokens: int


class LocalExecutor:
    """Evaluates members one after another on a single in-process engine."""

    def __init__(self, engine, scorer: Scorer, sigma: float):
        self.engine = engine
        self.scorer = scorer
        self.sigma = sigma

    def evaluate_population(self, member_seeds: Sequence[int], rows: Sequence[dict[str, Any]]) -> list[MemberResult]:
        """Perturb → generate → restore → score, for each member, on the same prompt batch."""
        prompts = [row["prompt"] for row in rows]
        results = []
        for seed in member_seeds:
            self.engine.perturb(seed, self.sigma)
            try:
                generation = self.engine.generate(prompts)
            finally:
                self.engine.restore()
            scores = self.scorer(rows, generation.texts)
            results.append(MemberResult(seed, scores.mean(), scores, sum(generation.num_tokens)))
        return results

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float]) -> None:
        """Apply θ += Σ coefficientsᵢ·εᵢ on the engine."""
        self.engine.update(member_seeds, coefficients)

    def generate(
        self, prompts: Sequence[str], mini_batch_size: int | None = None, sampling: Sampling | None = None
    ) -> Generation:
        """Completions of the unperturbed model (evaluation): greedy unless `sampling` says otherwise."""
        return self.engine.generate(prompts, mini_batch_size=mini_batch_size, sampling=sampling)

    def checksum(self) -> str:
        return self.engine.checksum()
