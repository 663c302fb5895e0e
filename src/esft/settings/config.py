"""ESConfig: every setting of a run (its fields: esft.settings.fields; CLI flags are their names in kebab-case), the
defaults' post-processing and the validation on construction (esft.settings.rules)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from esft.models.gguf import converted_folder, is_gguf
from esft.settings.fields import EMBEDDED_MODEL, GROUPS, GRPO_ONLY, Fields
from esft.settings.trl_names import not_an_esconfig, unknown_setting
from esft.es.optimizers import beta_pair
from esft.es.step_rules import default_alpha
from esft.settings.rules import CHOICES, ConfigError, check, custom_rewards, is_number, reward_weights, split_list, uses_lora

T = TypeVar("T")

__all__ = ["CHOICES", "DEMO_PRESET", "EMBEDDED_MODEL", "MODEL_PRESET", "GROUPS", "ConfigError", "ESConfig", "embedded_model_path", "es_config",
           "is_demo", "model_path", "settings_for", "split_list"]

# The demo's speed preset: on the embedded model, low-rank noise with the whole population in one batched
# generate call (--mini-batch-size auto: all 32 prompts × 30 members, 960 rows, on CPU) is the fastest
# setting measured to keep the demo's accuracy gain (docs/benchmarks.md). `esft train` adds it as defaults
# on the demo, the embedded model on its Countdown task (esft.settings.presets); the user's own data or
# reward on the embedded model, and ESConfig's own defaults, stay the paper's.
DEMO_PRESET = {"noise": "lowrank", "rank": 1, "population_batching": True}
MODEL_PRESET = {"noise": "lowrank", "rank": 4, "population_size": 64, "batch_size": 2, "step_rule": "sqrt_n",
                "sigma": "auto"}
"""What `esft train` adds as defaults on any model but the embedded one (esft.settings.presets): rank-4 low-rank
noise, 64 members on 2 prompts per iteration (128 completions), z-scored fitness with the step's norm kept at the
paper's rule at N = 8 (--step-rule sqrt_n, α = σ/(2√8)), σ chosen by --sigma auto on the run's own model and data.
The design learned most per completion on SmolLM2-135M-Instruct of those measured, across tasks and seeds
(docs/benchmarks.md#es-design)."""
USERS_OWN = ("train_data", "eval_data", "reward_funcs", "reward_model", "reward_url")
"""Settings that make a run on the embedded model the user's own, not the demo."""


def is_demo(settings: dict[str, Any]) -> bool:
    """Whether settings (the given ones, by name) are the demo's: ES on the embedded model and its Countdown
    task, with no data or reward of the user's."""
    return (settings.get("model", EMBEDDED_MODEL) == EMBEDDED_MODEL and settings.get("algorithm", "es") == "es"
            and settings.get("task", "countdown") == "countdown" and not any(settings.get(name) for name in USERS_OWN))


def embedded_model_path() -> Path:
    """Directory of the tiny Countdown model shipped inside the package."""
    from importlib import resources

    return Path(str(resources.files("esft") / "assets" / "countdown-tiny"))


def model_path(args: Any, model: str | None = None) -> str:
    """The directory or hub id to load: `model` or --model (`args`: an ESConfig or an engine's settings), with
    'embedded' resolved and a GGUF file converted to a safetensors folder (once: esft.models.gguf)."""
    name = model or args.model
    if name == EMBEDDED_MODEL:
        return str(embedded_model_path())
    if is_gguf(name):
        return str(converted_folder(name))
    return name


@dataclass
class ESConfig(Fields):
    """Settings of an ES fine-tuning run. Defaults: the paper's ES hyperparameters (N=30, σ=1e-3,
    α=σ/2, i.i.d. full-rank noise) on the embedded tiny model and easy Countdown, sized to finish in
    minutes on a CPU. `esft train` adds DEMO_PRESET as defaults on the demo and MODEL_PRESET on any other model
    (esft.settings.presets)."""

    def __post_init__(self) -> None:
        if self.alpha is None:  # --sigma auto: chosen with σ, before the first iteration
            self.alpha = default_alpha(self.sigma, self.step_rule) if is_number(self.sigma) else None
        if self.lora_alpha is None and is_number(self.lora_r) and self.lora_r > 0:
            self.lora_alpha = 2.0 * self.lora_r
        # a list (Python, YAML; GRPOConfig's form of reward_weights) means the same as commas
        for name in ("reward_model", "reward_url", "reward_skip_failing", "reward_weights"):
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, ",".join(str(item) for item in getattr(self, name)))
        if self.custom_rewards() and self.task == "countdown":  # the default task: the rewards replace it
            self.task = "custom"
        for name in ("output_dir", "train_data", "eval_data", "resume", "base_model", "model", "lora_adapter"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, name, str(Path(value).expanduser()))  # as a shell would
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field and how to fix it (esft.settings.rules)."""
        check(self)

    def uses_lora(self) -> bool:
        """LoRA-ES (esft.engines.lora): --lora-r or --lora-adapter given, or --model is a PEFT adapter directory."""
        return uses_lora(self)

    def custom_rewards(self) -> bool:
        """--reward-funcs, --reward-model or --reward-url given: the task is built from the data files."""
        return custom_rewards(self)

    def parsed_reward_weights(self) -> list[float] | None:
        """--reward-weights as floats, one per reward: --reward-funcs, then --reward-model, then --reward-url."""
        return reward_weights(self)

    def adam_beta_pair(self) -> tuple[float, float]:
        """--adam-betas as two floats (validated by esft.settings.rules)."""
        return beta_pair(self.adam_betas)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for config.yaml and checkpoints."""
        return dataclasses.asdict(self)


def settings_for(room: type[T], config: ESConfig) -> T:
    """The settings a room takes, from `config`: `room` is a dataclass of that room's (esft.tasks.building.TaskSettings,
    esft.rewards.runner.SandboxSettings) whose fields are ESConfig fields of the same names, so a room receives
    what it uses, never the whole ESConfig."""
    return room(**{f.name: getattr(config, f.name) for f in dataclasses.fields(room)})


def es_config(args: Any, **defaults: Any) -> ESConfig:
    """A trainer's `args`: an ESConfig as it is, None as ESConfig(**defaults); anything else (TRL's
    GRPOConfig, the first thing a TRL user passes) is a TypeError saying how its fields map to ESConfig's."""
    if args is None:
        return ESConfig(**defaults)
    if not isinstance(args, ESConfig):
        raise TypeError(not_an_esconfig(args))
    return args


_DATACLASS_INIT = ESConfig.__init__


class UnknownSetting(ConfigError, TypeError):
    """A keyword ESConfig does not have (a TypeError, as Python's own, and a ConfigError naming it)."""


@functools.wraps(_DATACLASS_INIT)
def _init_naming_unknown_settings(self, *args: Any, **kwargs: Any) -> None:
    known = [f.name for f in dataclasses.fields(ESConfig)]
    for name in kwargs:
        if name not in known:  # TRL's name for an esft setting: say which (esft.settings.trl_names)
            raise UnknownSetting(name, unknown_setting(name, known).removeprefix(f"--{name.replace('_', '-')} "))
    # TRL's settings named in an ES config are refused at any value, TRL's defaults too (num_generations=8);
    # a recorded config (config.yaml, a checkpoint's, dataclasses.replace) names all of them and is not refused
    self._typed_grpo = () if set(GRPO_ONLY) <= set(kwargs) else tuple(name for name in GRPO_ONLY if name in kwargs)
    _DATACLASS_INIT(self, *args, **kwargs)


ESConfig.__init__ = _init_naming_unknown_settings
