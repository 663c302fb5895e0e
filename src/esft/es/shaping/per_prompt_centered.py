"""per_prompt_centered: each prompt's rewards minus their mean over the members scored on that prompt, averaged per
member, not divided by any spread: EGGROLL's fitness centred within each prompt's group (ES-FRONTIER). The step
shrinks as the members' rewards on a prompt draw together, and a prompt that is easy or hard for everyone counts 0.

Members need not share prompts: an entry is centred among the entries of the same prompt index
(Fitness.prompts), so members in groups, each group on its own prompts, are centred within their group. A prompt
where every present member scored the same, or only one member is present, gives 0; NaN entries (no usable score)
count 0. A member's value is the mean of its row."""

from __future__ import annotations

import numpy as np

from esft.es.fitness import Fitness
from esft.es.shaping.base import Shaping


def per_prompt_centered(fitness: Fitness) -> np.ndarray:
    matrix, prompts = fitness.matrix, fitness.prompts
    present = ~np.isnan(matrix)
    centred = np.zeros_like(matrix)
    for prompt in np.unique(prompts[present]):
        entries = present & (prompts == prompt)
        values = matrix[entries]
        if values.max() > values.min():  # exactly: a mean of equal values need not equal them
            centred[entries] = values - values.mean()
    return centred.mean(axis=1)


SHAPING = Shaping("per_prompt_centered", per_prompt_centered, "each prompt's rewards minus their mean over the "
                  "members scored on it, averaged per member, without division by the spread (EGGROLL's group-centred "
                  "fitness; members may be scored on different prompts)", needs_prompts=True, needs_finite_spread=True)
