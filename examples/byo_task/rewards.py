"""A task of our own for esft: reward functions with TRL's signature, and a task factory."""

import json
from pathlib import Path


def exact_answer(prompts, completions, answer, **kwargs):
    """1.0 when the completion starts with the expected answer, else 0.0."""
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


def brevity(prompts, completions, **kwargs):
    """Shorter is better; None (no score) for an empty completion."""
    return [-len(c) / 100 if c.strip() else None for c in completions]


def read_jsonl(name):
    return [json.loads(line) for line in (Path(__file__).parent / name).read_text().splitlines()]


def make_task():
    """Used as --task examples/byo_task/rewards.py:make_task."""
    from esft.tasks import Task

    return Task(
        name="arithmetic",
        train_dataset=read_jsonl("train.jsonl"),
        eval_datasets={"easy": read_jsonl("eval.jsonl")},
        reward_funcs=[exact_answer, brevity],
        reward_weights=[1.0, 0.5],
        accuracy_func=exact_answer,
    )
