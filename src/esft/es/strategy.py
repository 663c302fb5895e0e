"""The ES strategy: pure math on seeds and rewards (no model, no torch).

Follows Qiu et al., "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning"
(arXiv 2509.24372). We MAXIMIZE reward (evosax minimizes fitness; the sign convention here is the
paper's). Ask/tell with explicit state, in the style of evosax:

    state = init(seed)
    seeds = ask(state, population_size)                    # member i perturbs θ + σ·ε(seeds[i])
    state, coefficients = tell(state, fitness, alpha, shaping)   # fitness: esft.es.fitness.Fitness
    # the engine then applies θ += Σ coefficients[i]·ε(seeds[i])   (= (α/N)·Σ zᵢ·εᵢ)

α is NOT divided by σ, as in the paper (classic OpenAI-ES uses α/(N·σ)).

Mirrored (antithetic) sampling: `ask(state, N, antithetic=True)` returns N/2 seeds each followed by
its mirror, `mirror(s) = -1 - s` (= ~s, always negative): member ~s is perturbed by −ε(s) (esft.es.noise
negates the noise of a negative seed), so every engine and executor evaluates it as an ordinary member
and only seeds cross processes. `merge_mirrored` folds each pair into one seed for the update
((c₊ − c₋)·ε(s) instead of c₊·ε(s) + c₋·(−ε(s)): half the noise draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from esft.es.fitness import Fitness
from esft.es.shaping import REWARD_SHAPING

SEED_RANGE = 2**30  # member seeds are drawn in [0, 2**30), as in the reference


@dataclass(frozen=True)
class ESState:
    """Everything the strategy needs: the run seed and how many updates have been applied."""

    seed: int
    iteration: int = 0


def init(seed: int) -> ESState:
    """A fresh strategy state."""
    return ESState(seed=int(seed), iteration=0)


def mirror(member_seed: int) -> int:
    """The seed of the mirrored member, perturbed by −ε(member_seed): -1 - s (= ~s; its own inverse).
    Seeds in [0, SEED_RANGE) map to negative seeds, so a negative seed always means "mirrored"."""
    return -1 - int(member_seed)


def ask(state: ESState, population_size: int, antithetic: bool = False) -> list[int]:
    """The member seeds of the current iteration, a function of (seed, iteration) alone. With
    `antithetic`, N/2 seeds drawn the same way, each followed by its mirror: [s₀, ~s₀, s₁, ~s₁, ...]."""
    rng = np.random.default_rng([state.seed, state.iteration])
    if not antithetic:
        return [int(s) for s in rng.integers(0, SEED_RANGE, population_size)]
    if population_size % 2:
        raise ValueError(f"antithetic sampling pairs members: the population size must be even, got {population_size}")
    return [seed for s in rng.integers(0, SEED_RANGE, population_size // 2) for seed in (int(s), mirror(int(s)))]


def merge_mirrored(member_seeds: Sequence[int], coefficients: Sequence[float]) -> tuple[list[int], list[float]]:
    """The same update with each mirrored member folded into its partner: θ += c·ε(s) + c'·ε(~s) =
    (c − c')·ε(s), one noise draw instead of two. Seeds are grouped by the seed they mirror (first
    appearance order); a list without negative seeds (no --antithetic) is returned unchanged, so the
    paper's update stays bit for bit what it was."""
    if len(member_seeds) != len(coefficients):
        raise ValueError(f"{len(member_seeds)} member seeds for {len(coefficients)} coefficients")
    if all(int(s) >= 0 for s in member_seeds):
        return [int(s) for s in member_seeds], [float(c) for c in coefficients]
    merged: dict[int, float] = {}
    for seed, coefficient in zip(member_seeds, coefficients):
        base, sign = (int(seed), 1.0) if seed >= 0 else (mirror(seed), -1.0)
        merged[base] = merged.get(base, 0.0) + sign * float(coefficient)
    return list(merged), list(merged.values())


def tell(state: ESState, fitness: Fitness | Sequence[float], alpha: float, shaping: str = "zscore"
         ) -> tuple[ESState, list[float]]:
    """Shape the members' fitness (esft.es.shaping's `shaping`) and return (next state, per-member update
    coefficients α/N·zᵢ). `fitness`: an esft.es.fitness.Fitness, or each member's fitness alone (then no
    shaping that compares members prompt by prompt)."""
    if not isinstance(fitness, Fitness):
        fitness = Fitness.of_members(fitness)
    if not np.all(np.isfinite(fitness.member)):
        raise ValueError(f"member rewards must be finite, got {fitness.member.tolist()}")
    with np.errstate(all="ignore"):
        shaped = REWARD_SHAPING[shaping](fitness)
    if not np.all(np.isfinite(shaped)):
        raise ValueError(f"{shaping} shaping of these rewards is not finite (too large to shape in float64)")
    coefficients = (alpha / len(fitness)) * shaped
    return replace(state, iteration=state.iteration + 1), [float(c) for c in coefficients]
