"""--prompt-format: a built-in task asks its question as raw text or in the tokenizer's chat format (auto: chat
where the tokenizer has a chat template), said in one line; and the arithmetic and times-table tasks sized for small pretrained
models (a fixed held-out split, labels that tell format from correctness)."""

from __future__ import annotations

from pathlib import Path

import pytest

from esft.tasks import load_task
from esft.tasks.base import Task
from esft.tasks.arithmetic import HELDOUT, arithmetic_reward
from esft.tasks.countdown import make_prompt
from esft.tasks.loading import format_prompts, render_rows
from test_cli import esft, read_jsonl
from tiny_model import build_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(chat_template: bool):
    tok = build_tokenizer()
    if chat_template:
        tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize("choice, template, form, said", [
    ("auto", False, "raw", None),
    ("auto", True, "chat", "through the tokenizer's chat template (--prompt-format auto; raw for the task's plain text)"),
    ("raw", True, "raw", "countdown's raw text (--prompt-format raw)"),
    ("chat", True, "chat", "through the tokenizer's chat template (--prompt-format chat)"),
    ("chat", False, "chat", "through ChatML text (the tokenizer has no chat template) (--prompt-format chat)"),
])
def test_countdown_asks_in_the_form_chosen_and_says_which(choice, template, form, said):
    task = load_task("countdown", train_size=3, eval_size=2)
    raw = make_prompt(task.train_dataset[0]["numbers"], task.train_dataset[0]["target"])
    tok = tokenizer(template)
    line = format_prompts(task, choice, tok)
    render_rows(task, tok)
    text = task.train_dataset[0]["prompt"]
    if said is None:
        assert line is None
    else:
        assert line.startswith("prompts: countdown") and line.endswith(said), line
    if form == "raw":
        assert text == raw  # the paper's prompt, untouched
    else:  # system, user, then the assistant's reply continued (no end-of-turn after it)
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
        assert "<|im_start|>user\nUsing the numbers" in text
        assert text.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")
        assert all(row["prompt"].startswith("<|im_start|>system") for row in task.eval_datasets["heldout"])


@pytest.mark.parametrize("choice", ["raw", "chat"])
def test_countdown_scores_a_right_answer_in_either_form(choice):
    """Scored as training scores it (the reward runner, which hands chat prompts' completions over in TRL's chat
    form): a right answer in the right format earns the full 1.1 and accuracy 1 in both forms (chat form
    completions once reached the reward as lists, every sample failed, and Countdown scored 0%)."""
    from esft.rewards.runner import RewardRunner

    task = load_task("countdown", train_size=2, eval_size=2)
    format_prompts(task, choice, tokenizer(True))
    render_rows(task, tokenizer(True))
    row = dict(task.train_dataset[0])
    row["target"] = sum(row["numbers"])  # so that adding every number is the right answer
    expression = " + ".join(str(n) for n in row["numbers"])
    completion = f"I add them all.</think>\n<answer>{expression}</answer>"
    runner = RewardRunner(task.reward_funcs, sandbox=False)
    try:
        assert runner.score([row], [completion]).total == [pytest.approx(1.1)]
        assert RewardRunner([task.accuracy_func], sandbox=False).score([row], [completion]).total == [1.0]
    finally:
        runner.close()


def test_your_own_data_keeps_its_prompts_under_every_format():
    own = Task("mine", [{"prompt": "Q: 1+1\nA:"}], {"dev": [{"prompt": "Q: 2+2\nA:"}]}, reward_funcs=[])
    for choice in ("auto", "raw", "chat"):
        assert format_prompts(own, choice, tokenizer(True)) is None
    assert own.train_dataset[0]["prompt"] == "Q: 1+1\nA:"


