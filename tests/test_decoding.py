"""The lean greedy decoder (esft.engines.decoding): the completions of transformers' greedy
`generate`, token for token, while it drops finished rows from the running batch, also under
population batching where the rows that remain belong to different members."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from esft.es.batches import prompt_batch
from esft.settings.config import embedded_model_path
from esft.engines import decoding
from esft.engines.base import generation_from_tokens
from esft.engines.member_rows import MemberRows
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
    real = decoding.decode

    def watched(*args, **kwargs):
        kwargs["on_rows"] = lambda active: seen.append(len(active))
        return real(*args, **kwargs)

    monkeypatch.setattr("esft.engines.transformers_engine.decode", watched)
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


@pytest.fixture(scope="module")
def iid_engine():
    """The embedded model with the paper's full-rank noise: population batching gives each member its own weights."""
    return TransformersEngine.from_pretrained(str(embedded_model_path()), device="cpu", noise="iid", max_tokens=48)


@pytest.mark.parametrize("noise", ["lowrank", "iid"])
@pytest.mark.parametrize("mini_batch_size", [None, 5, "auto"])
def test_population_batching_with_dropped_rows_equals_one_member_at_a_time(engine, iid_engine, prompts, mini_batch_size,
                                                                            noise, monkeypatch):
    engine = engine if noise == "lowrank" else iid_engine
    seeds, sigma = [11, 12, 13, 14, 15], 2e-3
    running = []
    real = MemberRows.set_rows
    monkeypatch.setattr(MemberRows, "set_rows", lambda self, active, n=0: (running.append(None if active is None else len(active)),
                                                                          real(self, active, n)))
    batched = generate_population(engine, prompts, seeds, sigma, mini_batch_size=mini_batch_size)
    assert any(None not in pair and pair[1] < pair[0] for pair in zip(running, running[1:]))  # rows dropped mid-call
    for seed, generation in zip(seeds, batched):
        engine.perturb(seed, sigma)
        try:
            assert engine.generate(prompts).token_ids == generation.token_ids, seed
        finally:
            engine.restore()
    assert len({tuple(map(tuple, g.token_ids)) for g in batched}) > 1  # members really differ


def test_full_rank_members_that_do_not_fit_run_in_groups(iid_engine, prompts, monkeypatch):
    """Each full-rank member holds its own copy of the weights: with room for two, five members run
    as groups of 2, 2 and 1, and complete exactly as all five at once."""
    from esft.engines import fullrank_population, sizing

    seeds, sigma = [11, 12, 13, 14, 15], 2e-3
    together = generate_population(iid_engine, prompts[:6], seeds, sigma)
    sizes = []
    real = fullrank_population.FullRankPopulation.__init__

    def counted(self, engine, member_seeds, sigma):
        sizes.append(len(member_seeds))
        real(self, engine, member_seeds, sigma)

    monkeypatch.setattr(fullrank_population.FullRankPopulation, "__init__", counted)
    monkeypatch.setattr(sizing, "free_memory", lambda model: int(2.5 * fullrank_population.member_bytes(iid_engine)
                                                                 / sizing.WEIGHTS_MEMORY_SHARE))
    monkeypatch.setattr(sizing, "auto_rows", lambda model, sequence_length: 10**6)
    assert generate_population(iid_engine, prompts[:6], seeds, sigma) == together
    assert sizes == [2, 2, 1]


def test_members_whose_prompts_fill_a_call_run_one_at_a_time_with_their_weights_in_place(iid_engine, monkeypatch):
    """Where one member's prompts already fill a call, batching full-rank members gains nothing: the
    executor evaluates them one at a time (no copies of the weights) and scores as the sequential path."""
    from esft.engines import fullrank_population, sizing
    from esft.executors import LocalExecutor
    from esft.rewards.runner import RewardRunner
    from esft.tasks.countdown import countdown_reward

    batch = prompt_batch(make_countdown_task(seed=0).train_dataset, 0, 12, 0)
    scorer = RewardRunner([countdown_reward], sandbox=False).score
    seeds = [11, 12, 13]
    sequential = LocalExecutor(iid_engine, scorer).evaluate_population(seeds, batch, 2e-3)
    monkeypatch.setattr(sizing, "auto_rows", lambda model, sequence_length: 12)  # one member's 12 prompts fill a call

    def no_copies(*args):
        raise AssertionError("members were batched")

    monkeypatch.setattr(fullrank_population.FullRankPopulation, "__init__", no_copies)
    batched = LocalExecutor(iid_engine, scorer, population_batching=True).evaluate_population(seeds, batch, 2e-3)
    assert [(m.seed, m.reward, m.num_tokens) for m in batched] == [(m.seed, m.reward, m.num_tokens) for m in sequential]


