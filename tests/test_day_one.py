"""Issue 20: users coming from TRL and from the paper's code, on day one: a notebook cell run twice,
the paper's data file (train and eval rows in one file), ES-at-Scale's reward signature and
DatasetDicts, TRL's reward configuration and keyword arguments, `train_dataset=DatasetDict`.

Real tiny models, real sandbox workers, the CLI run in-process or as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import esft
from safetensors.torch import load_file

from esft import ESConfig, ESTrainer
from tiny_model import build_tiny_model, subprocess_env
from toy_task import byte_reward, toy_rows

ROOT = Path(__file__).parents[1]
ESFT_SRC = Path(esft.__file__).parents[1]  # the esft under test, in subprocesses too
ENV = {**subprocess_env(),
       "PYTHONPATH": str(ESFT_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.03 perturbations (updates are never zero)."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def small_args(tmp_path: Path, name: str, **overrides) -> ESConfig:
    settings = dict(population_size=4, batch_size=2, max_tokens=6, iterations=2, sigma=0.03, eval_batch_size=4,
                    save_every=1, logging="none", progress=False, output_dir=str(tmp_path), run_name=name,
                    reward_sandbox=False, reward_timeout=120)  # a worker's first call imports this heavy module
    return ESConfig(**(settings | overrides))


# ------------------------------------------------------------------ 1. a notebook cell run twice
def test_a_second_train_continues_the_run_and_a_finished_run_is_left_alone(lively_model_dir, tmp_path, capsys):
    trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=byte_reward, args=small_args(tmp_path, "nb"),
                        train_dataset=toy_rows(20), eval_dataset={"heldout": toy_rows(4, start=100)})
    run = tmp_path / "nb"
    first = trainer.train()
    assert first["iteration"] == 2
    final_after_first = weights(run / "final")
    checkpoint_2 = (run / "checkpoint-2" / "model.safetensors").read_bytes()

    # the cell run again: nothing trains, nothing is overwritten, the same result comes back
    again = trainer.train()
    assert "already at iteration 2 of 2" in capsys.readouterr().err
    assert again == first
    assert [row["iteration"] for row in metrics(run)] == [0, 1, 2]
    assert (run / "checkpoint-2" / "model.safetensors").read_bytes() == checkpoint_2
    assert same_weights(weights(run / "final"), final_after_first)

    # more iterations: the same lineage goes on, rows 3 and 4 follow row 2
    trainer.args.iterations = 4
    last = trainer.train()
    assert last["iteration"] == 4
    assert [row["iteration"] for row in metrics(run)] == [0, 1, 2, 3, 4]
    assert json.loads((run / "final" / "trainer_state.json").read_text())["iteration"] == 4

    # ... to the very weights of one uninterrupted 4-iteration run
    straight = ESTrainer(model=str(lively_model_dir), reward_funcs=byte_reward,
                         args=small_args(tmp_path, "straight", iterations=4),
                         train_dataset=toy_rows(20), eval_dataset={"heldout": toy_rows(4, start=100)})
    straight.train()
    assert same_weights(weights(run / "final"), weights(tmp_path / "straight" / "final"))
    assert not same_weights(weights(run / "final"), final_after_first)

    # resume_from_checkpoint on a used trainer resumes from what it names
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert "resumed from" in capsys.readouterr().err
    assert [row["iteration"] for row in metrics(run)] == [0, 1, 2, 3, 4]
    assert same_weights(weights(run / "final"), weights(tmp_path / "straight" / "final"))


# ------------------------------------------------- 2. a data file whose rows are train and eval sets
SEEN_PROMPTS: list[str] = []


def recording_reward(prompts, completions, answer, **kwargs):
    """byte_reward, remembering every prompt it scored (in-process: --no-reward-sandbox)."""
    SEEN_PROMPTS.extend(prompts)
    return byte_reward(prompts, completions, answer)


def cli_train(model: Path, tmp_path: Path, name: str, *extra: str) -> int:
    from esft.cli import main

    return main(["train", "--preset", "none", "--model", str(model), "--population-size", "2", "--batch-size", "2",
                 "--max-tokens", "4", "--iterations", "1", "--eval-batch-size", "8", "--logging", "none",
                 "--no-progress", "--output-dir", str(tmp_path), "--run-name", name, "--no-reward-sandbox", *extra])


@pytest.fixture
def countdown_like_file(tmp_path) -> Path:
    """The paper's countdown.json layout in small: rows 0-7 are the training set, rows 8-11 the eval set."""
    path = tmp_path / "countdown.json"
    path.write_text(json.dumps([{"id": i, "prompt": f"Q{i}: {i} + {i} =", "answer": str(2 * i)} for i in range(12)]))
    return path


