"""Sampled ES rollouts with common random numbers (--rollout-temperature > 0, esft.engines.decoding.CommonNoise):
a completion's sampling noise depends on the seed, its prompt's text and the step alone, so the same prompt samples
the same completion under the same weights wherever it sits (position, call size, member batch), members differ only
by their perturbations, and a run is as reproducible as a greedy one."""

from __future__ import annotations

import pytest
import torch

from esft import ESConfig, ESTrainer
from esft.engines.base import Sampling, perturbed, prompt_noise_seed
from esft.engines.decoding import CommonNoise
from esft.engines.population import generate_population
from esft.engines.transformers_engine import TransformersEngine
from esft.es.batches import prompt_batch, rollout_seed
from esft.settings.config import ConfigError, embedded_model_path
from esft.tasks.countdown_task import make_countdown_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    return TransformersEngine.from_pretrained(str(embedded_model_path()), device="cpu", noise="lowrank", rank=1,
                                              max_tokens=24)


@pytest.fixture(scope="module")
def prompts():
    return prompt_batch(make_countdown_task(seed=0).train_dataset, 0, 6, 0).prompts


def sampled(seed: int, temperature: float = 1.0, top_p: float = 1.0) -> Sampling:
    return Sampling(temperature, top_p, 1, seed, common_noise=True)


def test_a_prompt_samples_the_same_completion_wherever_it_sits(engine, prompts):
    alone = [engine.generate([prompt], sampling=sampled(7)).texts[0] for prompt in prompts]
    batched = engine.generate(prompts, sampling=sampled(7))
    assert batched.texts == alone
    assert engine.generate(prompts, mini_batch_size=2, sampling=sampled(7)).texts == alone
    assert engine.generate(prompts[::-1] + prompts[:2], sampling=sampled(7)).texts == alone[::-1] + alone[:2]
    greedy = engine.generate(prompts).texts
    assert sum(a != b for a, b in zip(alone, greedy)) >= 4  # it samples: not the greedy completions
    other = engine.generate(prompts, sampling=sampled(8)).texts
    assert sum(a != b for a, b in zip(alone, other)) >= 4  # another seed draws other numbers


def test_common_noise_is_gumbel_max_sampling_at_the_temperature_and_top_p():
    """The token is argmax(logits/T + g): near T → 0 the argmax itself; at top_p → 0 only the most probable token;
    at T = 1 token frequencies follow softmax(logits)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rows = torch.tensor([0])
    cold = CommonNoise([1], temperature=1e-6)
    assert {int(cold(logits, rows)) for _ in range(50)} == {0}
    narrow = CommonNoise([1], temperature=1.0, top_p=1e-3)
    assert {int(narrow(logits, rows)) for _ in range(50)} == {0}
    draws = CommonNoise([3], temperature=1.0)
    counts = torch.bincount(torch.tensor([int(draws(logits, rows)) for _ in range(4000)]), minlength=4).float() / 4000
    assert torch.allclose(counts, logits.softmax(-1)[0], atol=0.03), counts
    nucleus = CommonNoise([3], temperature=1.0, top_p=0.7)  # softmax ≈ .64 .24 .09 .03: the first two
    assert {int(nucleus(logits, rows)) for _ in range(300)} == {0, 1}
    with pytest.raises(ValueError, match="temperature > 0"):
        CommonNoise([1], temperature=0.0)
    assert prompt_noise_seed(1, "a") == prompt_noise_seed(1, "a") != prompt_noise_seed(1, "b") != prompt_noise_seed(2, "a")


def test_batched_members_sample_what_each_member_samples_alone(engine, prompts):
    seeds = [11, 12, 13]
    batched = generate_population(engine, prompts, seeds, 0.05, sampling=sampled(5))
    for seed, generation in zip(seeds, batched):
        with perturbed(engine, seed, 0.05):
            assert engine.generate(prompts, sampling=sampled(5)).texts == generation.texts
    unperturbed = engine.generate(prompts, sampling=sampled(5)).texts
    same = generate_population(engine, prompts, [21, 22], 0.0, sampling=sampled(5))  # σ = 0: nothing but the noise
    assert same[0].texts == same[1].texts == unperturbed


def test_a_sampled_run_is_reproducible_and_differs_from_the_greedy_one(tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(list(completions))
        return [float(len(set(text))) for text in completions]

    rows = [{"prompt": f"Q{i}: {i} + {i} ="} for i in range(8)]

    def train(name: str, **settings):
        seen.clear()
        args = ESConfig(model="embedded", iterations=2, population_size=4, batch_size=2, max_tokens=12, eval_size=2,
                        sigma=1e-2, logging="none", progress=False, save_every=0, output_dir=str(tmp_path),
                        run_name=name, reward_sandbox=False, **settings)
        trainer = ESTrainer(reward_funcs=[reward], args=args, train_dataset=rows, eval_dataset=rows[:2])
        trainer.train()
        checksum, members = trainer.engine.checksum(), [list(call) for call in seen[1:5]]  # iteration 1's members
        trainer.close()
        return checksum, members

    first, members = train("a", rollout_temperature=1.0)
    assert (first, members) == train("b", rollout_temperature=1.0)  # the same samples, the same weights
    greedy, greedy_members = train("greedy")
    assert first != greedy and members != greedy_members  # sampled rollouts are not the greedy ones
    assert train("zero", rollout_temperature=0.0)[0] == greedy  # 0: greedy, as unset
    assert "rollout_temperature: 1.0" in (tmp_path / "a" / "config.yaml").read_text()


def test_a_negative_rollout_temperature_is_refused():
    with pytest.raises(ConfigError, match="--rollout-temperature: must be >= 0"):
        ESConfig(rollout_temperature=-1.0)
    assert ESConfig(algorithm="grpo").rollout_temperature is None  # GRPO reads it as TRL's 1.0
    assert rollout_seed(0, 1) == rollout_seed(0, 1) != rollout_seed(0, 2)
