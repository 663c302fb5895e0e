"""ES core: strategy math, noise, exact restore, the update rule, float32 master, generation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from esft.es.fitness import FAILED_SAMPLES, Fitness, same_prompts
from esft.es.shaping import REWARD_SHAPING
from esft.es.strategies import STRATEGIES
from esft.es.strategies.base import SEED_RANGE, ESState, shaped_coefficients
from esft.es.strategies.paper import STRATEGY as PAPER
from esft.settings.config import ConfigError, ESConfig
from esft.settings.rules import CHOICES

HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(ESConfig)}
from esft.engines.transformers_engine import TransformersEngine
from esft.es.noise import NOISE_SCHEMES, draw_noise


def load_engine(path, dtype=torch.float32, **kwargs) -> TransformersEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return TransformersEngine(model, AutoTokenizer.from_pretrained(path), **kwargs)


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for _, name, param in engine.trainable}


# ------------------------------------------------------------------ strategy
def test_member_seeds_depend_only_on_seed_and_iteration():
    state = ESState(seed=7, iteration=3)
    seeds = PAPER.ask(state, 30)
    assert seeds == PAPER.ask(ESState(seed=7, iteration=3), 30)
    assert len(set(seeds)) == 30 and all(0 <= s < SEED_RANGE for s in seeds)
    assert seeds != PAPER.ask(ESState(seed=7, iteration=4), 30)
    assert seeds != PAPER.ask(ESState(seed=8, iteration=3), 30)
    # (seed, iteration) pairs do not collide the way seed + iteration would
    assert PAPER.ask(ESState(1, 0), 5) != PAPER.ask(ESState(0, 1), 5)


EXPECTED_SHAPING = {
    "zscore": lambda r: (r - r.mean()) / (r.std() + 1e-8),
    "rank": None,  # checked through its properties below
    "raw": lambda r: r,
    # the matrix below: prompt 1's column is the rewards (z-scored), prompt 2 is constant (0): averaged
    "per_prompt": lambda r: (r - r.mean()) / (r.std() + 1e-8) / 2,
    "centered": lambda r: r - r.mean(),
    # prompt 1's column centred, prompt 2 constant (0): averaged
    "per_prompt_centered": lambda r: (r - r.mean()) / 2,
}
PROMPT_WISE = {"per_prompt", "per_prompt_centered"}
"""The shapings whose expectation above is written in prompt 1's rewards (they compare members prompt by prompt)."""


@pytest.mark.parametrize("shaping", list(REWARD_SHAPING))
def test_every_reward_shaping(shaping):
    """Every shaping of the registry maps a Fitness (the members × prompts matrix, every member on the same
    prompts) to one value per member; each registry entry has its expectation here."""
    assert shaping in EXPECTED_SHAPING, "new shaping: add its expectation here"
    entry = REWARD_SHAPING[shaping]
    assert entry.name == shaping and entry.summary and entry.summary in HELP["reward_shaping"]
    rewards = np.array([0.3, 1.1, -0.2, 0.3, 0.9])
    matrix = np.stack([rewards, np.full(5, 0.5)], axis=1)  # members × prompts: a second, constant prompt
    fitness = Fitness.of(matrix, same_prompts(5, 2))
    np.testing.assert_allclose(fitness.member, (rewards + 0.5) / 2, rtol=0, atol=1e-15)
    member = (rewards + 0.5) / 2
    shaped = entry(fitness)
    # Order-preserving (we maximize: a higher reward never gets a lower weight), ties equal.
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if rewards[i] > rewards[j]:
                assert shaped[i] > shaped[j]
    assert shaped[0] == shaped[3]
    if EXPECTED_SHAPING[shaping] is not None:
        expected = EXPECTED_SHAPING[shaping](rewards if shaping in PROMPT_WISE else member)
        np.testing.assert_allclose(shaped, expected, rtol=0, atol=1e-12)
    else:
        np.testing.assert_allclose(shaped, [-0.125, 0.5, -0.5, -0.125, 0.25])
    state, coefficients = PAPER.tell(ESState(0, 4), fitness, alpha=0.01, shaping=shaping)
    assert state.iteration == 5
    np.testing.assert_allclose(coefficients, 0.01 / 5 * shaped, rtol=1e-12)
    # members scored on different prompts: a shaping that compares prompt by prompt refuses, the others
    # shape the members' fitness as before
    apart = Fitness.of(matrix, np.array([[0, 1], [0, 1], [2, 3], [0, 1], [0, 1]]))
    assert not apart.shared_prompts and fitness.shared_prompts
    if entry.needs_shared_prompts:
        with pytest.raises(ValueError, match="same prompts"):
            PAPER.tell(PAPER.init(0), apart, alpha=0.01, shaping=shaping)
        with pytest.raises(ValueError, match="same prompts"):  # only member fitness, no prompts
            PAPER.tell(PAPER.init(0), member.tolist(), alpha=0.01, shaping=shaping)
    elif entry.needs_prompts:  # centred among the members scored on each prompt: member 2 alone on prompts 2, 3
        others = rewards[[0, 1, 3, 4]]
        np.testing.assert_allclose(entry(apart), [(rewards[0] - others.mean()) / 2, (rewards[1] - others.mean()) / 2, 0.0,
                                                  (rewards[3] - others.mean()) / 2, (rewards[4] - others.mean()) / 2],
                                   rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="prompt of each entry"):  # only member fitness, no prompts
            PAPER.tell(PAPER.init(0), member.tolist(), alpha=0.01, shaping=shaping)
    else:
        assert PAPER.tell(PAPER.init(0), apart, 0.01, shaping)[1] == coefficients
        assert PAPER.tell(PAPER.init(0), member.tolist(), 0.01, shaping)[1] == coefficients