def test_train_eval_overlap_is_said_recorded_and_row_slices_split_one_file(countdown_like_file, tiny_model_dir, tmp_path,
                                                                            capsys):
    data = str(countdown_like_file)
    reward = "test_day_one:recording_reward"
    assert cli_train(tiny_model_dir, tmp_path, "all", "--train-data", data, "--eval-data", data, "--reward-funcs", reward) == 0
    err = capsys.readouterr().err
    assert "eval rows whose prompt is also a training prompt: countdown 12 of 12" in err and "--train-rows" in err
    state = json.loads((tmp_path / "all" / "final" / "trainer_state.json").read_text())
    assert state["train_eval_overlap"] == {"countdown": 12}

    SEEN_PROMPTS.clear()
    assert cli_train(tiny_model_dir, tmp_path, "split", "--train-data", data, "--eval-data", data, "--reward-funcs", reward,
                     "--train-rows", "0:8", "--eval-rows", "8:", "--eval-size", "3") == 0
    assert "countdown 0 of 3" in capsys.readouterr().err
    evaluated = [json.loads(line)["prompt"] for line in
                 (tmp_path / "split" / "eval" / "iteration-0" / "countdown.jsonl").read_text().splitlines()]
    assert evaluated == ["Q8: 8 + 8 =", "Q9: 9 + 9 =", "Q10: 10 + 10 ="]  # rows 8:, the first 3 (--eval-size)
    trained = set(SEEN_PROMPTS) - set(evaluated)
    assert trained and trained <= {f"Q{i}: {i} + {i} =" for i in range(8)}
    state = json.loads((tmp_path / "split" / "final" / "trainer_state.json").read_text())
    assert state["train_eval_overlap"] == {"countdown": 0}

    # a slice that selects nothing, or is not a slice: one line, exit 2
    assert cli_train(tiny_model_dir, tmp_path, "bad", "--train-data", data, "--reward-funcs", reward, "--train-rows", "50:60") == 2
    assert "--train-rows '50:60' selects no row" in capsys.readouterr().err
    assert cli_train(tiny_model_dir, tmp_path, "bad2", "--train-data", data, "--reward-funcs", reward, "--train-rows", "0-200") == 2
    assert "--train-rows: expected START:STOP" in capsys.readouterr().err


# ------------------------------------ 3. ES-at-Scale's rewards and DatasetDicts, through the CLI and the API
THEIR_REWARD = '''
def reward_function(model_output: str, target: str, fast=False):
    """ES-at-Scale's signature: (label, reward) for one completion and its target."""
    assert isinstance(model_output, str) and isinstance(target, str)
    return ("long_target" if len(target) > 1 else "short_target"), len(target) / 10
'''


@pytest.fixture
def their_data(tmp_path) -> tuple[Path, Path, Path]:
    """Their layout: save_to_disk DatasetDicts with a context column and no prompt; their reward file."""
    import datasets

    def rows(ids):
        return [{"id": str(i), "context": f"Using the numbers [{i} {i}], make {2 * i}.", "numbers": f"[{i}, {i}]",
                 "target": str(2 * i), "solution": f"({i} + {i})"} for i in ids]

    train, evaluation = tmp_path / "train" / "countdown", tmp_path / "evaluation_suite" / "countdown"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(range(8)))}).save_to_disk(str(train))
    datasets.DatasetDict({"countdown_eval": datasets.Dataset.from_list(rows(range(3, 7)))}).save_to_disk(str(evaluation))
    reward_file = tmp_path / "their_rewards.py"
    reward_file.write_text(THEIR_REWARD)
    return train, evaluation, reward_file


