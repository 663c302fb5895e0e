"""Reproducibility, resume, checkpoint atomicity and the ESTrainer Python API.

Runs use the "toy" task (tests/toy_task.py) on a tiny model with larger initial weights: its members
generate different text and score differently, so every ES update really moves the weights (with
Countdown a random model scores 0 everywhere, updates are zero and these checks would be vacuous).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from esft.runs.checkpoint import (
    MASTER_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
    verify,
)
from esft.cli import main
from esft.settings.config import ESConfig
from esft.runs.directory import ResumeError, find_resume_point
from esft.tasks import TASKS, TaskError
from tiny_model import build_tiny_model, subprocess_env
from cli_runner import without_model_preset
from toy_task import byte_reward, make_toy_task, toy_rows

TESTS = Path(__file__).parent
REWARD_KEYS = ("reward/mean", "reward/std", "reward/min", "reward/max", "completions/mean_length")


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.03 perturbations."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


@pytest.fixture(autouse=True)
def _toy_task_and_one_thread(monkeypatch, one_torch_thread):
    monkeypatch.setitem(TASKS, "toy", make_toy_task)


def toy_args(model: Path, out: Path, run_name: str, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--task", "toy", "--population-size", "4", "--batch-size", "2",
            "--max-tokens", "6", "--eval-size", "4", "--train-size", "20", "--eval-batch-size", "4",
            "--sigma", "0.03", "--logging", "none", "--no-progress", "--output-dir", str(out),
            "--run-name", run_name, *extra]


def run_in_process(argv: list[str]) -> None:
    assert main(without_model_preset(argv)) == 0


def run_in_subprocess(argv: list[str], cwd: Path) -> None:
    """`esft` in a fresh interpreter (tests/toy_task.py registers the toy task, then runs the CLI)."""
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(TESTS / "toy_task.py"), *without_model_preset(argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def weights_of(directory: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(directory / name))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"tensors differ: {differing[:5]}"


def differing_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rewards(run_dir: Path) -> list[tuple]:
    """Per iteration: the population's reward statistics (everything but timings)."""
    return [(row["iteration"], *(row[key] for key in REWARD_KEYS)) for row in metrics(run_dir) if "reward/mean" in row]


# ------------------------------------------------------------------------- reproducibility
def test_same_seed_is_bitwise_reproducible_and_another_seed_is_not(lively_model_dir, tmp_path):
    run_in_process(toy_args(lively_model_dir, tmp_path, "a", "--iterations", "3", "--save-every", "0"))
    # the same run in a fresh interpreter (different hash seed, allocator, import order ...)
    run_in_subprocess(toy_args(lively_model_dir, tmp_path, "b", "--iterations", "3", "--save-every", "0"), tmp_path)
    run_in_process(toy_args(lively_model_dir, tmp_path, "c", "--iterations", "3", "--save-every", "0", "--seed", "1"))

    a, b, c = (weights_of(tmp_path / name / "final") for name in "abc")
    initial = weights_of(lively_model_dir)
    assert differing_tensors(initial, a), "training did not change the weights: the test would be vacuous"
    assert any(row[2] > 0 for row in rewards(tmp_path / "a")), "members never scored differently"

    assert_bitwise_equal(a, b)
    assert rewards(tmp_path / "a") == rewards(tmp_path / "b")
    evals = [{k: v for k, v in row.items() if k.startswith("eval/")} for row in metrics(tmp_path / "a")]
    assert evals == [{k: v for k, v in row.items() if k.startswith("eval/")} for row in metrics(tmp_path / "b")]

    assert differing_tensors(a, c), "--seed 1 gave the same weights as --seed 0"
    assert rewards(tmp_path / "a") != rewards(tmp_path / "c")


