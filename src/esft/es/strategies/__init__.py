"""ES strategies: how members are asked for and how their fitness becomes the update (ask/tell over explicit
state, esft.es.strategies.base). One module per strategy, each defining `STRATEGY`; this registry is the one
list of them (--strategy's choices, `esft train --help` and docs/reference/config.md are derived from it);
`register_strategy` adds one of your own. tests/test_es_core.py checks every entry with one parametrized test.

The other parts of an ES step have registries of their own, each one list: the reward shaping
(esft.es.shaping: z-score, per-prompt, centred, ...), the optimizer on the ES gradient (esft.es.optimizers:
sgd, adam) and the noise (esft.es.noise). RandOpt's selection of the best members is esft.randopt.selection.
Adding a strategy: a module here with its `STRATEGY`, its line below, its row in test_es_core's
EXPECTED_STRATEGIES (docs/architecture.md walks through one).
"""

from __future__ import annotations

from esft.es.strategies import antithetic, paper
from esft.es.strategies.base import ESState, Strategy

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (paper.STRATEGY, antithetic.STRATEGY)}
"""--strategy's choices, in the order --help lists them (paper, the default, first)."""

__all__ = ["ESState", "STRATEGIES", "Strategy", "register_strategy"]


def register_strategy(strategy: Strategy) -> Strategy:
    """Add a strategy of your own (or replace the one of the same name: a notebook cell run twice); it is then
    a --strategy choice like the built-in ones."""
    if not strategy.name or not strategy.name.replace("-", "_").isidentifier():
        raise ValueError(f"a strategy name is one word (letters, digits, - or _), got {strategy.name!r}")
    STRATEGIES[strategy.name] = strategy
    return strategy