def test_the_arithmetic_split_is_fixed_disjoint_and_seeded_only_in_its_training_order():
    first, second = load_task("arithmetic", seed=0, train_size=1000), load_task("arithmetic", seed=1, train_size=1000)
    assert len(first.eval_datasets["heldout"]) == HELDOUT and len(first.train_dataset) == 720 - HELDOUT
    assert first.eval_datasets["heldout"] == second.eval_datasets["heldout"]
    assert [r["target"] for r in first.train_dataset] != [r["target"] for r in second.train_dataset]
    held = {(r["a"], r["b"]) for r in first.eval_datasets["heldout"]}
    assert not held & {(r["a"], r["b"]) for r in first.train_dataset}
    assert all(int(r["target"]) == r["a"] * r["b"] for r in first.train_dataset)
    assert len(load_task("arithmetic", eval_size=50).eval_datasets["heldout"]) == 50


def test_the_times_table_holds_out_whole_pairs_in_every_phrasing():
    from esft.tasks.times_table import PHRASINGS

    first, second = load_task("times-table", seed=0), load_task("times-table", seed=1)
    held, train = first.eval_datasets["heldout"], first.train_dataset
    assert (len(held), len(train)) == (200, 121 * 5 - 200) and held == second.eval_datasets["heldout"]
    assert [r["prompt"] for r in train] != [r["prompt"] for r in second.train_dataset]
    held_pairs = {(r["a"], r["b"]) for r in held}
    assert len(held_pairs) == 40 and not held_pairs & {(r["a"], r["b"]) for r in train}
    assert all(int(r["target"]) == r["a"] * r["b"] and 2 <= min(r["a"], r["b"]) for r in held + train)
    fifty = load_task("times-table", eval_size=50).eval_datasets["heldout"]
    assert len(fifty) == 50 and all(any(q.format(a=r["a"], b=r["b"]) == r["question"] for r in fifty) for q in PHRASINGS)
    task = load_task("times-table")
    format_prompts(task, "chat", tokenizer(True))
    assert task.eval_datasets["heldout"][0]["prompt"] == [{"role": "user", "content": held[0]["question"]}]


def test_word_problems_hold_out_whole_number_pairs_in_every_story_and_answer_by_the_story():
    from esft.tasks.word_problems import ASK, STORIES

    first, second = load_task("word-problems", seed=0), load_task("word-problems", seed=1)
    held, train = first.eval_datasets["heldout"], first.train_dataset
    assert (len(held), len(train)) == (38 * len(STORIES), 152 * len(STORIES)) and held == second.eval_datasets["heldout"]
    assert [r["prompt"] for r in train] != [r["prompt"] for r in second.train_dataset]
    held_pairs = {(r["a"], r["b"]) for r in held}
    assert len(held_pairs) == 38 and not held_pairs & {(r["a"], r["b"]) for r in train}
    for row in held + train:  # the answer follows the story: more, together and in add; away, left and blue take away
        adds = any(word in row["question"] for word in (" more.", "together"))
        assert int(row["target"]) == (row["a"] + row["b"] if adds else row["a"] - row["b"]) > 0
        assert row["question"].endswith(ASK) and row["prompt"] == f"Question: {row['question']}\nAnswer:"
    assert len(load_task("word-problems", eval_size=50).eval_datasets["heldout"]) == 50
    assert {story.split(" ")[1] for story, _ in STORIES} <= {row["question"].split(" ")[1] for row in held[:60]}
    task = load_task("word-problems")
    format_prompts(task, "chat", tokenizer(True))
    assert task.eval_datasets["heldout"][0]["prompt"] == [{"role": "user", "content": held[0]["question"]}]


@pytest.mark.parametrize("completion, label, value", [
    ("423", "bare", 1.0), (" 423\n", "bare", 1.0), ("47 * 9 = 423", "correct", 1.0), ("1,423 no: 423", "correct", 1.0),
    ("47 * 9 = 433", "wrong", 0.0), ("423 is wrong, 424", "wrong", 0.0), ("To solve this problem", "no_number", 0.0),
])
def test_the_arithmetic_reward_grades_the_last_number_and_labels_the_form(completion, label, value):
    assert arithmetic_reward(completion, "423") == (label, value)


