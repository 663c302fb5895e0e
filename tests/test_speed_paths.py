"""Speed paths (issues 5 and 15): low-rank noise, sequential vs population-batched evaluation.

The batched path (all members in one generate call: low-rank terms added by forward hooks, or with
full-rank noise each member's own weights per module) must give the sequential path's logits (float
tolerance) and greedy completions for the same member seeds; the low-rank update must match a direct
computation; low-rank perturb/restore must be exact.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from esft.es.strategies.paper import STRATEGY as PAPER
from esft.es.batches import PromptBatch
from esft.settings.config import ConfigError, ESConfig
from esft.engines.fullrank_population import FullRankPopulation
from esft.engines.population import (
    LowRankPopulation,
    PopulationBatchingError,
    check_population_batching,
    generate_population,
    population_batching_problem,
)
from esft.engines.transformers_engine import TransformersEngine
from esft.executors import LocalExecutor
from esft.es.noise import draw_noise, lowrank_factors, perturbs
from esft.rewards.runner import RewardRunner
from tiny_model import build_tiny_model, build_tokenizer
from toy_task import byte_reward, toy_rows

PROMPTS = ["Using the numbers [1 2 3]", "abc", "a somewhat longer prompt here", "x", "Q7: 7 + 7 ="]
SEEDS = [3, 141, 59, 2653]
SIGMA = 0.05  # large enough that members' greedy completions differ on a tiny random model
NOISES = ["lowrank", "iid"]  # the batched paths: shared weights + low-rank hooks, members' own full-rank weights


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_dir(request, tmp_path_factory):
    """A tiny Llama whose greedy output moves under σ = 0.05 low-rank perturbations."""
    return build_tiny_model(tmp_path_factory.mktemp(f"lively-{request.param}"), initializer_range=0.3,
                            tie_word_embeddings=request.param == "tied")


def load_engine(path, dtype=torch.float32, rank=2, noise="lowrank", **kwargs) -> TransformersEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return TransformersEngine(model, AutoTokenizer.from_pretrained(path), noise=noise, rank=rank, **kwargs)


def hf_generate(engine, prompts) -> list[list[int]]:
    """Greedy `model.generate` (transformers' own loop) through the engine, for comparison."""
    from transformers import GenerationConfig

    from esft.engines.base import generation_from_tokens

    rows = [row for chunk in engine.generated_chunks(prompts, None, GenerationConfig(**engine.greedy.to_dict())) for row in chunk]
    return generation_from_tokens(rows, engine.eos_token_ids, engine.tokenizer).token_ids


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for _, name, param in engine.trainable}


# --------------------------------------------------------------------- noise
def test_lowrank_noise_is_a_regenerated_unit_variance_product_and_spares_non_matrices():
    a, b = lowrank_factors(7, 3, (300, 200), 4)
    assert a.shape == (300, 4) and b.shape == (200, 4)
    dense = draw_noise("lowrank", 7, 3, (300, 200), rank=4)
    torch.testing.assert_close(dense, a @ b.T / 2, rtol=0, atol=1e-6)
    assert torch.equal(dense, draw_noise("lowrank", 7, 3, (300, 200), rank=4))
    assert not torch.equal(dense, draw_noise("lowrank", 7, 4, (300, 200), rank=4))  # i.i.d. across tensors
    assert abs(float(dense.std()) - 1.0) < 0.1  # σ means what it means for iid noise
    assert torch.equal(draw_noise("lowrank", 7, 3, (64,), rank=4), torch.zeros(64))  # norms/biases: frozen
    assert perturbs("lowrank", (3, 4)) and not perturbs("lowrank", (4,)) and perturbs("iid", (4,))


# ------------------------------------------------------- sequential weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowrank_perturb_is_master_plus_sigma_ab_and_restore_is_exact(model_dir, dtype):
    engine = load_engine(model_dir, dtype=dtype, rank=3)
    before, checksum = weights(engine), engine.checksum()
    engine.perturb(42, sigma=1e-2)
    for index, name, param in engine.trainable:
        if param.dim() == 2:
            a, b = lowrank_factors(42, index, param.shape, 3)
            expected = (engine.master[name].double() + 1e-2 * (a @ b.T).double() / math.sqrt(3)).to(dtype)
            torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
            assert not torch.equal(param.detach(), before[name])
        else:
            assert torch.equal(param.detach(), before[name])  # frozen under low-rank noise
    engine.restore()
    for member_seed in range(30):
        engine.perturb(member_seed * 7919, sigma=1e-2)
        engine.restore()
    assert all(torch.equal(before[name], param.detach()) for _, name, param in engine.trainable)
    assert engine.checksum() == checksum


