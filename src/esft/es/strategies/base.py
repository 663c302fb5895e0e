"""What an ES strategy is (esft.es.strategies lists them): ask/tell over explicit state, in evosax's shape.

Pure math on seeds and rewards (no model, no torch). Follows Qiu et al., "Evolution Strategies at Scale:
LLM Fine-Tuning Beyond Reinforcement Learning" (arXiv 2509.24372). We MAXIMIZE reward (evosax minimizes
fitness; the sign convention here is the paper's):

    strategy = STRATEGIES[args.strategy]
    state = strategy.init(seed)
    seeds = strategy.ask(state, population_size)                      # member i perturbs θ + σ·ε(seeds[i])
    state, coefficients = strategy.tell(state, fitness, alpha, shaping)  # fitness: esft.es.fitness.Fitness
    engine.update(*strategy.update_terms(seeds, coefficients))          # θ += Σ cᵢ·ε(sᵢ)  (= (α/N)·Σ zᵢ·εᵢ)

α is NOT divided by σ, as in the paper (classic OpenAI-ES uses α/(N·σ)). The state is the run seed and
the number of updates applied, so every iteration's seeds are a function of (seed, iteration) alone: a
resumed run and a Ray worker ask the same members.
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
    """Everything a strategy needs: the run seed and how many updates have been applied."""

    seed: int
    iteration: int = 0


def draw_seeds(state: ESState, count: int) -> list[int]:
    """`count` member seeds in [0, SEED_RANGE), a function of (seed, iteration) alone (the paper's draw)."""
    rng = np.random.default_rng([state.seed, state.iteration])
    return [int(s) for s in rng.integers(0, SEED_RANGE, count)]


def shaped_coefficients(fitness: Fitness | Sequence[float], alpha: float, shaping: str) -> list[float]:
    """The paper's coefficients α/N·zᵢ, zᵢ the members' fitness shaped by esft.es.shaping's `shaping`.
    `fitness`: an esft.es.fitness.Fitness, or each member's fitness alone (then no shaping that compares
    members prompt by prompt). ValueError for a non-finite fitness or shaping."""
    if not isinstance(fitness, Fitness):
        fitness = Fitness.of_members(fitness)
    if not np.all(np.isfinite(fitness.member)):
        raise ValueError(f"member rewards must be finite, got {fitness.member.tolist()}")
    with np.errstate(all="ignore"):
        shaped = REWARD_SHAPING[shaping](fitness)
    if not np.all(np.isfinite(shaped)):
        raise ValueError(f"{shaping} shaping of these rewards is not finite (too large to shape in float64)")
    return [float(c) for c in (alpha / len(fitness)) * shaped]


class Strategy:
    """One ES strategy: how members are asked for and how their fitness becomes the update. Every method is
    a function of its arguments (state in, state out), so a strategy holds no state of its own and one
    instance serves every run. A subclass overrides what differs from the paper's rule; its module defines
    `STRATEGY = TheClass()`, and esft.es.strategies lists it (--strategy's choices, `esft train --help` and
    docs/reference/config.md come from that list)."""

    name: str = ""
    summary: str = ""
    """One line for --help and the docs."""
    mirrored: bool = False
    """Members come in ±σ pairs [s, ~s, ...] (esft.es.strategies.antithetic): the learning signal reports
    es/pairs_differ."""

    def init(self, seed: int) -> ESState:
        """A fresh state."""
        return ESState(seed=int(seed), iteration=0)

    def ask(self, state: ESState, population_size: int) -> list[int]:
        """The member seeds of the current iteration (a function of the state alone)."""
        return draw_seeds(state, population_size)

    def tell(self, state: ESState, fitness: Fitness | Sequence[float], alpha: float, shaping: str = "zscore"
             ) -> tuple[ESState, list[float]]:
        """(next state, one update coefficient per member, in the order ask gave them)."""
        return replace(state, iteration=state.iteration + 1), shaped_coefficients(fitness, alpha, shaping)

    def update_terms(self, member_seeds: Sequence[int], coefficients: Sequence[float]
                     ) -> tuple[list[int], list[float]]:
        """The (seeds, coefficients) the engine applies, θ += Σ cᵢ·ε(sᵢ): the same update tell described,
        in as few noise draws as the strategy allows (by default: the members themselves)."""
        if len(member_seeds) != len(coefficients):
            raise ValueError(f"{len(member_seeds)} member seeds for {len(coefficients)} coefficients")
        return [int(s) for s in member_seeds], [float(c) for c in coefficients]

    def population_problem(self, population_size: int) -> str | None:
        """Why this strategy cannot run `population_size` members, with a fix, as words that follow
        "--strategy NAME" (None: it can). Settings refuse such a --population-size before anything loads."""
        return None