def test_full_rank_members_per_call_fill_a_call_with_all_prompts_each(iid_engine):
    from esft.engines.fullrank_population import FullRankPopulation
    from esft.engines.sizing import CPU_TARGET_ROWS

    prompts = prompt_batch(make_countdown_task(seed=0).train_dataset, 0, 200, 0).prompts
    assert FullRankPopulation.members_per_call(iid_engine, 30, prompts[:64]) == CPU_TARGET_ROWS // 64  # 16 members
    assert FullRankPopulation.members_per_call(iid_engine, 30, prompts) == CPU_TARGET_ROWS // 200  # 5 members
    assert FullRankPopulation.members_per_call(iid_engine, 30, prompts[:32]) == 30  # 32 rows each: all in one call


def test_auto_rows_per_call_fit_the_cpu_target_and_memory(engine):
    from esft.engines.sizing import CPU_TARGET_ROWS, auto_prompts_per_call, bytes_per_row

    assert auto_prompts_per_call(engine.model, 200, 30, 90) == CPU_TARGET_ROWS // 30  # 34 prompts × 30 members
    assert auto_prompts_per_call(engine.model, 32, 30, 90) == 32  # the demo's 32 prompts × 30 members: one call
    assert auto_prompts_per_call(engine.model, 200, 1, 90) == 200  # one member: the whole batch fits
    assert auto_prompts_per_call(engine.model, 2000, 1, 90) == CPU_TARGET_ROWS
    assert auto_prompts_per_call(engine.model, 3, 30, 90) == 3
    assert bytes_per_row(engine.model, 100) > bytes_per_row(engine.model, 50) > 0
    assert engine.prompts_per_call(200, 30, "auto", 24) == CPU_TARGET_ROWS // 30


def test_the_cache_goes_by_the_name_the_model_takes(tiny_model_dir):
    """transformers >= 5.24 renamed forward's `past_key_values` to `cache` (the old name warns on every
    decoding step, and goes in 5.40): the decoder passes the name the model's forward declares, and
    greedy tokens are the same under either name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    import inspect

    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert decoding._cache_argument(model) == expected

    class RenamedCache(torch.nn.Module):  # a model of the newer signature, delegating to the real one
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, cache=None, attention_mask=None, position_ids=None, use_cache=True):
            return self.inner(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=use_cache)

    renamed = RenamedCache(model)
    assert decoding._cache_argument(renamed) == "cache"
    batch = tokenizer(["ab", "abcd"], return_tensors="pt", padding=True, padding_side="left")
    eos = [tokenizer.eos_token_id]
    assert decoding.decode(renamed, batch["input_ids"], batch["attention_mask"], 6, eos) == \
        decoding.decode(model, batch["input_ids"], batch["attention_mask"], 6, eos)


def test_the_output_head_reads_a_contiguous_input_in_greedy_and_sampled_generation(engine, prompts):
    """With logits_to_keep transformers hands the head a strided slice; torch's CPU matmul then expands the head's
    weight once per row (1.8 GB for 32 rows of SmolLM2 in bfloat16). esft's generation hands it a contiguous copy."""
    head = engine.model.get_output_embeddings()
    seen: list[bool] = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(args[0].is_contiguous()))
    try:
        ids = engine.tokenizer(prompts[:4], return_tensors="pt", padding=True)
        engine.model(**ids, logits_to_keep=1)
        assert seen == [False]  # what transformers itself passes: the hook below is needed
        seen.clear()
        engine.generate(prompts[:4])
        sampled = GenerationConfig(**{**engine.greedy.to_dict(), "do_sample": True, "temperature": 1.0})
        list(engine.generated_chunks(prompts[:4], None, sampled))
        assert len(seen) > 4 and all(seen)
        seen.clear()
        engine.model(**ids, logits_to_keep=1)
        assert seen == [False]  # the pre-hook is removed afterwards
    finally:
        handle.remove()
