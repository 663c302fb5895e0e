"""Which run's settings `esft eval` takes, and the one line that says what an evaluation used.

A run's weights come in three forms and each evaluates with the settings of the run that wrote them
(flags override): `--model RUN/checkpoint-N` or `RUN/final` (a checkpoint: its trainer_state.json),
`--model BASE --lora-adapter RUN/final` (the adapter is the checkpoint), and `--model
RUN/final-merged` (LoRA-ES's merged export, no state of its own: its run's final/ or config.yaml)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from esft.runs.checkpoint import CheckpointError, is_checkpoint, read_state, state_signed
from esft.runs.randopt_record import RECORD_FILE, record_vouched

EVAL_INHERITS = ("task", "train_data", "eval_data", "reward_funcs", "reward_weights", "difficulty", "train_size",
                 "eval_size", "seed", "max_tokens", "eval_batch_size", "eval_samples", "temperature", "top_p",
                 "dtype", "reward_sandbox", "reward_timeout", "reward_memory_mb", "reward_workers", "failure_reward")
"""What `esft eval` takes from the settings of the run that wrote the evaluated weights."""
RANDOPT_INHERITS = ("model", "algorithm", "sigma", "noise", "rank", "trainable", "strategy", "antithetic",
                    "population_size", "validation_size", "randopt_top_k", "prompt_format")
"""What `esft eval --model RUN_DIR` of a RandOpt run also takes: the base model and its members' settings."""
SHOWN = ("task", "train_data", "eval_data", "reward_funcs", "reward_model", "reward_url", "eval_size", "max_tokens",
         "temperature", "eval_samples", "seed")
"""The settings of an evaluation's one line (esft eval prints it every time)."""


def _config_of(path: Path) -> tuple[dict[str, Any], bool, list | None] | None:
    """The run settings recorded for a weights directory, whether they carry this user's signature
    (esft.runs.signature), and the code and data files they named (esft.runs.named_files); None if it is
    not a run's."""
    if is_checkpoint(path):
        try:
            state = read_state(path)
        except CheckpointError:
            return None
        return state["config"], state_signed(state), state.get("named_files")
    ensemble = path.is_dir() and (path / RECORD_FILE).is_file()  # a RandOpt run: its kept members vote
    if ensemble or (path.name == "final-merged" and path.is_dir()):  # LoRA-ES: the run's final/ holds the state
        found = None if ensemble else _config_of(path.parent / "final")
        if found is not None:
            return found
        config_file = (path if ensemble else path.parent) / "config.yaml"
        if config_file.is_file():
            from esft.files import SETTINGS_LIMIT, read_regular_text
            from esft.runs.directory import ResumeError, read_run_yaml
            from esft.runs.signature import yaml_vouched

            try:
                config = read_run_yaml(config_file)
            except ResumeError:
                return None
            signed, named = yaml_vouched(read_regular_text(config_file, SETTINGS_LIMIT), config)
            return config, signed and record_vouched(config_file.parent), named
    return None


def run_settings_of(model: str | None, lora_adapter: str | None = None
                    ) -> tuple[dict[str, Any], Path, bool, list | None] | None:
    """The settings `esft eval` inherits, the directory they come from, whether they carry this user's
    signature (esft.runs.signature) and the files they named (esft.runs.named_files), when `model` or
    `lora_adapter` is a run's weights; else None."""
    for candidate in (lora_adapter, model):
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        found = _config_of(path)
        if found is None:
            continue
        config, signed, named = found
        inherited = {name: config[name] for name in EVAL_INHERITS if name in config}
        inherited["base_model"] = config.get("base_model") or config.get("model")  # KL against the run's own base
        if (path / RECORD_FILE).is_file():  # the base model, and what regenerates and selects its members
            inherited |= {name: config[name] for name in RANDOPT_INHERITS if name in config}
        return inherited, path, signed, named
    return None


def check_evaluated_weights(model: str | None, lora_adapter: str | None = None) -> None:
    """Before `esft eval` loads a run's weights (a checkpoint, final/, or an adapter): CheckpointError when
    a file is missing, altered, truncated or not a regular file (esft.runs.checkpoint.verify, as --resume
    checks); a checkpoint that records no digests (written before they were, or removed) is evaluated
    with one line saying its files are unverified."""
    from esft.runs.checkpoint import verify

    for candidate in (lora_adapter, model):
        path = Path(candidate).expanduser() if candidate else None
        if path is None or not is_checkpoint(path):
            continue
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"{problem}; evaluate an intact checkpoint of the run")
        if "files" not in read_state(path):
            print(f"esft: warning: {path} records no digests of its files (written before esft recorded them, or "
                  "removed): its weights and tokenizer are unverified", file=sys.stderr)


def settings_line(config: Any) -> str:
    """`esft eval: task=..., eval_data=..., eval_size=..., max_tokens=..., ...` (what was unset is left out)."""
    shown = [f"{name}={getattr(config, name)}" for name in SHOWN if getattr(config, name, None) not in (None, "")]
    return "esft eval: evaluating with " + ", ".join(shown)
