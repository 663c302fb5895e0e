"""Reward models as reward functions, in-process: a real (tiny) LlamaForSequenceClassification scores
prompt + completion as TRL does, batched, in the trainer process; bad models and settings fail early."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from test_cli import assert_user_error, esft, read_jsonl
from tiny_model import build_tiny_reward_model, subprocess_env
from esft.cli import resolve_config
from esft.settings.config import ConfigError, ESConfig
from esft.rewards.models import RewardModel, RewardModelError
from esft.rewards.runner import RewardRunner
from esft.tasks.base import PROMPT_SOURCE
from esft.tasks.custom import task_from_objects
from esft.settings.config import embedded_model_path

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
PROMPTS = ["2 + 2 =", "Name a colour:", "x", "A much longer prompt, to make the padding matter:", "7 - 4 ="]
COMPLETIONS = [" 4", " blue", "yz", " and here is a long completion as well", " 3 <answer>3</answer>"]


def one_by_one(directory, texts: list[str]) -> list[float]:
    """The reference: each text alone through transformers, no padding, no batching."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for text in texts]


@pytest.fixture(scope="module")
def chat_reward_model_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("chat-rm"), seed=1, chat_template=CHAT_TEMPLATE)


def test_batched_scores_equal_each_text_scored_alone(tiny_reward_model_dir, one_torch_thread):
    scorer = RewardModel(str(tiny_reward_model_dir), device="cpu", batch_size=2)
    rewards = scorer(PROMPTS, COMPLETIONS, completion_ids=[[1]] * 5, answer=["a"] * 5)  # columns are ignored
    expected = one_by_one(tiny_reward_model_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert rewards == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert len(set(round(r, 3) for r in rewards)) == 5  # a real signal: every text scores differently
    assert scorer.__name__ == f"reward_model:{tiny_reward_model_dir.name}"
    assert scorer.info() == {"model": str(tiny_reward_model_dir), "dtype": "float32", "device": "cpu"}


def test_chat_prompts_go_through_the_reward_models_own_chat_template(chat_reward_model_dir, tiny_reward_model_dir, one_torch_thread):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 ="}]
    rows = [{"prompt": "rendered for the policy", PROMPT_SOURCE: messages, "answer": "4"}]
    runner = RewardRunner([RewardModel(str(chat_reward_model_dir))])  # as the trainer scores: messages in, completion text
    rewards = runner.score(rows, [" 4"]).total
    text = "[system] Be brief.\n[user] 2 + 2 =\n[assistant]  4\n"
    assert RewardModel(str(chat_reward_model_dir)).texts([messages], [" 4"]) == [text]
    assert rewards == pytest.approx(one_by_one(chat_reward_model_dir, [text]), rel=1e-4, abs=1e-4)
    # a tokenizer without a chat template gets the plain-text ChatML rendering
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2 =<|im_end|>\n<|im_start|>assistant\n 4<|im_end|>\n"
    assert RewardModel(str(tiny_reward_model_dir)).texts([messages], [[{"role": "assistant", "content": " 4"}]]) == [chatml]


def test_it_runs_trusted_in_the_trainer_process_and_a_pickled_copy_loads_its_own(tiny_reward_model_dir, one_torch_thread):
    scorer = RewardModel(str(tiny_reward_model_dir))
    runner = RewardRunner([scorer], sandbox=True)
    scores = runner.score([{"prompt": p} for p in PROMPTS], COMPLETIONS)
    assert runner.pool is None  # no sandbox worker was started: the model stays in this process
    assert scores.per_function[scorer.__name__] == pytest.approx(scorer(PROMPTS, COMPLETIONS))
    copy = pickle.loads(pickle.dumps(scorer))  # what a Ray actor receives
    assert copy.model is None and len(pickle.dumps(scorer)) < 10_000
    assert copy(PROMPTS, COMPLETIONS) == pytest.approx(scores.total)


def test_a_string_in_reward_funcs_is_a_reward_model_as_in_trl(tiny_reward_model_dir):
    task = task_from_objects([str(tiny_reward_model_dir), "esft.tasks.countdown:countdown_reward"],
                             [{"prompt": "p", "numbers": [1, 2], "target": 3}], None, None, None, reward_model_device="cpu")
    model, func = task.reward_funcs
    assert isinstance(model, RewardModel) and model.model is not None and str(model.model.device) == "cpu"
    assert func.__name__ == "countdown_reward"


@pytest.mark.parametrize("kind, message", [
    ("causal", "is a LlamaForCausalLM, not a reward model"),
    ("labels", "has 3 outputs (num_labels); a reward model has one"),
    ("empty", "cannot load it"),
])
def test_what_is_not_a_reward_model_is_refused_by_name(kind, message, tmp_path):
    path = {"causal": str(embedded_model_path()), "empty": str(tmp_path)}.get(kind)  # empty: a directory without a model
    if kind == "labels":
        path = str(build_tiny_reward_model(tmp_path))
        config = json.loads((tmp_path / "config.json").read_text())
        config["id2label"], config["label2id"] = {str(i): f"L{i}" for i in range(3)}, {f"L{i}": i for i in range(3)}
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardModelError, match=re.escape(message)) as error:
        RewardModel(path, where=f"--reward-model {path}").load()
    assert str(error.value).startswith(f"--reward-model {path}")


