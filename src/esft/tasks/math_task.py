r"""Math (ES-at-Scale): problems with a gold answer; reward 1 if the last `\boxed{}` is right, else 0.

Prompts are chat messages in Qwen-math's format: the system turn "Please reason step by step, and
put your final answer within \boxed{}.", then the problem; they are rendered with the tokenizer's
chat template (or its plain-text ChatML rendering when the tokenizer has none). Data: the
ES-at-Scale DatasetDict directories (columns `problem` and `answer`; the answer may be a float or a
list of accepted strings), or any data file with those columns. Each eval split is reported
separately (aime, amc, math500, ...). No format reward.

Every completion is graded in a sandbox worker process under CHECK_TIMEOUT seconds (sympy may never
return on hostile input); a check that times out or crashes scores 0. math-verify is imported only
there, and only when this task is used.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

from esft.rewards.sandbox import WorkerPool
from esft.tasks.base import Task, TaskError, trusted_reward
from esft.tasks.math_grading import final_answer, gold_answers
from esft.rewards.usercode import ByReference

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
CHECK_TIMEOUT = 2.0
"""Seconds per graded completion (normalised comparison + math-verify), as ~1 s in the reference."""
GRADER = ByReference("esft.tasks.math_grading", "grade")
GRADER_WORKERS = 2
GRADER_MEMORY_MB = 4096

logger = logging.getLogger("esft")
_pool: WorkerPool | None = None


def grader_pool() -> WorkerPool:
    """The process-wide pool of grading workers (math-verify preloaded and warmed up)."""
    global _pool
    if _pool is None:
        if importlib.util.find_spec("math_verify") is None:  # fail before training, not in a worker
            raise TaskError("--task math needs math-verify: pip install math-verify")
        _pool = WorkerPool(GRADER_WORKERS, GRADER_MEMORY_MB, preload=("esft.tasks.math_grading:warm_up",))
        atexit.register(_pool.close)
    return _pool


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def grade_all(completions: Sequence[Any], answers: Sequence[Any], grader: Any = GRADER,
              timeout: float = CHECK_TIMEOUT) -> list[float]:
    """1.0/0.0 per completion; each check is one time-limited job in the grading pool."""
    jobs = [(grader, (_text(c), gold_answers(a)), {}) for c, a in zip(completions, answers, strict=True)]
    scores = []
    for outcome in grader_pool().run(jobs, timeout):
        if not outcome.ok:
            logger.debug("math check failed (%s): %s", outcome.kind, outcome.message)
        scores.append(float(outcome.value) if outcome.ok else 0.0)
    return scores


@trusted_reward  # our code; the risky part (sympy on model output) runs in the grading workers
def math_reward(prompts: Sequence, completions: Sequence, answer: Sequence, **kwargs) -> list[float]:
    r"""1.0 if the last \boxed{} answer equals the gold answer (normalised or per math-verify)."""
    return grade_all(completions, answer)


def math_prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def _math_rows(source: Any) -> dict[str, list[dict[str, Any]]]:
    from esft.tasks.loading import load_splits

    splits = load_splits(source)
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            question = row.get("problem", row.get("question"))
            if question is None and isinstance(row.get("prompt"), str):
                question = row["prompt"]
            if "answer" not in row or (question is None and "prompt" not in row):
                raise TaskError(f"{source} (split {split!r}) row {index}: math rows need 'problem' and 'answer' "
                                f"columns, got {sorted(row)}")
            if question is not None:
                row["prompt"] = math_prompt(str(question))
    return splits


def make_math_task(*, train_data=None, eval_data=None, **_: Any) -> Task:
    """Math problems from `train_data` / `eval_data` (DatasetDict directories or data files)."""
    from esft.tasks.loading import train_split

    if train_data is None and eval_data is None:
        raise TaskError("--task math needs data: --train-data and/or --eval-data, e.g. a DatasetDict directory "
                        "with columns problem and answer")
    train = train_split(_math_rows(train_data), train_data)[1] if train_data is not None else []
    evals = _math_rows(eval_data) if eval_data is not None else {}
    grader_pool()
    return Task(
        name="math",
        train_dataset=train,
        eval_datasets=evals,
        reward_funcs=[math_reward],
        accuracy_func=math_reward,
        answer=final_answer,
        metadata={"train_where": str(train_data), "eval_where": str(eval_data)},
    )
