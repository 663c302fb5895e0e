"""One iteration's metrics.jsonl row, and the budgets that stop training (ES and GRPO alike)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from esft.rewards.runner import Scores, mean_of


def iteration_row(iteration: int, rewards: Sequence[float], batches: Sequence[Scores], tokens: int, elapsed: float,
                  budget: dict[str, float], screened: tuple[int, int] = (0, 0)) -> tuple[dict[str, float], dict[str, float]]:
    """One iteration's metrics.jsonl row and the budget spent after it. `rewards`: what the update
    used (ES: one per member; GRPO: one per completion); `batches`: the iteration's Scores (ES: one
    per member; GRPO: the generation batch); `tokens`: generated for them; `screened`: the completions and
    tokens generated to choose the batch (ES's --prompt-candidates), counted in the budget only."""
    values = np.array(rewards, dtype=float)
    completions = sum(len(scores.total) for scores in batches)
    budget = {"completions": budget["completions"] + completions + screened[0],
              "tokens": budget["tokens"] + tokens + screened[1], "seconds": budget["seconds"] + elapsed}
    row = {
        "iteration": iteration,
        "reward/mean": float(values.mean()),
        "reward/std": float(values.std()),
        "reward/min": float(values.min()),
        "reward/max": float(values.max()),
        "completions/mean_length": tokens / completions,
        "perf/iteration_s": elapsed,
        "perf/tokens_per_s": tokens / elapsed,
        "reward/failures": sum(scores.failures for scores in batches),
        "reward/errors": sum(scores.errors for scores in batches),
        "reward/timeouts": sum(scores.timeouts for scores in batches),
        **{f"budget/{key}": value for key, value in budget.items()},
    }
    for name in batches[0].per_function:
        present = [v for v in (mean_of(scores.per_function[name]) for scores in batches) if v is not None]
        row[f"rewards/{name}/mean"] = float(np.mean(present)) if present else 0.0
        row[f"rewards/{name}/failures"] = sum(scores.failed.get(name, 0) for scores in batches)
    return row | logged_metrics(batches), budget


def logged_metrics(batches: Sequence[Scores]) -> dict[str, float]:
    """What reward functions logged over these batches: TRL's log_metric values averaged under their
    own name (as TRL logs them), and the labels of (label, reward) rewards counted as
    `rewards/<fn>/labels/<label>` (esft.rewards.conventions)."""
    row: dict[str, float] = {}
    for name in dict.fromkeys(name for scores in batches for name in scores.logged):
        values = [value for scores in batches for value in scores.logged.get(name, [])]
        row[name] = float(np.mean(values))
    for function in dict.fromkeys(name for scores in batches for name in scores.labels):
        labels = [label for scores in batches for label in scores.labels.get(function, []) if label is not None]
        for label, count in Counter(labels).items():
            row[f"rewards/{function}/labels/{label}"] = count
    return row


def budget_spent(args: Any, budget: dict[str, float]) -> str | None:
    """Why training stops early: --budget-completions or --budget-tokens reached by `budget`
    (metrics.jsonl's budget/*), said in words; None while neither is."""
    for kind in ("completions", "tokens"):
        limit = getattr(args, f"budget_{kind}")
        if limit is not None and budget[kind] >= limit:
            return f"the budget of {limit} {kind} is spent ({budget[kind]} generated for training)"
    return None


def nothing_to_do(iteration: int, args: Any, budget: dict[str, float]) -> str | None:
    """Why a trainer that stands at `iteration` has nothing left to train (a second train() call):
    --iterations reached or a budget spent, said in words; None while it has."""
    if iteration >= args.iterations:
        return (f"already at iteration {iteration} of {args.iterations}; raise args.iterations (trainer.args.iterations "
                f"= {max(args.iterations, iteration) + 10}, say) to continue")
    if (stop := budget_spent(args, budget)) is not None:
        return f"{stop} at iteration {iteration}; raise the budget to continue"
    return None
