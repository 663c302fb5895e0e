"""`--algorithm grpo`: TRL's GRPOTrainer behind esft's run directory, metrics, evaluation, reward
sandbox and checkpoints, and the training budgets of both algorithms. Real TRL, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tiny_model import subprocess_env
from esft.settings.config import ConfigError, ESConfig
from test_cli import assert_user_error, esft, esft_process, read_jsonl, safetensors_of

pytest.importorskip("trl")

TASK = str(Path(__file__).parents[1] / "examples" / "byo_task" / "rewards.py") + ":make_task"
"""README's own task: exact answers plus a brevity reward, which varies between any two completions
(GRPO's advantages are zero when every completion of a group scores alike, as Countdown's on a random model)."""
SMALL = ["--task", TASK, "--max-tokens", "4", "--eval-batch-size", "4", "--no-progress", "--logging", "none"]
ES = ["--population-size", "2", "--batch-size", "2"]  # 4 completions per iteration
GRPO = ["--algorithm", "grpo", "--num-generations", "2", "--per-device-train-batch-size", "4",
        "--no-gradient-checkpointing", "--learning-rate", "1e-3"]  # 4 completions per optimizer step
ENV = subprocess_env()


def tree(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name != ".esft.lock"}


# --------------------------------------------------------------- one run of each, stopped by their budget
@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """ES and GRPO on the same tiny model and Countdown, --iterations 5 but --budget-completions 8:
    both stop after 2 iterations (4 completions each)."""
    out = tmp_path_factory.mktemp("grpo-vs-es")
    done = {}
    for name, flags in (("es", ES), ("grpo", GRPO)):
        proc, _ = esft_process("train", "--model", str(tiny_model_dir), *SMALL, *flags, "--iterations", "5", "--save-every", "2",
                       "--budget-completions", "8", "--output-dir", str(out), "--run-name", name, cwd=out, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done[name] = (proc, out / name)
    return done


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_the_completion_budget_stops_training_with_a_final_evaluation(runs, algorithm):
    proc, run = runs[algorithm]
    assert ("esft: the budget of 8 completions is spent (8 generated for training) at iteration 2 of 5: stopping "
            "(the final evaluation and final/ follow)") in proc.stderr
    rows = read_jsonl(run / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert [row["budget/completions"] for row in rows[1:]] == [4, 8]
    assert rows[2]["budget/tokens"] == pytest.approx(4 * (rows[1]["completions/mean_length"] + rows[2]["completions/mean_length"]))
    assert rows[2]["budget/seconds"] == pytest.approx(rows[1]["perf/iteration_s"] + rows[2]["perf/iteration_s"])
    assert "eval/easy/accuracy" in rows[2] and "eval/easy/accuracy" not in rows[1]
    assert json.loads((run / "final" / "trainer_state.json").read_text())["iteration"] == 2


def test_a_grpo_run_writes_what_an_es_run_writes(runs, tiny_model_dir):
    es_run, grpo_run = runs["es"][1], runs["grpo"][1]
    es_files, grpo_files = tree(es_run), tree(grpo_run)
    assert es_files <= grpo_files, es_files - grpo_files
    assert {"metrics.jsonl", "config.yaml", "report.html", "eval/iteration-0/easy.jsonl", "eval/iteration-2/easy.jsonl",
            "checkpoint-2/model.safetensors", "final/model.safetensors", "final/trainer_state.json"} <= es_files
    # what GRPO adds is TRL's own checkpoint, inside esft's
    assert {Path(name).parts[1] for name in grpo_files - es_files} == {"trl"}
    assert {"checkpoint-2/trl/optimizer.pt", "checkpoint-2/trl/model.safetensors"} <= grpo_files
    for es_row, grpo_row in zip(read_jsonl(es_run / "metrics.jsonl"), read_jsonl(grpo_run / "metrics.jsonl"), strict=True):
        es_shared = {key for key in es_row if not key.startswith("es/")}  # es/sigma, es/alpha: ES's own step sizes
        assert es_shared <= set(grpo_row) and all(key.startswith("grpo/") for key in set(grpo_row) - es_shared)
    assert {"grpo/loss", "grpo/learning_rate", "rewards/brevity/mean"} <= set(read_jsonl(grpo_run / "metrics.jsonl")[1])
    samples = read_jsonl(grpo_run / "eval" / "iteration-2" / "easy.jsonl")
    assert len(samples) == 3 and set(read_jsonl(es_run / "eval" / "iteration-2" / "easy.jsonl")[0]) == set(samples[0])
    assert yaml.safe_load((grpo_run / "config.yaml").read_text())["algorithm"] == "grpo"


def test_every_key_both_algorithms_write_is_in_the_metrics_reference(runs):
    """docs' metrics reference (esft.runs.metric_keys) documents every key of both runs' metrics.jsonl."""
    from esft.runs.metric_keys import entry_for

    for name in ("es", "grpo"):
        keys = {key for row in read_jsonl(runs[name][1] / "metrics.jsonl") for key in row}
        assert {"reward/std", "budget/completions"} <= keys
        assert sorted(key for key in keys if entry_for(key) is None) == [], name


def test_grpo_checkpoints_hold_esft_state_and_trl_state_apart(runs, tiny_model_dir):
    run = runs["grpo"][1]
    esft_state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    trl_state = json.loads((run / "checkpoint-2" / "trl" / "trainer_state.json").read_text())
    assert esft_state["iteration"] == 2 and esft_state["config"]["algorithm"] == "grpo"
    assert trl_state["global_step"] == 2 and "iteration" not in trl_state
    assert "trl/trainer_state.json" in esft_state["files"]  # TRL's state is digest-checked like every other file
    # one copy of the weights on disk: the model beside trl/ is the same file
    assert os.path.samefile(run / "final" / "model.safetensors", run / "final" / "trl" / "model.safetensors")
    trained = AutoModelForCausalLM.from_pretrained(run / "final")
    before = safetensors_of(tiny_model_dir)
    changed = [name for name, tensor in trained.state_dict().items() if name in before and not torch.equal(tensor, before[name])]
    assert changed, "GRPO changed no weight"


def test_esft_eval_of_a_grpo_model_reproduces_the_runs_final_evaluation(runs, tmp_path):
    run = runs["grpo"][1]
    proc, _ = esft("eval", "--model", str(run / "final"), "--output-dir", str(tmp_path), "--run-name", "eval", "--logging",
                   "none", "--trust-run-code", cwd=tmp_path)  # the run's --task is module:function code (README Security)
    assert proc.returncode == 0, proc.stderr[-2000:]
    final = read_jsonl(run / "metrics.jsonl")[-1]
    evaluated = read_jsonl(tmp_path / "eval" / "metrics.jsonl")[0]
    assert {k: v for k, v in evaluated.items() if k.startswith("eval/")} == {k: v for k, v in final.items() if k.startswith("eval/")}
    assert read_jsonl(tmp_path / "eval" / "eval" / "iteration-0" / "easy.jsonl") == read_jsonl(run / "eval" / "iteration-2" / "easy.jsonl")


def test_trl_tokenizes_prompts_as_esft_does(tmp_path, one_torch_thread):
    """A tokenizer that adds a BOS would give TRL's GRPOTrainer other prompt tokens than ES and the
    evaluation see (a rendered chat prompt already holds its BOS): esft's trainer adds none."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from esft import GRPOBaseline
    from esft.grpo.trl_trainer import build_trl_trainer
    from tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", tokenizer.pad_token_id)])
    tokenizer.save_pretrained(model_dir)
    assert len(tokenizer("ab").input_ids) == 3  # the tokenizer itself adds one
    config = ESConfig(algorithm="grpo", iterations=1, num_generations=2, per_device_train_batch_size=2, logging="none",
                      output_dir=str(tmp_path / "runs"), reward_sandbox=False)
    rows = [{"prompt": "ab"}, {"prompt": "a"}]
    trainer = GRPOBaseline(model=str(model_dir), reward_funcs=[lambda prompts, completions, **kw: [1.0] * len(completions)],
                           args=config, train_dataset=rows)
    trl_trainer = build_trl_trainer(trainer, tmp_path / "staging", trainer._reward_for_trl)
    engine_ids = trainer.engine.tokenizer(["ab", "a"], add_special_tokens=False).input_ids
    assert trl_trainer._tokenize_prompts(["ab", "a"])[0] == engine_ids == [[66, 67], [66]]


