"""`esft train` / `esft eval` judged as a user judges them: by exit code, files and the one-line error on
stderr. The trained run every file check reads is a subprocess, as a user runs it; the variations (bad input,
--help, --config, evaluation only) run in this process (tests/cli_runner.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from esft.cli import resolve_config
from esft.settings.config import DEMO_PRESET, MODEL_PRESET, ESConfig
from esft.tasks.countdown import countdown_accuracy, countdown_reward
from cli_runner import run_esft, run_esft_here
from tiny_model import subprocess_env

TINY = ["--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--eval-size", "4",
        "--train-size", "20", "--eval-batch-size", "4", "--no-progress"]
ITERATION_KEYS = ("iteration", "reward/mean", "reward/std", "reward/min", "reward/max",
                  "completions/mean_length", "perf/iteration_s", "perf/tokens_per_s")
SAMPLE_KEYS = {"prompt", "completion", "target", "reward", "accuracy"}


def cli_env() -> dict[str, str]:
    """The environment of an `esft` a test runs: this process's as it is now (a test may have set a variable)."""
    return {**subprocess_env(), "PYTHONIOENCODING": "utf-8", "COLUMNS": "100"}


def esft(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """`esft ARGS` in this process (tests/cli_runner.py: the variations of a path); returns the finished
    command and its wall time in seconds."""
    started = time.perf_counter()
    proc = run_esft_here(*args, cwd=cwd, env=cli_env())
    return proc, time.perf_counter() - started


def esft_process(*args: str, cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m esft.cli ARGS` in a process of its own, as a user runs it; the process and its wall time."""
    started = time.perf_counter()
    proc = run_esft(*args, cwd=cwd, env=cli_env(), timeout=timeout)
    return proc, time.perf_counter() - started


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for shard in sorted(directory.glob("model*.safetensors")):
        weights |= load_file(str(shard))
    assert weights, f"no model*.safetensors in {directory}"
    return weights


def assert_user_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit code 2, exactly one 'esft: error: ...' line on stderr containing `expected`, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{proc.stderr}"
    assert lines[0].startswith("esft: error: "), lines[0]
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


# ------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """One tiny `esft train` with TensorBoard logging: 4 iterations, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("cli-train")
    proc, _ = esft_process("train", "--model", str(tiny_model_dir), *TINY, "--iterations", "4", "--save-every", "2",
                   "--sigma", "0.002", "--seed", "3", "--logging", "tensorboard", "--output-dir", str(out),
                   "--run-name", "run", cwd=out)
    assert proc.returncode == 0, proc.stderr
    return proc, out / "run"


def test_train_exits_0_and_reports_the_run(trained_run):
    proc, run_dir = trained_run
    assert f"run directory: {run_dir}" in proc.stdout
    assert "heldout accuracy before: 0.0%" in proc.stderr  # a random model solves nothing
    assert "heldout accuracy after: 0.0%" in proc.stderr
    assert "esft: population batching: 2 of 2 members per generate call" in proc.stderr  # what `auto` chose, once
    assert proc.stderr.count("population batching:") == 1
    assert "Traceback" not in proc.stderr


def test_config_yaml_is_the_resolved_config(trained_run):
    _, run_dir = trained_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert set(config) == {f.name for f in dataclasses.fields(ESConfig)}
    assert config["sigma"] == 0.002
    assert config["alpha"] == config["sigma"] / 2 == 0.001  # the σ/2 default, written out
    assert (config["population_size"], config["batch_size"], config["max_tokens"]) == (2, 2, 4)
    assert (config["iterations"], config["save_every"], config["seed"]) == (4, 2, 3)
    assert (config["logging"], config["progress"], config["run_name"]) == ("tensorboard", False, "run")
    assert ESConfig(**config).to_dict() == config  # it is a complete, valid config


def test_metrics_jsonl_has_eval_row_then_one_row_per_iteration(trained_run):
    _, run_dir = trained_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3, 4]
    before = rows[0]
    assert "reward/mean" not in before
    assert before["eval/heldout/accuracy"] == 0.0
    assert before["eval/heldout/reward"] >= 0.0
    for row in rows[1:]:
        for key in ITERATION_KEYS:
            assert isinstance(row[key], (int, float)), (key, row)
        assert row["reward/min"] <= row["reward/mean"] <= row["reward/max"]
        assert row["reward/std"] >= 0.0
        assert 0 < row["completions/mean_length"] <= 4  # --max-tokens 4
        assert row["perf/iteration_s"] > 0 and row["perf/tokens_per_s"] > 0
    assert all("eval/heldout/reward" not in row for row in rows[1:-1])  # --eval-every 0
    last = rows[-1]
    assert 0.0 <= last["eval/heldout/accuracy"] <= 1.0
    assert isinstance(last["eval/heldout/reward"], float)


def test_eval_samples_hold_prompt_completion_target_reward_accuracy(trained_run):
    _, run_dir = trained_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for iteration, row in ((0, rows[0]), (4, rows[-1])):
        samples = read_jsonl(run_dir / "eval" / f"iteration-{iteration}" / "heldout.jsonl")
        assert len(samples) == 4  # --eval-size 4
        for sample in samples:
            assert SAMPLE_KEYS <= set(sample)
            assert "Using the numbers" in sample["prompt"]
            # the stored reward/accuracy are the task's scores of the stored completion
            args = dict(numbers=[sample["numbers"]], target=[sample["target"]])
            assert sample["reward"] == pytest.approx(countdown_reward([sample["prompt"]], [sample["completion"]], **args)[0])
            assert sample["accuracy"] == countdown_accuracy([sample["prompt"]], [sample["completion"]], **args)[0]
        assert row["eval/heldout/reward"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["iteration-0", "iteration-4"]


def test_checkpoints_follow_save_every(trained_run):
    _, run_dir = trained_run
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    for n in (2, 4):
        checkpoint = run_dir / f"checkpoint-{n}"
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["iteration"] == n and state["seed"] == 3
        assert state["config"]["iterations"] == 4
        assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
        assert not (checkpoint / "master.safetensors").exists()  # float32: the model file is the master
    assert not list(run_dir.glob(".*tmp"))  # no leftovers of the atomic writes


def test_final_model_loads_with_from_pretrained(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = trained_run
    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("<think>1 + 2", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == "<think>1 + 2"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    # the final model is the last checkpoint's, bit for bit
    final_weights, last = safetensors_of(final), safetensors_of(run_dir / "checkpoint-4")
    assert final_weights.keys() == last.keys()
    assert all(torch.equal(final_weights[name], last[name]) for name in final_weights)
    state = dict(model.state_dict())
    assert all(torch.equal(state[name], final_weights[name]) for name in final_weights)


def test_tensorboard_events_hold_the_scalars(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = trained_run
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert [event.step for event in accumulator.Scalars("eval/heldout/accuracy")] == [0, 4]


def test_existing_run_directory_needs_resume(trained_run, tiny_model_dir):
    _, run_dir = trained_run
    metrics = (run_dir / "metrics.jsonl").read_text()
    proc, seconds = esft("train", "--model", str(tiny_model_dir), *TINY, "--logging", "none",
                         "--output-dir", str(run_dir.parent), "--run-name", "run", cwd=run_dir.parent)
    assert_user_error(proc, "--run-name", str(run_dir), f"--resume {run_dir}")
    assert seconds < 15
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # the earlier run is untouched


# ------------------------------------------------------------------------- evaluate only
def test_eval_and_train_with_zero_iterations_only_evaluate(tiny_model_dir, tmp_path):
    rows = {}
    for name, command in (("eval", ["eval"]), ("zero", ["train", "--iterations", "0"])):
        proc, _ = esft(*command, "--model", str(tiny_model_dir), *TINY, "--logging", "none",
                       "--output-dir", str(tmp_path), "--run-name", name, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        run_dir = tmp_path / name
        assert f"run directory: {run_dir}" in proc.stdout
        assert "accuracy before" not in proc.stderr and "ES:" not in proc.stderr  # no training, no progress bar
        assert "heldout accuracy: 0.0%" in proc.stdout
        assert not (run_dir / "final").exists()
        assert not list(run_dir.glob("checkpoint-*"))
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["iterations"] == 0
        (rows[name],) = read_jsonl(run_dir / "metrics.jsonl")
        assert rows[name]["iteration"] == 0 and "reward/mean" not in rows[name]
        assert len(read_jsonl(run_dir / "eval" / "iteration-0" / "heldout.jsonl")) == 4
    assert rows["eval"] == rows["zero"]  # the same evaluation
    # an evaluation-only run directory cannot be resumed: the message says what to do instead
    proc, _ = esft("eval", "--model", str(tiny_model_dir), *TINY, "--logging", "none",
                   "--output-dir", str(tmp_path), "--run-name", "eval", cwd=tmp_path)
    assert_user_error(proc, "--run-name", "another --run-name")


# ------------------------------------------------------------------------------ bad input
def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    "sigma-zero": (lambda d: ["--sigma", "0"], ["--sigma:", "> 0"]),
    "sigma-negative": (lambda d: ["--sigma", "-1"], ["--sigma:", "-1"]),
    "population-one": (lambda d: ["--population-size", "1"], ["--population-size:", ">= 2", "got 1"]),
    "batch-zero": (lambda d: ["--batch-size", "0"], ["--batch-size:", ">= 1", "got 0"]),
    "unknown-task": (lambda d: ["--task", "nope"], ["--task:", "'nope'", "countdown"]),
    "missing-model": (lambda d: ["--model", "/missing/dir"], ["--model:", "/missing/dir"]),
    "missing-train-data": (lambda d: ["--train-data", str(d / "missing.json")], ["--train-data:", "missing.json", "does not exist"]),
    "malformed-train-rows": (
        lambda d: ["--train-data", _write(d / "rows.json", '[{"numbers": [1, 2], "target": 3}, {"numbers": "12", "target": 3}]')],
        ["rows.json", "row 1", "'numbers'"],
    ),
    "train-data-not-json": (lambda d: ["--train-data", _write(d / "rows.json", "[{")], ["rows.json", "not valid JSON"]),
    "noise": (lambda d: ["--noise", "foo"], ["--noise:", "iid, correlated", "'foo'"]),
    "reward-shaping": (lambda d: ["--reward-shaping", "foo"], ["--reward-shaping:", "zscore, rank, raw", "'foo'"]),
    "dtype": (lambda d: ["--dtype", "float8"], ["--dtype:", "float32, bfloat16, float16", "'float8'"]),
    "trainable-regex": (lambda d: ["--trainable", "("], ["--trainable:", "regular expression"]),
    "config-unknown-key": (
        lambda d: ["--config", _write(d / "run.yaml", "sigma: 0.01\nstep_size: 0.1\n")],
        ["--config", "run.yaml", "unknown setting 'step_size'"],
    ),
    "config-not-yaml": (
        lambda d: ["--config", _write(d / "run.yaml", "model: [unclosed\nsigma: 0.01\n")],
        ["--config", "run.yaml", "not valid YAML", "line 2"],
    ),
    "config-not-a-mapping": (lambda d: ["--config", _write(d / "run.yaml", "- sigma\n- 0.01\n")], ["--config", "run.yaml", "mapping"]),
    "config-missing": (lambda d: ["--config", str(d / "nope.yaml")], ["--config", "nope.yaml", "cannot read"]),
    "config-bad-value": (lambda d: ["--config", _write(d / "run.yaml", "eval-every: -1\n")], ["--eval-every:", "got -1", "run.yaml"]),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_fast_with_one_line(case, tmp_path):
    """Every case uses an EMPTY directory as --model (unless testing --model): had the model been
    loaded first, the error would be about the model. So each check runs before any model load."""
    make_args, expected = BAD_INPUT[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (tmp_path / "empty-model").mkdir()
    out = tmp_path / "runs"
    proc, seconds = esft("train", "--model", str(tmp_path / "empty-model"), *TINY, "--logging", "none",
                         "--output-dir", str(out), *make_args(inputs), cwd=tmp_path)
    assert_user_error(proc, *expected)
    assert "--model: could not load" not in proc.stderr
    assert seconds < 15
    assert not out.exists()  # no run directory was created


# ----------------------------------------------------------------------- --config / --help
def test_config_file_sets_values_and_flags_override_it(tiny_model_dir, tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        f"model: {tiny_model_dir}\n"
        "population-size: 3\n"   # keys may use - ...
        "max_tokens: 4\n"        # ... or _
        "sigma: 2e-3\n"          # YAML 1.1 reads this as a string; it must still be the float 0.002
        "seed: 5\n"
        "eval_size: 4\n"
        "iterations: 0\n"
        "logging: none\n"
        "preset: none\n"        # esft train's own key: no model preset, ESConfig's defaults (the batch size below)
    )
    proc, _ = esft("train", "--config", str(config_file), "--population-size", "4", "--no-progress",
                   "--output-dir", str(tmp_path), "--run-name", "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert config["population_size"] == 4          # the flag beats the file
    assert config["sigma"] == 0.002 and config["alpha"] == 0.001
    assert (config["seed"], config["max_tokens"], config["eval_size"], config["iterations"]) == (5, 4, 4, 0)
    assert config["model"] == str(tiny_model_dir) and config["logging"] == "none"
    assert config["batch_size"] == ESConfig().batch_size  # neither file nor flag: the default


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_documents_every_setting(command, tmp_path):
    proc, _ = esft(command, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    squashed = "".join(proc.stdout.split())  # argparse wraps lines (even at hyphens)
    for field in dataclasses.fields(ESConfig):
        if command == "eval" and field.name == "iterations":
            continue  # esft eval never trains (a test below: the flag is refused)
        flag = "--" + field.name.replace("_", "-")
        assert f"{flag} " in proc.stdout or f"{flag}," in proc.stdout, f"{flag} missing from --help"
        assert "".join(field.metadata["help"].split()) in squashed, f"help text of {flag} missing"
    assert "--no-progress" in proc.stdout
    assert "--config YAML" in proc.stdout


# ------------------------------------------------------------------------- the demo preset
PAPER = {"noise": "iid", "rank": 1, "population_batching": "auto", "mini_batch_size": "auto"}


LOWRANK = PAPER | DEMO_PRESET


@pytest.mark.parametrize(
    "command, given, expected, dropped",
    [
        ("train", {}, LOWRANK, ""),                                       # `esft train`: the demo, fast
        ("train", {"iterations": 3, "sigma": 2e-3}, LOWRANK, ""),         # ES hyperparameters keep it
        ("train", {"model": "embedded"}, LOWRANK, ""),
        ("train", {"mini_batch_size": 8}, LOWRANK | {"mini_batch_size": 8}, ""),  # a flag overrides its own value only
        ("train", {"rank": 4}, LOWRANK | {"rank": 4}, ""),
        ("train", {"noise": "lowrank"}, LOWRANK, ""),                  # the preset's own value: nothing changes
        ("train", {"workers": 1, "executor": "local"}, LOWRANK, ""),  # defaults typed out change nothing
        ("train", {"executor": "ray", "workers": 2}, LOWRANK, ""),    # Ray actors batch their share
        ("train", {"engine": "transformers"}, LOWRANK, ""),
        ("train", {"noise": "iid"}, PAPER | {"population_batching": True}, ""),  # full-rank members batch too
        ("train", {"noise": "correlated"}, PAPER | {"noise": "correlated", "population_batching": True}, ""),
        ("train", {"population_batching": False}, LOWRANK | {"population_batching": False}, ""),
        ("train", {"engine": "vllm"}, PAPER, "--engine vllm turns off the demo preset's --noise, --rank, --population-batching"),
        ("train", {"task": "arithmetic"}, PAPER, ""),                     # not the demo's task: the paper's
        ("eval", {}, PAPER, ""),                                           # nothing to speed up
    ],
)
def test_demo_preset_applies_as_defaults(command, given, expected, dropped, capsys):
    config, (which, preset), _ = resolve_config(command, dict(given))
    assert {name: getattr(config, name) for name in PAPER} == expected
    assert all(DEMO_PRESET[name] == value and name not in given for name, value in preset.items())  # defaults only
    assert which == ("demo" if command == "train" and given.get("model", "embedded") == "embedded"
                     and "task" not in given else None)
    if which is None:
        assert preset == {}
    err = capsys.readouterr().err
    assert (dropped in err) if dropped else "turns off" not in err
    assert ESConfig().noise == "iid" and ESConfig().population_batching == "auto"  # the API's defaults: the paper's noise


def test_demo_preset_values_from_a_yaml_file_count_as_given(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("noise: iid\n")
    config, (_, preset), _ = resolve_config("train", {"config": str(config_file)})
    assert preset == {"population_batching": True} and config.noise == "iid" and config.rank == 1


MODEL_DESIGN = ("noise", "rank", "population_size", "batch_size", "step_rule", "sigma", "alpha")


@pytest.mark.parametrize(
    "given, expected, dropped",
    [
        ({}, ("lowrank", 4, 64, 2, "sqrt_n", "auto", None), ""),  # σ, and α with it, chosen before the first iteration
        ({"sigma": 0.01}, ("lowrank", 4, 64, 2, "sqrt_n", 0.01, 0.01 / (2 * 8 ** 0.5)), ""),  # sqrt_n's own α
        ({"sigma": 0.01, "alpha": 0.002}, ("lowrank", 4, 64, 2, "sqrt_n", 0.01, 0.002), ""),
        ({"population_size": 8, "batch_size": 16}, ("lowrank", 4, 8, 16, "sqrt_n", "auto", None), ""),
        ({"noise": "iid"}, ("iid", 1, 64, 2, "sqrt_n", "auto", None), ""),  # no rank for full-rank noise
        ({"lora_r": 4}, ("iid", 1, 64, 2, "sqrt_n", "auto", None), "--lora-r turns off the model preset's --noise, --rank"),
        ({"optimizer": "adam", "sigma": 0.01, "alpha": 1e-4}, ("lowrank", 4, 64, 2, "paper", 0.01, 1e-4),
         "--optimizer adam turns off the model preset's --step-rule (adam normalizes its own step)"),
    ],
)
def test_the_model_preset_applies_as_defaults_on_any_model_but_the_embedded_one(given, expected, dropped, capsys):
    config, (which, preset), _ = resolve_config("train", {"model": "org/some-model", **given})
    assert which == "model" and tuple(getattr(config, name) for name in MODEL_DESIGN) == pytest.approx(expected)
    assert all(MODEL_PRESET[name] == value and name not in given for name, value in preset.items())  # defaults only
    err = capsys.readouterr().err
    assert (dropped in err) if dropped else "turns off" not in err
    assert ESConfig(model="org/some-model").population_size == 30  # the API's defaults: the paper's
    for command, more in (("eval", {}), ("train", {"algorithm": "grpo"}), ("train", {"algorithm": "randopt"})):
        assert resolve_config(command, {"model": "org/some-model", **more})[1] == (None, {})  # ES's training only


def test_an_error_caused_by_the_demo_preset_says_so(tmp_path):
    """Only norms trainable: low-rank noise has no matrix to perturb. The user typed no speed flag,
    so the error names the preset and how to turn it off."""
    proc, _ = esft("train", "--trainable", "norm", "--iterations", "1", "--eval-size", "4", "--logging", "none",
                   "--no-progress", "--output-dir", str(tmp_path), cwd=tmp_path)
    assert_user_error(proc, "--population-batching: no trainable matrix", "set by the demo preset", "--noise iid")
