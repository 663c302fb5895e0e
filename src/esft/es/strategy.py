"""The ES strategy: pure math on seeds and rewards (no model, no torch).

Follows Qiu et al., "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning"
(arXiv 2509.24372). We MAXIMIZE reward (evosax minimizes fitness; the sign convention here is the
paper's). Ask/tell with explicit state, in the style of evosax:

    state = init(seed)
    seeds = ask(state, population_size)                    # member i perturbs θ + σ·ε(seeds[i])
    state, coefficients = tell(state, rewards, alpha, shaping)
    # the engine then applies θ += Σ coefficients[i]·ε(seeds[i])   (= (α/N)·Σ zᵢ·εᵢ)

α is NOT divided by σ, as in the paper (classic OpenAI-ES uses α/(N·σ)).
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


def ask(state: ESState, population_size: int) -> list[int]:
    """The member seeds of the current iteration, a function of (seed, iteration) alone."""
    rng = np.random.default_rng([state.seed, state.iteration])
    return [int(s) for s in rng.integers(0, SEED_RANGE, population_size)]


def zscore(rewards: np.ndarray) -> np.ndarray:
    """(R - mean) / (std + 1e-8), population std (ddof 0): the paper's shaping."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


def centered_rank(rewards: np.ndarray) -> np.ndarray:
    """Ranks mapped to [-0.5, 0.5] (ties share their mean rank), as in OpenAI-ES."""
    n = len(rewards)
    order = np.argsort(rewards, kind="stable")
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.arange(n, dtype=np.float64)
    for value in np.unique(rewards):  # ties: equal rewards must get equal weight
        tied = rewards == value
        ranks[tied] = ranks[tied].mean()
    return ranks / (n - 1) - 0.5 if n > 1 else np.zeros(n)


def raw(rewards: np.ndarray) -> np.ndarray:
    """Rewards as they are (no shaping)."""
    return rewards.copy()


REWARD_SHAPING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "zscore": zscore,
    "rank": centered_rank,
    "raw": raw,
}


def tell(
    state: ESState, rewards: Sequence[float], alpha: float, shaping: str = "zscore"
) -> tuple[ESState, list[float]]:
    """Shape the members' rewards and return (next state, per-member update coefficients α/N·zᵢ)."""
    values = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"member rewards must be finite, got {values.tolist()}")
    shaped = REWARD_SHAPING[shaping](values)
    coefficients = (alpha / len(values)) * shaped
    return replace(state, iteration=state.iteration + 1), [float(c) for c in coefficients]
