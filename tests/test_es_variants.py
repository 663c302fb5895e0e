"""Issue 22's ES variants: mirrored (antithetic) members, per-prompt shaping, σ/α schedules, through
the noise, the engine, the trainer, the CLI (a subprocess), resume and the Ray executor. The vLLM
engine's side is tests/test_vllm_antithetic.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from esft.settings.config import ConfigError, ESConfig
from esft.engines.transformers_engine import TransformersEngine
from esft.es import schedules
from esft.es.strategies.antithetic import STRATEGY as ANTITHETIC, merge_mirrored, mirror
from esft.es.strategies.base import SEED_RANGE, ESState
from esft.es.strategies.paper import STRATEGY as PAPER
from esft.es.batches import PromptBatch
from esft.es.noise import NOISE_SCHEMES, draw_noise, lowrank_factors, perturbs
from esft.executors import LocalExecutor
from esft.es.fitness import Fitness, same_prompts
from esft.es.shaping import REWARD_SHAPING
from esft.loop.member_fitness import reward_matrix
from esft.rewards.runner import RewardRunner, score
from cli_runner import run_esft_here
from tiny_model import build_tiny_model, subprocess_env
from toy_task import byte_reward, toy_rows

TESTS = Path(__file__).parent
NOISES = list(NOISE_SCHEMES)
SIGMA = 0.05


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.05 perturbations (as in test_checkpoint)."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


def engine_of(path, noise: str, **kwargs) -> TransformersEngine:
    return TransformersEngine.from_pretrained(str(path), device="cpu", max_tokens=8, noise=noise, rank=2, **kwargs)


# ------------------------------------------------------------------ antithetic: seeds and noise
def test_ask_pairs_each_seed_with_its_mirror():
    seeds = ANTITHETIC.ask(ESState(7, 3), 6)
    assert len(seeds) == 6 and seeds[1::2] == [~s for s in seeds[0::2]] == [-1 - s for s in seeds[0::2]]
    assert all(0 <= s < SEED_RANGE for s in seeds[0::2]) and all(s < 0 for s in seeds[1::2])
    assert mirror(mirror(12345)) == 12345
    assert seeds == ANTITHETIC.ask(ESState(7, 3), 6)  # a function of (seed, iteration)
    assert seeds[0::2] == PAPER.ask(ESState(7, 3), 3)  # the paper's draw of N/2 seeds, each then mirrored
    with pytest.raises(ValueError, match="even"):
        ANTITHETIC.ask(ESState(7, 3), 5)


@pytest.mark.parametrize("noise", NOISES)
def test_a_mirrored_members_noise_is_the_exact_negative(noise):
    for seed, index, shape in [(123, 0, (7, 5)), (2**30 - 1, 4, (16, 3)), (0, 2, (11,))]:
        plus = draw_noise(noise, seed, index, shape, rank=2)
        minus = draw_noise(noise, ~seed, index, shape, rank=2)
        assert torch.equal(minus, -plus)
        if perturbs(noise, shape):
            assert plus.abs().sum() > 0
        out = torch.empty(shape)
        assert draw_noise(noise, ~seed, index, shape, out=out, rank=2) is out and torch.equal(out, -plus)
    a, b = lowrank_factors(123, 3, (7, 5), 2)
    mirrored_a, mirrored_b = lowrank_factors(~123, 3, (7, 5), 2)
    assert torch.equal(mirrored_a, -a) and torch.equal(mirrored_b, b)  # A·Bᵀ flips sign once


@pytest.mark.parametrize("noise", NOISES)
def test_a_mirrored_members_weights_are_master_minus_sigma_noise(tiny_model_dir, noise):
    engine = engine_of(tiny_model_dir, noise)
    master = {name: engine.master[name].clone() for name in engine.master}
    seed = 4242
    engine.perturb(~seed, SIGMA)
    perturbed = 0
    for index, name, param in engine.trainable:
        if noise == "lowrank":
            if param.dim() != 2:
                assert torch.equal(param.detach(), master[name])  # frozen under low-rank noise
                continue
            a, b = lowrank_factors(seed, index, param.shape, 2)
            expected = torch.addmm(master[name], a, b.T, alpha=-SIGMA / math.sqrt(2))
        else:
            expected = torch.sub(master[name], draw_noise(noise, seed, index, param.shape), alpha=SIGMA)
        assert torch.equal(param.detach(), expected), name
        perturbed += 1
    assert perturbed > 0
    engine.restore()
    assert all(torch.equal(param.detach(), master[name]) for _, name, param in engine.trainable)


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_the_update_of_a_pair_is_the_difference_of_its_coefficients_times_the_noise(tiny_model_dir, noise):
    seeds = ANTITHETIC.ask(PAPER.init(3), 4)
    coefficients = [3e-3, -1e-3, 5e-4, 2e-3]
    merged_seeds, merged = merge_mirrored(seeds, coefficients)
    assert merged_seeds == seeds[0::2] and merged == [3e-3 - -1e-3, 5e-4 - 2e-3]
    assert merge_mirrored([5, 9], [0.1, 0.2]) == ([5, 9], [0.1, 0.2])  # one-sided seeds: unchanged
    engine, unmerged = engine_of(tiny_model_dir, noise), engine_of(tiny_model_dir, noise)
    base = {name: tensor.double() for name, tensor in engine.master.items()}
    engine.update(merged_seeds, merged)
    unmerged.update(seeds, coefficients)  # the same update, each member drawn on its own
    moved = 0
    for index, name, param in engine.trainable:
        step = sum(c * draw_noise(noise, s, index, param.shape, rank=2).double()
                   for c, s in [(3e-3 - -1e-3, seeds[0]), (5e-4 - 2e-3, seeds[2])])
        torch.testing.assert_close(engine.master[name].double(), base[name] + step, rtol=0, atol=1e-7)
        torch.testing.assert_close(unmerged.master[name], engine.master[name], rtol=0, atol=1e-7)
        moved += not torch.equal(engine.master[name], base[name].float())
    assert moved > 0


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_population_batching_evaluates_mirrored_members_as_one_at_a_time(lively_model_dir, noise):
    scorer = RewardRunner([byte_reward], sandbox=False).score
    seeds = ANTITHETIC.ask(PAPER.init(1), 4)
    batch = PromptBatch(0, toy_rows(4))
    one = LocalExecutor(engine_of(lively_model_dir, noise), scorer).evaluate_population(seeds, batch, SIGMA)
    two = LocalExecutor(engine_of(lively_model_dir, noise), scorer, population_batching=True).evaluate_population(
        seeds, batch, SIGMA)
    assert [(m.seed, m.reward, m.scores.total) for m in one] == [(m.seed, m.reward, m.scores.total) for m in two]
    assert len({m.reward for m in one}) > 1


def test_lora_es_mirrored_member_is_the_adapter_minus_sigma_noise(tiny_model_dir):
    from esft.engines import build_engine
    from esft.engines.settings import EngineSettings

    args = ESConfig(model=str(tiny_model_dir), lora_r=2, device="cpu", max_tokens=4, logging="none")
    engine = build_engine(EngineSettings.of(args), str(tiny_model_dir))
    master = {name: tensor.clone() for name, tensor in engine.master.items()}
    engine.perturb(~77, SIGMA)
    for index, name, param in engine.trainable:
        assert torch.equal(param.detach(), torch.sub(master[name], draw_noise("iid", 77, index, param.shape), alpha=SIGMA))
    engine.restore()


# ------------------------------------------------------------------ per-prompt shaping
def test_per_prompt_shaping_on_a_hand_made_reward_matrix():
    nan = float("nan")
    matrix = np.array([[1.0, 0.3, 2.0],
                       [0.0, 0.3, 4.0],
                       [1.0, 0.3, nan],   # no usable score for prompt 3: left out of its column
                       [0.0, 0.3, 0.0]])  # prompt 2: every member alike, contributes 0
    fitness = Fitness.of(matrix, same_prompts(4, 3))
    np.testing.assert_allclose(fitness.member, np.nanmean(matrix, axis=1), rtol=1e-15)
    shaped = REWARD_SHAPING["per_prompt"](fitness)
    first = 0.5 / (0.5 + 1e-8)  # column 1: mean 0.5, std 0.5
    third = 2 / (math.sqrt(8 / 3) + 1e-8)  # column 3 over 3 members: mean 2, std √(8/3)
    expected = [(first + 0 + 0) / 3, (-first + 0 + third) / 3, (first + 0 + 0) / 3, (-first + 0 - third) / 3]
    np.testing.assert_allclose(shaped, expected, rtol=1e-12)
    # constant columns give exactly 0, also where the mean of equal values is not exactly that value
    assert REWARD_SHAPING["per_prompt"](Fitness.of(np.full((3, 2), 0.1), same_prompts(3, 2))).tolist() == [0.0] * 3
    _, coefficients = PAPER.tell(PAPER.init(0), fitness, alpha=0.4, shaping="per_prompt")
    np.testing.assert_allclose(coefficients, 0.4 / 4 * np.array(expected), rtol=1e-12)
    with pytest.raises(ValueError, match="same prompts"):  # member fitness alone says nothing of the prompts
        PAPER.tell(PAPER.init(0), fitness.member.tolist(), alpha=0.4, shaping="per_prompt")
    # the same prompts in another order per member are not the same columns: refused, not mixed up
    shuffled = Fitness.of(matrix, np.array([[0, 1, 2], [0, 1, 2], [2, 1, 0], [0, 1, 2]]))
    with pytest.raises(ValueError, match="same prompts"):
        PAPER.tell(PAPER.init(0), shuffled, alpha=0.4, shaping="per_prompt")


def test_reward_matrix_leaves_out_failed_and_unscored_samples_but_not_a_skipped_function():
    def partly(prompts, completions, **kwargs):  # member's own value, a NaN (a failure) and a None (no score)
        return [float(len(completions[0])), float("nan"), None, 1.0]

    def broken(prompts, completions, **kwargs):
        raise RuntimeError("down")

    rows = [{"prompt": f"p{i}"} for i in range(4)]
    members = [score([partly], rows, [text] * 4, failure_reward=-5.0) for text in ("a", "bbb")]
    matrix = reward_matrix(members)
    assert matrix.shape == (2, 4) and np.isnan(matrix[:, 1:3]).all()
    assert matrix[:, 0].tolist() == [1.0, 3.0] and matrix[:, 3].tolist() == [1.0, 1.0]
    # a function that failed on every sample (the run goes on only with --reward-skip-failing) adds
    # its failure reward to every entry alike: entries are not left out for it
    members = [score([partly, broken], rows, [text] * 4, failure_reward=-5.0) for text in ("a", "bbb")]
    matrix = reward_matrix(members)
    assert matrix[:, 0].tolist() == [-4.0, -2.0] and np.isnan(matrix[:, 1]).all()
    assert matrix[:, 2].tolist() == [-5.0, -5.0]  # only the skipped function's failure reward: alike, shaped to 0


# ------------------------------------------------------------------ schedules
@pytest.mark.parametrize("spec, values", [
    ("constant", [0.2, 0.2, 0.2]),
    ("linear", [0.2, 0.2 * (1 - 0.9 * 0.5), 0.2 * 0.1]),
    ("linear:0.5", [0.2, 0.2 * 0.75, 0.1]),
    ("linear:0", [0.2, 0.1, 0.0]),
    ("cosine", [0.2, 0.2 * (0.1 + 0.9 * 0.5), 0.2 * 0.1]),
    ("cosine:0.25", [0.2, 0.2 * (0.25 + 0.75 * 0.5), 0.05]),
])
def test_schedule_values_at_the_first_middle_and_last_iteration(spec, values):
    got = [schedules.scheduled(spec, 0.2, t, 5) for t in (0, 2, 4)]
    np.testing.assert_allclose(got, values, rtol=1e-12, atol=1e-15)
    assert got[0] == 0.2  # the full value at t = 0, exactly
    if spec.startswith("cosine"):  # flat at both ends, below linear's value in the first half
        final = values[-1] / 0.2
        assert schedules.scheduled(spec, 0.2, 1, 5) == pytest.approx(0.2 * (final + (1 - final) * (1 + math.cos(math.pi / 4)) / 2))
    assert schedules.scheduled(spec, 0.2, 0, 1) == 0.2  # a one-iteration run: the initial value
    config = ESConfig(sigma=0.2, alpha=0.3, sigma_schedule=spec, alpha_schedule="linear:0", iterations=5)
    assert schedules.step_sizes(config, 2) == (got[1], pytest.approx(0.15))


@pytest.mark.parametrize("spec", ["cosine:2", "linear:-1", "constant:", "constant:0.5", "linear:", "cosine:nan",
                                  "cosine:inf", "exp", "linear:x"])
def test_a_schedule_the_parser_refuses_is_refused_by_the_settings(spec):
    """One parser (esft.es.schedules.parse) decides what a schedule is: the settings refuse exactly what it refuses."""
    with pytest.raises(ValueError):
        schedules.parse(spec)
    with pytest.raises(ConfigError, match=r"--alpha-schedule: must be constant, linear, cosine"):
        ESConfig(alpha_schedule=spec)


# ------------------------------------------------------------------ the CLI, resume, metrics
VARIANTS = ["--antithetic", "--sigma-schedule", "cosine", "--alpha-schedule", "linear", "--reward-shaping", "per_prompt",
            "--noise", "iid_matrices"]
GROUPED = ["--antithetic", "--sigma-schedule", "cosine", "--alpha-schedule", "linear", "--reward-shaping",
           "per_prompt_centered", "--prompt-groups", "2", "--step-rule", "sqrt_n", "--rollout-temperature", "1.0",
           "--prompt-candidates", "2"]
"""Issue 63's budget designs on top of the schedules: 2 prompt groups (each pair of members on its own 2 prompts),
fitness centred within them, the √N step, rollouts sampled with common random numbers, the batch the 4 of 8
candidates the unperturbed model scores lowest."""
DESIGNS = {"variants": (VARIANTS, 16), "grouped": (GROUPED, 16)}
"""name: (flags, training completions per iteration of 4 members × 4 prompts)."""


def toy_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`esft` with the toy task registered (tests/toy_task.py), in this process (tests/cli_runner.py)."""
    return run_esft_here(*args, cwd=cwd, env=subprocess_env(), script=TESTS / "toy_task.py")


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("design", DESIGNS)
def test_resumed_variant_run_is_bitwise_the_uninterrupted_one_and_logs_its_schedule(lively_model_dir, tmp_path, design):
    """Every variant at once (and with prompt groups, centred fitness and the √N step), resumed from checkpoint-2,
    ends bitwise equal to the run that was never stopped (slow: three runs of 4 iterations with 4 members)."""
    flags, per_iteration = DESIGNS[design]
    common = ["train", "--model", str(lively_model_dir), "--task", "toy", "--iterations", "4", "--population-size", "4",
              "--batch-size", "4", "--eval-size", "4", "--max-tokens", "8", "--train-size", "20", "--eval-batch-size", "4",
              "--sigma", "0.05", "--alpha", "0.05", "--save-every", "2", "--logging", "none", "--no-progress",
              "--output-dir", str(tmp_path), *flags]
    whole = toy_cli(*common, "--run-name", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    # the same run, stopped after 2 iterations and resumed from checkpoint-2
    cut = toy_cli(*common, "--run-name", "cut", "--budget-completions", str(2 * per_iteration), cwd=tmp_path)
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert json.loads((tmp_path / "cut" / "checkpoint-2" / "trainer_state.json").read_text())["iteration"] == 2
    assert not (tmp_path / "cut" / "checkpoint-4").exists()
    resumed = toy_cli("train", "--resume", str(tmp_path / "cut"), "--budget-completions", "100000", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at iteration 2" in resumed.stderr

    final = {run: load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("whole", "cut")}
    start = load_file(str(lively_model_dir / "model.safetensors"))
    assert any(not torch.equal(final["whole"][name], start[name]) for name in start)  # training moved the weights
    assert all(torch.equal(final["whole"][name], final["cut"][name]) for name in start)

    rows = {run: [row for row in rows_of(tmp_path / run) if "reward/mean" in row] for run in ("whole", "cut")}
    assert [row["iteration"] for row in rows["whole"]] == [1, 2, 3, 4] == [row["iteration"] for row in rows["cut"]]
    for row in rows["whole"]:
        t = row["iteration"] - 1  # the row of iteration t + 1 holds the values that iteration ran with
        sigma = 0.05 * (0.1 + (1 - 0.1) * (1 + math.cos(math.pi * (t / 3))) / 2) if t else 0.05
        alpha = 0.05 * (0.1 + (1 - 0.1) * (1 - t / 3)) if t else 0.05
        assert (row["es/sigma"], row["es/alpha"]) == (sigma, alpha)
    assert rows["whole"][-1]["es/sigma"] == rows["whole"][-1]["es/alpha"] == 0.05 * 0.1
    keys = ("es/sigma", "es/alpha", "reward/mean", "reward/std", "reward/max")
    assert [[row[k] for k in keys] for row in rows["whole"]] == [[row[k] for k in keys] for row in rows["cut"]]
    assert any(row["reward/std"] > 0 for row in rows["whole"])  # members scored differently: updates were not zero
    assert [row["budget/completions"] for row in rows["whole"]] == [per_iteration * i for i in (1, 2, 3, 4)]
    config = (tmp_path / "cut" / "config.yaml").read_text()
    assert ("prompt_groups: 2" in config and "step_rule: sqrt_n" in config and "rollout_temperature: 1.0" in config
            and "prompt_candidates: 2" in config) == (design == "grouped")
    assert all(("selection/batch_reward" in row) == (design == "grouped") for row in rows["whole"] + rows["cut"])


def test_constant_schedules_log_sigma_and_alpha_every_iteration(lively_model_dir, tmp_path):
    from esft.trainer import ESTrainer

    args = ESConfig(model=str(lively_model_dir), iterations=2, population_size=2, batch_size=2, max_tokens=4,
                    eval_size=2, eval_batch_size=2, sigma=0.04, logging="none", progress=False, save_every=0,
                    output_dir=str(tmp_path), run_name="run")
    trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(8),
                        eval_dataset=toy_rows(2, start=1000))
    trainer.train()
    rows = [row for row in rows_of(tmp_path / "run") if "reward/mean" in row]
    assert [(row["es/sigma"], row["es/alpha"]) for row in rows] == [(0.04, 0.02)] * 2


@pytest.mark.parametrize("flags, expected", [
    (["--antithetic", "--population-size", "5"], "--population-size: --strategy antithetic pairs members"),
    (["--algorithm", "grpo", "--antithetic"], "--antithetic: is an ES setting, which --algorithm grpo does not use"),
    (["--algorithm", "grpo", "--sigma-schedule", "cosine"], "--sigma-schedule: is an ES setting"),
    (["--algorithm", "grpo", "--reward-shaping", "per_prompt"], "--reward-shaping: is an ES setting"),
    (["--reward-shaping", "per-prompt"], "per_prompt"),  # the choices name it
    # issue 63's designs: a split into prompt groups that cannot be made, a step rule that would change nothing
    (["--prompt-groups", "4"], "--prompt-groups: splits the --population-size 30 members into 4 equal groups"),
    (["--prompt-groups", "2", "--batch-size", "5"], "B must be a multiple of 2: use --batch-size 6"),
    (["--prompt-groups", "2", "--strategy", "antithetic", "--population-size", "6", "--batch-size", "4"],
     "N/G must be even; got 6/2 = 3"),
    (["--prompt-groups", "2", "--reward-shaping", "per_prompt"], "use per_prompt_centered"),
    (["--prompt-groups", "0"], "--prompt-groups: must be >= 1"),
    (["--step-rule", "sqrt_n", "--optimizer", "adam"], "--step-rule: sqrt_n scales the sgd step"),
    (["--step-rule", "sqrt"], "--step-rule: must be one of paper, sqrt_n"),
    (["--algorithm", "randopt", "--prompt-groups", "2"], "--prompt-groups: is a setting of the ES update"),
    (["--prompt-choice", "extremes"], "--prompt-choice: extremes chooses the batch among --prompt-candidates'"),
    (["--algorithm", "grpo", "--prompt-candidates", "8"], "--prompt-candidates: is an ES setting"),
    (["--sigma", "nope"], "--sigma: must be a number such as 1e-3, or auto"),
    (["--algorithm", "randopt", "--sigma", "auto"], "--sigma: auto is chosen before ES's first iteration"),
])
def test_cli_refuses_bad_variant_settings_in_one_line(tmp_path, flags, expected):
    proc = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--model", "embedded", *flags, "--no-progress",
                           "--output-dir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("esft: error: ") and expected in lines[0], proc.stderr
    assert not any(tmp_path.iterdir())  # refused before any run directory


# ------------------------------------------------------------------ Ray = local
@pytest.mark.slow
@pytest.mark.parametrize("design", [{"reward_shaping": "per_prompt", "noise": "iid_matrices"},
                                    {"reward_shaping": "per_prompt_centered", "prompt_groups": 2, "step_rule": "sqrt_n",
                                     "rollout_temperature": 1.0, "prompt_candidates": 2}],
                         ids=["variants", "grouped"])
def test_ray_and_local_runs_with_every_variant_end_with_the_same_weights(ray_cluster, lively_model_dir, tmp_path,
                                                                         design):
    """Every variant on Ray (2 actors) ends with the local run's weights, also with prompt groups (a group's rows
    travel with its members), sampled rollouts (the sampling goes with them) and a batch chosen from candidates
    (an actor answers them; the chosen rows travel with the members) (slow: Ray actors start and load the model)."""
    from esft.trainer import ESTrainer

    finals = {}
    for executor in ("local", "ray"):
        args = ESConfig(model=str(lively_model_dir), executor=executor, workers=2 if executor == "ray" else 1,
                        iterations=2, population_size=4, batch_size=4, max_tokens=8, sigma=SIGMA, device="cpu",
                        antithetic=True, sigma_schedule="linear:0.5", alpha_schedule="cosine:0.2", **design,
                        population_batching=False, eval_batch_size=4, save_every=0,
                        logging="none", progress=False, output_dir=str(tmp_path), run_name=executor)
        trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=[byte_reward], args=args,
                            train_dataset=toy_rows(20), eval_dataset=toy_rows(4, start=1000))
        trainer.train()
        finals[executor] = load_file(str(tmp_path / executor / "final" / "model.safetensors"))
        if executor == "ray":
            trainer.executor.close()
    start = load_file(str(lively_model_dir / "model.safetensors"))
    assert any(not torch.equal(finals["ray"][n], start[n]) for n in start)
    assert all(torch.equal(finals["local"][n], finals["ray"][n]) for n in start)
    sigmas = {run: [row["es/sigma"] for row in rows_of(tmp_path / run) if "es/sigma" in row] for run in finals}
    assert sigmas["local"] == sigmas["ray"] == [SIGMA, SIGMA * 0.5]

