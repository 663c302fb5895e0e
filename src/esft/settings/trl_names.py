"""TRL's (and transformers' TrainingArguments') names for settings esft spells otherwise: a user who
types one is told the esft flag, instead of "unknown setting" (ESConfig, --config YAML, the CLI).
README "Coming from TRL" lists these and the TRL names esft takes as they are."""

from __future__ import annotations

import dataclasses
import difflib
import re

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
    "rollout_temperature": "--rollout-temperature (0, ES's default, is greedy; > 0 samples members' rollouts with "
                           "common random numbers; --temperature is the evaluation's)",
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


SAME_VALUE = {"max_steps": "iterations", "max_completion_length": "max_tokens", "save_steps": "save_every",
              "eval_steps": "eval_every", "per_device_eval_batch_size": "eval_batch_size", "adam_epsilon": "adam_eps",
              "output_dir": "output_dir", "seed": "seed", "reward_weights": "reward_weights"}
"""GRPOConfig fields whose value an ESConfig field takes as it is."""
SWITCHES = {"bf16": "dtype='bfloat16'", "fp16": "dtype='float16'", "use_cpu": "device='cpu'", "use_vllm": "engine='vllm'"}
"""GRPOConfig's on/off fields: the ESConfig setting each means when on."""


def not_an_esconfig(args: object) -> str:
    """The message for ESTrainer(args=...) given something else than an ESConfig: for TRL's GRPOConfig
    (any transformers TrainingArguments), the fields the user changed, in ESConfig's names."""
    kind = type(args).__name__
    if not dataclasses.is_dataclass(args) or not hasattr(args, "max_steps"):
        return f"args must be an esft.ESConfig, got {kind}: ESConfig(...) takes the esft train flags as keywords"
    copied, counterparts, unused = [], [], []
    for name, value in _changed(args).items():
        if name in SAME_VALUE:
            copied.append(f"{SAME_VALUE[name]}={value!r}")
        elif name in SWITCHES:
            copied += [SWITCHES[name]] if value else []
        elif name in ES_EQUIVALENTS or name == "temperature" or name in RENAMED:
            text = ES_EQUIVALENTS.get("rollout_temperature" if name == "temperature" else name) or RENAMED[name]
            (unused if text.startswith("nothing") else counterparts).append(f"{name}={value!r} -> {_python(text)}")
    parts = [f"args is TRL's {kind}, not an esft.ESConfig: build esft.ESConfig(...), whose keywords are the esft "
             "train flags (ESConfig(algorithm='grpo', ...) runs TRL's GRPO through esft)"]
    if copied:
        parts.append(f"Yours that carry over: ESConfig({', '.join(copied)})")
    if counterparts:
        parts.append(f"No value to copy, ES's counterpart instead: {'; '.join(counterparts)}")
    if unused:
        parts.append(f"Not needed: {'; '.join(unused)}")
    return ". ".join(parts)


def _changed(args: object) -> dict[str, object]:
    """The dataclass fields of `args` that differ from their defaults (falsy report_to values are "none")."""
    changed = {}
    for field in dataclasses.fields(args):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue
        value = getattr(args, field.name, default)
        if value != default and not (field.name == "report_to" and value in ([], "none", ["none"])):
            changed[field.name] = value
    return changed


def _python(text: str) -> str:
    """'--max-tokens (...)' -> 'max_tokens (...)': a flag as ESConfig's keyword."""
    return re.sub(r"--([a-z][a-z-]*)", lambda match: match.group(1).replace("-", "_"), text)
