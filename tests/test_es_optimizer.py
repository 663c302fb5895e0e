"""--optimizer (issue 22): Adam / AdamW on the ES gradient estimate, sgd's weight decay, the paper's
rule unchanged, the optimizer state in checkpoints (resume stays bitwise), Ray = local."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_runner import run_esft_here
from tiny_model import subprocess_env
from esft.engines.transformers_engine import TransformersEngine
from esft.es import lowrank
from esft.es.noise import draw_noise, perturbs
from esft.es.optimizers import ESOptimizer

SEEDS = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
COEFFICIENTS = [[0.5, -0.25, 0.125], [-0.3, 0.6, 0.1], [0.2, 0.2, -0.7]]


def engine_of(path, **kwargs) -> TransformersEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TransformersEngine(model, AutoTokenizer.from_pretrained(path), **kwargs)


def es_gradient(engine, index, shape, seeds, coefficients) -> torch.Tensor:
    """G = Σ cᵢ·εᵢ of one tensor, computed by hand from the noise definition."""
    total = torch.zeros(shape)
    for seed, coefficient in zip(seeds, coefficients):
        total.add_(draw_noise(engine.noise, seed, index, shape, rank=engine.rank), alpha=coefficient)
    return total


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_steps_equal_torch_adam_fed_the_same_gradient(weight_decay):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(7, 5, generator=generator)
    ours, theirs = start.clone(), torch.nn.Parameter(start.clone())
    kind = torch.optim.AdamW if weight_decay else torch.optim.Adam
    reference = kind([theirs], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, maximize=True)
    optimizer = ESOptimizer("adam", betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    for _ in range(3):
        gradient = torch.randn(7, 5, generator=generator) * 1e-3
        theirs.grad = gradient.clone()
        reference.step()
        optimizer.step("w", ours, gradient.clone(), learning_rate=1e-2)
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-7, atol=1e-7)
    assert optimizer.state["w"].step == 3
    # the moments are of the ascent gradient (torch's, under maximize, are their negatives)
    torch.testing.assert_close(optimizer.state["w"].exp_avg, -reference.state[theirs]["exp_avg"], rtol=0, atol=0)


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_engine_adam_update_is_torch_adamw_on_the_es_gradient(tiny_model_dir, noise):
    """Through the engine: G of every tensor (low-rank: the dense matrix), then AdamW's step."""
    options = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    engine = engine_of(tiny_model_dir, noise=noise, rank=2, optimizer=dict(
        kind="adam", betas=options["betas"], eps=options["eps"], weight_decay=options["weight_decay"]))
    stepped = [(index, name, param) for index, name, param in engine.trainable if perturbs(noise, param.shape)]
    frozen = {name: engine.master[name].clone() for _, name, param in engine.trainable if not perturbs(noise, param.shape)}
    params = {name: torch.nn.Parameter(engine.master[name].clone()) for _, name, _ in stepped}
    reference = torch.optim.AdamW(list(params.values()), maximize=True, **options)
    for seeds, coefficients in zip(SEEDS, COEFFICIENTS):
        for index, name, param in stepped:
            params[name].grad = es_gradient(engine, index, param.shape, seeds, coefficients)
        reference.step()
        engine.update(seeds, coefficients, learning_rate=options["lr"])
        for _, name, param in stepped:
            torch.testing.assert_close(engine.master[name], params[name].detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(param.detach(), engine.master[name])  # θ ← master
    for name, before in frozen.items():  # low-rank leaves norms and biases alone, and keeps no state for them
        assert torch.equal(engine.master[name], before)
    state = engine.optimizer_state()
    assert {key.partition(".")[2] for key in state} == set(params)
    assert all(int(state[f"step.{name}"]) == 3 for name in params)


@pytest.mark.parametrize("noise", ["iid", "lowrank"])
def test_sgd_is_the_paper_rule_bitwise_and_its_weight_decay_decoupled(tiny_model_dir, noise):
    plain = engine_of(tiny_model_dir, noise=noise, rank=2)
    decayed = engine_of(tiny_model_dir, noise=noise, rank=2, optimizer=dict(kind="sgd", weight_decay=0.5))
    expected = {name: tensor.clone() for name, tensor in plain.master.items()}
    for seeds, coefficients in zip(SEEDS, COEFFICIENTS):
        plain.update(seeds, coefficients, learning_rate=0.01)  # sgd without decay: learning_rate not applied
        decayed.update(seeds, coefficients, learning_rate=0.01)
        for index, name, param in plain.trainable:
            if not perturbs(noise, param.shape):
                continue
            if noise == "lowrank":  # the in-place addmm of the paper path, unchanged
                lowrank.accumulate_update(expected[name], index, seeds, coefficients, 2)
            else:
                expected[name].add_(es_gradient(plain, index, param.shape, seeds, coefficients))
    for index, name, param in plain.trainable:
        assert torch.equal(plain.master[name], expected[name]), name
    assert plain.optimizer_state() == {} and decayed.optimizer_state() == {}
    # decay: θ ← θ·(1 − lr·wd) before each += G (here three times by 0.995)
    fresh = engine_of(tiny_model_dir, noise=noise, rank=2)
    name = next(name for _, name, param in fresh.trainable if perturbs(noise, param.shape))
    manual = fresh.master[name].clone()
    index = next(i for i, n, _ in fresh.trainable if n == name)
    for seeds, coefficients in zip(SEEDS, COEFFICIENTS):
        gradient = (lowrank.dense_update(torch.empty(manual.shape), index, seeds, coefficients, 2) if noise == "lowrank"
                    else es_gradient(fresh, index, manual.shape, seeds, coefficients))
        manual.mul_(1 - 0.01 * 0.5).add_(gradient)
    assert torch.equal(decayed.master[name], manual)
    assert not math.isclose(float(decayed.master[name].norm()), float(plain.master[name].norm()), rel_tol=1e-3)


# ------------------------------------------------------------------ the CLI: checkpoints and resume
RUN = ["--model", "embedded", "--population-size", "4", "--batch-size", "4", "--eval-size", "4", "--max-tokens", "40",
       "--train-size", "20", "--save-every", "2", "--no-progress", "--output-dir", "runs"]
ADAM = ["--optimizer", "adam", "--alpha", "1e-4", "--weight-decay", "0.01"]


def esft(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`esft train ARGS` in this process (tests/cli_runner.py)."""
    return run_esft_here("train", *args, cwd=cwd, env=subprocess_env())


def safetensors_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.glob("*.safetensors"))}


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["--noise", "iid"], [], ["--lora-r", "2"]], ids=["iid", "lowrank", "lora"])
def test_adam_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, variant):
    """Adam's moments survive a checkpoint: 4 iterations straight against 2 + a resume to 4, for each noise and
    LoRA (slow: three runs per variant, compared bit for bit)."""
    from safetensors.torch import load_file

    straight = esft(*RUN, *ADAM, *variant, "--iterations", "4", "--run-name", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    first = esft(*RUN, *ADAM, *variant, "--iterations", "2", "--run-name", "split", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = esft("--resume", "runs/split", "--iterations", "4", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "checkpoint-2" in resumed.stderr
    runs = tmp_path / "runs"
    state = load_file(str(runs / "split" / "checkpoint-2" / "optimizer" / "optimizer.safetensors"))
    steps = {int(tensor) for key, tensor in state.items() if key.startswith("step.")}
    assert steps == {2} and any(key.startswith("exp_avg_sq.") for key in state)
    final = safetensors_bytes(runs / "straight" / "final")
    assert not any(name.startswith("optimizer") for name in final)  # vLLM loads every top-level *.safetensors
    assert final and final == safetensors_bytes(runs / "split" / "final")
    assert (safetensors_bytes(runs / "straight" / "checkpoint-4" / "optimizer")
            == safetensors_bytes(runs / "split" / "checkpoint-4" / "optimizer"))
    assert safetensors_bytes(runs / "straight" / "checkpoint-2") != safetensors_bytes(runs / "straight" / "checkpoint-4")


def test_resuming_an_sgd_checkpoint_with_adam_is_one_clear_error(tmp_path):
    tiny = ["--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--eval-size", "2"]
    sgd = esft(*RUN, *tiny, "--iterations", "1", "--save-every", "1", "--run-name", "sgd", cwd=tmp_path)
    assert sgd.returncode == 0, sgd.stderr
    resumed = esft("--resume", "runs/sgd", "--iterations", "2", "--optimizer", "adam", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 2, resumed.stderr
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("esft: error")]
    assert len(lines) == 1 and "no optimizer state" in lines[0] and "--optimizer sgd" in lines[0], resumed.stderr
    assert "Traceback" not in resumed.stderr


# ------------------------------------------------------------------ TRL's names, --algorithm grpo
def test_trl_adam_names_point_to_the_esft_flags():
    from esft.settings.config import ConfigError, ESConfig, UnknownSetting

    for name, flag in (("adam_beta1", "--adam-betas"), ("adam_beta2", "--adam-betas"), ("adam_epsilon", "--adam-eps")):
        with pytest.raises(UnknownSetting, match=f"TRL's name; did you mean {flag}"):
            ESConfig(**{name: 0.9})
    with pytest.raises(ConfigError, match="--optimizer: is an ES setting.*TRL's AdamW"):
        ESConfig(algorithm="grpo", optimizer="adam")


def test_grpo_gets_the_adam_flags_as_trls_names():
    pytest.importorskip("trl")  # the grpo extra; the README's test command installs it
    from esft.settings.config import ESConfig
    from esft.grpo.trl_trainer import grpo_config

    config = grpo_config(ESConfig(algorithm="grpo", weight_decay=0.1, adam_betas="0.8,0.95", adam_eps=1e-6, device="cpu"),
                         Path("unused"))
    assert (config.adam_beta1, config.adam_beta2, config.adam_epsilon, config.weight_decay) == (0.8, 0.95, 1e-6, 0.1)
    default = grpo_config(ESConfig(algorithm="grpo", device="cpu"), Path("unused"))  # TRL's own defaults, unchanged
    assert (default.adam_beta1, default.adam_beta2, default.adam_epsilon, default.weight_decay) == (0.9, 0.999, 1e-8, 0.0)


# ------------------------------------------------------------------ the trainer's side of the contract
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_trainer_gives_adam_the_es_gradient_and_alpha_as_its_learning_rate(tiny_model_dir, tmp_path, optimizer):
    """sgd: coefficients α·zᵢ/N as in the paper (Σc² = α²/N under z-scores), learning rate α for the decay;
    adam: coefficients zᵢ/N, so G = g = (1/N)·Σ zᵢεᵢ (Σc² = 1/N), and α as Adam's learning rate."""
    from toy_task import byte_reward, toy_rows

    from esft.settings.config import ESConfig
    from esft.trainer import ESTrainer

    args = ESConfig(model=str(tiny_model_dir), population_size=6, batch_size=4, max_tokens=8, sigma=0.05, alpha=0.01,
                    iterations=2, save_every=0, eval_batch_size=4, device="cpu", logging="none", progress=False,
                    optimizer=optimizer, output_dir=str(tmp_path), run_name="run")
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(20),
                        eval_dataset=toy_rows(4, start=1000))
    calls, update = [], trainer.executor.update
    trainer.executor.update = lambda seeds, coefficients, learning_rate=1.0: (  # the real update, watched
        calls.append((list(coefficients), learning_rate)), update(seeds, coefficients, learning_rate))
    trainer.train()
    assert len(calls) == 2
    scale = 1.0 if optimizer == "adam" else args.alpha
    for coefficients, learning_rate in calls:
        assert learning_rate == args.alpha
        assert sum(c * c for c in coefficients) * len(coefficients) == pytest.approx(scale ** 2, rel=1e-6)
    assert (trainer.engine.optimizer_state() != {}) == (optimizer == "adam")
