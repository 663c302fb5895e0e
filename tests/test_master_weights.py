"""--master-weights none (issue 64): the weights without a float32 master. A float32 model is the same run bit for
bit without the copy; bfloat16 weights restore exactly after every member, round each update stochastically
(seeded: the same every time), say how much of it survived, and refuse what cannot work in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from esft.engines.settings import EngineSettings
from esft.engines.transformers_engine import TransformersEngine
from esft.es.rounding import round_stochastically, rounding_seed
from esft.settings.config import ConfigError, ESConfig
from tiny_model import build_sparse_model, build_tiny_model

PROMPTS = ["hello there", "abc def ghi"]


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.05 perturbations."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


def engine(model: Path, dtype: str, noise: str, master_weights: str, **options) -> TransformersEngine:
    return TransformersEngine.from_pretrained(str(model), dtype=dtype, device="cpu", max_tokens=5, noise=noise, rank=2,
                                              master_weights=master_weights, **options)


def iterate(engine: TransformersEngine, iteration: int, sigma: float = 0.05, step: float = 0.01) -> list[list[str]]:
    """One ES iteration by hand: three members (one mirrored) perturbed in place, then an update."""
    seeds = [10 * iteration + 1, 10 * iteration + 2, -(10 * iteration + 2)]
    texts = []
    for seed in seeds:
        engine.perturb(seed, sigma)
        texts.append(engine.generate(PROMPTS).texts)
        engine.restore()
    engine.update(seeds, [step, -2 * step, step / 2])
    return texts


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
@pytest.mark.parametrize("optimizer", [None, {"kind": "adam"}])
def test_float32_weights_without_a_master_are_the_master_run_bit_for_bit(lively_model_dir, noise, optimizer):
    with_master = engine(lively_model_dir, "float32", noise, "float32", optimizer=optimizer)
    without = engine(lively_model_dir, "float32", noise, "none", optimizer=optimizer)
    assert all(without.master[name].data_ptr() == param.data_ptr() for _, name, param in without.trainable)  # no copy
    start = without.checksum()
    assert start == with_master.checksum()
    for iteration in range(3):
        assert iterate(with_master, iteration) == iterate(without, iteration)
        assert with_master.checksum() == without.checksum()
        assert with_master.last_update_ratio == without.last_update_ratio > 0
        assert without.last_update_survival is None  # nothing was rounded
    assert without.checksum() != start
    assert all(torch.equal(a, b) for a, b in zip(with_master.model.parameters(), without.model.parameters()))
    assert with_master.optimizer_state().keys() == without.optimizer_state().keys()
    assert all(torch.equal(with_master.optimizer_state()[k], without.optimizer_state()[k]) for k in without.optimizer_state())


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_bfloat16_weights_without_a_master_restore_exactly_and_round_each_update_alike(lively_model_dir, noise):
    first, second = (engine(lively_model_dir, "bfloat16", noise, "none") for _ in range(2))
    weights = {name: param.detach().clone() for name, param in first.model.named_parameters()}
    for seed in (3, -3, 17):  # a member's perturbation moves the weights; restore puts every bit back
        first.perturb(seed, 0.05)
        assert any(not torch.equal(param, weights[name]) for name, param in first.model.named_parameters())
        first.restore()
        assert all(torch.equal(param, weights[name]) for name, param in first.model.named_parameters())
    assert first.master_state()[first.trainable_names()[0]].dtype == torch.bfloat16  # the weights: no float32 copy
    for iteration in range(3):  # seeded: two replicas (Ray actors, a resumed run) take the same update bit for bit
        assert iterate(first, iteration) == iterate(second, iteration)
        assert first.checksum() == second.checksum()
        assert 0.9 < first.last_update_survival < 1.1  # stochastic rounding keeps the step on average
    assert first.checksum() != engine(lively_model_dir, "bfloat16", noise, "none").checksum()


def test_a_step_far_below_bfloat16_precision_survives_on_average_where_rounding_to_nearest_drops_it():
    """1 + 0.3 ulp: nearest rounding gives 1 every time; stochastic rounding 1 + ulp in 30% of the elements."""
    ulp = 2.0**-7  # bfloat16 spacing at 1
    value = torch.full((200_000,), 1.0 + 0.3 * ulp)
    out = torch.empty(value.shape, dtype=torch.bfloat16)
    round_stochastically(value, out, torch.Generator().manual_seed(rounding_seed([1, 2], 0)))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(float(out.float().mean()) - (1.0 + 0.3 * ulp)) < 0.01 * ulp
    again = torch.empty_like(out)
    round_stochastically(value, again, torch.Generator().manual_seed(rounding_seed([1, 2], 0)))
    assert torch.equal(out, again)  # seeded: the same every time
    assert rounding_seed([1, 2], 0) != rounding_seed([1, 2], 1) != rounding_seed([3, 4], 1)
    assert torch.equal(value.bfloat16(), torch.ones_like(out))  # what rounding to nearest keeps: nothing


def test_an_update_that_would_overflow_leaves_weights_without_a_master_unchanged(lively_model_dir):
    from esft.engines.base import NonFiniteWeights

    for dtype in ("float32", "bfloat16"):
        subject = engine(lively_model_dir, dtype, "iid", "none")
        before = {name: param.detach().clone() for name, param in subject.model.named_parameters()}
        with pytest.raises(NonFiniteWeights, match=r"non-finite .*\(weights unchanged\)"):
            subject.update([1, 2], [3e38, 3e38])
        assert all(torch.equal(param, before[name]) for name, param in subject.model.named_parameters())


def test_auto_is_none_for_float32_weights_and_a_master_for_bfloat16_ones_that_fit(tiny_model_dir):
    from esft.engines import build_engine

    built = build_engine(EngineSettings.of(ESConfig(model=str(tiny_model_dir), device="cpu")))
    assert built.master_weights == "none"
    built = build_engine(EngineSettings.of(ESConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16")))
    assert built.master_weights == "float32"
    lora = build_engine(EngineSettings.of(ESConfig(model=str(tiny_model_dir), device="cpu", lora_r=2)))
    assert lora.master_weights == "float32"  # LoRA-ES: the adapter's master is a few MB


def test_auto_drops_the_master_in_one_line_when_it_would_not_fit(tmp_path, monkeypatch):
    """A 7B Llama shape in bfloat16 (a sparse file): 12.6 GiB of weights, 38.1 GiB with a float32 master. With 16 GiB
    available, auto keeps no master and says so; with the master asked for, the refusal names --master-weights none."""
    from esft.engines import check_folder
    from esft.engines.master_weights import resolve_master_weights
    from esft.models import footprint

    folder = str(build_sparse_model(tmp_path / "7b", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, head_dim=128, vocab_size=32000,
                                    tie_word_embeddings=False))
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 16 * footprint.GIB)
    settings, line = resolve_master_weights(EngineSettings(model=folder, dtype="bfloat16", device="cpu"), folder)
    assert settings.master_weights == "none"
    assert line == ("master weights: none (bfloat16 weights and a float32 master need about 38.1 GiB, 16.0 GiB "
                    "available): each update is rounded stochastically into the bfloat16 weights (es/update_survival "
                    "says how much of it survived); --master-weights float32 insists on the master")
    check_folder(settings, folder)  # fits without the master
    with pytest.raises(ConfigError, match=r"needs about 38\.1 GiB .* --master-weights none would need about 14\.0 GiB"):
        check_folder(dataclasses.replace(settings, master_weights="float32"), folder)
    monkeypatch.setattr(footprint, "available_bytes", lambda device: 40 * footprint.GIB)
    assert resolve_master_weights(EngineSettings(model=folder, dtype="bfloat16", device="cpu"), folder) == (
        dataclasses.replace(settings, master_weights="float32"), None)  # it fits: the master, silently


def test_master_weights_none_on_an_engine_that_keeps_a_master_is_refused():
    with pytest.raises(ConfigError, match=r"--engine vllm keeps a float32 master .* needs --engine transformers"):
        ESConfig(engine="vllm", master_weights="none")
    with pytest.raises(ConfigError, match="--master-weights: must be one of auto, float32, none; got 'bfloat16'"):
        ESConfig(master_weights="bfloat16")
    ESConfig(engine="vllm")  # auto: vLLM keeps its master


def test_population_batching_without_a_master_writes_what_one_member_at_a_time_writes(lively_model_dir):
    """Full-rank batched members, each its own weights built from the bfloat16 weights, complete exactly as the same
    members perturbed in place and restored, and leave the weights untouched. (Low-rank batching adds σ·(x·B)·Aᵀ to
    W·x in bfloat16 arithmetic, which rounds otherwise than (W + σ·A·Bᵀ)·x, with or without a master.)"""
    from esft.engines.population import generate_population

    subject = engine(lively_model_dir, "bfloat16", "iid", "none")
    subject.update([5, 6], [0.02, -0.01])  # weights no master could round to: what the members start from
    start = subject.checksum()
    seeds, sigma = [11, 12, -12], 0.05
    batched = generate_population(subject, PROMPTS, seeds, sigma)
    assert subject.checksum() == start
    for seed, generation in zip(seeds, batched):
        subject.perturb(seed, sigma)
        assert subject.generate(PROMPTS).token_ids == generation.token_ids, seed
        subject.restore()
    assert subject.checksum() == start
    assert len({tuple(map(tuple, g.token_ids)) for g in batched}) > 1  # members really differ


def test_row_blocks_change_memory_only_in_a_bfloat16_run_without_a_master(lively_model_dir, monkeypatch):
    """Low-rank noise on bfloat16 weights without a master is added, taken away and updated a block of rows at a time
    (no float32 copy of a whole matrix): blocks of two rows give the perturbed weights, the exact restore, the update
    of one block per matrix, bit for bit."""
    from esft.es import lowrank

    def run() -> list:
        subject, seen = engine(lively_model_dir, "bfloat16", "lowrank", "none"), []
        for iteration in range(2):
            for seed in (10 * iteration + 1, -(10 * iteration + 1)):
                before = subject.checksum()
                subject.perturb(seed, 0.05)
                seen.append([param.detach().clone() for _, _, param in subject.trainable])
                subject.restore()
                assert subject.checksum() == before  # every bit back
            subject.update([10 * iteration + 1, -(10 * iteration + 1)], [0.01, -0.005])
            seen.append((subject.checksum(), subject.last_update_survival))
        return seen

    whole = run()
    widest = max(param.shape[-1] for _, _, param in engine(lively_model_dir, "bfloat16", "lowrank", "none").trainable)
    monkeypatch.setattr(lowrank, "ROW_BLOCK", 2 * widest)
    assert len(lowrank.row_blocks((64, widest))) == 32
    blocked = run()
    for one, other in zip(whole, blocked):
        if isinstance(one, tuple):  # the same weights; survival summed block by block, in another order
            assert one[0] == other[0] and one[1] == pytest.approx(other[1], rel=1e-9)
        else:
            assert all(torch.equal(a, b) for a, b in zip(one, other))
    assert whole[-1][1] is not None and whole[-1][0] != whole[2][0]  # rounded updates that moved the weights


def test_without_a_master_the_check_perturbs_groups_of_matrices_and_still_refuses_what_it_refused(
        tmp_path, monkeypatch):
    """Without a master, population batching's check perturbs a large model's matrices in place a group at a time
    (what restoring keeps is a group's share): GPT-2 in bfloat16 in several groups passes once its broadcast position
    embedding is excluded and is refused with it (its one row for the whole batch), and the check leaves every
    weight as it was."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import esft.engines.population as population
    from esft.engines.member_rows import PopulationBatchingError
    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.eos_token_id, initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(population, "CHECK_GROUP_BYTES", 1)  # this 0.1 MB model in CHECK_GROUPS groups
    subject = engine(tmp_path, "bfloat16", "lowrank", "none", trainable=r"^(?!transformer\.wpe)")
    assert len(population._check_groups(subject)) == population.CHECK_GROUPS
    start, trainable = subject.checksum(), subject.trainable
    population.check_population_batching(subject)
    assert subject.checksum() == start and subject.trainable is trainable
    with pytest.raises(PopulationBatchingError):  # its wpe is one row for the whole batch
        population.check_population_batching(engine(tmp_path, "bfloat16", "lowrank", "none"))
    assert len(population._check_groups(engine(tmp_path, "bfloat16", "lowrank", "float32"))) == 1  # a master: one


def test_checked_in_groups_a_matrix_read_outside_its_module_is_still_refused(lively_model_dir, monkeypatch):
    """The check's groups (without a master) still catch what it exists for: a model that reads a perturbed matrix
    outside its module (here one MLP's up_proj weight through F.linear, which its hooks never see) is refused by
    the logits comparison of that matrix's group; the same model read through its modules passes."""
    import torch.nn.functional as F

    import esft.engines.population as population
    from esft.engines.member_rows import PopulationBatchingError

    monkeypatch.setattr(population, "CHECK_GROUP_BYTES", 1)  # this tiny model in CHECK_GROUPS groups
    honest = engine(lively_model_dir, "bfloat16", "lowrank", "none")
    assert len(population._check_groups(honest)) == population.CHECK_GROUPS
    population.check_population_batching(honest)
    subject = engine(lively_model_dir, "bfloat16", "lowrank", "none")
    mlp = subject.model.model.layers[1].mlp
    monkeypatch.setattr(mlp, "forward",
                        lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * F.linear(x, mlp.up_proj.weight)))
    start = subject.checksum()
    with pytest.raises(PopulationBatchingError, match="batched logits differ .* outside the module that owns it"):
        population.check_population_batching(subject)
    assert subject.checksum() == start  # refused with every weight as it was
