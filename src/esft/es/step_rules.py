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


def alpha_for_strategy(rule: str, alpha: float, members: int) -> float:
    """The α a strategy's tell gets (it divides by N) so that the update divides by the rule's D(N)."""
    if rule == "paper":
        return alpha
    if rule == "sqrt_n":
        return alpha * math.sqrt(members)
    raise ValueError(f"--step-rule must be one of {', '.join(STEP_RULES)}, got {rule!r}")