def test_arithmetic_trains_from_the_cli_in_chat_form_with_its_labels_logged(tiny_model_dir, tmp_path):
    proc, _ = esft("train", "--model", str(tiny_model_dir), "--task", "arithmetic", "--prompt-format", "chat",
                   "--max-tokens", "4", "--population-size", "2", "--batch-size", "2", "--eval-size", "4",
                   "--iterations", "1", "--no-progress", "--logging", "none", "--output-dir", str(tmp_path),
                   "--run-name", "a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "esft: prompts: arithmetic's question in a user turn, through ChatML text" in proc.stderr
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert "eval/heldout/accuracy" in rows[-1]
    labels = {k: v for k, v in rows[1].items() if k.startswith("rewards/arithmetic_reward/labels/")}
    assert sum(labels.values()) == 4, rows[1]  # 2 members × 2 prompts, every completion labelled
    (sample, *_) = read_jsonl(tmp_path / "a" / "eval" / "iteration-1" / "heldout.jsonl")
    assert sample["prompt_text"].startswith("<|im_start|>user\nWhat is ") and sample["prompt"][0]["role"] == "user"
    assert Path(tmp_path / "a" / "final" / "model.safetensors").is_file()


def test_the_smollm2_recipe_config_is_what_its_docs_say(tiny_model_dir, tmp_path):
    """examples/smollm2-times-table.yaml: the settings measured on SmolLM2; the file runs as the docs call it
    (here on the tiny model, later flags shrinking the run)."""
    import yaml

    recipe = Path(__file__).parents[1] / "examples" / "smollm2-times-table.yaml"
    settings = yaml.safe_load(recipe.read_text())
    assert settings | {"sigma": 0.01} == settings and settings["noise"] == "lowrank" and settings["task"] == "times-table"
    assert (settings["rank"], settings["iterations"]) == (4, 12)  # docs/benchmarks.md, stage (c): +37.0 over seeds 0-3
    assert (settings["population_size"], settings["batch_size"], settings["step_rule"]) == (64, 2, "sqrt_n")
    proc, _ = esft("train", "--preset", "auto", "--config", str(recipe), "--model", str(tiny_model_dir), "--iterations", "1",
                   "--population-size", "2", "--batch-size", "2", "--eval-size", "4", "--max-tokens", "4", "--no-progress",
                   "--logging", "none", "--output-dir", str(tmp_path), "--run-name", "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert (config["task"], config["noise"], config["sigma"], config["step_rule"]) == ("times-table", "lowrank", 0.01, "sqrt_n")
    assert config["alpha"] == pytest.approx(0.01 / (2 * 8 ** 0.5))  # the √N step's default: the paper's step at N = 8


HOSTILE_TEMPLATES = {  # issue 66, case 7: each was a hang, a MemoryError after 4.3 GB, or a traceback
    "loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}"
              "{% endfor %}{% endfor %}", "did not render the first chat prompt within 3 s"),
    "memory": ("{{ 'A' * (messages|length * 4000000000) }}", "needed more than 2 GiB to render the first chat prompt"),
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the tokenizer's chat template failed on a chat prompt (SecurityError"),
    "raises": ("{{ raise_exception('no chat here') }}", "the tokenizer's chat template failed on a chat prompt"),
}


@pytest.mark.parametrize("kind", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_line_bounded_in_time_and_memory(kind, tiny_model_dir, tmp_path, monkeypatch):
    """A chat template is code of the model folder's: the first prompt renders in a forked child under a time
    limit (PROBE_SECONDS, 3 s here) and a 2 GiB cap, and any error of the template is one line, exit 2."""
    import json
    import shutil
    import time

    from esft import template_probe

    monkeypatch.setattr(template_probe, "PROBE_SECONDS", 3.0)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template, expected = HOSTILE_TEMPLATES[kind]
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    started = time.monotonic()
    proc, _ = esft("train", "--model", str(model), "--task", "arithmetic", "--max-tokens", "4", "--population-size", "2",
                   "--batch-size", "2", "--eval-size", "4", "--iterations", "1", "--no-progress", "--logging", "none",
                   "--output-dir", str(tmp_path / "runs"), "--run-name", "a", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("esft: error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr  # the last line, the only error
    assert expected in errors[0] and "--prompt-format raw" in errors[0], errors[0]
    assert time.monotonic() - started < 60