def test_es_at_scale_rewards_and_datasetdicts_work_as_they_are(their_data, tiny_model_dir, tmp_path):
    train, evaluation, reward_file = their_data
    proc = subprocess.run(
        [sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data", str(train),
         "--eval-data", str(evaluation), "--prompt-column", "context", "--reward-funcs", f"{reward_file}:reward_function",
         "--target-column", "target", "--population-size", "2", "--batch-size", "3", "--max-tokens", "4",
         "--iterations", "1", "--logging", "none", "--no-progress", "--output-dir", str(tmp_path / "runs"),
         "--run-name", "theirs"], env=ENV, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = metrics(tmp_path / "runs" / "theirs")
    targets = [str(2 * i) for i in range(3, 7)]  # 6, 8, 10, 12: the reward is len(target) / 10
    assert rows[0]["eval/countdown_eval/reward"] == pytest.approx(sum(len(t) for t in targets) / 40)
    assert rows[0]["eval/countdown_eval/rewards/reward_function/labels/long_target"] == 2
    assert rows[0]["eval/countdown_eval/rewards/reward_function/labels/short_target"] == 2
    counted = sum(value for key, value in rows[1].items() if key.startswith("rewards/reward_function/labels/"))
    assert counted == 2 * 3  # every sample of the iteration (2 members x 3 prompts) counted under its label
    sample = json.loads((tmp_path / "runs" / "theirs" / "eval" / "iteration-0" / "countdown_eval.jsonl")
                        .read_text().splitlines()[0])
    assert sample["prompt"] == "Using the numbers [3 3], make 6." and sample["labels"] == {"reward_function": "short_target"}

    # the API: the same function, their DatasetDicts as load_from_disk returns them
    import datasets

    from esft.rewards.usercode import load_callable

    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=load_callable(f"{reward_file}:reward_function", "test"),
                        args=small_args(tmp_path, "api", iterations=1, prompt_column="context", target_column="target",
                                        reward_sandbox=True),
                        train_dataset=datasets.load_from_disk(str(train)),
                        eval_dataset=datasets.load_from_disk(str(evaluation)))
    assert len(trainer.task.train_dataset) == 8
    assert trainer.evaluate()["eval/countdown_eval/reward"] == pytest.approx(sum(len(t) for t in targets) / 40)
    trainer.close()


def test_a_datasetdict_as_train_dataset_takes_its_train_split_or_names_the_splits(tiny_model_dir, tmp_path):
    import datasets

    from esft.tasks import TaskError

    data = datasets.DatasetDict({"train": datasets.Dataset.from_list(toy_rows(6)),
                                 "test": datasets.Dataset.from_list(toy_rows(2, start=50), split="test")})  # as load_dataset
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=byte_reward, args=small_args(tmp_path, "dd"),
                        train_dataset=data, eval_dataset=data["test"])
    assert [row["prompt"] for row in trainer.task.train_dataset] == [row["prompt"] for row in toy_rows(6)]
    assert list(trainer.task.eval_datasets) == ["test"]  # one eval dataset: eval/test/..., its own split name
    trainer.close()
    with pytest.raises(TaskError, match=r"splits a, b and none is named 'train'"):
        ESTrainer(model=str(tiny_model_dir), reward_funcs=byte_reward, args=small_args(tmp_path, "dd2"),
                  train_dataset=datasets.DatasetDict({"a": data["train"], "b": data["test"]}))


