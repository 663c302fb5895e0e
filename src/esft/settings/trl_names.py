"""TRL's (and transformers' TrainingArguments') names for settings esft spells otherwise: a user who
types one is told the esft flag, instead of "unknown setting" (ESConfig, --config YAML, the CLI).
README "Coming from TRL" lists these and the TRL names esft takes as they are."""

from __future__ import annotations

import difflib

RENAMED = {
    "max_completion_length": "--max-tokens (new tokens per completion)",
    "max_steps": "--iterations (ES updates; GRPO optimizer steps)",
    "num_train_epochs": "--iterations (ES counts updates, each on --batch-size prompts)",
    "report_to": "--logging (tensorboard, wandb or none)",
    "logging_dir": "--output-dir (metrics.jsonl and TensorBoard events live in the run directory)",
    "save_steps": "--save-every",
    "save_strategy": "--save-every (0 = no checkpoints)",
    "eval_steps": "--eval-every",
    "eval_strategy": "--eval-every (0 = before and after training only)",
    "per_device_eval_batch_size": "--eval-batch-size",
    "bf16": "--dtype bfloat16",
    "fp16": "--dtype float16",
    "torch_dtype": "--dtype",
    "use_vllm": "--engine vllm",
    "use_cpu": "--device cpu",
    "resume_from_checkpoint": "--resume",
    "model_name_or_path": "--model",
    "dataset_name": "--train-data (a file, a save_to_disk directory, or a dataset in the local cache)",
    "dataset_train_split": "--train-data (a DatasetDict trains on its 'train' split)",
    "num_completions_to_print": "nothing: per-sample completions are in <run>/eval/iteration-<N>/<split>.jsonl",
    "logging_steps": "nothing: every iteration is logged (metrics.jsonl)",
    "adam_beta1": "--adam-betas B1,B2 (both betas in one flag, e.g. 0.9,0.999)",
    "adam_beta2": "--adam-betas B1,B2 (both betas in one flag, e.g. 0.9,0.999)",
    "adam_epsilon": "--adam-eps",
}
"""TRL/transformers name -> what esft uses instead."""

ES_EQUIVALENTS = {
    "learning_rate": "--alpha (ES's step; --sigma is the noise scale)",
    "per_device_train_batch_size": "--batch-size (prompts per iteration, the same for every member)",
    "num_generations": "--population-size (members per iteration, each one completion per prompt)",
    "gradient_accumulation_steps": "--mini-batch-size (memory only: prompts per generate call)",
    "rollout_temperature": "nothing: ES generates greedily (--temperature is the evaluation's)",
}
"""ESConfig's GRPO (TRL) settings -> what an --algorithm es run uses instead."""


def unknown_setting(name: str, known: list[str] | tuple[str, ...] = ()) -> str:
    """The message for a setting ESConfig does not have: the esft flag for TRL's name, else the closest
    setting's name, else where the settings are listed."""
    key = name.replace("-", "_")
    flag = "--" + key.replace("_", "-")
    if key in RENAMED:
        return f"{flag} is TRL's name; did you mean {RENAMED[key]}?"
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f"unknown setting {name!r}; did you mean --{close[0].replace('_', '-')}?"
    return f"unknown setting {name!r}; see 'esft train --help' for the settings"
