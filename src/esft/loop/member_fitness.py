"""An iteration's Scores (one per member) made into esft.es.fitness.Fitness: the --failed-samples policy
applied to what the reward functions returned. Which samples are usable is decided here, once; member
fitness and every shaping then read the Fitness."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from esft.es.fitness import Fitness, same_prompts
from esft.rewards.runner import Scores, failing_everywhere


def reward_matrix(batches: Sequence[Scores], failed_samples: str = "omit") -> np.ndarray:
    """The members × samples matrix of an iteration's rewards (`batches`: one Scores per member). NaN
    marks an entry with no usable score: a sample no function scored (None), or, under "omit", one a
    reward function failed on (its value is the failure reward, not a score; under "fill" it stays that
    value). A function that failed on every sample of the iteration (the run goes on only under
    --reward-skip-failing) is not held against any sample: it adds the same failure reward to every entry."""
    everywhere = set(failing_everywhere(batches))
    matrix = np.full((len(batches), max((len(scores.total) for scores in batches), default=0)), np.nan)
    for row, scores in zip(matrix, batches):
        failed_here = set() if failed_samples == "fill" else {i for name, samples in scores.failed_samples.items()
                                                              if name not in everywhere for i in samples}
        for i, value in enumerate(scores.total):
            if value is not None and i not in failed_here:
                row[i] = value
    return matrix


def fitness_of(batches: Sequence[Scores], failed_samples: str = "omit", prompts: np.ndarray | None = None) -> Fitness:
    """The Fitness of an iteration (`batches`: one Scores per member; `prompts`: which prompt each entry
    answered, by default every member on the same prompts, the batch's order). Without failures a
    member's fitness is Scores.mean to the bit under either policy. Under "omit", when no member has any
    usable sample the members keep the "fill" fitness (Scores.mean: the failure reward where nothing was
    scored), as nothing else is known of them."""
    matrix = reward_matrix(batches, failed_samples)
    if prompts is None:
        prompts = same_prompts(*matrix.shape)
    failure_reward = batches[0].failure_reward if batches else 0.0
    fitness = Fitness.of(matrix, prompts, failure_reward, failed_samples)
    if failed_samples == "omit" and batches and np.isnan(matrix).all():
        fitness = Fitness(matrix, fitness.prompts, Fitness.of(reward_matrix(batches, "fill"), prompts, failure_reward,
                                                               "fill").member)
    return fitness
