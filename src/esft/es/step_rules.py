"""How the step divides by the population (--step-rule): the update is θ += (α/D(N))·Σ cᵢ·εᵢ over the N members'
shaped fitness cᵢ. The paper's D(N) = N makes the step's norm fall as 1/√N for unit-spread fitness (z-scores):
the N noises are independent, so ‖Σ zᵢ·εᵢ‖ grows as √N. D(N) = √N keeps that norm the same at every N, so designs
with different populations are compared at one α (issue 63's matched step; ES-FRONTIER's step that grows with √N
relative to the paper's). Pure arithmetic: strategies put α/N into their coefficients, and the trainer hands them
α·N/D(N).
"""

from __future__ import annotations

import math

STEP_RULES = {
    "paper": "θ += (α/N)·Σ cᵢ·εᵢ, the paper's: with z-scored fitness the step's norm falls as 1/√N",
    "sqrt_n": "θ += (α/√N)·Σ cᵢ·εᵢ: with z-scored fitness the step's norm is the same at every N (compare "
              "populations at one α)",
}
"""--step-rule's choices (paper, the default, first) and what each does."""


REFERENCE_MEMBERS = 8
"""sqrt_n's default α gives the step of the paper's default (α = σ/2) at this N."""


def default_alpha(sigma: float, rule: str) -> float:
    """α when none is given: σ/2 under the paper's rule (the paper's default); under sqrt_n σ/(2·√8), the same
    step as the paper's default at N = 8 (the SmolLM2 recipe's), at every N."""
    if rule == "sqrt_n":
        return sigma / (2 * math.sqrt(REFERENCE_MEMBERS))
    return sigma / 2


def alpha_for_strategy(rule: str, alpha: float, members: int) -> float:
    """The α a strategy's tell gets (it divides by N) so that the update divides by the rule's D(N)."""
    if rule == "paper":
        return alpha
    if rule == "sqrt_n":
        return alpha * math.sqrt(members)
    raise ValueError(f"--step-rule must be one of {', '.join(STEP_RULES)}, got {rule!r}")