def reward_model_with_unembedded_tokens(path, kind: str):
    """A saved reward model whose tokenizer gained a token its 258-row embedding has none for: a pad
    token ("added pad", as users do for GPT-2) or a turn marker its chat template uses ("template token")."""
    build_tiny_reward_model(path, chat_template="{% for m in messages %}<|turn|>{{ m['content'] }}{% endfor %}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"pad_token": "<newpad>"} if kind == "added pad" else {"additional_special_tokens": ["<|turn|>"]})
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind, expected", [
    ("added pad", "the pad token '<newpad>' is id 258, past the model's 258 embedding rows"),
    ("template token", "its chat template holds token '<|turn|>' (id 258), past the model's 258 embedding rows"),
])
def test_a_reward_model_whose_tokenizer_outgrew_its_weights_is_refused_at_load(kind, expected, tmp_path):
    """Every padded batch (or every chat sample) would look such a token up: before, `esft train` stopped
    after its first iteration's scoring (on CUDA: a device-side assert) and `serve-reward` served it."""
    path = reward_model_with_unembedded_tokens(tmp_path / "rm", kind)
    with pytest.raises(RewardModelError, match=re.escape(expected)):
        RewardModel(str(path)).load()
    (tmp_path / "train.jsonl").write_text('{"prompt": "2 + 2 ="}\n{"prompt": "a longer prompt"}\n')
    proc, _ = esft("train", "--reward-model", str(path), "--reward-model-device", "cpu", "--train-data", "train.jsonl",
                   "--iterations", "1", "--population-size", "2", "--max-tokens", "4", "--no-progress", cwd=tmp_path)
    line = assert_user_error(proc, f"--reward-model {path}", expected, "resize_token_embeddings(len(tokenizer))")
    assert "does not match its weights" in line and not (tmp_path / "runs").exists()
    proc, _ = esft("serve-reward", "--model", str(path), "--port", "0", cwd=tmp_path)  # refused before it serves
    assert_user_error(proc, f"--model {path}", expected)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(path)))  # what the message says to do
    model.save_pretrained(path)
    assert len(RewardModel(str(path))(["2 + 2 =", "x"], [" 4", "a longer completion"])) == 2


def test_a_chat_template_that_rejects_the_load_check_still_loads(tmp_path):
    """The load renders a user/assistant conversation to look for template tokens past the rows; a template
    that insists on a system turn raises there, and that is no reason to refuse a model that scores text."""
    rejecting = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}{{ messages[-1]['content'] }}"
    scorer = RewardModel(str(build_tiny_reward_model(tmp_path, chat_template=rejecting)), device="cpu")
    assert scorer.load().model is not None and len(scorer(["2 + 2 ="], [" 4"])) == 1


@pytest.mark.parametrize("template, expected", [  # issue 66, case 7, for a reward model's folder
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}"
     "{% endfor %}", "did not render a user/assistant conversation within 3 s"),
    ("{{ 'A' * (messages|length * 4000000000) }}", "needed more than 2 GiB to render a user/assistant conversation"),
])
def test_a_reward_models_chat_template_that_loops_or_blows_up_is_one_line_at_load(template, expected, tmp_path,
                                                                                   monkeypatch):
    """The load renders a conversation through the reward model's own template (to look for tokens past its rows):
    that rendering is bounded as the trained model's is (esft.template_probe; 3 s here), before any scoring."""
    import time

    from esft import template_probe

    monkeypatch.setattr(template_probe, "PROBE_SECONDS", 3.0)
    model = build_tiny_reward_model(tmp_path / "rm", chat_template=template)
    (tmp_path / "train.jsonl").write_text('{"prompt": "2 + 2 ="}\n')
    started = time.monotonic()
    proc, _ = esft("train", "--reward-model", str(model), "--reward-model-device", "cpu", "--train-data", "train.jsonl",
                   "--iterations", "1", "--population-size", "2", "--max-tokens", "4", "--no-progress", "--logging",
                   "none", "--run-name", "run", cwd=tmp_path)
    line = assert_user_error(proc, f"--reward-model {model}", expected, "fix the chat_template")
    assert time.monotonic() - started < 60 and not (tmp_path / "runs" / "run").exists(), line