# ---------------------------------------- 4. TRL's reward configuration and keyword arguments
def judge(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A TRL-style reward that reads trainer_state and logs a metric and a column."""
    log_metric("judge/global_step", trainer_state.global_step)
    log_metric("judge/max_steps", trainer_state.max_steps)
    log_extra("judge_note", [f"len {len(c)}" for c in completions])
    return [1.0] * len(completions)


def constant_two(prompts, completions, **kwargs):
    return [2.0] * len(completions)


def test_trl_reward_weights_list_and_trainer_state_log_metric_log_extra(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = small_args(tmp_path, "trl", iterations=2, reward_weights=[1.0, 0.5], reward_sandbox=True, logging="tensorboard")
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=[judge, constant_two], args=args,
                        train_dataset=toy_rows(6), eval_dataset={"heldout": toy_rows(2, start=50)})
    trainer.train()
    rows = metrics(tmp_path / "trl")
    assert [row["reward/mean"] for row in rows[1:]] == [2.0, 2.0]  # 1.0 x 1 + 2.0 x 0.5
    assert [row["judge/global_step"] for row in rows[1:]] == [0, 1]  # updates done when the iteration scored
    assert rows[1]["judge/max_steps"] == 2
    assert rows[0]["eval/heldout/judge/global_step"] == 0 and rows[2]["eval/heldout/judge/global_step"] == 2
    sample = json.loads((tmp_path / "trl" / "eval" / "iteration-2" / "heldout.jsonl").read_text().splitlines()[0])
    assert sample["judge_note"] == f"len {len(sample['completion'])}"
    events = EventAccumulator(str(tmp_path / "trl"))
    events.Reload()
    assert [event.value for event in events.Scalars("judge/global_step")] == [0, 1]

    # the string form with functions given to ESTrainer, and a count that does not match: one clear error
    from esft.tasks import TaskError

    with pytest.raises(TaskError, match="reward_weights has 3 values for 2 reward functions"):
        ESTrainer(model=str(tiny_model_dir), reward_funcs=[judge, constant_two], train_dataset=toy_rows(6),
                  args=small_args(tmp_path, "trl2", reward_weights="1,0.5,2"))


# ------------------------------------------------ 5. async rewards and verl's compute_score
async def async_judge(prompts, completions, answer, **kwargs):
    """An LLM-judge-like reward: awaits (here a sleep instead of an HTTP call)."""
    import asyncio

    await asyncio.sleep(0.01)
    return [float(len(c) + len(a)) for c, a in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature; a dict result gives its "score"."""
    assert data_source == "toy" and extra_info == {"index": int(ground_truth)}
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}


def test_async_rewards_and_verl_compute_score_score_in_the_sandbox():
    from esft.rewards.runner import RewardRunner

    rows = [{"prompt": f"p{i}", "answer": str(i), "data_source": "toy", "reward_model": {"ground_truth": str(i)},
             "extra_info": {"index": i}} for i in range(3)]
    runner = RewardRunner([async_judge, compute_score], timeout=120, workers=2, target_column="reward_model")
    try:
        scores = runner.score(rows, ["0", " 7", "22"])
        assert scores.failures == 0, scores.first_failure
        assert scores.per_function["async_judge"] == [2.0, 3.0, 3.0]
        assert scores.per_function["compute_score"] == [1.0, 0.0, 0.0]
    finally:
        runner.close()