# ------------------------------------------------------------------------------------------ user errors
def test_grpo_without_trl_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    main = ("import sys; sys.modules['trl'] = None  # TRL not installed: importing it fails\n"
            "from esft.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", main, "train", "--algorithm", "grpo", "--model", str(tiny_model_dir), *SMALL,
                           "--output-dir", str(tmp_path / "runs")], env=ENV, capture_output=True, text=True, timeout=120)
    assert_user_error(proc, "--algorithm: grpo runs TRL's GRPOTrainer, and TRL is not installed", "pip install 'esft[grpo]'")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing claimed


@pytest.mark.parametrize("settings, flag, words", [
    ({"algorithm": "grpo", "batch_size": 4}, "batch_size", "--per-device-train-batch-size"),
    ({"algorithm": "grpo", "noise": "lowrank"}, "noise", "is an ES setting"),
    ({"learning_rate": 1e-5}, "learning_rate", "add --algorithm grpo"),
    ({"algorithm": "grpo", "num_generations": 3}, "per_device_train_batch_size", "not a multiple of --num-generations 3"),
    ({"algorithm": "grpo", "loss_type": "ppo"}, "loss_type", "dapo"),
    ({"algorithm": "grpo", "dtype": "float16"}, "dtype", "float32 or bfloat16"),
    ({"budget_tokens": 0}, "budget_tokens", ">= 1"),
])
def test_settings_of_the_other_algorithm_are_refused(settings, flag, words):
    with pytest.raises(ConfigError) as error:
        ESConfig(**settings)
    assert error.value.name == flag and words in str(error.value)