def test_a_reward_model_built_by_hand_in_a_script_is_checked_when_the_trainer_is_built(tmp_path, tiny_model_dir):
    """`ESTrainer(model, RewardModel(path), ...)` in a user's script: the reward model loads (and is
    refused) with the task, before the policy does; before, it loaded at the first scoring call."""
    path = reward_model_with_unembedded_tokens(tmp_path / "rm", "added pad")
    script = tmp_path / "train_script.py"
    script.write_text(
        "from esft import ESConfig, ESTrainer\n"
        "from esft.rewards.models import RewardModel\n"
        f"args = ESConfig(output_dir='out', iterations=1, population_size=2, max_tokens=4, logging='none', progress=False)\n"
        f"trainer = ESTrainer({str(tiny_model_dir)!r}, RewardModel({str(path)!r}, device='cpu'), args,\n"
        "                    train_dataset=[{'prompt': '2 + 2 ='}, {'prompt': 'a longer prompt'}])\n"
        "print('BUILT')\n")
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "BUILT" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("esft.tasks.base.TaskError: reward model ") and "the pad token '<newpad>' is id 258" in last, last
    assert not (tmp_path / "out").exists()


def test_reward_model_and_url_flags_repeat_and_combine_with_reward_funcs(tiny_reward_model_dir):
    config, _, _ = resolve_config("train", {"reward_funcs": "m:f", "reward_model": f"{tiny_reward_model_dir},org/rm",
                                         "reward_url": "http://127.0.0.1:1|http://127.0.0.1:2", "reward_weights": "1,2,3,4"})
    assert config.task == "custom" and config.parsed_reward_weights() == [1, 2, 3, 4]
    assert ESConfig(reward_model=["a/b", "c/d"]).reward_model == "a/b,c/d"  # a list (YAML, Python) = commas
    from esft.cli import build_parser

    args = build_parser().parse_args(["train", "--reward-model", "a/b", "--reward-model", "c/d", "--reward-url", "http://h:1"])
    assert (args.reward_model, args.reward_url) == ("a/b,c/d", "http://h:1")
    with pytest.raises(ConfigError, match="--reward-weights: '1,2' must be 3 finite numbers, one per reward"):
        ESConfig(reward_model="a/b,c/d", reward_url="http://h:1", reward_weights="1,2")
    with pytest.raises(ConfigError, match="--reward-model-device: must be auto, cpu, cuda or cuda:N"):
        ESConfig(reward_model="a/b", reward_model_device="gpu0")


@pytest.mark.parametrize("flags, expected", [
    (["--reward-model", "./no/such/dir"], "--reward-model: directory './no/such/dir' does not exist"),
    (["--reward-url", "localhost:8000"], "--reward-url: 'localhost:8000' is not an http(s) URL with a host"),
    (["--reward-url", "http://127.0.0.1:99999"], "--reward-url: 'http://127.0.0.1:99999' is not a valid URL"),
    (["--reward-url", "http://127.0.0.1:8000", "--reward-weights", "1,2"], "--reward-weights: '1,2' must be 1 finite numbers"),
])
def test_bad_reward_model_settings_are_one_line_errors(flags, expected, tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "2 + 2 ="}\n')
    proc, _ = esft("train", *flags, "--train-data", "train.jsonl", cwd=tmp_path)
    assert_user_error(proc, expected)


def test_an_es_run_scored_by_two_reward_models(tiny_reward_model_dir, chat_reward_model_dir, tmp_path):
    """`esft train --reward-model A --reward-model B --reward-weights`: the summed reward of the
    evaluation's completions is what the two models give them, weighted."""
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in PROMPTS))
    proc, _ = esft("train", "--reward-model", str(tiny_reward_model_dir), "--reward-model", str(chat_reward_model_dir),
                   "--reward-weights", "1,-0.5", "--reward-model-device", "cpu", "--train-data", "train.jsonl",
                   "--eval-data", "train.jsonl", "--iterations", "1", "--population-size", "2", "--batch-size", "2",
                   "--max-tokens", "4", "--no-progress", "--logging", "none", "--run-name", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "runs/run/metrics.jsonl")
    assert rows[1]["reward/errors"] == 0
    assert {f"rewards/reward_model:{tiny_reward_model_dir.name}/mean", f"rewards/reward_model:{chat_reward_model_dir.name}/mean"} <= set(rows[1])
    samples = read_jsonl(tmp_path / "runs/run/eval/iteration-1/train.jsonl")
    first = RewardModel(str(tiny_reward_model_dir), device="cpu")([s["prompt"] for s in samples], [s["completion"] for s in samples])
    second = RewardModel(str(chat_reward_model_dir), device="cpu")([s["prompt"] for s in samples], [s["completion"] for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx([a - 0.5 * b for a, b in zip(first, second)], rel=1e-4, abs=1e-4)
    assert rows[-1]["eval/train/reward"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples), rel=1e-6)
