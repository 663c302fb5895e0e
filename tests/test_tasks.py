"""Custom tasks (data files of every format, chat prompts, TRL reward functions, bad input), the
conciseness and math tasks, and the README's bring-your-own-task example run as written."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox_rewards as R
from esft.cli import main
from esft.settings.config import ESConfig
from esft.rewards.runner import RewardRunner
from esft.rewards.usercode import ByReference as FuncRef
from esft.tasks import TASKS
from esft.tasks.base import PROMPT_SOURCE, Task, TaskError
from esft.tasks.conciseness import EVAL_PAIRS, TRAIN_PAIRS, conciseness_reward, make_conciseness_task
from esft.tasks.custom import load_callable, prepare_task, task_from_data
from esft.tasks.loading import chatml, load_splits, render_prompt
from esft.tasks.math_grading import gold_answers, grade, last_boxed, normalize
from esft.tasks.math_task import SYSTEM_PROMPT, grade_all, math_reward
from tiny_model import build_tokenizer, subprocess_env
from cli_runner import without_model_preset

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "byo_task"
ROWS = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 3 =", "answer": "5"}, {"prompt": "say hi", "answer": "hi"}]
TINY = ["--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--eval-batch-size", "8",
        "--logging", "none", "--no-progress", "--save-every", "0"]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(without_model_preset(argv))
    return code, capsys.readouterr().err


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------- loaders
def _cached_dataset(tmp_path: Path, name: str) -> Path:
    """Put `name` into a fresh HF datasets cache the way load_dataset leaves a hub dataset there."""
    import datasets

    (tmp_path / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    built = tmp_path / "build"
    datasets.load_dataset("json", data_files={"train": str(tmp_path / "src.jsonl"), "test": str(tmp_path / "src.jsonl")},
                          cache_dir=str(built))
    (info,) = built.glob("json/*/*/*/dataset_info.json")
    cache = tmp_path / "cache"
    target = cache / name.replace("/", "___") / "default" / "0.0.0" / "abc"
    shutil.copytree(info.parent, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", name.split("/")[-1] + "-"))
    return cache


def _write_all_formats(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in ROWS))  # blank lines are fine
    with open(tmp_path / "rows.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one_split"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "hard": datasets.Dataset.from_list(ROWS[:1])}
                         ).save_to_disk(str(tmp_path / "dict"))
    return {"rows.json": ("rows", ["rows"]), "lines.json": ("lines", ["lines"]), "rows.jsonl": ("rows", ["rows"]),
            "rows.csv": ("rows", ["rows"]), "rows.parquet": ("rows", ["rows"]), "one_split": ("one_split", ["one_split"]),
            "dict": ("train", ["train", "hard"])}


def test_every_data_format_loads_the_same_rows(tmp_path, monkeypatch):
    import datasets

    for name, (split, splits) in _write_all_formats(tmp_path).items():
        loaded = load_splits(str(tmp_path / name))
        assert list(loaded) == splits, name
        assert loaded[split] == ROWS, name
    cache = _cached_dataset(tmp_path, "someorg/tiny_qa")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    offline_before = datasets.config.HF_HUB_OFFLINE
    loaded = load_splits("someorg/tiny_qa")  # a name, not a path: the local cache, offline
    assert sorted(loaded) == ["test", "train"] and loaded["train"] == ROWS
    assert datasets.config.HF_HUB_OFFLINE == offline_before  # the offline switch is put back
    assert ESConfig(train_data="someorg/tiny_qa", reward_funcs="m:f").train_data == "someorg/tiny_qa"
    with pytest.raises(TaskError, match=r"nobody/nothing: not a file or directory, and not a dataset in the local"):
        load_splits("nobody/nothing")


def test_a_dataset_dict_trains_on_train_and_evaluates_every_other_split(tmp_path):
    _write_all_formats(tmp_path)
    task = task_from_data(str(tmp_path / "dict"), None, "sandbox_rewards:length_reward", None)
    assert task.train_dataset == ROWS and list(task.eval_datasets) == ["hard"]
    task = task_from_data(str(tmp_path / "rows.csv"), str(tmp_path / "dict"), "sandbox_rewards:length_reward", None)
    assert list(task.eval_datasets) == ["train", "hard"]


@pytest.mark.parametrize("name, content, expected", [
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', r"bad.jsonl: line 2 is not valid JSON"),
    ("bad.json", '{"prompt": "a"}', r"bad.json: expected a JSON list of row objects, got a JSON dict"),
    ("bad.json", '[{"prompt": "a"}, 3]', r"bad.json: row 1 is a int"),
    ("bad.csv", "prompt,answer\na,1,extra\n", r"bad.csv: row 0 has more fields than the header"),
    ("bad.parquet", "not parquet", r"bad.parquet: cannot read it as Parquet"),
    ("bad.txt", "hello", r"bad.txt: unsupported data file type '.txt'"),
])
def test_unreadable_files_are_named(tmp_path, name, content, expected):
    (tmp_path / name).write_text(content)
    with pytest.raises(TaskError, match=expected):
        load_splits(str(tmp_path / name))


# --------------------------------------------------------------------------- chat prompts
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]


def test_chat_prompts_use_the_chat_template_or_plain_chatml():
    tokenizer = build_tokenizer()
    assert render_prompt(MESSAGES, tokenizer) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt("plain", tokenizer) == "plain"
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert render_prompt(MESSAGES, tokenizer) == "[system] Be brief.\n[user] 2 + 2?\n[assistant] "
    # a final assistant message is continued, not closed (as TRL does)
    assert render_prompt(MESSAGES + [{"role": "assistant", "content": "It is"}], build_tokenizer()).endswith(
        "<|im_start|>assistant\nIt is")
    assert chatml(MESSAGES, add_generation_prompt=False).count("<|im_start|>") == 2


def test_chat_rows_reach_trl_rewards_as_messages_and_the_model_as_text(tiny_model_dir, tmp_path):
    from esft import ESTrainer

    rows = [{"prompt": MESSAGES, "solution": "4"}, {"prompt": "raw text prompt", "solution": "55"}]
    seen = []

    def conversational(prompts, completions, solution, **kwargs):
        seen.append((prompts, completions, solution))
        return [1.0] * len(prompts)

    args = ESConfig(population_size=2, batch_size=2, max_tokens=3, iterations=1, save_every=0, logging="none",
                    progress=False, output_dir=str(tmp_path), run_name="chat", reward_sandbox=False)
    trainer = ESTrainer(model=str(tiny_model_dir), reward_funcs=[conversational, R.trl_uses_prompts_and_column],
                        args=args, train_dataset=rows, eval_dataset={"mixed": rows})
    rendered = chatml(MESSAGES)
    assert trainer.task.train_dataset[0]["prompt"] == rendered and trainer.task.train_dataset[0][PROMPT_SOURCE] == MESSAGES
    last = trainer.train()
    prompts, completions, solution = seen[-1]
    assert prompts == [MESSAGES, "raw text prompt"] and solution == ["4", "55"]
    assert completions[0][0]["role"] == "assistant" and isinstance(completions[0][0]["content"], str)
    assert isinstance(completions[1], str)  # a text prompt keeps a text completion
    # the sandboxed TRL-style function saw the original messages too: len("4") + len("2 + 2?")
    assert last["eval/mixed/reward"] == pytest.approx(((1 + 1 + 6) + (1 + 2 + 15)) / 2)
    samples = read_jsonl(tmp_path / "chat" / "eval" / "iteration-1" / "mixed.jsonl")
    assert samples[0]["prompt"] == MESSAGES and samples[0]["prompt_text"] == rendered
    assert samples[1]["prompt"] == "raw text prompt" and "prompt_text" not in samples[1]


# ------------------------------------------------------------------- TRL reward functions
def test_trl_style_reward_functions_work_unchanged_in_the_sandbox():
    rows = [{"prompt": MESSAGES}, {"prompt": MESSAGES}]
    runner = RewardRunner([R.trl_reward_len], timeout=20)
    try:
        assert runner.score([{"prompt": "p"}] * 2, ["abc", "abcdefgh"]).total == [-2.0, -3.0]
    finally:
        runner.close()
    runner = RewardRunner([R.trl_conversational_format], timeout=20)
    try:
        assert runner.score(rows, ["<think>x</think>", "no"]).total == [1.0, 0.0]
    finally:
        runner.close()


@pytest.mark.parametrize("batched", [False, True])
def test_rewards_receive_the_generated_completion_ids(tiny_model_dir, batched):
    """completion_ids as TRL passes them (generated ids up to and including EOS), in the sandbox, for
    training members (one at a time and population-batched) and for evaluation."""
    from esft.engines.transformers_engine import TransformersEngine
    from esft.loop.evaluation import EvalSettings, evaluate_split
    from esft.es.batches import PromptBatch
    from esft.executors import LocalExecutor
    from esft.tasks.custom import check_reward_func

    check_reward_func(R.token_count, set(), "the data")  # needs no such column: every call provides it
    engine = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=6,
                                                noise="lowrank" if batched else "iid")
    runner = RewardRunner([R.token_count], timeout=20)
    try:
        executor = LocalExecutor(engine, runner.score, population_batching=batched)
        rows = [{"prompt": p, "completion_ids": "a dataset column of that name is shadowed"} for p in ("ab", "c", "xyz")]
        members = executor.evaluate_population([5, 6], PromptBatch(0, rows), 0.05)
        assert [m.reward for m in members] == [m.num_tokens / len(rows) for m in members]
        assert all(m.scores.errors == 0 for m in members)
        metrics, records = evaluate_split(lambda prompts, sampling: engine.generate(prompts), rows, runner, None,
                                          EvalSettings(batch_size=8, samples=1, temperature=0.0, top_p=1.0, seed=0))
        assert metrics["reward"] == metrics["mean_length"] > 0
    finally:
        runner.close()


def test_trl_rewards_package_if_installed():
    rewards = pytest.importorskip("trl.rewards")
    runner = RewardRunner([rewards.think_format_reward], timeout=60)
    try:
        scores = runner.score([{"prompt": MESSAGES}] * 2, ["<think>\nok\n</think>\n4", "4"])
        assert scores.total == [1.0, 0.0]
    finally:
        runner.close()


# ------------------------------------------------------------------------------ bad input
def _bad_input_cases(d: Path) -> dict[str, tuple[list[str], list[str]]]:
    (d / "ok.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    (d / "noprompt.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    (d / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    (d / "rw.py").write_text(
        "def needs_solution(prompts, completions, solution, **kwargs):\n    return [0.0] * len(prompts)\n"
        "def one_arg(texts):\n    return [0.0] * len(texts)\n"
        "def positional_only(prompts, completions, /):\n    return [0.0]\n"
        "def make_task():\n    return {'not': 'a task'}\n"
        "def raising_factory():\n    raise RuntimeError('no data today')\n"
    )
    (d / "syntax.py").write_text("def f(:\n")
    ok, rw = str(d / "ok.jsonl"), str(d / "rw.py")
    return {
        "missing-prompt": (["--train-data", str(d / "noprompt.jsonl"), "--reward-funcs", f"{rw}:needs_solution"],
                           ["noprompt.jsonl row 1", "needs a 'prompt' column", "['answer', 'question']"]),
        "missing-column": (["--train-data", ok, "--reward-funcs", f"{rw}:needs_solution"],
                           ["reward function needs_solution needs column 'solution'", "ok.jsonl", "answer"]),
        "wrong-signature": (["--train-data", ok, "--reward-funcs", f"{rw}:one_arg"],
                            ["one_arg(texts) has a wrong signature", "completions"]),
        "positional-only": (["--train-data", ok, "--reward-funcs", f"{rw}:positional_only"],
                            ["positional_only", "wrong signature: positional-only"]),
        "unreadable": (["--train-data", str(d / "broken.jsonl"), "--reward-funcs", f"{rw}:needs_solution"],
                       ["broken.jsonl: line 2 is not valid JSON"]),
        "no-module": (["--train-data", ok, "--reward-funcs", "no_such_module_xyz:f"],
                      ["--reward-funcs no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"]),
        "no-function": (["--train-data", ok, "--reward-funcs", f"{rw}:nope"], ["rw.py:nope", "has no 'nope'", "one_arg"]),
        "syntax-error": (["--train-data", ok, "--reward-funcs", f"{d / 'syntax.py'}:f"], ["syntax.py", "SyntaxError"]),
        "not-a-task": (["--task", f"{rw}:make_task"], ["rw.py:make_task returned a dict, not an esft Task"]),
        "factory-raises": (["--task", f"{rw}:raising_factory"], ["raising_factory", "RuntimeError: no data today"]),
        "weights": (["--train-data", ok, "--reward-funcs", f"{rw}:needs_solution", "--reward-weights", "1,2"],
                    ["--reward-weights", "1 finite numbers"]),
        "no-data": (["--reward-funcs", f"{rw}:needs_solution"], ["--reward-funcs", "--train-data"]),
        "not-cached": (["--train-data", "nobody/nothing", "--reward-funcs", f"{rw}:needs_solution"],
                       ["nobody/nothing", "local Hugging Face cache"]),
        "math-no-data": (["--task", "math"], ["--task math needs data"]),
    }


def test_bad_input_is_one_clear_error_before_the_model_loads(tmp_path, capsys):
    """An EMPTY --model directory: had the model been loaded first, the error would be about it."""
    (tmp_path / "empty-model").mkdir()
    for case, (argv, expected) in _bad_input_cases(tmp_path).items():
        started = time.perf_counter()
        code, err = run_cli(["train", "--model", str(tmp_path / "empty-model"), *TINY, "--output-dir",
                             str(tmp_path / "runs"), *argv], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (case, err)
        assert len(lines) == 1 and lines[0].startswith("esft: error: "), (case, err)
        for text in expected:
            assert text in lines[0], (case, text, lines[0])
        assert "could not load" not in lines[0] and time.perf_counter() - started < 10
    assert not (tmp_path / "runs").exists()


def test_task_factories_and_templates(tmp_path, monkeypatch):
    (tmp_path / "my_task_module.py").write_text(
        "from esft.tasks import Task\n"
        "def score(prompts, completions, answer, **kwargs):\n    return [1.0] * len(prompts)\n"
        "def make_task(train_data=None, seed=0):\n"
        "    rows = [{'question': f'q{i}', 'answer': str(seed)} for i in range(3)]\n"
        "    return Task('mine', rows, {'dev': rows[:1]}, [score], prompt_template='Q: {question}\\nA:')\n"
    )
    monkeypatch.chdir(tmp_path)  # `module:function` imports from the current directory
    factory = load_callable("my_task_module:make_task", "--task")
    task = prepare_task(factory(seed=7))
    assert [row["prompt"] for row in task.train_dataset] == ["Q: q0\nA:", "Q: q1\nA:", "Q: q2\nA:"]
    assert task.eval_datasets["dev"][0]["prompt"] == "Q: q0\nA:" and task.train_dataset[0]["answer"] == "7"
    broken = Task("x", [{"question": "q"}], {}, [R.length_reward], prompt_template="{missing}")
    with pytest.raises(TaskError, match=r"train_dataset row 0: prompt template '\{missing\}' cannot be filled"):
        prepare_task(broken)


# ---------------------------------------------------------------------------- conciseness
def test_conciseness_data_and_reward():
    task = make_conciseness_task()
    assert len(task.train_dataset) == len(TRAIN_PAIRS) >= 2 and len(task.eval_datasets["heldout"]) == len(EVAL_PAIRS) == 8
    assert task.report_kl and TASKS["conciseness"] is make_conciseness_task
    assert all(row["prompt"] == q for row, (q, _) in zip(task.train_dataset, TRAIN_PAIRS))  # the raw question
    answers = ["Paris", "144"]
    assert conciseness_reward(["q", "q"], ["  Paris \n", "one hundred and forty-four"], answers) == [0.0, -23.0]
    assert conciseness_reward(["q"], ["Pa"], ["Paris"]) == [-3.0]


# ----------------------------------------------------------------------------------- math
@pytest.mark.parametrize("text, boxed", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{a}{b}}", r"\frac{a}{b}"),
    (r"\boxed{\left\{1,2\right\}}", r"\left\{1,2\right\}"),
    (r"\boxed{unclosed", None),
    ("no box", None),
    (r"\boxed 7$", "7"),
    (r"\fbox{x}", "x"),
])
def test_last_boxed_matches_braces(text, boxed):
    assert last_boxed(text) == boxed


def test_normalisation_and_math_verify_grading():
    assert normalize(r"\dfrac{1}{2}") == normalize(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert normalize(r"x = 5.0") == "5" and normalize("1,000") == "1000" and normalize(r"\text{(B)}") == "(B)"
    assert normalize(r"90^\circ") == "90" and normalize("50\\%") == "50"
    assert gold_answers(5.0) == ["5"] and gold_answers(0.25) == ["0.25"] and gold_answers(["a", "b"]) == ["a", "b"]
    assert grade(r"The answer is \boxed{\frac{1}{2}}", ["0.5"]) == 1.0      # math-verify: equal values
    assert grade(r"\boxed{(x+1)^2}", ["x^2+2x+1"]) == 1.0                 # math-verify: equal expressions
    assert grade(r"\boxed{6}", ["5"]) == 0.0 and grade("5", ["5"]) == 0.0  # wrong; or not boxed
    assert grade(r"\boxed{b}", ["a", "b"]) == 1.0                          # any accepted answer


def test_math_reward_runs_checks_in_time_limited_processes():
    completions = [r"\boxed{5}", [{"role": "assistant", "content": r"\boxed{\frac{\sqrt{3}}{2}}"}], r"\boxed{3}"]
    assert math_reward(["p"] * 3, completions, [5.0, [r"\frac{\sqrt3}{2}", "0.866"], "4"]) == [1.0, 1.0, 0.0]
    started = time.monotonic()
    assert grade_all([r"\boxed{1}"] * 2, ["1", "1"], grader=FuncRef("sandbox_rewards", "slow_grade"), timeout=0.5) == [0.0, 0.0]
    assert time.monotonic() - started < 5  # hung checks were killed, not waited for
    assert math_reward(["p"], [r"\boxed{2}"], [2]) == [1.0]  # and the pool still grades


def test_math_task_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "What is 2 + 3?", "answer": "5"}] * 2)}
                         ).save_to_disk(str(tmp_path / "train"))
    datasets.DatasetDict({  # the ES-at-Scale formats: float answers (amc) and lists of strings (minerva)
        "amc": datasets.Dataset.from_list([{"problem": "1 + 1?", "answer": 2.0}, {"problem": "3 * 3?", "answer": 9.0}]),
        "minerva": datasets.Dataset.from_list([{"problem": "Half of 1?", "answer": ["0.5", r"\frac{1}{2}"]}]),
    }).save_to_disk(str(tmp_path / "eval"))
    code, err = run_cli(["train", "--model", str(tiny_model_dir), "--task", "math", "--train-data", str(tmp_path / "train"),
                         "--eval-data", str(tmp_path / "eval"), *TINY, "--iterations", "1", "--output-dir", str(tmp_path),
                         "--run-name", "math"], capsys)
    assert code == 0, err
    rows = read_jsonl(tmp_path / "math" / "metrics.jsonl")
    for split, size in (("amc", 2), ("minerva", 1)):
        assert rows[0][f"eval/{split}/accuracy"] == 0.0 and rows[-1][f"eval/{split}/accuracy"] == 0.0
        samples = read_jsonl(tmp_path / "math" / "eval" / "iteration-1" / f"{split}.jsonl")
        assert len(samples) == size and all(s["reward"] == 0.0 and s["accuracy"] == 0.0 for s in samples)
        assert samples[0]["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        # the tiny tokenizer has no chat template: the plain-text Qwen (ChatML) rendering
        assert samples[0]["prompt_text"].startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    assert rows[1]["rewards/math_reward/mean"] == 0.0 and rows[1]["reward/errors"] == 0


# ------------------------------------------------------------------ the docs' example (docs/tasks-and-rewards.md)
def _readme_blocks() -> list[str]:
    return re.findall(r"```(?:\w+)?\n(.*?)```", (ROOT / "docs" / "tasks-and-rewards.md").read_text(), re.DOTALL)


def test_readme_example_files_are_included_verbatim():
    blocks = _readme_blocks()
    for name in ("rewards.py", "train.jsonl", "eval.jsonl"):
        assert (EXAMPLE / name).read_text() in blocks, f"README does not show examples/byo_task/{name} verbatim"


def test_readme_example_commands_run(tiny_model_dir, tmp_path):
    commands = [shlex.split(line.rstrip("\\")) for block in _readme_blocks() for line in block.replace("\\\n", " ").splitlines()
                if line.startswith("esft train") and "byo_task" in line]
    assert len(commands) == 2, commands
    env = subprocess_env()
    results = []
    for index, command in enumerate(commands):
        proc = subprocess.run([sys.executable, "-m", "esft.cli", *without_model_preset([*command[1:], "--model", str(tiny_model_dir)]), *TINY,
                               "--iterations", "2", "--output-dir", str(tmp_path), "--run-name", f"r{index}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results.append(read_jsonl(tmp_path / f"r{index}" / "metrics.jsonl"))
    for rows in results:
        assert [row["iteration"] for row in rows] == [0, 1, 2]
        for row in rows[1:]:
            assert -0.04 <= row["rewards/brevity/mean"] < 0 and 0 <= row["rewards/exact_answer/mean"] <= 1
            assert row["reward/errors"] == row["reward/timeouts"] == 0
    no_code, factory = results
    assert "eval/eval/reward" in no_code[0]       # --eval-data eval.jsonl: split "eval"
    assert factory[0]["eval/easy/accuracy"] == 0.0  # make_task: split "easy" with an accuracy function