# ---------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("dtype, master_weights", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "none")])
def test_resume_continues_bit_exactly(dtype, master_weights, lively_model_dir, tmp_path, capsys):
    """float32 weights are their own master (auto); bfloat16 ones keep a float32 master (auto, it fits) or, with
    --master-weights none, round each update stochastically: a resume continues each of them bit for bit."""
    out = tmp_path
    flags = ("--dtype", dtype, "--master-weights", master_weights)
    # A: 4 uninterrupted iterations
    run_in_process(toy_args(lively_model_dir, out, "A", "--iterations", "4", "--save-every", "2", *flags))
    # B: the same run stopped after 2 iterations ...
    run_in_process(toy_args(lively_model_dir, out, "B", "--iterations", "2", "--save-every", "2", *flags))
    run_b = out / "B"
    assert [p.name for p in list_checkpoints(run_b)] == ["checkpoint-2"]
    # ... after a crash: a row logged past the checkpoint, a row torn mid-write, a half-written
    # checkpoint directory (temp name) and one lacking trainer_state.json (never completed)
    with open(run_b / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"iteration": 3, "reward/mean": 123.0}) + "\n")
        handle.write('{"iteration": 4, "reward/me')
    shutil.copytree(run_b / "checkpoint-2", run_b / ".checkpoint-4.x1y2.tmp")
    shutil.copytree(run_b / "checkpoint-2", run_b / "checkpoint-6")
    (run_b / "checkpoint-6" / STATE_FILE).unlink()
    capsys.readouterr()

    # ... resumed: the checkpoint's config, with --iterations overriding it
    assert main(["train", "--resume", str(run_b), "--iterations", "4"]) == 0
    assert f"resumed from {run_b / 'checkpoint-2'} at iteration 2" in capsys.readouterr().err

    run_a = out / "A"
    initial = weights_of(lively_model_dir)
    assert differing_tensors(weights_of(run_a / "checkpoint-2"), weights_of(run_a / "final")), "iterations 3-4 changed nothing"
    assert differing_tensors(initial, weights_of(run_a / "checkpoint-2")) or dtype == "bfloat16"
    assert_bitwise_equal(weights_of(run_a / "final"), weights_of(run_b / "final"))
    assert_bitwise_equal(weights_of(run_a / "checkpoint-4"), weights_of(run_b / "checkpoint-4"))
    assert next(iter(weights_of(run_b / "final").values())).dtype == getattr(torch, dtype)

    if dtype == "float32" or master_weights == "none":  # the model file holds the weights exactly
        assert not (run_b / "checkpoint-2" / MASTER_FILE).exists()
        survival = [row.get("es/update_survival") for row in metrics(run_b) if row["iteration"] > 0]
        assert all(0.5 < value < 1.5 for value in survival) if dtype == "bfloat16" else survival == [None] * 4
    else:
        # bfloat16 weights cannot hold the float32 master: the checkpoint stores it beside them
        master = weights_of(run_b / "checkpoint-2", MASTER_FILE)
        assert master and all(t.dtype == torch.float32 for t in master.values())
        assert differing_tensors(master, {k: v.float() for k, v in weights_of(run_b / "checkpoint-2").items() if k in master}), \
            "master equals its bfloat16 rounding: the master file would be pointless here"
        assert_bitwise_equal(weights_of(run_a / "checkpoint-4", MASTER_FILE), weights_of(run_b / "checkpoint-4", MASTER_FILE))

    rows_b = metrics(run_b)
    assert [row["iteration"] for row in rows_b] == [0, 1, 2, 3, 4]  # exactly one row per iteration
    assert 123.0 not in [row.get("reward/mean") for row in rows_b]
    assert rewards(run_a) == rewards(run_b)
    assert metrics(run_a)[-1]["eval/heldout/reward"] == rows_b[-1]["eval/heldout/reward"]

    config = yaml.safe_load((run_b / "config.yaml").read_text())
    assert config["iterations"] == 4                                  # the flag
    assert (config["population_size"], config["sigma"], config["dtype"]) == (4, 0.03, dtype)  # the checkpoint's
    state = json.loads((run_b / "checkpoint-4" / STATE_FILE).read_text())
    assert state["iteration"] == 4 and state["config"]["iterations"] == 4


def test_resume_of_a_finished_run_continues_from_its_final_weights(lively_model_dir, tmp_path, capsys):
    run_in_process(toy_args(lively_model_dir, tmp_path, "r", "--iterations", "1", "--save-every", "0"))
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "r"), "--iterations", "2"]) == 0
    assert f"resumed from {tmp_path / 'r' / 'final'} at iteration 1" in capsys.readouterr().err
    assert [row["iteration"] for row in metrics(tmp_path / "r")] == [0, 1, 2]
    run_in_process(toy_args(lively_model_dir, tmp_path, "straight", "--iterations", "2", "--save-every", "0"))
    assert_bitwise_equal(weights_of(tmp_path / "r" / "final"), weights_of(tmp_path / "straight" / "final"))


