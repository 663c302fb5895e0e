"""The rules an ESConfig must satisfy (its fields: esft.settings.fields): one ConfigError naming the field (the
flag) and the fix, the first invalid one of the whole config, ES variants and RandOpt's settings included."""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
from pathlib import Path
from typing import Any

from esft.engines.registry import ENGINES, MASTER_WEIGHTS
from esft.es.fitness import FAILED_SAMPLES
from esft.es.batches import PROMPT_CHOICES
from esft.es.groups import groups_problem
from esft.es import schedules
from esft.es.noise import NOISE_SCHEMES
from esft.es.optimizers import LEARNING_RATE_IN_STEP, OPTIMIZERS
from esft.es.shaping import REWARD_SHAPING
from esft.es.step_rules import STEP_RULES, default_alpha
from esft.es.strategies import STRATEGIES
from esft.files import looks_like_path
from esft.models.gguf import gguf_problem, is_gguf
from esft.settings.fields import ALGORITHMS, DEFAULTS, EMBEDDED_MODEL, ES_ONLY, GRPO_ONLY, RANDOPT_OWN, RANDOPT_UNUSED
from esft.settings.trl_names import ES_EQUIVALENTS

CHOICES = {  # the ES and engine choices are their registries themselves (a registered one is a choice too)
    "noise": NOISE_SCHEMES,
    "optimizer": OPTIMIZERS,
    "step_rule": STEP_RULES,
    "reward_shaping": REWARD_SHAPING,
    "prompt_choice": PROMPT_CHOICES,
    "strategy": STRATEGIES,
    "failed_samples": FAILED_SAMPLES,
    "prompt_format": ("auto", "raw", "chat"),
    "dtype": ("float32", "bfloat16", "float16"),
    "master_weights": ("auto", *MASTER_WEIGHTS),
    "logging": ("tensorboard", "wandb", "none"),
    "engine": ENGINES,
    "executor": ("local", "ray"),
    "vllm_cpu_gemm": ("repack", "plain"),
    "algorithm": ALGORITHMS,
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),  # TRL 1.16's
    "scale_rewards": ("group", "batch", "none"),
}


SHOWN_CHARS = 200
"""The most characters of a value an error message echoes (a 340-byte YAML can hold 10^9 values)."""
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 8, SHOWN_CHARS, SHOWN_CHARS


def shown(value: Any) -> str:
    """repr(value) for an error message, at most SHOWN_CHARS characters (never the whole of a huge value)."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


class ConfigError(ValueError):
    """An invalid setting; `name` is the field (flag) at fault."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"--{name.replace('_', '-')}: {message}")


def differs_from_default(config, name: str) -> bool:
    """Whether setting `name` differs from its default (α's follows σ: esft.es.step_rules.default_alpha): a setting
    given for an engine, executor or algorithm the run does not use is refused, never ignored."""
    if name == "alpha":  # None until --sigma auto has chosen σ
        return getattr(config, name) != (default_alpha(config.sigma, config.step_rule) if is_number(config.sigma) else None)
    return getattr(config, name) != DEFAULTS[name]


def custom_rewards(settings) -> bool:
    """--reward-funcs, --reward-model or --reward-url given (an ESConfig or a room's settings holding them): the
    task is built from the data files."""
    return bool(settings.reward_funcs or settings.reward_model or settings.reward_url)


def uses_lora(settings) -> bool:
    """LoRA-ES (esft.engines.lora), for an ESConfig or an engine's settings: --lora-r or --lora-adapter given, or
    --model is a PEFT adapter directory."""
    return settings.lora_r > 0 or settings.lora_adapter is not None or is_adapter_dir(settings.model)


MAXIMUM = {"population_size": (2**24, "EGGROLL's largest populations are 2^20 members"),
           "batch_size": (2**24, "prompts per iteration"), "iterations": (10**9, "the most a checkpoint records"),
           "train_size": (10**6, "generated problems: a million take about a minute to make here"),
           "eval_size": (10**6, "evaluation rows per split, each generated for at every evaluation"),
           "rank": (4096, "a low-rank perturbation wider than any matrix is full-rank noise at more cost"),
           "eval_samples": (4096, "completions sampled per evaluation prompt, each kept in memory"),
           "reward_workers": (256, "reward worker processes, each a Python interpreter"),
           "sigma": (1.0, "σ = 1 already adds noise as large as a typical weight: no model survives more")}
