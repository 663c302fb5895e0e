"""RandOpt's math on seeds and scores (no model): which members are kept, how they vote, and the
weights that fold them into one model. We MAXIMIZE reward.

RandOpt (Gan & Isola, "Neural Thickets", arXiv 2603.12228): sample N Gaussian perturbations θ + σ·εᵢ of a
pretrained model once, score each on a small validation set, keep the K best and answer by majority vote
of the K.

Consolidation, after CoRP (Consolidating Rewarded Perturbations, arXiv 2605.31494), which folds the rewarded
population into one model by reward-weighted aggregation, compatibility-aware reweighting and a held-out
validation gate. esft implements the first and the last: θ + σ·Σ wᵢ·εᵢ over the K kept members with
wᵢ = softmax(zᵢ), zᵢ their z-scored validation rewards (esft's choice of weights: ES's own shaping, made
positive and summing to 1, so the combination stays in the span of the kept perturbations at σ), kept only
if it beats the base model on the validation split. CoRP's reweighting of each perturbation by its
alignment with the reward-weighted direction is not implemented.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


def top_k(members: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The k members with the highest `reward`, best first; equal rewards keep their scoring order
    (the earlier seed first), so the choice is a function of the scores alone."""
    order = sorted(range(len(members)), key=lambda i: (-float(members[i]["reward"]), i))
    return [members[i] for i in order[:k]]


def vote(answers: Sequence[Sequence[Hashable | None]]) -> list[int]:
    """For each position, the member (index into `answers`, members best first) whose answer wins the
    majority vote: answers are `answers[member][position]`, None for a completion that gives none (it does
    not vote). A tie goes to the answer of the best-ranked member among the tied ones; a position where no
    member answers goes to the best member (0)."""
    if not answers:
        raise ValueError("a vote needs at least one member")
    winners = []
    for position in range(len(answers[0])):
        given = [member[position] for member in answers]
        counts = Counter(answer for answer in given if answer is not None)
        if not counts:
            winners.append(0)
            continue
        most = max(counts.values())
        # members are best first: the first member holding a most-voted answer breaks the tie
        winners.append(next(i for i, answer in enumerate(given) if answer is not None and counts[answer] == most))
    return winners


def consolidation_weights(rewards: Sequence[float]) -> list[float]:
    """wᵢ = softmax(zᵢ), zᵢ = (Rᵢ − mean) / (std + 1e-8) over the kept members' validation rewards (equal
    rewards: equal weights). Positive, summing to 1."""
    values = np.asarray(rewards, dtype=np.float64)
    z = (values - values.mean()) / (values.std() + 1e-8)
    weights = np.exp(z - z.max())
    return [float(w) for w in weights / weights.sum()]


def validation_indices(rows: int, size: int, seed: int) -> list[int]:
    """The training rows of the validation split: `size` of them without repetition, drawn from `seed`
    alone (the same split on resume, in `esft eval` and in every benchmark run of that seed), in order."""
    rng = np.random.default_rng([seed, 53])  # 53: a stream of its own, not prompt_batch's (seed, 1, epoch)
    return sorted(int(i) for i in rng.choice(rows, size=size, replace=False))