# ------------------------------------------------------------------------------ atomicity
def _fake_checkpoint(directory: Path, iteration: int, complete: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights")
    if complete:
        (directory / STATE_FILE).write_text(json.dumps({"iteration": iteration, "config": {}}))
    return directory


def test_resume_point_is_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run / "checkpoint-2", 2)
    _fake_checkpoint(run / "checkpoint-3", 3)
    _fake_checkpoint(run / ".checkpoint-4.k2j3.tmp", 4)            # a save interrupted before its rename
    _fake_checkpoint(run / "checkpoint-6", 6, complete=False)     # no trainer_state.json
    _fake_checkpoint(run / "checkpoint-7-old", 7)                 # not a checkpoint-<N> name
    (run / "checkpoint-8").write_text("a file, not a directory")
    assert find_resume_point(run).checkpoint == run / "checkpoint-3"
    assert list_checkpoints(run) == [run / "checkpoint-2", run / "checkpoint-3"]
    assert find_resume_point(run / "checkpoint-2").checkpoint == run / "checkpoint-2"  # a checkpoint itself
    _fake_checkpoint(run / "checkpoint-10", 10)
    assert find_resume_point(run).checkpoint == run / "checkpoint-10"  # numeric order, not "3" > "10"
    with pytest.raises(ResumeError, match="neither a checkpoint nor a run directory"):
        find_resume_point(run / "checkpoint-6")
    with pytest.raises(ResumeError, match="neither a checkpoint nor a run directory"):
        find_resume_point(tmp_path)


class _Engine:
    """Just enough engine for save_checkpoint; optionally fails half-way through saving."""

    def __init__(self, fail: bool = False, optimizer: dict | None = None):
        self.fail = fail
        self.optimizer = optimizer or {}

    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "model.safetensors").write_bytes(b"new weights")
        if self.fail:
            raise OSError("disk full")

    def master_state(self) -> dict[str, torch.Tensor]:
        return {"w": torch.ones(2)}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.optimizer


def test_save_checkpoint_is_all_or_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_Engine(fail=True), run / "checkpoint-2", {"iteration": 2}, save_master=False)
    assert list(run.iterdir()) == []  # neither checkpoint-2 nor a temporary directory

    old = _fake_checkpoint(run / "checkpoint-4", 4)
    with pytest.raises(OSError):
        save_checkpoint(_Engine(fail=True), old, {"iteration": 4}, save_master=False)
    assert (old / "model.safetensors").read_bytes() == b"weights"  # the previous one is intact
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4"]

    saved = save_checkpoint(_Engine(), old, {"iteration": 4, "x": 1}, save_master=True)
    state = json.loads((old / STATE_FILE).read_text())
    assert saved == old and {k: state[k] for k in ("iteration", "x")} == {"iteration": 4, "x": 1}
    assert sorted(state["files"]) == [MASTER_FILE, "model.safetensors"]  # digests of what was written
    assert (old / "model.safetensors").read_bytes() == b"new weights"
    assert torch.equal(load_file(str(old / MASTER_FILE))["w"], torch.ones(2))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4"]

    adam = {"exp_avg.w": torch.full((2,), 0.5), "exp_avg_sq.w": torch.ones(2), "step.w": torch.tensor(3)}
    save_checkpoint(_Engine(optimizer=adam), old, {"iteration": 4, "config": {}}, save_master=False)  # --optimizer adam
    state = json.loads((old / STATE_FILE).read_text())
    assert sorted(state["files"]) == ["model.safetensors", OPTIMIZER_FILE]  # covered by the digests
    assert all(torch.equal(load_file(str(old / OPTIMIZER_FILE))[k], v) for k, v in adam.items())
    assert not (old / "optimizer.safetensors").exists()  # not beside the weights: vLLM would load it as weights
    assert OPTIMIZER_FILE not in str(verify(old))  # (the fake model file is what it objects to)
    (old / OPTIMIZER_FILE).write_bytes(b"not what was written")
    assert OPTIMIZER_FILE in verify(old) and "digest" in verify(old)  # a damaged state is never resumed from


def test_save_total_limit_prunes_oldest_checkpoints(lively_model_dir, tmp_path):
    run_in_process(toy_args(lively_model_dir, tmp_path, "p", "--iterations", "4", "--save-every", "1", "--save-total-limit", "2"))
    run = tmp_path / "p"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert (run / "final").is_dir()
    # pruning counts complete checkpoints only, and never touches incomplete ones
    _fake_checkpoint(run / "checkpoint-9", 9, complete=False)
    prune_checkpoints(run, 1)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-9"]
    prune_checkpoints(run, None)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-9"]