"""Upper bounds of sizes (each with why), so that a typo is one line, not an allocation of terabytes."""


def check(config) -> None:
    """Raise ConfigError naming the first invalid field of an ESConfig and how to fix it."""
    for f in dataclasses.fields(config):
        _check_type(f.name, getattr(config, f.name), f.type)
        if f.type.startswith("float") and is_number(getattr(config, f.name)) and not math.isfinite(getattr(config, f.name)):
            raise ConfigError(f.name, f"must be a finite number, got {getattr(config, f.name)}")
    if isinstance(config.sigma, str) and config.sigma != "auto":
        raise ConfigError("sigma", f"must be a number such as 1e-3, or auto (measured before training); got "
                          f"{shown(config.sigma)}")
    positive = {"sigma": "a small positive noise scale such as 1e-3", "alpha": "a positive step such as 5e-4"}
    for name, hint in positive.items():
        if getattr(config, name) is None or getattr(config, name) == "auto":  # α of --sigma auto: set once σ is chosen
            continue
        if not getattr(config, name) > 0:
            raise ConfigError(name, f"must be > 0, got {getattr(config, name)}; use {hint}")
    if config.rollout_temperature is not None and not config.rollout_temperature >= 0:
        raise ConfigError("rollout_temperature", f"must be >= 0 (0: greedy rollouts), got {config.rollout_temperature}")
    minimum = {"seed": 0, "population_size": 2, "batch_size": 1, "prompt_groups": 1, "prompt_candidates": 1,
               "max_tokens": 1, "eval_batch_size": 1,
               "train_size": 1, "eval_size": 1, "iterations": 0, "eval_every": 0, "save_every": 0, "eval_samples": 1,
               "reward_workers": 1, "reward_memory_mb": 0, "rank": 1, "tensor_parallel_size": 1, "workers": 1,
               "ray_cpus_per_worker": 0, "ray_gpus_per_worker": 0}
    for name, low in minimum.items():
        if getattr(config, name) is not None and getattr(config, name) < low:
            raise ConfigError(name, f"must be >= {low}, got {getattr(config, name)}")
    for name, (high, why) in MAXIMUM.items():  # checked before anything loads: beyond them, arrays of terabytes
        if is_number(getattr(config, name)) and getattr(config, name) > high:
            raise ConfigError(name, f"must be <= {high} ({why}), got {shown(getattr(config, name))}")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {config.gpu_memory_utilization}")
    if isinstance(config.mini_batch_size, str) and config.mini_batch_size != "auto":
        if not config.mini_batch_size.isdigit():
            raise ConfigError("mini_batch_size", f"must be auto or a number of prompts, got {shown(config.mini_batch_size)}")
        config.mini_batch_size = int(config.mini_batch_size)
    for name in ("mini_batch_size", "save_total_limit", "max_model_len", "vllm_max_loras"):
        if isinstance(getattr(config, name), int) and getattr(config, name) < 1:
            raise ConfigError(name, f"must be >= 1 (or left unset), got {getattr(config, name)}")
    for name, allowed in CHOICES.items():
        if getattr(config, name) not in allowed:
            raise ConfigError(name, f"must be one of {', '.join(allowed)}; got {shown(getattr(config, name))}")
    _check_scale_out(config)
    _check_master_weights(config)
    _check_algorithm(config)
    if config.population_batching not in (True, False, "auto"):
        raise ConfigError("population_batching", f"must be true, false or auto; got {shown(config.population_batching)}")
    if config.population_batching is True and not ENGINES[config.engine].batches_members(config.noise, config.uses_lora()):
        raise ConfigError("population_batching", f"with --engine {config.engine} needs --noise lowrank (members as "
                          "LoRA adapters); full-rank members run one at a time: drop --population-batching")
    _check_lora(config)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", config.device):
        raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N; got {shown(config.device)}")
    if config.trainable is not None:
        try:
            re.compile(config.trainable)
        except re.error as error:
            raise ConfigError("trainable", f"is not a valid regular expression ({error})") from None
    if config.run_name is not None and (config.run_name in ("", ".", "..") or "/" in config.run_name or "\\" in config.run_name):
        raise ConfigError("run_name", f"must be a plain directory name (no '/', not '.' or '..'), got {shown(config.run_name)}")
    if Path(config.output_dir).exists() and not Path(config.output_dir).is_dir():
        raise ConfigError("output_dir", f"{shown(config.output_dir)} is a file, not a directory; pick a directory for runs")
    if is_gguf(config.model) and (problem := gguf_problem(config.model)):
        raise ConfigError("model", problem)
    if (config.model != EMBEDDED_MODEL and not is_gguf(config.model) and _looks_like_path(config.model)
            and not Path(config.model).is_dir()):
        raise ConfigError(
            "model", f"directory {shown(config.model)} does not exist; give a model directory or a hub id"
        )
    for name in ("train_data", "eval_data", "resume"):
        value = getattr(config, name)
        # train/eval data may also name a dataset in the local cache: checked when loaded
        if value is not None and not Path(value).exists() and (name == "resume" or looks_like_path(value)):
            raise ConfigError(name, f"{shown(value)} does not exist; check the path")
    if (config.task == "custom") != custom_rewards(config):
        raise ConfigError("task" if custom_rewards(config) else "reward_funcs",
                          f"--reward-funcs/--reward-model/--reward-url build their own task from --train-data/--eval-data; "
                          f"drop --task {config.task}" if custom_rewards(config) else "--task custom needs --reward-funcs module:function")
    _check_reward_services(config)
    if not config.reward_url_deadline >= 0:
        raise ConfigError("reward_url_deadline", f"must be >= 0 seconds, got {config.reward_url_deadline}")
    _check_data_selection(config)
    if not config.reward_timeout > 0:
        raise ConfigError("reward_timeout", f"must be > 0 seconds, got {config.reward_timeout}")
    if not config.temperature >= 0:
        raise ConfigError("temperature", f"must be >= 0, got {config.temperature}")
    if not 0 < config.top_p <= 1:
        raise ConfigError("top_p", f"must be in (0, 1], got {config.top_p}")
    if config.eval_samples > 1 and config.temperature == 0:
        raise ConfigError("eval_samples", f"{config.eval_samples} samples per prompt need sampling: add --temperature 1 "
                          "(greedy decoding gives the same completion every time)")
    config.parsed_reward_weights()
    _check_variants(config)
    _check_randopt(config)