def test_lowrank_update_matches_direct_computation(model_dir):
    engine = load_engine(model_dir, rank=2)
    base = {name: m.double().clone() for name, m in engine.master.items()}
    seeds = PAPER.ask(PAPER.init(3), 6)
    rewards = [0.1, 0.9, 0.4, 0.4, 0.0, 1.1]
    _, coefficients = PAPER.tell(PAPER.init(3), rewards, alpha=5e-4)
    engine.update(seeds, coefficients)
    z = (np.array(rewards) - np.mean(rewards)) / (np.std(rewards) + 1e-8)
    for index, name, param in engine.trainable:
        if param.dim() != 2:
            assert torch.equal(engine.master[name].double(), base[name])
            continue
        step = torch.zeros_like(base[name])
        for zi, seed in zip(z, seeds):
            a, b = lowrank_factors(seed, index, param.shape, 2)
            step += zi * (a.double() @ b.double().T) / math.sqrt(2)
        torch.testing.assert_close(engine.master[name].double(), base[name] + 5e-4 / 6 * step, rtol=0, atol=1e-7)
        assert torch.equal(param.detach(), engine.master[name])
    # the same update through the generic dense noise (the reference's per-member accumulation)
    dense = load_engine(model_dir, rank=2)
    for index, name, param in dense.trainable:
        if param.dim() == 2:
            total = sum(c * draw_noise("lowrank", s, index, param.shape, rank=2).double() for c, s in zip(coefficients, seeds))
            torch.testing.assert_close(engine.master[name].double(), dense.master[name].double() + total, rtol=0, atol=1e-7)


