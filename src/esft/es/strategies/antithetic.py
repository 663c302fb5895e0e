"""Mirrored (antithetic) sampling, as in OpenAI-ES and EGGROLL: N/2 seeds, each evaluated at θ + σ·ε and
θ − σ·ε, both used in the update.

`ask` returns N/2 seeds each followed by its mirror, `mirror(s) = -1 - s` (= ~s, always negative): member ~s
is perturbed by −ε(s) (esft.es.noise negates the noise of a negative seed), so every engine and executor
evaluates it as an ordinary member and only seeds cross processes. `update_terms` folds each pair into one
seed for the update ((c₊ − c₋)·ε(s) instead of c₊·ε(s) + c₋·(−ε(s)): half the noise draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from esft.es.strategies.base import SEED_RANGE, ESState, Strategy


def mirror(member_seed: int) -> int:
    """The seed of the mirrored member, perturbed by −ε(member_seed): -1 - s (= ~s; its own inverse).
    Seeds in [0, SEED_RANGE) map to negative seeds, so a negative seed always means "mirrored"."""
    return -1 - int(member_seed)


def merge_mirrored(member_seeds: Sequence[int], coefficients: Sequence[float]) -> tuple[list[int], list[float]]:
    """The same update with each mirrored member folded into its partner: θ += c·ε(s) + c'·ε(~s) =
    (c − c')·ε(s), one noise draw instead of two. Seeds are grouped by the seed they mirror (first
    appearance order); a list without negative seeds is returned unchanged."""
    if len(member_seeds) != len(coefficients):
        raise ValueError(f"{len(member_seeds)} member seeds for {len(coefficients)} coefficients")
    if all(int(s) >= 0 for s in member_seeds):
        return [int(s) for s in member_seeds], [float(c) for c in coefficients]
    merged: dict[int, float] = {}
    for seed, coefficient in zip(member_seeds, coefficients):
        base, sign = (int(seed), 1.0) if seed >= 0 else (mirror(seed), -1.0)
        merged[base] = merged.get(base, 0.0) + sign * float(coefficient)
    return list(merged), list(merged.values())


class Antithetic(Strategy):
    name = "antithetic"
    summary = ("mirrored pairs: N/2 seeds, each evaluated at θ + σ·ε and θ − σ·ε (members 2k and 2k+1), both in the "
               "update (--population-size even)")
    mirrored = True

    def ask(self, state: ESState, population_size: int) -> list[int]:
        """[s₀, ~s₀, s₁, ~s₁, ...]: N/2 seeds drawn as the paper's, each followed by its mirror."""
        if problem := self.population_problem(population_size):
            raise ValueError(f"the {self.name} strategy {problem}")
        rng = np.random.default_rng([state.seed, state.iteration])
        return [seed for s in rng.integers(0, SEED_RANGE, population_size // 2) for seed in (int(s), mirror(int(s)))]

    def update_terms(self, member_seeds: Sequence[int], coefficients: Sequence[float]
                     ) -> tuple[list[int], list[float]]:
        return merge_mirrored(member_seeds, coefficients)

    def population_problem(self, population_size: int) -> str | None:
        if population_size % 2:
            return (f"pairs members (θ ± σ·ε), so N must be even; got {population_size}: use {population_size + 1} or "
                    f"{population_size - 1}")
        return None


STRATEGY = Antithetic()
