"""Prompt groups (--prompt-groups G): the N members in G consecutive groups, the iteration's B prompts in G
consecutive slices, group g's members scored on slice g only (ES-FRONTIER: many members on few prompts, a
member's fitness compared only with members that answered the same prompts). An iteration then costs N·B/G
completions instead of N·B, and every prompt is answered by N/G members.

G = 1 is the paper's iteration: every member on every prompt. Under G > 1 the members' fitness is not an
average over the same prompts, so shapings that compare members prompt by prompt against a shared batch
(per_prompt) are refused; per_prompt_centered centres each prompt's rewards among the members that answered
it, i.e. within the group. Mirrored pairs (members 2k, 2k+1) stay in one group. Pure arithmetic on indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptGroup:
    """One group: its members (indices into the iteration's seeds) and its prompts (indices into its batch)."""

    members: range
    prompts: range


def groups_problem(population_size: int, batch_size: int, groups: int, mirrored: bool = False) -> str | None:
    """Why N members and B prompts cannot be split into `groups` groups, with a fix (words that follow
    "--prompt-groups G"), or None when they can."""
    if groups < 1:
        return f"must be >= 1, got {groups}"
    if population_size % groups:
        return (f"splits the --population-size {population_size} members into {groups} equal groups, so N must be a "
                f"multiple of {groups}: use --population-size {population_size + groups - population_size % groups}")
    if batch_size % groups:
        return (f"splits the --batch-size {batch_size} prompts into {groups} equal slices, so B must be a multiple "
                f"of {groups}: use --batch-size {batch_size + groups - batch_size % groups}")
    if mirrored and (population_size // groups) % 2:
        return (f"keeps each mirrored pair in one group, so N/G must be even; got {population_size}/{groups} = "
                f"{population_size // groups}: use --population-size {2 * population_size}")
    return None


def prompt_groups(population_size: int, batch_size: int, groups: int = 1) -> list[PromptGroup]:
    """The groups of an iteration, in member order (ValueError when groups_problem says they cannot be)."""
    if problem := groups_problem(population_size, batch_size, groups):
        raise ValueError(f"--prompt-groups {groups} {problem}")
    members, prompts = population_size // groups, batch_size // groups
    return [PromptGroup(range(g * members, (g + 1) * members), range(g * prompts, (g + 1) * prompts))
            for g in range(groups)]


def prompts_of_members(groups: list[PromptGroup]) -> np.ndarray:
    """members × samples: the batch index of the prompt each of a member's samples answered (esft.es.fitness)."""
    return np.array([list(group.prompts) for group in groups for _ in group.members], dtype=np.int64)
