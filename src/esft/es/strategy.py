"""The ES strategy: pure math on seeds and rewards (no model, no torch).

Follows Qiu et al., "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning"
(arXiv 2509.24372). We MAXIMIZE reward (evosax minimizes fitness; the sign convention here is the
paper's). Ask/tell with explicit state, in the style of evosax:

    state = init(seed)
    seeds = ask(state, population_size)                    # member i perturbs θ + σ·ε(seeds[i])
    state, coefficients = tell(state, rewards, alpha, shaping)
    # the engine then applies θ += Σ coefficients[i]·ε(seeds[i])   (= (α/N)·Σ zᵢ·εᵢ)

α is NOT divided by σ, as in the paper (classic OpenAI-ES uses α/(N·σ)).

Mirrored (antithetic) sampling: `ask(state, N, antithetic=True)` returns N/2 seeds each followed by
its mirror, `mirror(s) = -1 - s` (= ~s, always negative): member ~s is perturbed by −ε(s) (esft.es.noise
negates the noise of a negative seed), so every engine and executor evaluates it as an ordinary member
and only seeds cross processes. `merge_mirrored` folds each pair into one seed for the update
((c₊ − c₋)·ε(s) instead of c₊·ε(s) + c₋·(−ε(s)): half the noise draws).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

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


def zscore(rewards: np.ndarray, per_prompt: np.ndarray | None = None) -> np.ndarray:
    """(R - mean) / (std + 1e-8), population std (ddof 0): the paper's shaping."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


def centered_rank(rewards: np.ndarray, per_prompt: np.ndarray | None = None) -> np.ndarray:
    """Ranks mapped to [-0.5, 0.5] (ties share their mean rank), as in OpenAI-ES."""
    n = len(rewards)
    order = np.argsort(rewards, kind="stable")
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.arange(n, dtype=np.float64)
    for value in np.unique(rewards):  # ties: equal rewards must get equal weight
        tied = rewards == value
        ranks[tied] = ranks[tied].mean()
    return ranks / (n - 1) - 0.5 if n > 1 else np.zeros(n)


def raw(rewards: np.ndarray, per_prompt: np.ndarray | None = None) -> np.ndarray:
    """Rewards as they are (no shaping)."""
    return rewards.copy()


def per_prompt_zscore(rewards: np.ndarray, per_prompt: np.ndarray | None = None) -> np.ndarray:
    """Z-scores prompt by prompt, then averaged per member: each column of `per_prompt` (members ×
    prompts; NaN = no usable score for that member on that prompt, left out of the column) becomes
    (R - mean) / (std + 1e-8) over its present entries (population std); a column where every present
    member scored the same (or fewer than two are present) gives 0; NaN entries count 0. A member's
    shaped value is the mean of its row over all prompts. The ES analogue of GRPO's group baseline:
    a prompt that is easy or hard for everyone no longer dominates the ranking."""
    if per_prompt is None:
        raise ValueError("per_prompt shaping needs the members × prompts reward matrix")
    matrix = np.asarray(per_prompt, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != len(rewards):
        raise ValueError(f"the reward matrix must be members × prompts with {len(rewards)} rows, got {matrix.shape}")
    present = ~np.isnan(matrix)
    count = present.sum(axis=0)
    filled = np.where(present, matrix, 0.0)
    mean = filled.sum(axis=0) / np.maximum(count, 1)
    std = np.sqrt(np.where(present, (matrix - mean) ** 2, 0.0).sum(axis=0) / np.maximum(count, 1))
    highest = np.where(present, matrix, -np.inf).max(axis=0)
    lowest = np.where(present, matrix, np.inf).min(axis=0)
    constant = (count < 2) | (highest == lowest)  # exactly: a mean of equal values need not equal them
    z = np.where(present & ~constant, (matrix - mean) / (std + 1e-8), 0.0)
    return z.mean(axis=1)


Shaping = Callable[[np.ndarray, np.ndarray | None], np.ndarray]
REWARD_SHAPING: dict[str, Shaping] = {
    "zscore": zscore,
    "rank": centered_rank,
    "raw": raw,
    "per_prompt": per_prompt_zscore,
}
"""shaping(rewards, per_prompt) -> one value per member. `rewards`: each member's fitness (its mean
reward over the batch, as the trainer computes it); `per_prompt`: the members × prompts matrix (NaN
where a sample has no usable score) or None. zscore, rank and raw shape `rewards` alone."""


def tell(
    state: ESState, rewards: Sequence[float], alpha: float, shaping: str = "zscore",
    per_prompt: np.ndarray | Sequence[Sequence[float]] | None = None,
) -> tuple[ESState, list[float]]:
    """Shape the members' rewards and return (next state, per-member update coefficients α/N·zᵢ).
    `per_prompt`: the members × prompts reward matrix (NaN = left out), which `per_prompt` shaping needs."""
    values = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"member rewards must be finite, got {values.tolist()}")
    matrix = None if per_prompt is None else np.asarray(per_prompt, dtype=np.float64)
    with np.errstate(all="ignore"):
        shaped = REWARD_SHAPING[shaping](values, matrix)
    if not np.all(np.isfinite(shaped)):
        raise ValueError(f"{shaping} shaping of these rewards is not finite (too large to shape in float64)")
    coefficients = (alpha / len(values)) * shaped
    return replace(state, iteration=state.iteration + 1), [float(c) for c in coefficients]
