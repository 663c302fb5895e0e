"""Evaluation of the current weights on every eval split: one code path for `esft eval` and for the
evaluations during training, so both report the same numbers.

Per split (`eval/<split>/...`): `reward` (mean over scored completions), `mean_length` (tokens),
`accuracy` (mean of the task's accuracy function = pass@1), and with K = --eval-samples > 1 sampled
completions per prompt, `pass@k` for k = 1, 2, 4, ... and K (unbiased estimator
1 − C(n−c, k)/C(n, k) averaged over prompts) and `mean@K` (mean accuracy of the K samples). A sample
counts as correct for pass@k when its accuracy is > 0.5. Tasks that ask for it also get `kl`, the
mean per-token KL(fine-tuned || base) over all generated tokens. Greedy decoding (K = 1) is the
default, as in the paper. Per-sample results go to `<run>/eval/iteration-<N>/<split>.jsonl`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esft.console import progress_bar
from esft.engines.base import Generation, Sampling, optional
from esft.files import write_text_atomic
from esft.loop.iteration_metrics import logged_metrics
from esft.rewards.runner import PROMPT_SOURCE, RewardError, RewardRunner, Scores, failing_everywhere, mean_of
from esft.tasks.base import Task


@dataclass
class EvalSettings:
    """How to decode during evaluation."""

    batch_size: int = 128
    """Prompts per generate call."""
    samples: int = 1
    """Completions per prompt (K)."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    """Seeds the sampler: every evaluation of a run (and `esft eval`) samples alike."""
    progress: bool = False
    """Show a progress bar over the evaluation's prompts (stderr)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k)/C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def ks_for(samples: int) -> list[int]:
    """The k reported for K samples: powers of two below K, and K."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def _stop_if_unscorable(scores: Scores, split: str) -> None:
    """An evaluation in which a function failed on every sample measures nothing: RewardError."""
    for name, failure in failing_everywhere([scores]).items():
        raise RewardError(name, failure, f"the evaluation of split {split!r}")


def evaluate_split(
    generate: Callable[[Sequence[str], Sampling], Any],
    rows: Sequence[dict[str, Any]],
    rewards: RewardRunner,
    accuracy: RewardRunner | None,
    settings: EvalSettings,
    kl: Callable[[Sequence[str], Sequence[Sequence[int]]], list[list[float]]] | None = None,
    split: str = "eval",
    bar: Any = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics (without the `eval/<split>/` prefix) and per-sample records of one split."""
    k = settings.samples
    sampling = Sampling(settings.temperature, settings.top_p, k, settings.seed)
    generation = _generate(generate, [row["prompt"] for row in rows], sampling, settings.batch_size, bar)
    expanded = [row for row in rows for _ in range(k)]  # Generation lists the K samples prompt by prompt
    scores = rewards.score(expanded, generation.texts, generation.token_ids)
    _stop_if_unscorable(scores, split)
    metrics = {"reward": scores.mean(), "mean_length": sum(generation.num_tokens) / len(generation.num_tokens)}
    metrics |= logged_metrics([scores])  # TRL's log_metric values, labels of (label, reward) rewards
    if accuracy is not None:
        accuracy_scores = scores if accuracy is rewards else accuracy.score(expanded, generation.texts, generation.token_ids)
        _stop_if_unscorable(accuracy_scores, split)
        accuracies = accuracy_scores.total
        metrics["accuracy"] = mean_of(accuracies) or 0.0
        correct = [value is not None and value > 0.5 for value in accuracies]
        if k > 1:
            counts = [sum(correct[i * k : (i + 1) * k]) for i in range(len(rows))]
            for j in ks_for(k):
                metrics[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in counts) / len(rows)
            metrics[f"mean@{k}"] = metrics["accuracy"]
    token_kl = None
    if kl is not None and generation.token_ids is not None:
        token_kl = kl([row["prompt"] for row in expanded], generation.token_ids)
        total_tokens = sum(len(values) for values in token_kl)
        metrics["kl"] = sum(sum(values) for values in token_kl) / total_tokens if total_tokens else 0.0
    samples = []
    for i, (row, text) in enumerate(zip(expanded, generation.texts)):
        sample = {"prompt": row.get(PROMPT_SOURCE, row["prompt"]), "completion": text, "reward": scores.total[i],
                  "num_tokens": generation.num_tokens[i]}
        if PROMPT_SOURCE in row:
            sample["prompt_text"] = row["prompt"]
        if k > 1:
            sample["sample"] = i % k
        if len(scores.per_function) > 1:
            sample["rewards"] = {name: values[i] for name, values in scores.per_function.items()}
        if scores.labels:
            sample["labels"] = {name: labels[i] for name, labels in scores.labels.items()}
        sample |= {column: values[i] for column, values in scores.extras.items() if i < len(values) and _jsonable(values[i])}
        if accuracy is not None:
            sample["accuracy"] = accuracies[i]
        if token_kl is not None:
            sample["kl"] = sum(token_kl[i]) / len(token_kl[i]) if token_kl[i] else 0.0
        sample |= {key: value for key, value in row.items() if key not in ("prompt", PROMPT_SOURCE) and key not in sample
                   and _jsonable(value)}
        samples.append(sample)
    return metrics, samples