# ------------------------------------------------------------------------------- 7. smaller things
def test_finished_run_resumed_adds_no_row_and_accuracy_after_is_its_own_line(tiny_model_dir, tmp_path):
    """`esft train` with stderr going to a file (a job log), then --resume of the finished run."""
    argv = [sys.executable, str(ROOT / "tests" / "toy_task.py"), "train", "--preset", "none", "--task", "toy", "--model",
            str(tiny_model_dir),
            "--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--iterations", "2",
            "--logging", "none", "--output-dir", str(tmp_path), "--run-name", "log"]
    with open(tmp_path / "stderr.txt", "w") as log:
        proc = subprocess.run(argv, env=ENV, stdout=subprocess.PIPE, stderr=log, text=True, timeout=240)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, err
    assert any(line.startswith("heldout accuracy after: ") for line in err.splitlines()), err
    assert [row["iteration"] for row in metrics(tmp_path / "log")] == [0, 1, 2]

    resumed = subprocess.run([*argv[:2], "train", "--resume", str(tmp_path / "log"), "--no-progress"], env=ENV,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "already at iteration 2 of 2" in resumed.stderr
    assert [row["iteration"] for row in metrics(tmp_path / "log")] == [0, 1, 2]
    assert "heldout accuracy: " in resumed.stdout  # the summary still reports the run's final numbers


def test_trainer_model_and_processing_class_as_in_trl(tiny_model_dir, tmp_path):
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=byte_reward, args=small_args(tmp_path, "attrs"),
                        train_dataset=toy_rows(4))
    assert trainer.model is trainer.engine.model and trainer.model.config.num_hidden_layers == 2
    assert trainer.processing_class is trainer.engine.tokenizer
    assert list(trainer.evaluate()) == []  # no eval data
    with_eval = ESTrainer(model=str(tiny_model_dir), reward_funcs=byte_reward, args=small_args(tmp_path, "attrs2"),
                          train_dataset=toy_rows(4), eval_dataset=toy_rows(2, start=9))
    assert "eval/heldout/reward" in with_eval.evaluate()  # a single eval_dataset: not eval/eval/...
    with_eval.close()
    assert trainer.processing_class.decode(trainer.processing_class("2 + 2")["input_ids"]) == "2 + 2"
    trainer.close()