# ---------------------------------------------------- batched vs sequential
@pytest.mark.parametrize("noise", NOISES)
def test_batched_logits_match_sequential(model_dir, noise):
    engine = load_engine(model_dir, noise=noise)
    encoded = engine._encode(PROMPTS)  # left-padded: the mask matters
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    model = engine.model
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=mask).logits
        sequential = []
        for seed in SEEDS:
            engine.perturb(seed, SIGMA)
            sequential.append(model(input_ids=ids, attention_mask=mask).logits)
            engine.restore()
        with (LowRankPopulation if noise == "lowrank" else FullRankPopulation)(engine, SEEDS, SIGMA):
            batched = model(input_ids=ids.repeat(len(SEEDS), 1), attention_mask=mask.repeat(len(SEEDS), 1)).logits
        after = model(input_ids=ids, attention_mask=mask).logits  # hooks removed: the base model again
    expected = torch.cat(sequential)
    real = mask.repeat(len(SEEDS), 1).bool()
    assert float((expected - base.repeat(len(SEEDS), 1, 1))[real].abs().max()) > 0.1  # the test is not vacuous
    torch.testing.assert_close(batched[real], expected[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(after, base)


def test_modules_reading_one_input_share_one_lowrank_product(model_dir, monkeypatch):
    """q/k/v (and gate/up) read the same hidden states: one x·[B_q B_k B_v] per layer input, not one per
    module; logits as with a product per module."""
    from esft.engines import shared_product

    engine = load_engine(model_dir)
    names = {id(module): name for name, module in engine.model.named_modules()}
    population = LowRankPopulation(engine, SEEDS, SIGMA)
    product_of = {names[id(entry[0])]: entry[2] for entry in population._plan if entry[1] == "matmul"}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        q, k, v, o = (product_of[prefix + f"self_attn.{p}_proj"] for p in "qkvo")
        gate, up, down = (product_of[prefix + f"mlp.{p}_proj"] for p in ("gate", "up", "down"))
        assert q is k is v and gate is up
        assert len({id(q), id(o), id(gate), id(down)}) == 4
    assert q.left_by_member.shape == (len(SEEDS), 3 * engine.rank, 32)  # three modules' rank-2 factors

    computed = []
    real_product = shared_product.SharedProduct._product
    monkeypatch.setattr(shared_product.SharedProduct, "_product",
                        lambda self, x: computed.append(self) or real_product(self, x))
    ids = torch.randint(0, 60, (len(SEEDS), 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), population:
        shared = engine.model(input_ids=ids).logits
    with torch.no_grad():
        group_of = engine._esft_input_groups
        monkeypatch.setattr(engine, "_esft_input_groups", {key: {} for key in group_of})  # every module alone
        with LowRankPopulation(engine, SEEDS, SIGMA):
            alone = engine.model(input_ids=ids).logits
    assert "lm_head" in product_of  # (tied: the embedding's weight, used again by the head)
    shared_forward, alone_forward = 2 * 4 + 1, 2 * 7 + 1  # per layer qkv, o, gate/up, down; the head
    assert len(computed) == shared_forward + alone_forward
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-5)


def test_the_prompt_pass_takes_each_members_own_weights_and_decoding_the_hooks(model_dir, monkeypatch):
    """Where a member brings more token rows than a linear layer has inputs (the prompt pass), its rows are
    multiplied by its own W + σ/√r·A·Bᵀ (no shared product); a decoding step (one row per prompt) keeps the
    hooks. Both give the sequential path's completions (the logits and completions tests above run both)."""
    from esft.engines import population as population_module
    from esft.engines import shared_product

    engine = load_engine(model_dir, max_tokens=6)
    check_population_batching(engine)  # its short input takes the hooks: not counted below
    chosen, products = [], []
    real_pays, real_product = population_module._per_member_pays, shared_product.SharedProduct._product
    monkeypatch.setattr(population_module, "_per_member_pays",
                        lambda x, members, outputs: chosen.append((x.shape[1], real_pays(x, members, outputs))) or chosen[-1][1])
    monkeypatch.setattr(shared_product.SharedProduct, "_product", lambda self, x: products.append(x.shape[1]) or real_product(self, x))
    batched = generate_population(engine, PROMPTS, SEEDS, SIGMA)
    prompt_length = engine._encode(PROMPTS)["input_ids"].shape[1]
    assert {pays for positions, pays in chosen if positions == prompt_length} == {True}
    assert {pays for positions, pays in chosen if positions == 1} == {False}
    assert products and set(products) == {1}  # the shared product only at decoding steps
    for seed, generation in zip(SEEDS, batched):
        engine.perturb(seed, SIGMA)
        assert engine.generate(PROMPTS).token_ids == generation.token_ids, seed
        engine.restore()
    assert not any("forward" in vars(module) for module in engine.model.modules())  # uninstalled: the class's forward


def test_rank_one_factors_have_row_major_strides(model_dir):
    """At rank 1 a single-column product's factors (N, 1, in) must have the strides of a fresh tensor: the
    (in, 1, 1) that `.contiguous()` leaves on a transposed factor sends CPU bmm down a path 2.3-3.6× slower
    (docs/benchmarks.md). Every product and output factor of the population is checked."""
    engine = load_engine(model_dir, rank=1)
    population = LowRankPopulation(engine, SEEDS, SIGMA)
    factors = [entry[2].left_by_member for entry in population._plan if entry[1] == "matmul"]
    factors += [entry[-1] for entry in population._plan]  # each module's output-side factor (N, 1, out)
    assert any(f.shape[1] == 1 for f in factors[:-len(population._plan)])  # o_proj, down_proj, the head alone
    for factor in factors:
        assert factor.stride() == torch.empty(factor.shape).stride(), factor.shape


def members_tensors(entry) -> list[torch.Tensor]:
    """The per-member tensors of one plan entry: low-rank factors (a shared product's too), full-rank weight stacks."""
    found = []
    for item in entry[1:]:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif hasattr(item, "left_by_member"):
            found.append(item.left_by_member)
        elif isinstance(item, dict):
            found += [stack for _, stack in item.values()]
    return found


@pytest.mark.parametrize("noise", NOISES)
def test_a_population_frees_its_members_factors_on_exit_without_the_garbage_collector(model_dir, noise):
    """The plan's shared products point back at the population (a reference cycle): unless exiting drops the plan,
    every member's factors stay until the cyclic collector runs, and iterations' populations pile up (+2 GB at 64
    members of SmolLM2, docs/benchmarks.md). With the collector off, they must be gone once the block ends."""
    import gc
    import weakref

    engine = load_engine(model_dir, noise=noise)
    check_population_batching(engine)  # the one-time check, before the collector is switched off
    population_class = engine.population_class if noise == "iid" else LowRankPopulation
    gc.disable()
    try:
        with population_class(engine, SEEDS, SIGMA) as population:
            held = [weakref.ref(tensor) for entry in population._plan for tensor in members_tensors(entry)]
            engine.model(input_ids=torch.tensor([[1, 2, 3]] * len(SEEDS)))
        assert held
        del population
        assert [ref for ref in held if ref() is not None] == []
    finally:
        gc.enable()


def test_a_shared_product_is_recomputed_for_another_or_changed_input(model_dir, monkeypatch):
    """The sharing is a speed hint: k_proj called on another tensor than q_proj was, or on q_proj's tensor
    changed in place, gets its own member terms for what it is given."""
    engine = load_engine(model_dir)
    attention = engine.model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randn(len(SEEDS) * 3, 32, generator=generator) for _ in range(2))
    with torch.no_grad():
        with LowRankPopulation(engine, SEEDS, SIGMA):
            attention.q_proj(first)
            k_of_second = attention.k_proj(second)
            attention.q_proj(first)
            first.mul_(2)
            k_of_changed = attention.k_proj(first)
        monkeypatch.setattr(engine, "_esft_input_groups", {key: {} for key in engine._esft_input_groups})
        with LowRankPopulation(engine, SEEDS, SIGMA):  # every module a product of its own
            expected_second, expected_changed = attention.k_proj(second), attention.k_proj(first)
    assert not torch.allclose(expected_second, attention.k_proj(second))  # the members' terms are there
    torch.testing.assert_close(k_of_second, expected_second, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_of_changed, expected_changed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("noise", NOISES)
def test_batched_greedy_completions_match_sequential(model_dir, noise):
    engine = load_engine(model_dir, max_tokens=12, noise=noise)
    base = engine.generate(PROMPTS)
    batched = generate_population(engine, PROMPTS, SEEDS, SIGMA)
    assert len(batched) == len(SEEDS)
    changed = 0
    for seed, generation in zip(SEEDS, batched):
        engine.perturb(seed, SIGMA)
        sequential = engine.generate(PROMPTS)
        engine.restore()
        assert generation.token_ids == sequential.token_ids
        assert generation.texts == sequential.texts and generation.num_tokens == sequential.num_tokens
        changed += generation.texts != base.texts
    assert changed >= 2  # members really differ from the base model
    assert engine.generate(PROMPTS) == base  # nothing left behind
    # mini-batches of prompts (× members rows per call) change nothing
    assert generate_population(engine, PROMPTS, SEEDS, SIGMA, mini_batch_size=2) == batched


@pytest.mark.parametrize("noise", NOISES)
def test_population_batching_executor_equals_sequential_executor(tmp_path, noise):
    path = build_tiny_model(tmp_path / "model", initializer_range=0.3)
    rows = PromptBatch(0, toy_rows(4))
    scorer = RewardRunner([byte_reward], sandbox=False).score
    sequential = LocalExecutor(load_engine(path, max_tokens=8, noise=noise), scorer)
    batched = LocalExecutor(load_engine(path, max_tokens=8, noise=noise), scorer, population_batching=True)
    one = sequential.evaluate_population(SEEDS, rows, SIGMA)
    two = batched.evaluate_population(SEEDS, rows, SIGMA)
    assert [(m.seed, m.reward, m.num_tokens, m.scores.total) for m in one] == \
           [(m.seed, m.reward, m.num_tokens, m.scores.total) for m in two]
    assert len({m.reward for m in one}) > 1
    _, coefficients = PAPER.tell(PAPER.init(0), [m.reward for m in one], alpha=0.01)
    sequential.update(SEEDS, coefficients)
    batched.update(SEEDS, coefficients)
    assert sequential.checksum() == batched.checksum()


@pytest.mark.parametrize("noise", NOISES)
def test_conv1d_models_work_and_unsupported_uses_are_refused(tmp_path, noise):
    """GPT-2 (Conv1D layers, tied wte/lm_head, LayerNorm): works once the broadcast position embedding
    (one row for the whole batch, so not per member) is excluded; with it, the engine is refused."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.eos_token_id, initializer_range=0.3)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = load_engine(tmp_path, max_tokens=6, trainable=r"^(?!transformer\.wpe)", noise=noise)
    check_population_batching(engine)
    batched = generate_population(engine, PROMPTS[:3], SEEDS[:2], SIGMA)
    for seed, generation in zip(SEEDS[:2], batched):
        engine.perturb(seed, SIGMA)
        assert engine.generate(PROMPTS[:3]).token_ids == generation.token_ids
        engine.restore()
    with pytest.raises(PopulationBatchingError):
        check_population_batching(load_engine(tmp_path, noise=noise))


def test_auto_population_batching_falls_back_to_one_member_at_a_time_where_the_check_fails(tmp_path):
    """`esft train --model GPT2DIR` (population batching auto): GPT-2's broadcast position embedding
    fails the batched path's check, so members run one at a time, said in one line, and the run
    succeeds; insisting with --population-batching is a user error (exit 2) naming the tensor."""
    from test_cli import TINY, assert_user_error, esft

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=512,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.eos_token_id, initializer_range=0.3)).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    common = ("train", "--model", str(tmp_path / "gpt2"), *TINY, "--iterations", "1", "--logging", "none",
              "--output-dir", str(tmp_path / "runs"))
    proc, _ = esft(*common, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "population batching is off" in line]
    assert len(notes) == 1 and "transformer.wpe" in notes[0] and "--trainable" in notes[0], proc.stderr
    proc, _ = esft(*common, "--population-batching", cwd=tmp_path)
    assert_user_error(proc, "--population-batching: ", "transformer.wpe")


# Decoder architectures beyond Llama: biases (Qwen2), q/k norms (Qwen3), fused qkv / gate_up (Phi3),
# a scaled word embedding (Gemma), parallel attention+MLP (GPT-NeoX, Falcon, GPT-J), learned positions
# (OPT: refused until --trainable excludes them). Each: (config class, extra settings, trainable).
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", {}, None),
    "qwen3": ("Qwen3Config", {"head_dim": 8}, None),
    "phi3": ("Phi3Config", {}, None),
    "gemma": ("GemmaConfig", {"head_dim": 8}, None),
    "gpt_neox": ("GPTNeoXConfig", {}, None),
    "falcon": ("FalconConfig", {}, None),
    "gptj": ("GPTJConfig", {"rotary_dim": 4}, None),
    "opt": ("OPTConfig", {}, r"^(?!.*embed_positions)"),
}


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_batched_completions_match_sequential_across_architectures(architecture, noise, tmp_path):
    import transformers

    config_class, extra, trainable = ARCHITECTURES[architecture]
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, initializer_range=0.3, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    if trainable is not None:  # the model as it comes is refused, with a way out
        with pytest.raises(PopulationBatchingError, match="--trainable"):
            check_population_batching(load_engine(tmp_path, noise=noise))
    engine = load_engine(tmp_path, max_tokens=10, trainable=trainable, noise=noise)
    check_population_batching(engine)
    base = engine.generate(PROMPTS[:4])
    assert base.token_ids == hf_generate(engine, PROMPTS[:4])  # the lean decoder is greedy generate, token for token
    batched = generate_population(engine, PROMPTS[:4], SEEDS[:3], SIGMA)
    for seed, generation in zip(SEEDS[:3], batched):
        engine.perturb(seed, SIGMA)
        assert engine.generate(PROMPTS[:4]).token_ids == generation.token_ids, seed
        engine.restore()
    assert sum(generation.texts != base.texts for generation in batched) >= 2  # members really differ


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_self_check_accepts_low_precision_models(model_dir, dtype, noise):
    engine = load_engine(model_dir, dtype=dtype, noise=noise)
    assert population_batching_problem(engine) is None
    assert getattr(engine, "_esft_population_checked")  # checked once, then trusted


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_refuses_a_model_that_uses_a_weight_outside_its_module(model_dir, noise, dtype):
    """A forward that reads a perturbed matrix directly (F.linear on the weight, not the module call)
    never meets the hooks: the batched logits would miss that perturbation, so the model is refused (in
    bfloat16 too, where a failure is measured again at a smaller σ)."""
    engine = load_engine(model_dir, dtype=dtype, noise=noise)
    mlp = engine.model.model.layers[0].mlp

    def forward(x):
        return torch.nn.functional.linear(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)

    mlp.forward = forward
    problem = population_batching_problem(engine)
    assert problem is not None and "differ from the sequential path" in problem


@pytest.mark.parametrize("settings, accepted", [
    (dict(noise="lowrank", rank=4, population_batching=True), True),
    (dict(noise="lowrank", population_batching=True, executor="ray", workers=2), True),
    (dict(population_batching=True), True),  # full-rank members batch too, each with its own weights
    (dict(population_batching=True, engine="vllm"), "--population-batching: with --engine vllm needs --noise lowrank"),
    (dict(population_batching=True, engine="vllm", noise="lowrank"), True),  # members as vLLM LoRA adapters (issue 21)
    (dict(population_batching="auto", engine="vllm"), True),  # auto: one member at a time there
    (dict(population_batching="sometimes"), "--population-batching: must be true, false or auto"),
    (dict(noise="lowrank", rank=0), "--rank"),
    (dict(noise="lowrank", engine="vllm"), True),
    (dict(vllm_max_loras=4), "--vllm-max-loras: is a setting of --engine vllm"),
    (dict(vllm_max_loras=0, engine="vllm", noise="lowrank"), "--vllm-max-loras: must be >= 1"),
])
def test_config_rules(settings, accepted):
    if accepted is True:
        assert ESConfig(**settings).noise == settings.get("noise", "iid")
    else:
        with pytest.raises(ConfigError, match=accepted):
            ESConfig(**settings)
