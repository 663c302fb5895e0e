"""The presets `esft train` adds as defaults: the demo preset on the demo (the embedded model on its built-in
Countdown task), the model preset on any other model; and how they are spelled as flags. A setting the user gave
(flag or --config file) overrides only its own value, and a preset value the user's choice makes impossible is
dropped, said in one line. The Python API (ESConfig) keeps the paper's defaults."""

from __future__ import annotations

from typing import Any

from esft.engines.registry import ENGINES
from esft.settings.config import DEMO_PRESET, EMBEDDED_MODEL, MODEL_PRESET, ESConfig, is_demo

PRESET_CHOICES = ("auto", "none")
"""esft train --preset: auto adds the preset that fits (preset_for), none adds none (ESConfig's defaults)."""
PRESET_NAMES = {"demo": "demo preset", "model": "model preset"}
PRESET_WHY = {"demo": "the fastest setting that keeps the demo's accuracy gain; --noise iid gives the paper's full-rank noise",
              "model": "the ES design measured to learn most per completion across tasks on SmolLM2, docs/models.md"}
"""What `esft train` says of each preset when it adds one."""


def preset_for(settings: dict[str, Any]) -> tuple[str | None, dict[str, Any], list[str]]:
    """Which preset `esft train` adds to `settings` (the given ones, by name): "demo", "model" or None, the values
    it adds, and one line per value dropped and why."""
    if settings.get("algorithm", "es") != "es":
        return None, {}, []  # the presets are ES's: GRPO and RandOpt keep their own defaults
    if is_demo(settings):
        return "demo", *demo_preset_for(settings)
    if settings.get("model", EMBEDDED_MODEL) != EMBEDDED_MODEL:
        return "model", *model_preset_for(settings)
    return None, {}, []  # the user's own data or reward on the embedded model: the paper's defaults


def demo_preset_for(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The DEMO_PRESET values `esft train` adds to the demo, and one line per value dropped and why."""
    preset = {name: value for name, value in DEMO_PRESET.items() if name not in settings}
    reasons = []
    engine = ENGINES.get(settings.get("engine", ESConfig.engine))
    if engine is not None and engine.demo_preset is not None:  # the preset was measured on another engine
        reasons.append((f"--engine {settings['engine']}", ("noise", "rank", "population_batching"), engine.demo_preset))
    reasons += _lora_reasons(settings)
    if settings.get("noise", "lowrank") != "lowrank":  # full-rank members still batch, each with its own weights;
        preset.pop("rank", None)  # the rank means nothing to them (and the preset's is ESConfig's default): nothing to say
    if settings.get("population_batching") is False:
        reasons.append(("--no-population-batching", (), ""))
    return _drop(preset, reasons, "demo")


def model_preset_for(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The MODEL_PRESET values `esft train` adds on a model of the user's, and one line per value dropped and why."""
    preset = {name: value for name, value in MODEL_PRESET.items() if name not in settings}
    reasons = _lora_reasons(settings)
    if settings.get("noise", "lowrank") != "lowrank":
        preset.pop("rank", None)  # the rank means nothing to full-rank noise: nothing to say
    if settings.get("optimizer", ESConfig.optimizer) != "sgd":
        reasons.append((f"--optimizer {settings['optimizer']}", ("step_rule",), "adam normalizes its own step"))
    return _drop(preset, reasons, "model")


def _lora_reasons(settings: dict[str, Any]) -> list[tuple[str, tuple[str, ...], str]]:
    if settings.get("lora_r") or settings.get("lora_adapter"):  # LoRA-ES: the adapter is small, full-rank noise
        return [("--lora-r" if settings.get("lora_r") else "--lora-adapter", ("noise", "rank"),
                 "LoRA-ES perturbs the adapter with the paper's i.i.d. noise, still batched")]
    return []


def _drop(preset: dict[str, Any], reasons, which: str) -> tuple[dict[str, Any], list[str]]:
    dropped = []
    for flag, names, why in reasons:
        gone = [name for name in names if preset.pop(name, None) is not None]
        if gone:
            dropped.append(f"{flag} turns off the {PRESET_NAMES[which]}'s {', '.join(_flags(gone))} ({why})")
    return preset, dropped


def _flags(names) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names]


def preset_flags(preset: dict[str, Any]) -> str:
    """{'noise': 'lowrank', 'population_batching': True} -> '--noise lowrank --population-batching'."""
    return " ".join(flag + ("" if value is True else f" {value}") for flag, value in zip(_flags(preset), preset.values()))