def _check_scale_out(config) -> None:
    """An engine's own settings need that --engine (esft.engines.registry) and Ray settings --executor ray:
    never silently ignored."""
    owners = [("engine", spec.name, spec.own_settings) for spec in ENGINES.values()]
    for engine_or_executor, wanted, names in (
        *owners, ("executor", "ray", ("workers", "ray_address", "ray_cpus_per_worker", "ray_gpus_per_worker")),
    ):
        if getattr(config, engine_or_executor) == wanted:
            continue
        for name in names:
            if differs_from_default(config, name):
                flag = f"--{engine_or_executor} {wanted}"
                raise ConfigError(name, f"is a setting of {flag}, which this run does not use (--{engine_or_executor} "
                                  f"{getattr(config, engine_or_executor)}); add {flag} or drop it")


def _check_master_weights(config) -> None:
    """--master-weights none on an engine that keeps it (esft.engines.registry: master_free)."""
    if config.master_weights == "none" and not ENGINES[config.engine].master_free:
        free = ", ".join(name for name, spec in ENGINES.items() if spec.master_free)
        raise ConfigError("master_weights", f"--engine {config.engine} keeps a float32 master of the weights; "
                          f"--master-weights none needs --engine {free} (or leave it at auto)")


def _check_lora(config) -> None:
    """LoRA-ES settings (esft.engines.lora): consistent, and never silently ignored."""
    if config.lora_r < 0:
        raise ConfigError("lora_r", f"must be >= 0 (0 = off), got {config.lora_r}")
    if config.lora_dropout != 0:
        raise ConfigError("lora_dropout", f"ES uses no gradients, so LoRA dropout (got {config.lora_dropout}) would "
                          "only add noise to the rollouts' rewards; drop --lora-dropout (0 is the only value)")
    adapter = config.lora_adapter
    if adapter is not None and not is_adapter_dir(adapter):
        raise ConfigError("lora_adapter", f"{shown(adapter)} is not a PEFT adapter directory (no adapter_config.json); "
                          "give a directory written by PeftModel.save_pretrained or an esft LoRA run's final/")
    if is_adapter_dir(config.model):
        if adapter is not None:
            raise ConfigError("lora_adapter", f"--model {config.model} is itself a LoRA adapter (on its base model); "
                              "drop --lora-adapter, or give the base model as --model")
        adapter = config.model
    if adapter is not None:
        for name in ("lora_r", "lora_alpha", "lora_target_modules"):
            if getattr(config, name):
                raise ConfigError(name, f"the adapter {adapter} sets its own rank, scaling and target modules; "
                                  "drop this flag")
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        raise ConfigError("lora_alpha", f"must be > 0, got {config.lora_alpha}")
    if config.lora_r == 0:
        for name in ("lora_alpha", "lora_target_modules"):
            if getattr(config, name) is not None:
                raise ConfigError(name, "is a setting of --lora-r, which this run does not use; add --lora-r R or drop it")
    if config.uses_lora() and config.algorithm == "grpo":
        raise ConfigError("algorithm", "LoRA-ES (--lora-r, --lora-adapter, an adapter as --model) is an ES path; "
                          "--algorithm grpo trains the full model: drop the LoRA settings or use --algorithm es")
    if config.uses_lora() and config.noise not in ENGINES[config.engine].lora_noise:
        raise ConfigError("noise", f"LoRA-ES on --engine {config.engine} perturbs the adapter with --noise "
                          f"{' or '.join(ENGINES[config.engine].lora_noise)} (each member is an adapter already): drop "
                          f"--noise {config.noise}")