def test_the_demo_preset_is_es_only_and_resume_keeps_the_algorithm(runs, tmp_path):
    from esft.cli import UserError, resolve_config

    config, preset, _ = resolve_config("train", {"algorithm": "grpo"})
    assert preset == (None, {}) and config.noise == "iid" and config.population_batching == "auto"
    with pytest.raises(UserError, match="was trained with --algorithm grpo"):
        resolve_config("train", {"resume": str(runs["grpo"][1]), "algorithm": "es"})
    assert resolve_config("train", {"resume": str(runs["grpo"][1]), "trust_run_code": True})[0].algorithm == "grpo"


# ------------------------------------------------- slow: a reward written in the user's script, resuming
SCRIPT = """
import os, sys
from esft import ESConfig, ESTrainer, GRPOBaseline

def script_reward(prompts, completions, answer, **kwargs):  # defined in __main__: reaches the sandbox by value
    with open(PIDS, "a") as handle:
        handle.write(f"{os.getpid()}\\n")
    return [1.0 if c.strip().startswith(a) else len(c) / 100 for c, a in zip(completions, answer)]

rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(8)]
for algorithm, trainer, settings in (("es", ESTrainer, dict(population_size=2, batch_size=2)),
                                     ("grpo", GRPOBaseline, dict(algorithm="grpo", num_generations=2,
                                                                 per_device_train_batch_size=4, gradient_checkpointing=False))):
    config = ESConfig(iterations=2, max_tokens=4, output_dir=OUT, run_name=algorithm, logging="none", progress=False,
                      save_every=0, reward_timeout=30, **settings)
    result = trainer(model=MODEL, reward_funcs=[script_reward], args=config, train_dataset=rows, eval_dataset=rows[:2]).train()
    print(algorithm, "FAILURES", result.get("reward/failures_total", 0), "PID", os.getpid())
"""


