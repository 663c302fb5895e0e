"""ESConfig: every setting of a run, one documented field each (CLI flags are these in kebab-case)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded"
CHOICES = {
    "noise": ("iid", "correlated"),
    "reward_shaping": ("zscore", "rank", "raw"),
    "dtype": ("float32", "bfloat16", "float16"),
    "logging": ("tensorboard", "wandb", "none"),
}


class ConfigError(ValueError):
    """An invalid setting; `name` is the field (flag) at fault."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"--{name.replace('_', '-')}: {message}")


def _doc(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ESConfig:
    """Settings of an ES fine-tuning run. Defaults: the paper's ES hyperparameters (N=30, σ=1e-3,
    α=σ/2) on the embedded tiny model and easy Countdown, sized to finish in minutes on a CPU."""

    model: str = _doc(
        f"Hugging Face hub id or local directory of a causal LM; '{EMBEDDED_MODEL}' is the tiny "
        "Countdown model shipped inside esft.",
        default=EMBEDDED_MODEL,
    )
    task: str = _doc("Task name (registered tasks: countdown).", default="countdown")
    train_data: str | None = _doc(
        "Training data file or directory (Countdown: a JSON list of {numbers, target} rows or a "
        "save_to_disk dataset directory). Default: problems generated from --seed.",
        default=None,
    )
    eval_data: str | None = _doc(
        "Evaluation data file or directory; every split is reported separately. Default: "
        "--eval-size generated held-out problems never used for training.",
        default=None,
    )
    difficulty: str = _doc("Countdown generator setting: easy, medium or paper.", default="easy")
    train_size: int = _doc("Generated training problems (when --train-data is not given).", default=1000)
    eval_size: int = _doc("Generated held-out problems (when --eval-data is not given).", default=500)
    population_size: int = _doc("N, perturbed members per iteration.", default=30)
    sigma: float = _doc("σ, the noise scale of member perturbations θ + σ·ε.", default=1e-3)
    alpha: float | None = _doc(
        "α, the step: θ += (α/N)·Σ zᵢ·εᵢ (not divided by σ, as in the paper). Default: σ/2.",
        default=None,
    )
    iterations: int = _doc("ES iterations (updates); 0 = evaluate only.", default=40)
    batch_size: int = _doc("Prompts per iteration, the same batch for every member.", default=32)
    mini_batch_size: int | None = _doc(
        "Prompts per generate call (memory only: results are identical). Default: the whole batch.",
        default=None,
    )
    max_tokens: int = _doc("Most new tokens generated per completion.", default=64)
    eval_every: int = _doc(
        "Evaluate every this many iterations (0 = only before training and at the end).", default=0
    )
    eval_batch_size: int = _doc("Prompts per generate call during evaluation.", default=128)
    noise: str = _doc(
        "Noise scheme: iid (tensor k seeded from member seed + k) or correlated (every tensor "
        "seeded alike, the paper's original scheme).",
        default="iid",
    )
    reward_shaping: str = _doc(
        "Fitness shaping of member rewards: zscore (paper), rank (centered ranks) or raw. "
        "Reward is maximized.",
        default="zscore",
    )
    trainable: str | None = _doc(
        "Regular expression; ES perturbs and updates only parameters whose name matches "
        "(re.search). Default: all parameters.",
        default=None,
    )
    dtype: str = _doc("Model weights dtype: float32, bfloat16 or float16.", default="float32")
    device: str = _doc("cpu, cuda, cuda:N or auto (CUDA if available).", default="auto")
    seed: int = _doc("Run seed: member seeds and prompt batches derive from it and the iteration.", default=0)
    output_dir: str = _doc("Directory that holds run directories.", default="runs")
    run_name: str | None = _doc(
        "Run directory name under --output-dir. Default: <task>-s<seed>-<timestamp>.", default=None
    )
    logging: str = _doc("Metrics sink besides metrics.jsonl: tensorboard, wandb or none.", default="tensorboard")
    save_every: int = _doc("Write checkpoint-<N>/ every this many iterations (0 = never).", default=10)
    save_total_limit: int | None = _doc("Keep at most this many checkpoints (oldest deleted).", default=None)
    resume: str | None = _doc(
        "Resume from a checkpoint-<N> directory, or from the newest complete checkpoint of a run "
        "directory.",
        default=None,
    )
    progress: bool = _doc("Show a progress bar.", default=True)

    def __post_init__(self) -> None:
        if self.alpha is None:
            self.alpha = self.sigma / 2 if _is_number(self.sigma) else None
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field and how to fix it."""
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        positive = {"sigma": "a small positive noise scale such as 1e-3", "alpha": "a positive step such as 5e-4"}
        for name, hint in positive.items():
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}; use {hint}")
        minimum = {
            "population_size": 2,
            "batch_size": 1,
            "max_tokens": 1,
            "eval_batch_size": 1,
            "train_size": 1,
            "eval_size": 1,
            "iterations": 0,
            "eval_every": 0,
            "save_every": 0,
        }
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ConfigError(name, f"must be >= {low}, got {getattr(self, name)}")
        for name in ("mini_batch_size", "save_total_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1 (or left unset), got {getattr(self, name)}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.trainable is not None:
            try:
                re.compile(self.trainable)
            except re.error as error:
                raise ConfigError("trainable", f"is not a valid regular expression ({error})") from None
        if self.run_name is not None and (not self.run_name or "/" in self.run_name):
            raise ConfigError("run_name", f"must be a plain directory name, got {self.run_name!r}")
        if self.model != EMBEDDED_MODEL and _looks_like_path(self.model) and not Path(self.model).is_dir():
            raise ConfigError(
                "model", f"directory {self.model!r} does not exist; give a model directory or a hub id"
            )
        for name in ("train_data", "eval_data", "resume"):
            value = getattr(self, name)
            if value is not None and not Path(value).exists():
                raise ConfigError(name, f"{value!r} does not exist; check the path")

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for config.yaml and checkpoints."""
        return dataclasses.asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _looks_like_path(model: str) -> bool:
    # Hub ids are "name" or "org/name"; anything with more slashes, a leading dot/slash or ~ is a path.
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).exists()


def _check_type(name: str, value: Any, annotation: str) -> None:
    optional = "None" in annotation
    if value is None:
        if not optional:
            raise ConfigError(name, "must be set")
        return
    base = annotation.replace("| None", "").strip()
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": _is_number(value),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[base]
    if not ok:
        raise ConfigError(name, f"must be {'an' if base == 'int' else 'a'} {base}, got {value!r}")