def test_trl_names_get_the_esft_flag_in_python_yaml_and_the_cli(tmp_path, capsys):
    from esft.cli import main
    from esft.settings.config import ConfigError

    with pytest.raises(TypeError, match=r"max-completion-length.*TRL's name; did you mean --max-tokens"):
        ESConfig(max_completion_length=128)
    with pytest.raises(ConfigError, match=r"report-to.*did you mean --logging"):
        ESConfig(report_to="none")
    with pytest.raises(ConfigError, match=r"learning-rate: is a GRPO setting.*in an ES run, did you mean --alpha"):
        ESConfig(learning_rate=1e-5)
    with pytest.raises(ConfigError, match=r"per-device-train-batch-size.*did you mean --batch-size"):
        ESConfig(per_device_train_batch_size=4)

    with pytest.raises(SystemExit) as exited:  # argparse exits
        main(["train", "--max-completion-length", "128"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean --max-tokens" in err[0]
    (tmp_path / "run.yaml").write_text("report_to: none\nmax_steps: 3\n")
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report-to is TRL's name; did you mean --logging" in err[0]


def test_an_evaluation_shows_progress_and_the_same_numbers(lively_model_dir, tmp_path, capsys):
    def evaluate(progress: bool) -> dict:
        trainer = ESTrainer(model=str(lively_model_dir), reward_funcs=byte_reward,
                            args=small_args(tmp_path, f"p{progress}", progress=progress, eval_batch_size=2),
                            train_dataset=toy_rows(4), eval_dataset={"a": toy_rows(5, start=20), "b": toy_rows(2)})
        try:
            return trainer.evaluate()
        finally:
            trainer.close()

    quiet = evaluate(False)
    assert "7/7" not in capsys.readouterr().err
    shown = evaluate(True)
    err = capsys.readouterr().err
    assert "eval:" in err and "/7 [" in err and "split=b" in err  # one bar over both splits' 7 prompts
    assert shown == quiet


# -------------------------------------------- the README's commands for the paper's and ES-at-Scale's data
THEIR_MATH_REWARD = '''
def reward_function(model_output, target, fast=False):
    return ("correct", 1.0) if target in model_output else ("wrong", 0.0)
'''


@pytest.mark.slow
def test_readme_commands_for_their_data_run_as_written(tiny_model_dir, tmp_path):
    """Their layout rebuilt in small (es-at-scale/datasets/..., countdown.json, their reward files), then
    each README command run as written, with a tiny model and a short run appended (later flags win)."""
    import re
    import shlex

    import datasets

    def countdown_rows(ids):
        return [{"id": str(i), "context": f"Using the numbers [{i} {i}], make {2 * i}.", "numbers": f"[{i}, {i}]",
                 "target": str(2 * i), "solution": f"({i} + {i})"} for i in ids]

    base = tmp_path / "es-at-scale" / "datasets"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(countdown_rows(range(6)))}).save_to_disk(
        str(base / "train" / "countdown"))
    datasets.DatasetDict({"countdown_eval": datasets.Dataset.from_list(countdown_rows(range(6, 9)))}).save_to_disk(
        str(base / "evaluation_suite" / "countdown"))
    math_rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(math_rows)}).save_to_disk(str(base / "train" / "math_lvl3to5_8k"))
    datasets.DatasetDict({"aime": datasets.Dataset.from_list(math_rows[:2]), "math500": datasets.Dataset.from_list(
        math_rows[2:5])}).save_to_disk(str(base / "evaluation_suite" / "math"))
    (tmp_path / "countdown.json").write_text(json.dumps(countdown_rows(range(204))))  # rows 200: are its eval set
    (tmp_path / "their_reward.py").write_text(THEIR_REWARD)
    (tmp_path / "their_math_reward.py").write_text(THEIR_MATH_REWARD)

    readme = (ROOT / "docs" / "tasks-and-rewards.md").read_text()
    section = readme.split("## Coming from the paper's scripts or ES-at-Scale")[1].split("\n## ")[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("esft train")]
    assert len(commands) == 3
    assert [command.count("--preset") for command in commands] == [1, 1, 0]  # the paper's settings on their models
    for index, command in enumerate(commands):
        command = [word.replace("path/to/", "") for word in command]
        proc = subprocess.run(
            [sys.executable, "-m", "esft.cli", *command[1:], "--model", str(tiny_model_dir), "--dtype", "float32",
             "--device", "cpu", "--population-size", "2", "--batch-size", "2", "--iterations", "1", "--max-tokens", "4",
             # the third names no model (the embedded one's demo preset); on the tiny one it would get the model
             # preset, whose --sigma auto finds no signal in a random model: the paper's defaults, as the others
             *([] if "--preset" in command else ["--preset", "none"]),
             "--logging", "none", "--no-progress", "--output-dir", str(tmp_path / "runs"), "--run-name", f"r{index}"],
            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
        rows = metrics(tmp_path / "runs" / f"r{index}")
        assert [row["iteration"] for row in rows] == [0, 1]
        assert rows[1]["reward/errors"] == 0
    countdown, math, paper = (metrics(tmp_path / "runs" / f"r{i}")[0] for i in range(3))
    assert countdown["eval/countdown_eval/reward"] == pytest.approx(0.2)  # targets 12, 14, 16: len / 10
    assert {"eval/aime/reward", "eval/math500/reward"} <= set(math)
    assert paper["eval/countdown/reward"] == pytest.approx(0.3)  # rows 200-203 only: targets 400-406


JUDGES_STARTED: set[str] = set()


async def _judge_waiting_for_the_other(name: str, value: float, completions) -> list[float]:
    """A judge (an HTTP call) that answers only once the other judge's call has started too: awaited one
    after the other, the first never sees the second and gives up after 10 s (its samples then fail).
    No wall-clock bound, so a loaded machine cannot fail it."""
    import asyncio

    JUDGES_STARTED.add(name)
    for _ in range(500):
        if JUDGES_STARTED == {"a", "b"}:
            return [value] * len(completions)
        await asyncio.sleep(0.02)
    raise TimeoutError(f"judge {name}: the other judge never started while this one waited")


async def slow_judge_a(prompts, completions, **kwargs):
    return await _judge_waiting_for_the_other("a", 1.0, completions)


async def slow_judge_b(prompts, completions, **kwargs):
    return await _judge_waiting_for_the_other("b", 2.0, completions)


def test_async_rewards_in_process_run_concurrently():
    from esft.rewards.runner import RewardRunner

    JUDGES_STARTED.clear()
    runner = RewardRunner([slow_judge_a, slow_judge_b], sandbox=False)
    scores = runner.score([{"prompt": "p"}, {"prompt": "q"}], ["a", "b"])
    assert scores.total == [3.0, 3.0] and scores.failures == 0