@pytest.mark.slow
def test_a_reward_defined_in_the_users_script_works_under_both_algorithms(tmp_path, tiny_model_dir):
    """A user's script that defines its reward and trains with ES, then GRPO (slow: a subprocess that trains twice;
    the reward must run in sandbox workers, not in the script)."""
    header = f"PIDS, OUT, MODEL = {str(tmp_path / 'pids')!r}, {str(tmp_path / 'out')!r}, {str(tiny_model_dir)!r}\n"
    (tmp_path / "train.py").write_text(header + textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script_pid = proc.stdout.split("PID ")[1].split()[0]
    assert "es FAILURES 0" in proc.stdout and "grpo FAILURES 0" in proc.stdout
    pids = set((tmp_path / "pids").read_text().split())
    assert pids and script_pid not in pids  # it ran in sandbox worker processes, not in the script
    for algorithm in ("es", "grpo"):
        rows = read_jsonl(tmp_path / "out" / algorithm / "metrics.jsonl")
        assert [row["iteration"] for row in rows] == [0, 1, 2]
        assert all(row["rewards/script_reward/mean"] > 0 and row["reward/errors"] == 0 for row in rows[1:])
        assert rows[0]["eval/heldout/reward"] > 0


@pytest.mark.slow
def test_a_grpo_run_resumed_from_its_checkpoint_ends_with_the_same_weights(tiny_model_dir, tmp_path):
    """GRPO stopped by a token budget and resumed ends with the uninterrupted run's weights (slow: three TRL runs)."""
    base = ["train", "--model", str(tiny_model_dir), *SMALL, *GRPO, "--iterations", "4", "--save-every", "2",
            "--output-dir", str(tmp_path)]
    whole, _ = esft(*base, "--run-name", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    # the same run stopped by a token budget after step 2, then resumed without one
    cut, _ = esft(*base, "--run-name", "cut", "--budget-tokens", "20", cwd=tmp_path)
    assert cut.returncode == 0 and "at iteration 2 of 4: stopping" in cut.stderr, cut.stderr[-2000:]
    resumed, _ = esft("train", "--resume", str(tmp_path / "cut"), "--budget-tokens", "1000000", "--trust-run-code",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {tmp_path / 'cut' / 'checkpoint-2'} at iteration 2" in resumed.stderr
    whole_weights, resumed_weights = safetensors_of(tmp_path / "whole" / "final"), safetensors_of(tmp_path / "cut" / "final")
    assert all(torch.equal(whole_weights[name], resumed_weights[name]) for name in whole_weights)
    training = lambda rows: [{k: v for k, v in row.items() if not k.startswith(("perf/", "budget/seconds", "eval/"))}  # noqa: E731
                             for row in rows]
    assert training(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == training(read_jsonl(tmp_path / "whole" / "metrics.jsonl"))


@pytest.mark.slow
def test_a_grpo_reward_that_breaks_mid_run_stops_with_a_checkpoint_to_resume(tiny_model_dir, tmp_path):
    """A reward that raises in GRPO step 2 stops the run with a checkpoint, and the resume finishes it (slow: two
    TRL runs)."""
    (tmp_path / "rewards.py").write_text(textwrap.dedent("""
        from pathlib import Path
        def flaky(prompts, completions, **kwargs):
            calls = Path("calls"); n = int(calls.read_text()) + 1 if calls.exists() else 1
            calls.write_text(str(n))
            if n >= 2 and not Path("fixed").exists():  # call n scores step n (there is no eval split)
                raise ConnectionError("the scoring service is down")
            return [len(c) / 10 for c in completions]
    """))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + {i} ="}) + "\n" for i in range(6)))
    flags = ["--model", str(tiny_model_dir), "--train-data", str(data), "--reward-funcs", "rewards.py:flaky", *GRPO,
             "--iterations", "3", "--max-tokens", "4", "--logging", "none", "--no-progress", "--output-dir", "runs"]
    broken, _ = esft("train", *flags, "--run-name", "r", cwd=tmp_path)
    run = tmp_path / "runs" / "r"
    assert broken.returncode == 2, broken.stderr[-2000:]
    error = next(line for line in broken.stderr.splitlines() if line.startswith("esft: error:"))
    assert error.startswith("esft: error: reward function flaky raised an exception on every sample of iteration 2 "
                            "(ConnectionError: the scoring service is down (at rewards.py:")
    assert error.endswith("the weights from before it are in runs/r/checkpoint-1; fix it and --resume runs/r")
    assert json.loads((run / "checkpoint-1" / "trl" / "trainer_state.json").read_text())["global_step"] == 1
    assert [row["iteration"] for row in read_jsonl(run / "metrics.jsonl")] == [0, 1]
    (tmp_path / "fixed").touch()
    resumed, _ = esft("train", "--resume", "runs/r", "--reward-funcs", "rewards.py:flaky", "--train-data", str(data),
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [row["iteration"] for row in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_an_es_run_stopped_by_its_token_budget_resumes_only_with_a_larger_one(tiny_model_dir, tmp_path):
    """A token budget stops ES; resumed with the same budget nothing trains, with a larger one it goes on (slow:
    three runs)."""
    base = ["--model", str(tiny_model_dir), *SMALL, *ES, "--iterations", "4", "--save-every", "1", "--sigma", "0.05"]
    first, _ = esft("train", *base, "--budget-tokens", "20", "--output-dir", str(tmp_path), "--run-name", "r", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    stop = rows[-1]["iteration"]
    assert 0 < stop < 4 and rows[-1]["budget/tokens"] >= 20 > rows[-2].get("budget/tokens", 0)
    assert f"esft: the budget of 20 tokens is spent ({rows[-1]['budget/tokens']} generated for training) at iteration {stop} of 4" in first.stderr
    # resumed with the same budget: nothing more to train, the final evaluation again
    again, _ = esft("train", "--resume", str(tmp_path / "r"), "--no-progress", "--task", TASK, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    # (issue 20: a finished run resumed adds no second row for its last iteration; its evaluation is in that row)
    assert [row["iteration"] for row in rows].count(stop) == 1 and rows[-1]["iteration"] == stop
    assert "eval/easy/reward" in rows[-1] and "already at iteration" in again.stderr
    # with a larger one it trains on to --iterations
    more, _ = esft("train", "--resume", str(tmp_path / "r"), "--budget-tokens", "100000", "--no-progress", "--trust-run-code",
                   cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    assert read_jsonl(tmp_path / "r" / "metrics.jsonl")[-1]["iteration"] == 4
    assert json.loads((tmp_path / "r" / "final" / "trainer_state.json").read_text())["iteration"] == 4