EXPECTED_STRATEGIES = {
    # name: (members that are mirrors of another, noise draws of the update for 6 members, odd N refused)
    "paper": (0, 6, False),
    "antithetic": (3, 3, True),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy(name):
    """Every strategy of the registry (esft.es.strategies): seeds a function of (seed, iteration) alone, one
    coefficient per member, the next state, and update_terms the same update tell described (Σ cᵢ·ε(sᵢ) over
    the members equals it over the terms); each registry entry has its row here."""
    assert name in EXPECTED_STRATEGIES, "new strategy: add its expectation here"
    mirrors, draws, refuses_odd = EXPECTED_STRATEGIES[name]
    entry = STRATEGIES[name]
    assert entry.name == name and entry.summary and entry.summary in HELP["strategy"]
    state = entry.init(7)
    assert state == ESState(7, 0)
    seeds = entry.ask(ESState(7, 3), 6)
    assert len(seeds) == 6 and seeds == entry.ask(ESState(7, 3), 6) != entry.ask(ESState(7, 4), 6)
    assert sum(seed < 0 for seed in seeds) == mirrors and entry.mirrored == (mirrors > 0)
    assert (entry.population_problem(5) is not None) == refuses_odd and entry.population_problem(6) is None
    fitness = Fitness.of_members([0.3, 1.1, -0.2, 0.3, 0.9, 0.0])
    after, coefficients = entry.tell(ESState(7, 3), fitness, alpha=0.01, shaping="zscore")
    assert after == ESState(7, 4) and len(coefficients) == 6
    assert coefficients == shaped_coefficients(fitness, 0.01, "zscore")
    terms = entry.update_terms(seeds, coefficients)
    assert len(terms[0]) == len(terms[1]) == draws
    update = lambda pairs: sum(c * draw_noise("iid", s, 0, (64,)).double()  # noqa: E731
                               for s, c in zip(*pairs))
    torch.testing.assert_close(update(terms), update((seeds, coefficients)), rtol=0, atol=1e-12)


def test_the_strategy_choices_are_the_registry():
    assert CHOICES["strategy"] is STRATEGIES and next(iter(STRATEGIES)) == "paper"
    assert ESConfig(population_size=4).strategy == "paper"
    # --antithetic, the spelling from before --strategy, is read into the strategy and never written
    config = ESConfig(population_size=4, antithetic=True)
    assert (config.strategy, config.antithetic, config.to_dict()["antithetic"]) == ("antithetic", None, None)
    with pytest.raises(ConfigError, match=r"--population-size: --strategy antithetic pairs members \(θ ± σ·ε\), so N "
                                          "must be even; got 5: use 6 or 4"):
        ESConfig(population_size=5, strategy="antithetic")
    with pytest.raises(ConfigError, match="strategy: must be one of paper, antithetic"):
        ESConfig(strategy="eggroll")


def test_the_shaping_choices_are_the_registry():
    assert CHOICES["reward_shaping"] is REWARD_SHAPING and next(iter(REWARD_SHAPING)) == "zscore"
    assert CHOICES["failed_samples"] is FAILED_SAMPLES and CHOICES["noise"] is NOISE_SCHEMES


def test_zscore_is_population_std_and_constant_rewards_give_zero_step():
    shaped = REWARD_SHAPING["zscore"](Fitness.of_members([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_allclose(shaped.std(), 1.0, atol=1e-6)
    assert PAPER.tell(PAPER.init(0), [0.5] * 4, alpha=1.0)[1] == [0.0] * 4
    with pytest.raises(ValueError, match="finite"):
        PAPER.tell(PAPER.init(0), [0.5, float("nan")], alpha=1.0)


# --------------------------------------------------------------------- noise
def test_noise_is_regenerated_from_seed_and_schemes_differ():
    a = draw_noise("iid", 123, 4, (50, 3))
    assert torch.equal(a, draw_noise("iid", 123, 4, (50, 3)))
    assert a.dtype == torch.float32 and abs(float(a.std()) - 1.0) < 0.15
    assert not torch.equal(a, draw_noise("iid", 123, 5, (50, 3)))  # i.i.d. across tensors
    assert torch.equal(draw_noise("correlated", 123, 4, (50, 3)), draw_noise("correlated", 123, 5, (50, 3)))
    assert NOISE_SCHEMES["iid"](10, 3) == 13 and NOISE_SCHEMES["correlated"](10, 3) == 10


# ----------------------------------------------------------- engine weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_is_bit_exact_over_many_cycles(tiny_model_dir, dtype):
    engine = load_engine(tiny_model_dir, dtype=dtype)
    before, checksum = weights(engine), engine.checksum()
    for member_seed in range(60):
        engine.perturb(member_seed * 7919, sigma=1e-2)
        engine.restore()
    after = weights(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert engine.checksum() == checksum


def test_perturb_adds_sigma_times_regenerated_noise(tiny_model_dir):
    engine = load_engine(tiny_model_dir)
    base = weights(engine)
    engine.perturb(42, sigma=1e-3)
    for index, name, param in engine.trainable:
        expected = base[name] + 1e-3 * draw_noise("iid", 42, index, param.shape)
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-7)
    engine.restore()


def test_iid_matrices_gives_each_matrix_its_iid_noise_and_freezes_every_other_tensor(tiny_model_dir):
    iid, matrices = load_engine(tiny_model_dir), load_engine(tiny_model_dir, noise="iid_matrices")
    base = weights(matrices)
    frozen = [name for _, name, param in matrices.trainable if param.dim() != 2]
    assert frozen and len(frozen) < len(matrices.trainable)  # the tiny Llama has norm weights beside its matrices
    iid.perturb(42, sigma=1e-3)
    matrices.perturb(42, sigma=1e-3)
    for (_, name, param), (_, _, twin) in zip(matrices.trainable, iid.trainable):
        if name in frozen:
            assert torch.equal(param.detach(), base[name]) and not torch.equal(twin.detach(), base[name])
        else:
            assert torch.equal(param.detach(), twin.detach())
    matrices.restore()
    iid.restore()
    matrices.update([5, 9], [1e-3, -2e-3])
    iid.update([5, 9], [1e-3, -2e-3])
    for name in base:
        assert torch.equal(matrices.master[name], base[name] if name in frozen else iid.master[name])
    assert not draw_noise("iid_matrices", 1, 0, (8,)).any() and draw_noise("iid_matrices", 1, 0, (8, 2)).any()


def test_update_matches_direct_computation(tiny_model_dir):
    engine = load_engine(tiny_model_dir)
    base = {name: t.double() for name, t in weights(engine).items()}
    seeds = PAPER.ask(PAPER.init(3), 6)
    rewards = [0.1, 0.9, 0.4, 0.4, 0.0, 1.1]
    _, coefficients = PAPER.tell(PAPER.init(3), rewards, alpha=5e-4)
    engine.update(seeds, coefficients)
    z = (np.array(rewards) - np.mean(rewards)) / (np.std(rewards) + 1e-8)
    for index, name, param in engine.trainable:
        step = sum(zi * draw_noise("iid", s, index, param.shape).double() for zi, s in zip(z, seeds))
        expected = base[name] + 5e-4 / 6 * step
        torch.testing.assert_close(param.detach().double(), expected, rtol=0, atol=1e-7)
        assert torch.equal(param.detach(), engine.master[name])


def test_bfloat16_master_equals_float32_computation_after_100_updates(tiny_model_dir):
    bf16 = load_engine(tiny_model_dir, dtype=torch.bfloat16)
    fp32 = load_engine(tiny_model_dir, dtype=torch.float32)
    # Start both from the same (bfloat16-representable) weights.
    fp32.load_master_state({name: m.clone() for name, m in bf16.master.items()})
    start = {name: m.clone() for name, m in bf16.master.items()}
    rng = np.random.default_rng(0)
    for iteration in range(100):
        seeds = PAPER.ask(ESState(1, iteration), 4)
        coefficients = (rng.standard_normal(4) * 5e-4 / 4).tolist()
        bf16.update(seeds, coefficients)
        fp32.update(seeds, coefficients)
    for name in start:
        assert torch.equal(bf16.master[name], fp32.master[name])
        # the model's weights are the master rounded once to bfloat16
        param = dict(bf16.model.named_parameters())[name]
        assert torch.equal(param.detach(), fp32.master[name].to(torch.bfloat16))
    # And the master did move: naive bfloat16 accumulation would have lost most of it.
    moved = sum(int((bf16.master[n] != start[n]).sum()) for n in start)
    total = sum(t.numel() for t in start.values())
    assert moved / total > 0.99


def test_trainable_regex_limits_what_moves_without_changing_noise(tiny_model_dir):
    full = load_engine(tiny_model_dir)
    partial = load_engine(tiny_model_dir, trainable=r"mlp\.")
    assert {name for _, name, _ in partial.trainable} == {n for _, n, _ in full.trainable if "mlp." in n}
    before = dict(partial.model.named_parameters())
    frozen = {n: p.detach().clone() for n, p in before.items() if "mlp." not in n}
    seeds, coefficients = [5, 9], [1e-3, -2e-3]
    partial.update(seeds, coefficients)
    full.update(seeds, coefficients)
    after = dict(partial.model.named_parameters())
    assert all(torch.equal(frozen[n], after[n].detach()) for n in frozen)
    for name in partial.master:
        assert torch.equal(partial.master[name], full.master[name])
    with pytest.raises(ValueError, match="matches no parameter"):
        load_engine(tiny_model_dir, trainable="no-such-layer")


# ---------------------------------------------------------------- generation
PROMPTS = ["Using the numbers [1 2 3]", "abc", "a somewhat longer prompt here", "x"]


def manual_greedy(model, tokenizer, prompt: str, steps: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_greedy_ignores_checkpoint_sampling_settings(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A checkpoint whose generation_config would make generate() sample and penalize repeats.
    model.generation_config.update(do_sample=True, temperature=0.7, top_k=5, repetition_penalty=5.0, no_repeat_ngram_size=2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = TransformersEngine.from_pretrained(str(tmp_path), device="cpu", max_tokens=12)
    generation = engine.generate(PROMPTS)
    for prompt, text, count in zip(PROMPTS, generation.texts, generation.num_tokens):
        expected = manual_greedy(engine.model, tokenizer, prompt, 12)
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert count == 12
    # The saved model keeps the checkpoint's own generation settings.
    engine.save_pretrained(tmp_path / "saved")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").generation_config.repetition_penalty == 5.0


def test_generation_stops_at_eos_and_excludes_prompt(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = manual_greedy(model, tokenizer, "abc", 8)
    stop = tokens[3]
    model.generation_config.eos_token_id = [stop]  # pretend the 4th greedy token is an EOS
    engine = TransformersEngine(model, tokenizer, max_tokens=8)
    generation = engine.generate(["abc"])
    first = tokens.index(stop)
    assert generation.num_tokens == [first + 1]
    assert generation.texts == [tokenizer.decode(tokens[: first + 1])]


def test_mini_batches_give_identical_results(tiny_model_dir):
    engine = load_engine(tiny_model_dir, max_tokens=10)
    engine.perturb(11, sigma=0.05)
    whole = engine.generate(PROMPTS)
    for size in (1, 3):
        engine.mini_batch_size = size
        assert engine.generate(PROMPTS) == whole
    engine.restore()


def test_perturbation_changes_completions_and_restore_brings_them_back(tiny_model_dir):
    engine = load_engine(tiny_model_dir, max_tokens=10)
    base = engine.generate(PROMPTS)
    changed = 0
    for member_seed in range(5):
        engine.perturb(member_seed, sigma=0.5)
        changed += engine.generate(PROMPTS).texts != base.texts
        engine.restore()
    assert changed >= 1
    assert engine.generate(PROMPTS) == base


def test_the_update_follows_the_engines_noise_and_rank_as_they_are_now(tiny_model_dir):
    """benchmarks/throughput.py switches a built engine's --noise and --rank between its paths: the update
    (esft.es.update) must take them as they are then, not as the engine was built (398fba3 cached them)."""
    switched = load_engine(tiny_model_dir, noise="iid")
    switched.noise, switched.rank = "lowrank", 2
    built = load_engine(tiny_model_dir, noise="lowrank", rank=2)
    stayed = load_engine(tiny_model_dir, noise="iid")
    for engine in (switched, built, stayed):
        engine.update([1, 2], [0.3, -0.2])
    assert switched.checksum() == built.checksum() != stayed.checksum()
    assert switched.last_update_ratio == built.last_update_ratio > 0
