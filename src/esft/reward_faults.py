"""What a run does when a reward function fails on every sample of an iteration (README "Reliability"):
it stops, unless --reward-skip-failing names that function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from esft.config_rules import split_list
from esft.tasks.base import TaskError


def skip_failing(args: Any, names: Sequence[str]) -> set[str]:
    """The reward functions --reward-skip-failing names (a name that is none of the run's reward
    functions is an error before the model loads: a typo would silently leave the rule on)."""
    wanted = split_list(getattr(args, "reward_skip_failing", None))
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise TaskError(f"--reward-skip-failing: no reward function named {', '.join(unknown)}; this run's reward "
                        f"functions: {', '.join(names)}")
    return set(wanted)
