"""Issue 63's budget designs: prompt groups (--prompt-groups: each group of members scored on its own slice of the
batch, fitness compared within the group) and the step rule (--step-rule sqrt_n: θ += (α/√N)·Σ cᵢ·εᵢ), through
the index arithmetic, the shaping, the trainer and the CLI (a subprocess). Resume and Ray with them:
tests/test_es_variants.py's "grouped" design."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from esft.es.fitness import Fitness
from esft.es.groups import PromptGroup, groups_problem, prompt_groups, prompts_of_members
from esft.es.shaping import REWARD_SHAPING
from esft.es.step_rules import STEP_RULES, alpha_for_strategy
from esft.es.strategies import STRATEGIES, ESState
from esft.loop.learning_signal import distinct_per_prompt
from esft.settings.config import ESConfig
from tiny_model import build_tiny_model
from toy_task import byte_reward, toy_rows



@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.05 perturbations (as in test_es_variants)."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


# ------------------------------------------------------------------ the arithmetic
def test_groups_split_members_and_prompts_into_equal_consecutive_slices():
    groups = prompt_groups(6, 4, 2)
    assert groups == [PromptGroup(range(0, 3), range(0, 2)), PromptGroup(range(3, 6), range(2, 4))]
    assert prompts_of_members(groups).tolist() == [[0, 1]] * 3 + [[2, 3]] * 3
    assert prompt_groups(4, 3, 1) == [PromptGroup(range(4), range(3))]  # one group: the paper's iteration
    assert prompt_groups(8, 8, 8)[5] == PromptGroup(range(5, 6), range(5, 6))


@pytest.mark.parametrize("members, prompts, groups, mirrored, expected", [
    (30, 32, 4, False, "N must be a multiple of 4: use --population-size 32"),
    (32, 30, 4, False, "B must be a multiple of 4: use --batch-size 32"),
    (12, 12, 4, True, "N/G must be even; got 12/4 = 3: use --population-size 24"),
    (12, 12, 0, False, "must be >= 1"),
])
def test_a_split_that_cannot_be_made_says_why_and_how_to_fix_it(members, prompts, groups, mirrored, expected):
    assert expected in groups_problem(members, prompts, groups, mirrored)
    assert groups_problem(24, 12, 4, True) is None and groups_problem(12, 12, 4, False) is None
    with pytest.raises(ValueError, match="--prompt-groups"):
        prompt_groups(30, 32, 4)


def test_centred_shaping_compares_a_member_only_with_its_group():
    """Group 0 (members 0-1) on prompts 0-1, group 1 (members 2-3) on prompts 2-3: a member's value is its rewards
    minus its group's mean per prompt; a group that ties on everything gets 0 whatever the other group scored."""
    groups = prompt_groups(4, 4, 2)
    matrix = np.array([[1.0, 0.0], [0.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    fitness = Fitness.of(matrix, prompts_of_members(groups))
    shaped = REWARD_SHAPING["per_prompt_centered"](fitness)
    assert shaped.tolist() == [0.25, -0.25, 0.0, 0.0]  # ((1 - 0.5) + 0)/2, ((0 - 0.5) + 0)/2; group 1 tied
    assert not fitness.shared_prompts
    with pytest.raises(ValueError, match="same prompts"):
        REWARD_SHAPING["per_prompt"](fitness)
    # z-scoring over all members still sees every member (members of different groups are compared)
    assert REWARD_SHAPING["zscore"](fitness)[2] != 0


def test_distinct_completions_are_counted_per_prompt_among_the_members_that_answered_it():
    prompts = prompts_of_members(prompt_groups(4, 4, 2))
    fingerprints = [(1, 2), (1, 3), (7, 8), (7, 8)]
    assert distinct_per_prompt(fingerprints, prompts) == [1, 2, 1, 1]
    assert distinct_per_prompt(fingerprints) == [2, 3]  # without prompts: columns, as for shared prompts


@pytest.mark.parametrize("members", [2, 8, 128])
def test_the_sqrt_n_step_is_the_papers_times_sqrt_n_and_keeps_a_zscored_steps_norm_flat(members):
    assert list(STEP_RULES) == ["paper", "sqrt_n"]
    strategy = STRATEGIES["paper"]
    rewards = np.random.default_rng(members).normal(size=members)
    _, paper = strategy.tell(ESState(0), rewards, alpha_for_strategy("paper", 0.01, members))
    _, sqrt_n = strategy.tell(ESState(0), rewards, alpha_for_strategy("sqrt_n", 0.01, members))
    assert np.allclose(np.array(sqrt_n), np.array(paper) * math.sqrt(members), rtol=1e-12)
    # independent unit noises: ‖Σ cᵢ·εᵢ‖ ≈ ‖c‖·√d, and ‖c‖ of z-scores under sqrt_n is α (up to z-score's 1e-8)
    assert math.isclose(float(np.linalg.norm(sqrt_n)), 0.01, rel_tol=1e-6)
    assert math.isclose(float(np.linalg.norm(paper)), 0.01 / math.sqrt(members), rel_tol=1e-6)
    with pytest.raises(ValueError, match="--step-rule"):
        alpha_for_strategy("sqrt", 0.01, members)


# ------------------------------------------------------------------ the trainer
def test_each_group_is_scored_on_its_own_slice_of_the_batch(lively_model_dir, tmp_path):
    """N = 4, B = 4, G = 2: the reward sees members 0-1 on the batch's first two prompts, members 2-3 on the
    last two, every iteration (one call per member, in order: rewards in this process), and the budget counts
    N·B/G completions."""
    from esft.es.batches import prompt_batch
    from esft.trainer import ESTrainer

    seen: list[list[str]] = []

    def recording_reward(prompts, completions, answer, **kwargs):
        seen.append(list(prompts))
        return byte_reward(prompts, completions, answer)

    args = ESConfig(model=str(lively_model_dir), iterations=2, population_size=4, batch_size=4, prompt_groups=2,
                    reward_shaping="per_prompt_centered", reward_sandbox=False, max_tokens=6, eval_size=2, eval_batch_size=2, sigma=0.05,
                    eval_every=0, logging="none", progress=False, save_every=0, output_dir=str(tmp_path), run_name="run")
    train = toy_rows(12)
    trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[recording_reward], args=args, train_dataset=train,
                        eval_dataset=toy_rows(2, start=1000))
    before = len(seen)
    trainer.train()
    evaluation = [prompts for prompts in seen if prompts and prompts[0].startswith("Q100")]
    training = [prompts for prompts in seen[before:] if not prompts[0].startswith("Q100")]
    assert len(evaluation) == 2  # before and after training
    for iteration in range(2):
        batch = [row["prompt"] for row in prompt_batch(train, 0, 4, iteration).rows]
        assert training[4 * iteration : 4 * iteration + 4] == [batch[:2], batch[:2], batch[2:], batch[2:]]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["budget/completions"] for row in rows if "reward/mean" in row] == [8, 16]
    assert all(row["es/distinct_completions"] >= 1 for row in rows if "reward/mean" in row)


def test_population_batching_gives_each_group_the_completions_of_one_member_at_a_time(lively_model_dir, tmp_path):
    """The same grouped run with members batched and one at a time ends with the same weights (lowrank noise)."""
    from esft.trainer import ESTrainer

    finals = {}
    for batching in (True, False):
        args = ESConfig(model=str(lively_model_dir), iterations=2, population_size=4, batch_size=4, prompt_groups=2,
                        noise="lowrank", rank=2, reward_shaping="per_prompt_centered", step_rule="sqrt_n", alpha=0.05,
                        population_batching=batching, max_tokens=6, eval_size=2, eval_batch_size=2, sigma=0.05,
                        logging="none", progress=False, save_every=0, output_dir=str(tmp_path), run_name=f"b{batching}")
        trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[byte_reward], args=args,
                            train_dataset=toy_rows(12), eval_dataset=toy_rows(2, start=1000))
        trainer.train()
        finals[batching] = load_file(str(tmp_path / f"b{batching}" / "final" / "model.safetensors"))
    start = load_file(str(lively_model_dir / "model.safetensors"))
    assert any(not torch.equal(finals[True][n], start[n]) for n in start)
    assert all(torch.allclose(finals[True][n], finals[False][n], atol=1e-6) for n in start)
