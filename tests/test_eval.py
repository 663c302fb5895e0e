"""Evaluation: pass@k against a direct computation, sampled `esft eval` (numbers recomputed from the
per-sample JSONL and equal to those of a training run), KL(fine-tuned || base) against an independent
computation, and the conciseness task end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from esft.cli import main
from esft.engines.logprobs import KLScorer, k3
from esft.engines.base import Generation
from esft.loop.evaluation import EvalSettings, evaluate_split, ks_for, pass_at_k
from esft.rewards.runner import RewardRunner
from tiny_model import build_tiny_model
from cli_runner import without_model_preset

TINY = ["--population-size", "4", "--batch-size", "3", "--max-tokens", "6", "--eval-batch-size", "16",
        "--logging", "none", "--no-progress", "--save-every", "0"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(argv: list[str], capsys) -> str:
    code = main(without_model_preset(argv))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose outputs change visibly under σ = 0.05 perturbations."""
    return build_tiny_model(tmp_path_factory.mktemp("lively"), initializer_range=0.3)


# ----------------------------------------------------------------------------------- pass@k
def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                direct = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12), (n, c, k)
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def correct_if_odd(prompts, completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def test_evaluate_split_metrics_match_a_direct_computation():
    rows = [{"prompt": f"p{i}"} for i in range(3)]
    # K = 4 samples per prompt; odd length = correct: 0, 1 and 3 correct samples per prompt
    texts = ["aa", "bb", "cc", "dd", "a", "bb", "cc", "dd", "a", "b", "c", "dddd"]

    def generate(prompts, sampling):
        assert list(prompts) == ["p0", "p1", "p2"] and (sampling.n, sampling.temperature) == (4, 1.0)
        return Generation(texts=texts, num_tokens=[len(t) for t in texts])

    runner = RewardRunner([correct_if_odd], sandbox=False)
    metrics, samples = evaluate_split(generate, rows, runner, runner, EvalSettings(8, 4, 1.0, 1.0, 0))
    counts = [0, 1, 3]
    for k in (1, 2, 4):
        assert metrics[f"pass@{k}"] == pytest.approx(sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3) and metrics["pass@1"] == pytest.approx(4 / 12)
    assert metrics["accuracy"] == metrics["mean@4"] == pytest.approx(4 / 12) == metrics["reward"]
    assert metrics["mean_length"] == pytest.approx(sum(map(len, texts)) / 12)
    assert [s["sample"] for s in samples] == [0, 1, 2, 3] * 3 and [s["prompt"] for s in samples[3:5]] == ["p0", "p1"]
    assert [s["accuracy"] for s in samples] == [float(len(t) % 2) for t in texts]


# ------------------------------------------------------------------------- sampled esft eval
TASK_FILE = '''
from esft.tasks import Task

def odd_length(prompts, completions, **kwargs):
    return [float(len(c) % 2) for c in completions]

def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def make_task():
    rows = [{"prompt": f"Item {i}:"} for i in range(5)]
    return Task("odd", rows, {"dev": rows}, [length], accuracy_func=odd_length)
'''


def test_sampled_eval_reports_pass_at_k_and_matches_training(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "odd_task.py").write_text(TASK_FILE)
    common = ["--model", str(tiny_model_dir), "--task", f"{tmp_path / 'odd_task.py'}:make_task", *TINY,
              "--temperature", "1", "--top-p", "0.95", "--eval-samples", "4", "--output-dir", str(tmp_path)]
    out = run(["eval", *common, "--run-name", "eval"], capsys)
    (row,) = read_jsonl(tmp_path / "eval" / "metrics.jsonl")
    samples = read_jsonl(tmp_path / "eval" / "eval" / "iteration-0" / "dev.jsonl")
    assert len(samples) == 20 and [s["sample"] for s in samples[:4]] == [0, 1, 2, 3]
    assert len({s["completion"] for s in samples}) > 5, "samples should differ"
    for s in samples:
        assert s["accuracy"] == len(s["completion"]) % 2 and s["reward"] == len(s["completion"])
    counts = [sum(s["accuracy"] for s in samples[i * 4 : (i + 1) * 4]) for i in range(5)]
    assert 0 < sum(counts) < 20, "a test where every sample is right (or wrong) proves little"
    for k in (1, 2, 4):
        direct = sum(1 - math.comb(4 - int(c), k) / math.comb(4, k) for c in counts) / 5
        assert row[f"eval/dev/pass@{k}"] == pytest.approx(direct)
    assert row["eval/dev/accuracy"] == row["eval/dev/mean@4"] == pytest.approx(sum(counts) / 20)
    assert row["eval/dev/reward"] == pytest.approx(sum(s["reward"] for s in samples) / 20)
    assert row["eval/dev/mean_length"] == pytest.approx(sum(s["num_tokens"] for s in samples) / 20)
    assert f"dev accuracy: {100 * row['eval/dev/accuracy']:.1f}%" in out and "pass@4" in out
    # a training run evaluates the same way before its first update: the same numbers
    run(["train", *common, "--iterations", "1", "--run-name", "train"], capsys)
    before = read_jsonl(tmp_path / "train" / "metrics.jsonl")[0]
    assert before == row
    assert read_jsonl(tmp_path / "train" / "eval" / "iteration-0" / "dev.jsonl") == samples


# --------------------------------------------------------------------------------------- KL
def direct_kl(finetuned, base, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """One unpadded sequence at a time, log-softmax over the full logits, k3 written out."""
    ids = torch.tensor([prompt_ids + completion_ids])
    values = []
    with torch.no_grad():
        lf = torch.log_softmax(finetuned(ids).logits[0].double(), -1)
        lb = torch.log_softmax(base(ids).logits[0].double(), -1)
    for position, token in enumerate(completion_ids):
        at = len(prompt_ids) + position - 1
        delta = (lb[at, token] - lf[at, token]).item()
        values.append(math.exp(delta) - delta - 1)
    return values


def test_kl_matches_a_direct_computation_and_is_zero_against_itself(tiny_model_dir, lively_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    finetuned = AutoModelForCausalLM.from_pretrained(lively_model_dir).eval()
    prompts = ["What is 2 + 2?", "Hi", "A longer prompt, padded in a batch"]
    completions = [[70, 71, 1], [80], [90, 91, 92, 93, 94]]
    scorer = KLScorer(finetuned, tokenizer, str(tiny_model_dir), batch_size=2)
    values = scorer(prompts, completions)
    assert [len(v) for v in values] == [3, 1, 5]
    for prompt, completion, got in zip(prompts, completions, values):
        expected = direct_kl(finetuned, base, tokenizer(prompt, add_special_tokens=False)["input_ids"], completion)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert min(min(v) for v in values) > 0
    assert all(v == 0.0 for row in KLScorer(base, tokenizer, base)(prompts, completions) for v in row)
    assert k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_kl_in_memory_sized_chunks_equals_one_pass(tiny_model_dir, lively_model_dir, monkeypatch):
    """Rows per forward pass come from free memory (esft.engines.sizing.logprob_rows): with almost none
    free every pass scores one row, and the values equal those of one pass over all rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esft.engines import sizing

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    finetuned = AutoModelForCausalLM.from_pretrained(lively_model_dir).eval()
    prompts = ["What is 2 + 2?", "Hi", "A longer prompt, padded in a batch", "Four", "Five rows"]
    completions = [[70, 71, 1], [80], [90, 91, 92, 93, 94], [60, 61], [50]]
    rows_per_pass: list[int] = []
    finetuned.register_forward_pre_hook(lambda _, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape[0]),
                                         with_kwargs=True)
    whole = KLScorer(finetuned, tokenizer, str(tiny_model_dir), batch_size=len(prompts))(prompts, completions)
    assert rows_per_pass == [5]
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) + len(c) for p, c in zip(prompts, completions))
    monkeypatch.setattr(sizing, "free_memory", lambda model: 1)
    assert sizing.logprob_rows(finetuned, longest) == 1
    rows_per_pass.clear()
    one_by_one = KLScorer(finetuned, tokenizer, str(tiny_model_dir))(prompts, completions)
    assert rows_per_pass == [1] * 5
    # room for two rows' logits, float32 copy, log-softmax and activations in the CPU share: passes of 2, 2, 1
    per_row = longest * finetuned.config.vocab_size * 12 + sizing.bytes_per_row(finetuned, longest)
    monkeypatch.setattr(sizing, "free_memory", lambda model: int(2.5 * per_row / sizing.CPU_MEMORY_SHARE))
    rows_per_pass.clear()
    pairs = KLScorer(finetuned, tokenizer, str(tiny_model_dir))(prompts, completions)
    assert rows_per_pass == [2, 2, 1]
    for chunked in (one_by_one, pairs):
        assert [len(v) for v in chunked] == [3, 1, 5, 2, 1]
        for got, expected in zip(chunked, whole):
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-8)
    assert min(min(v) for v in whole) > 0


def test_sampled_generation_sizes_calls_for_every_sample(tiny_model_dir, monkeypatch):
    """--mini-batch-size auto counts the n samples each prompt brings: 8 rows per call with n = 4 is 2 prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esft.engines import sizing
    from esft.engines.base import Sampling
    from esft.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir),
                                max_tokens=3, mini_batch_size="auto")
    monkeypatch.setattr(sizing, "auto_rows", lambda model, length: 8)
    rows_per_call: list[int] = []
    generate = engine.model.generate
    monkeypatch.setattr(engine.model, "generate", lambda **kw: rows_per_call.append(kw["input_ids"].shape[0]) or generate(**kw))
    generation = engine.generate(["a", "b", "c", "d", "e"], sampling=Sampling(temperature=1.0, n=4, seed=1))
    assert len(generation.texts) == 20
    assert rows_per_call == [2, 2, 1]  # prompts per call (model.generate repeats each n times inside)


def test_conciseness_end_to_end_with_kl(lively_model_dir, tmp_path, capsys):
    common = ["--model", str(lively_model_dir), "--task", "conciseness", *TINY, "--sigma", "0.05",
              "--temperature", "1", "--eval-samples", "2", "--output-dir", str(tmp_path)]
    run(["train", *common, "--iterations", "3", "--save-every", "3", "--run-name", "c"], capsys)
    rows = read_jsonl(tmp_path / "c" / "metrics.jsonl")
    assert rows[0]["eval/heldout/kl"] == 0.0  # before training the model is its own base
    assert any(row["reward/std"] > 0 for row in rows[1:]), "members never differed: the update would be zero"
    last = rows[-1]
    assert last["eval/heldout/kl"] > 0
    samples = read_jsonl(tmp_path / "c" / "eval" / "iteration-3" / "heldout.jsonl")
    assert len(samples) == 16  # 8 questions x 2 samples
    for s in samples:
        assert s["reward"] == -abs(len(s["completion"].strip()) - len(s["answer"]))
    tokens = sum(s["num_tokens"] for s in samples)
    assert last["eval/heldout/kl"] == pytest.approx(sum(s["kl"] * s["num_tokens"] for s in samples) / tokens)
    assert last["eval/heldout/reward"] == pytest.approx(sum(s["reward"] for s in samples) / 16)
    # `esft eval` of the saved model against the original base: the same numbers, KL included
    run(["eval", *common, "--model", str(tmp_path / "c" / "final"), "--base-model", str(lively_model_dir),
         "--run-name", "e"], capsys)
    (again,) = read_jsonl(tmp_path / "e" / "metrics.jsonl")
    for key in ("eval/heldout/reward", "eval/heldout/mean_length", "eval/heldout/kl"):
        assert again[key] == pytest.approx(last[key], rel=1e-6), key


def test_kl_base_of_a_model_passed_as_an_object_is_its_weights_before_training(lively_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esft import ESConfig, ESTrainer

    model = AutoModelForCausalLM.from_pretrained(lively_model_dir)
    args = ESConfig(task="conciseness", max_tokens=5, temperature=1.0, eval_samples=2, logging="none", progress=False,
                    output_dir=str(tmp_path))
    trainer = ESTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(lively_model_dir), args=args)
    assert trainer.evaluate()["eval/heldout/kl"] == 0.0
    trainer.engine.update([1, 2], [0.05, -0.05])  # move the weights the engine trains in place
    assert trainer.evaluate()["eval/heldout/kl"] > 0
