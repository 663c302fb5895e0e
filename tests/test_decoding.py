"""The lean greedy decoder (esft.engines.decoding): the completions of transformers' greedy
`generate`, token for token, while it drops finished rows from the running batch, also under
population batching where the rows that remain belong to different members."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from esft.batches import prompt_batch
from esft.config import embedded_model_path
from esft.engines import decoding
from esft.engines.base import generation_from_tokens
from esft.engines.population import generate_population
from esft.engines.transformers_engine import TransformersEngine
from esft.tasks.countdown_task import make_countdown_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    """The embedded Countdown model: its completions end at EOS after 20-35 tokens, at different steps."""
    return TransformersEngine.from_pretrained(str(embedded_model_path()), device="cpu", noise="lowrank", rank=1,
                                              max_tokens=48)


@pytest.fixture(scope="module")
def prompts():
    return prompt_batch(make_countdown_task(seed=0).train_dataset, 0, 12, 0).prompts


def hf_tokens(engine, prompts) -> list[list[int]]:
    rows = [row for chunk in engine.generated_chunks(prompts, None, GenerationConfig(**engine.greedy.to_dict()))
            for row in chunk]
    return generation_from_tokens(rows, engine.eos_token_ids, engine.tokenizer).token_ids


def test_greedy_decoding_equals_generate_while_dropping_finished_rows(engine, prompts, monkeypatch):
    seen = []
    real = decoding.decode_greedy

    def watched(*args, **kwargs):
        kwargs["on_rows"] = lambda active: seen.append(len(active))
        return real(*args, **kwargs)

    monkeypatch.setattr("esft.engines.transformers_engine.decode_greedy", watched)
    ours = engine.generate(prompts)
    assert ours.token_ids == hf_tokens(engine, prompts)
    assert seen[0] == len(prompts) and len(seen) > 2 and seen == sorted(seen, reverse=True)  # rows were dropped
    lengths = {len(ids) for ids in ours.token_ids}
    assert len(lengths) > 3 and all(ids[-1] in engine.eos_token_ids for ids in ours.token_ids if len(ids) < 48)


def test_min_new_tokens_forces_equal_lengths(engine, prompts):
    engine.min_new_tokens = engine.max_tokens
    try:
        assert {len(ids) for ids in engine.generate(prompts[:4]).token_ids} == {engine.max_tokens}
    finally:
        engine.min_new_tokens = 0


@pytest.mark.parametrize("mini_batch_size", [None, 5, "auto"])
def test_population_batching_with_dropped_rows_equals_one_member_at_a_time(engine, prompts, mini_batch_size):
    seeds, sigma = [11, 12, 13, 14, 15], 2e-3
    batched = generate_population(engine, prompts, seeds, sigma, mini_batch_size=mini_batch_size)
    for seed, generation in zip(seeds, batched):
        engine.perturb(seed, sigma)
        try:
            assert engine.generate(prompts).token_ids == generation.token_ids, seed
        finally:
            engine.restore()
    assert len({tuple(map(tuple, g.token_ids)) for g in batched}) > 1  # members really differ


def test_auto_rows_per_call_fit_the_cpu_target_and_memory(engine):
    from esft.engines.sizing import CPU_TARGET_ROWS, auto_prompts_per_call, bytes_per_row

    assert auto_prompts_per_call(engine.model, 200, 30, 90) == CPU_TARGET_ROWS // 30  # 17 prompts × 30 members
    assert auto_prompts_per_call(engine.model, 200, 1, 90) == 200  # one member: the whole batch fits
    assert auto_prompts_per_call(engine.model, 2000, 1, 90) == CPU_TARGET_ROWS
    assert auto_prompts_per_call(engine.model, 3, 30, 90) == 3
    assert bytes_per_row(engine.model, 100) > bytes_per_row(engine.model, 50) > 0
    assert engine.prompts_per_call(200, 30, "auto", 24) == CPU_TARGET_ROWS // 30
