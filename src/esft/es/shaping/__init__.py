"""Reward shaping: a member's fitness (esft.es.fitness.Fitness) becomes the weight of its noise in the
update. One module per shaping, each defining `SHAPING`; this registry is the one list of them
(--reward-shaping's choices, `esft train --help` and docs/reference/config.md are derived from it);
`register_shaping` adds one of your own.
tests/test_es_core.py checks every entry with one parametrized test.

A shaping maps a Fitness to one float64 value per member, order-preserving for members scored on the
same prompts (reward is maximized: a higher fitness never gets a lower weight). Adding one: a module
here with its `SHAPING`, its line below, its row in test_es_core's EXPECTED_SHAPING.
"""

from __future__ import annotations

from esft.es.shaping import centered, per_prompt, per_prompt_centered, rank, raw, zscore
from esft.es.shaping.base import Shaping

REWARD_SHAPING: dict[str, Shaping] = {s.name: s for s in (zscore.SHAPING, rank.SHAPING, raw.SHAPING,
                                                           per_prompt.SHAPING, centered.SHAPING,
                                                           per_prompt_centered.SHAPING)}
"""--reward-shaping's choices, in the order --help lists them (zscore, the paper's, first: the default)."""


def register_shaping(shaping: Shaping) -> Shaping:
    """Add a shaping of your own (or replace the one of the same name: a notebook cell run twice); it is then
    a --reward-shaping choice like the built-in ones."""
    if not shaping.name or not shaping.name.replace("-", "_").isidentifier():
        raise ValueError(f"a shaping name is one word (letters, digits, - or _), got {shaping.name!r}")
    REWARD_SHAPING[shaping.name] = shaping
    return shaping
