"""The paper's rule (Qiu et al., arXiv 2509.24372, Algorithm 1): N one-sided seeds, θ += (α/N)·Σ zᵢ·εᵢ.
Every method is esft.es.strategies.base.Strategy's own."""

from __future__ import annotations

from esft.es.strategies.base import Strategy


class Paper(Strategy):
    name = "paper"
    summary = "the paper's rule: N one-sided seeds θ + σ·εᵢ, θ += (α/N)·Σ zᵢ·εᵢ"


STRATEGY = Paper()