def _check_algorithm(config) -> None:
    """ES settings need --algorithm es and GRPO settings --algorithm grpo; budgets and GRPO values in range."""
    for name in ("budget_completions", "budget_tokens"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ConfigError(name, f"must be >= 1 (or left unset for no limit), got {getattr(config, name)}")
    typed = getattr(config, "_typed_grpo", ()) if config.algorithm != "grpo" else ()  # esft.settings.config
    changed = [name for name in (ES_ONLY if config.algorithm == "grpo" else GRPO_ONLY)
               if differs_from_default(config, name) or name in typed]
    if changed and config.algorithm == "grpo":
        hint = "; GRPO's batch is --per-device-train-batch-size completions" if changed[0] in ("batch_size", "population_size") else ""
        if changed[0] == "optimizer":
            hint = "; GRPO always steps with TRL's AdamW, which --adam-betas, --adam-eps and --weight-decay set"
        raise ConfigError(changed[0], f"is an ES setting, which --algorithm grpo does not use{hint}; drop it")
    if changed:
        instead = f"; in an ES run, did you mean {ES_EQUIVALENTS[changed[0]]}?" if changed[0] in ES_EQUIVALENTS else ""
        raise ConfigError(changed[0], f"is a GRPO setting (TRL's name); add --algorithm grpo or drop it{instead}")
    if config.algorithm != "grpo":
        return
    for name, low in {"num_generations": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
                      "num_iterations": 1}.items():
        if getattr(config, name) < low:
            raise ConfigError(name, f"must be >= {low}, got {getattr(config, name)}")
    if config.rollout_temperature is not None and not config.rollout_temperature > 0:
        raise ConfigError("rollout_temperature", f"must be > 0 for GRPO (it samples), got {config.rollout_temperature}")
    for name in ("learning_rate", "epsilon", "max_grad_norm"):
        if not getattr(config, name) > 0:
            raise ConfigError(name, f"must be > 0, got {getattr(config, name)}")
    if not config.beta >= 0:
        raise ConfigError("beta", f"must be >= 0, got {config.beta}")
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps
    if batch % config.num_generations:
        raise ConfigError("per_device_train_batch_size", f"{config.per_device_train_batch_size} x "
                          f"{config.gradient_accumulation_steps} accumulation steps = {batch} completions per generation "
                          f"batch, not a multiple of --num-generations {config.num_generations} (whole prompt groups)")
    if config.dtype == "float16":
        raise ConfigError("dtype", "float16 is not trained by --algorithm grpo here; use float32 or bfloat16")
    if re.fullmatch(r"cuda:[1-9]\d*", config.device):
        raise ConfigError("device", f"{config.device}: TRL trains on the first visible GPU; use "
                          f"CUDA_VISIBLE_DEVICES={config.device[5:]} with --device cuda")


def _check_reward_services(config) -> None:
    """--reward-model directories exist, --reward-url URLs parse, --reward-model-device is a device."""
    for spec in split_list(config.reward_model):
        if _looks_like_path(spec) and not Path(spec).is_dir():
            raise ConfigError("reward_model", f"directory {shown(spec)} does not exist; give a reward model directory or a hub id")
    for url in (url for group in split_list(config.reward_url) for url in group.split("|")):
        if problem := url_problem(url):
            raise ConfigError("reward_url", problem)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", config.reward_model_device):
        raise ConfigError("reward_model_device", f"must be auto, cpu, cuda or cuda:N; got {shown(config.reward_model_device)}")


def url_problem(url: str) -> str | None:
    """Why `url` is not a reward service URL such as http://host:8000 (None if it is one)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as error:
        return f"{shown(url)} is not a valid URL ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{shown(url)} is not an http(s) URL with a host, such as http://127.0.0.1:8000"
    if parts.query or parts.fragment:
        return f"{shown(url)}: give the service's base URL, without ?query or #fragment"
    return None


def reward_weights(config) -> list[float] | None:
    """--reward-weights as floats, checked against the number of rewards (--reward-funcs, then
    --reward-model, then --reward-url)."""
    if config.reward_weights is None:
        return None
    try:
        weights = [float(w) for w in config.reward_weights.split(",")]
    except ValueError:
        raise ConfigError("reward_weights", f"must be comma-separated numbers such as 1,0.5 (or a list); got "
                          f"{shown(config.reward_weights)}") from None
    if not custom_rewards(config):  # functions given to ESTrainer: it checks the count against them
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError("reward_weights", f"must be finite numbers, got {shown(config.reward_weights)}")
        return weights
    count = sum(len(split_list(value)) for value in (config.reward_funcs, config.reward_model, config.reward_url))
    if len(weights) != count or not all(math.isfinite(w) for w in weights):
        raise ConfigError("reward_weights", f"{shown(config.reward_weights)} must be {count} finite numbers, one per reward "
                          "(--reward-funcs, then --reward-model, then --reward-url)")
    return weights


def is_adapter_dir(path: str | None) -> bool:
    """Whether `path` is a PEFT adapter directory (it holds adapter_config.json)."""
    return path is not None and (Path(path).expanduser() / "adapter_config.json").is_file()


def split_list(value: str | None) -> list[str]:
    """A comma-separated setting as its non-empty items."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def is_number(value: Any) -> bool:
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
    if base == "int | str":  # a number, or a word such as "auto" (checked by its own rule)
        base = "int" if isinstance(value, int) else "str"
    if base == "float | str":  # a number, or a word such as "auto" (checked by its own rule)
        base = "str" if isinstance(value, str) else "float"
    if base == "bool | str":  # true/false, or a word such as "auto" (checked by its own rule)
        base = "bool" if isinstance(value, bool) else "str"
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": is_number(value),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[base]
    if not ok:
        raise ConfigError(name, f"must be {'an' if base == 'int' else 'a'} {base}, got {shown(value)}")


def _check_data_selection(config) -> None:
    """--train-rows/--eval-rows are START:STOP slices; --prompt-column/--prompt-template need data of
    their own (a registered task or a --task factory builds its own prompts)."""
    for name in ("train_rows", "eval_rows"):
        value = getattr(config, name)
        if value is not None and not re.fullmatch(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*", value):
            raise ConfigError(name, f"expected START:STOP such as 0:200, 200: or :-100 (a Python slice of the rows), "
                              f"got {shown(value)}")
    if config.prompt_column is not None and config.prompt_template is not None:
        raise ConfigError("prompt_column", "give --prompt-column or --prompt-template, not both (a template names "
                          "its columns itself, e.g. '{context}')")
    for name in ("prompt_column", "prompt_template"):
        if getattr(config, name) is not None and config.task != "custom" and not custom_rewards(config):
            if config.task != "countdown" or config.train_data is not None or config.eval_data is not None:
                raise ConfigError(name, f"applies to data given with --reward-funcs (or --reward-model, --reward-url) "
                                  f"or to ESTrainer's datasets; --task {config.task} builds its own prompts")


def _check_variants(config) -> None:
    """ConfigError naming the first invalid ES-variant setting and how to fix it."""
    if config.antithetic:  # the spelling from before --strategy: read into the strategy, never written
        if config.strategy not in ("paper", "antithetic"):
            raise ConfigError("antithetic", f"--antithetic is --strategy antithetic, but --strategy is "
                              f"{config.strategy}: give one of them")
        config.strategy = "antithetic"
    config.antithetic = None
    strategy = STRATEGIES[config.strategy]
    if problem := strategy.population_problem(config.population_size):
        raise ConfigError("population_size", f"--strategy {config.strategy} {problem}")
    if config.step_rule != "paper" and config.optimizer in LEARNING_RATE_IN_STEP:
        raise ConfigError("step_rule", f"{config.step_rule} scales the sgd step; --optimizer {config.optimizer} "
                          "normalizes its step, so the rule would change nothing: drop --step-rule or use --optimizer sgd")
    if config.prompt_choice != DEFAULTS["prompt_choice"] and config.prompt_candidates == 1:
        raise ConfigError("prompt_choice", f"{config.prompt_choice} chooses the batch among --prompt-candidates' "
                          "candidates, and there are none to choose from at --prompt-candidates 1: give "
                          "--prompt-candidates 8, say, or drop --prompt-choice")
    if config.prompt_groups > 1:
        if problem := groups_problem(config.population_size, config.batch_size, config.prompt_groups, strategy.mirrored):
            raise ConfigError("prompt_groups", problem)
        if REWARD_SHAPING[config.reward_shaping].needs_shared_prompts:
            raise ConfigError("reward_shaping", f"{config.reward_shaping} compares members on the same prompts, and "
                              f"--prompt-groups {config.prompt_groups} scores each group on its own: use "
                              "per_prompt_centered (centred within each group's prompts) or a shaping over members")
    parts = str(config.adam_betas).split(",")
    try:
        betas = [float(part) for part in parts]
    except ValueError:
        betas = []
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        raise ConfigError("adam_betas", f"must be two numbers in [0, 1) such as 0.9,0.999; got {shown(config.adam_betas)}")
    if not config.adam_eps > 0:
        raise ConfigError("adam_eps", f"must be > 0, got {config.adam_eps}; use e.g. 1e-8")
    if config.weight_decay < 0:
        raise ConfigError("weight_decay", f"must be >= 0, got {config.weight_decay}")
    for name in ("sigma_schedule", "alpha_schedule"):
        value = getattr(config, name)
        try:
            schedules.parse(value)
        except ValueError:
            raise ConfigError(name, f"must be constant, linear, cosine, or linear:F / cosine:F with a final fraction F "
                              f"in [0, 1] (e.g. cosine:0.1); got {shown(value)}")


def _check_randopt(config) -> None:
    """ConfigError naming the first invalid RandOpt setting (or one RandOpt does not use) and how to fix it."""
    if config.algorithm != "randopt":
        for name in RANDOPT_OWN:
            if differs_from_default(config, name):
                raise ConfigError(name, f"is a setting of --algorithm randopt, which this run does not use "
                                  f"(--algorithm {config.algorithm}); add --algorithm randopt or drop it")
        return
    if config.sigma == "auto":
        raise ConfigError("sigma", "auto is chosen before ES's first iteration; RandOpt's members are drawn at one "
                          "σ of yours: run esft sigma-scan with these settings and give its --sigma")
    for name in RANDOPT_UNUSED:
        if differs_from_default(config, name):
            instead = "; its members are scored on --validation-size rows" if name == "batch_size" else ""
            raise ConfigError(name, f"is a setting of the ES update, which --algorithm randopt (no update: N members "
                              f"scored once) does not use{instead}; drop it")
    if config.iterations not in (0, DEFAULTS["iterations"]):
        raise ConfigError("iterations", "--algorithm randopt scores --population-size members once and has no "
                          "iterations; drop --iterations (the budget: --population-size x --validation-size completions)")
    for name in ("randopt_top_k", "validation_size"):
        if getattr(config, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(config, name)}")
    if config.randopt_top_k > config.population_size:
        raise ConfigError("randopt_top_k", f"keeps K of the --population-size members, so K <= N; got K = "
                          f"{config.randopt_top_k} > N = {config.population_size}: lower K or raise N")
    if config.uses_lora():
        raise ConfigError("algorithm", "--algorithm randopt perturbs the full model here; drop the LoRA settings "
                          "(--lora-r, --lora-adapter)")
