"""--prompt-candidates K: the batch is B of K·B candidate prompts, chosen by the unperturbed model's rewards on them
(--prompt-choice: esft.es.batches.PROMPT_CHOICES), through the choices, the trainer, the budget and the settings.
Resume and Ray with it: tests/test_es_variants.py's "grouped" design."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from esft.es.batches import PROMPT_CHOICES, prompt_batch
from esft.settings.config import ConfigError, ESConfig
from tiny_model import build_tiny_model
from toy_task import byte_reward, toy_rows


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.05 perturbations (as in test_es_variants)."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


@pytest.mark.parametrize("choice, rewards, size, chosen", [
    ("lowest", [0.5, 0.1, 0.9, 0.1], 2, [1, 3]),  # the two lowest, in the candidates' order
    ("lowest", [0.3, 0.2, 0.2, 0.2], 2, [1, 2]),  # a tie goes to the earlier candidate
    ("lowest", [None, 0.9, 0.8, None], 3, [0, 1, 2]),  # unscored ones come last: the first None fills the third place
    ("lowest", [1.0, 0.0], 2, [0, 1]),  # all of them
    ("lowest", [-1.0, 0.0, -2.0], 1, [2]),  # negative rewards: the lowest is the most negative
    ("extremes", [0.5, 0.1, 0.9, 0.1], 2, [1, 2]),  # the lowest and the highest
    ("extremes", [0.5, 0.1, 0.9, 0.1, 0.7], 3, [1, 2, 3]),  # two lowest (half, rounded up) and the highest
    ("extremes", [0.0, 0.0, 0.0, 0.0], 2, [0, 1]),  # all tied: the first two
    ("extremes", [0.0, 1.0, 1.0, None], 2, [0, 1]),  # the earlier of two highest
    ("extremes", [None, 0.2, None, 0.4], 2, [1, 3]),  # unscored ones are neither the lowest nor the highest
    ("extremes", [0.3, 0.2], 1, [1]),  # one prompt: the lowest
])
def test_each_prompt_choice_picks_its_rewards_in_candidate_order(choice, rewards, size, chosen):
    assert PROMPT_CHOICES[choice](rewards, size) == chosen


def row_value(prompt: str) -> int:
    """The toy row's number i ("Qi: i + i =")."""
    return int(prompt.split(":")[0][1:])


@pytest.mark.parametrize("choice", ["lowest", "extremes"])
def test_the_batch_is_the_candidates_the_choice_picks_and_their_completions_count(lively_model_dir, tmp_path, choice):
    """K = 4, B = 2: each iteration the reward first sees the 8 candidates (prompt_batch of 8 rows: the unperturbed
    model's greedy answers), then each member's completions of the 2 the choice picked by those rewards; the reward
    is the row's number plus less than 1, so those are the 2 smallest numbers among the candidates (lowest), or the
    smallest and the largest (extremes). The budget counts N·B + K·B completions per iteration and the row logs the
    candidates' and the batch's mean rewards."""
    from esft.trainer import ESTrainer

    seen: list[list[str]] = []

    def row_reward(prompts, completions, answer, **kwargs):
        seen.append(list(prompts))
        return [row_value(p) + 0.5 * r for p, r in zip(prompts, byte_reward(prompts, completions, answer), strict=True)]

    train = toy_rows(24)
    args = ESConfig(model=str(lively_model_dir), iterations=2, population_size=4, batch_size=2, prompt_candidates=4,
                    prompt_choice=choice, reward_sandbox=False, max_tokens=6, eval_size=2, eval_batch_size=8, sigma=0.05, eval_every=0,
                    logging="none", progress=False, save_every=0, output_dir=str(tmp_path), run_name="run")
    trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[row_reward], args=args, train_dataset=train,
                        eval_dataset=toy_rows(2, start=1000))
    trainer.train()
    training = [prompts for prompts in seen if not prompts[0].startswith("Q100")]
    assert len(training) == 2 * (1 + 4)  # per iteration: the candidates' call, then one per member
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "reward/mean" in row]
    for iteration, row in enumerate(rows):
        candidates = prompt_batch(train, 0, 8, iteration).prompts
        ranked = sorted(candidates, key=row_value)
        picked = ranked[:2] if choice == "lowest" else [ranked[0], ranked[-1]]
        chosen = [prompt for prompt in candidates if prompt in picked]  # in the candidates' order
        assert training[5 * iteration] == candidates
        assert training[5 * iteration + 1 : 5 * iteration + 5] == [chosen] * 4
        assert chosen != prompt_batch(train, 0, 2, iteration).prompts  # not what --prompt-candidates 1 trains on
        numbers = [row_value(p) for p in candidates]
        assert sum(numbers) / 8 <= row["selection/candidate_reward"] < sum(numbers) / 8 + 0.5
        assert sum(map(row_value, chosen)) / 2 <= row["selection/batch_reward"] < sum(map(row_value, chosen)) / 2 + 0.5
    assert [row["budget/completions"] for row in rows] == [16, 32]  # 4 members × 2 prompts + 8 candidates


def test_without_candidates_the_batch_is_the_next_rows_and_nothing_is_screened(lively_model_dir, tmp_path):
    from esft.trainer import ESTrainer

    seen: list[list[str]] = []

    def recording_reward(prompts, completions, answer, **kwargs):
        seen.append(list(prompts))
        return byte_reward(prompts, completions, answer)

    train = toy_rows(24)
    args = ESConfig(model=str(lively_model_dir), iterations=1, population_size=4, batch_size=2, reward_sandbox=False,
                    max_tokens=6, eval_size=2, eval_batch_size=8, sigma=0.05, eval_every=0, logging="none",
                    progress=False, save_every=0, output_dir=str(tmp_path), run_name="run")
    ESTrainer(model=str(lively_model_dir), reward_funcs=[recording_reward], args=args, train_dataset=train,
              eval_dataset=toy_rows(2, start=1000)).train()
    assert [p for p in seen if not p[0].startswith("Q100")] == [prompt_batch(train, 0, 2, 0).prompts] * 4
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert row["budget/completions"] == 8 and not any(key.startswith("selection/") for key in row)


@pytest.mark.parametrize("settings, expected", [
    ({"prompt_candidates": 0}, "--prompt-candidates: must be >= 1, got 0"),
    ({"prompt_candidates": 2, "algorithm": "grpo"}, "--prompt-candidates: is an ES setting"),
    ({"prompt_candidates": 2, "algorithm": "randopt"}, "--prompt-candidates: is a setting of the ES update"),
    ({"prompt_choice": "extremes"}, "--prompt-choice: extremes chooses the batch among --prompt-candidates' "
     "candidates, and there are none to choose from at --prompt-candidates 1"),
    ({"prompt_choice": "highest", "prompt_candidates": 2}, "--prompt-choice: must be one of lowest, extremes"),
])
def test_bad_candidate_settings_are_refused(settings, expected):
    with pytest.raises(ConfigError, match=expected):
        ESConfig(**settings)