def evaluate_task(
    generate: Callable[[Sequence[str], Sampling], Any],
    task: Task,
    rewards: RewardRunner,
    accuracy: RewardRunner | None,
    settings: EvalSettings,
    kl: Callable | None = None,
    samples_dir: Path | None = None,
) -> dict[str, float]:
    """`eval/<split>/<metric>` for every eval split; per-sample JSONL in `samples_dir` if given."""
    metrics: dict[str, float] = {}
    total = sum(len(rows) for rows in task.eval_datasets.values())
    bar = progress_bar(total, desc="eval", unit="prompt", enabled=settings.progress, leave=False) if total else None
    for split, rows in task.eval_datasets.items():
        if bar is not None:
            bar.set_postfix(split=split)
        split_metrics, samples = evaluate_split(generate, rows, rewards, accuracy, settings, kl if task.report_kl else None,
                                                split, bar)
        metrics |= {f"eval/{split}/{name}": value for name, value in split_metrics.items()}
        if samples_dir is not None:
            samples_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(samples_dir / f"{split}.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    if bar is not None:
        bar.close()
    return metrics


def _generate(generate: Callable[[Sequence[str], Sampling], Any], prompts: list[str], sampling: Sampling, batch: int,
              bar: Any) -> Any:
    """`generate(prompts, sampling)`, advancing `bar`: greedy evaluations go --eval-batch-size prompts at a
    time (the calls the engine makes anyway: the same completions); sampled ones in one call, so that
    the seeded sampler draws as it always does."""
    if bar is None or sampling.temperature > 0 or len(prompts) <= batch:
        generation = generate(prompts, sampling)
        if bar is not None:
            bar.update(len(prompts))
        return generation
    parts = []
    for start in range(0, len(prompts), batch):
        parts.append(generate(prompts[start : start + batch], sampling))
        bar.update(len(parts[-1].texts))
    ids = None if any(part.token_ids is None for part in parts) else [row for part in parts for row in part.token_ids]
    return Generation([text for part in parts for text in part.texts], [n for part in parts for n in part.num_tokens], ids)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def kl_scorer(engine, base: Any):
    """KL(current || base) per token (esft.engines.logprobs.KLScorer; `base` a path or a state dict), or
    None, said in one line, for an engine whose model is not in this process."""
    model = optional(engine, "model")
    if model is None:
        print("KL needs an in-process transformers engine; not reported", file=sys.stderr)
        return None
    from esft.engines.logprobs import KLScorer

    return KLScorer(model, engine.tokenizer, base)