# ---------------------------------------------------------------------------- Python API
def test_estrainer_python_api(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esft import ESTrainer

    train, evaluation = toy_rows(20), toy_rows(4, start=100)
    answers = {row["prompt"]: row["answer"] for row in train + evaluation}
    calls: list[int] = []

    def answer_length(prompts, completions, answer, **kwargs):
        # TRL calling convention: every non-prompt column arrives as a list aligned with prompts
        assert list(answer) == [answers[p] for p in prompts]
        assert len(completions) == len(prompts) and all(isinstance(c, str) for c in completions)
        calls.append(len(prompts))
        return [float(len(a)) for a in answer]

    # in-process (no sandbox) so that `calls` sees every call; the sandboxed path: tests/test_user_rewards.py
    args = ESConfig(model="unused", population_size=2, batch_size=3, max_tokens=4, iterations=2, eval_batch_size=4,
                    save_every=0, logging="none", progress=False, output_dir=str(tmp_path), run_name="api",
                    reward_sandbox=False)
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=[answer_length], args=args,
                        train_dataset=train, eval_dataset=evaluation)
    last = trainer.train()
    assert last["iteration"] == 2 and trainer.run_dir == tmp_path / "api"
    # 2 iterations x 2 members on batches of 3, plus evaluation before and after on 4 rows
    assert sorted(calls) == [3, 3, 3, 3, 4, 4]
    expected_eval = sum(len(row["answer"]) for row in evaluation) / 4  # answers "200","202","204","206"
    assert last["eval/heldout/reward"] == expected_eval == 3.0
    assert [row["iteration"] for row in metrics(tmp_path / "api")] == [0, 1, 2]

    result = trainer.evaluate()
    assert result["eval/heldout/reward"] == expected_eval
    assert result["eval/heldout/mean_length"] <= 4

    trainer.save_model(tmp_path / "saved")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert tokenizer.decode(tokenizer("2 + 2")["input_ids"]) == "2 + 2"
    assert_bitwise_equal({k: v for k, v in model.state_dict().items() if k in weights_of(tmp_path / "saved")},
                         weights_of(tmp_path / "saved"))
    assert_bitwise_equal(weights_of(tmp_path / "saved"), weights_of(tmp_path / "api" / "final"))


def test_estrainer_accepts_a_datasets_dataset(lively_model_dir, tmp_path):
    import datasets

    from esft import ESTrainer

    def trainer(name, train, evaluation):
        args = ESConfig(population_size=4, batch_size=2, max_tokens=6, iterations=2, sigma=0.03, eval_batch_size=4,
                        save_every=0, logging="none", progress=False, output_dir=str(tmp_path), run_name=name)
        return ESTrainer(model=str(lively_model_dir), reward_funcs=byte_reward, args=args,
                         train_dataset=train, eval_dataset=evaluation)

    from_lists = trainer("lists", toy_rows(20), toy_rows(4, start=100))
    from_lists.train()
    from_dataset = trainer("dataset", datasets.Dataset.from_list(toy_rows(20)),
                           {"heldout": datasets.Dataset.from_list(toy_rows(4, start=100))})
    last = from_dataset.train()
    assert "eval/heldout/reward" in last  # a dict of eval datasets: one split each
    # same rows, same seed: the same run, whatever container held the rows
    assert rewards(tmp_path / "lists") == rewards(tmp_path / "dataset")
    assert_bitwise_equal(weights_of(tmp_path / "lists" / "final"), weights_of(tmp_path / "dataset" / "final"))


def test_rows_without_a_prompt_are_named(tiny_model_dir, tmp_path):
    from esft import ESTrainer

    args = ESConfig(logging="none", progress=False, output_dir=str(tmp_path))
    bad = [{"prompt": "1 + 1 =", "answer": "2"}, {"question": "2 + 2 =", "answer": "4"}]
    with pytest.raises(TaskError, match=r"train_dataset row 1: needs a 'prompt' column.*\['answer', 'question'\]"):
        ESTrainer(model=str(tiny_model_dir), reward_funcs=[byte_reward], args=args, train_dataset=bad)
    with pytest.raises(TaskError, match=r"eval_dataset row 0: needs a 'prompt' column"):
        ESTrainer(model=str(tiny_model_dir), reward_funcs=[byte_reward], args=args,
                  train_dataset=bad[:1], eval_dataset=[{"text": "x"}])
    with pytest.raises(TaskError, match=r"eval_dataset\['hard'\] row 0: needs a 'prompt' column"):
        ESTrainer(model=str(tiny_model_dir), reward_funcs=[byte_reward], args=args,
                  train_dataset=bad[:1], eval_dataset={"hard": [{"prompt": 3}]})
    assert not list(tmp_path.iterdir())  # nothing written
