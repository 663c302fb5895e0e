"""The demo preset: the settings `esft train` adds on the demo (the embedded model on its built-in
Countdown task) as defaults, and how they are spelled as flags."""

from __future__ import annotations

from typing import Any

from esft.engines.registry import ENGINES
from esft.settings.config import DEMO_PRESET, ESConfig, is_demo


def demo_preset_for(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The DEMO_PRESET values `esft train` adds to the demo (the embedded model on its built-in Countdown
    task), as defaults: a setting the user gave overrides only its own value, and a preset value the
    user's choice makes impossible is dropped. Returns (the values added, one line per value dropped and why)."""
    if not is_demo(settings):
        return {}, []  # the preset is ES's, measured on the demo: any other run gets the paper's defaults
    preset = {name: value for name, value in DEMO_PRESET.items() if name not in settings}
    reasons = []
    engine = ENGINES.get(settings.get("engine", ESConfig.engine))
    if engine is not None and engine.demo_preset is not None:  # the preset was measured on another engine
        reasons.append((f"--engine {settings['engine']}", ("noise", "rank", "population_batching"), engine.demo_preset))
    lora = settings.get("lora_r") or settings.get("lora_adapter")
    if lora:  # LoRA-ES: the adapter is small, its full-rank noise batches per member (esft.engines.adapter_population)
        reasons.append(("--lora-r" if settings.get("lora_r") else "--lora-adapter", ("noise", "rank"),
                        "LoRA-ES perturbs the adapter with the paper's i.i.d. noise, still batched"))
    if settings.get("noise", "lowrank") != "lowrank":  # full-rank members still batch, each with its own weights;
        preset.pop("rank", None)  # the rank means nothing to them (and the preset's is ESConfig's default): nothing to say
    if settings.get("population_batching") is False:
        reasons.append(("--no-population-batching", (), ""))
    dropped = []
    for flag, names, why in reasons:
        gone = [name for name in names if preset.pop(name, None) is not None]
        if gone:
            dropped.append(f"{flag} turns off the demo preset's {', '.join(_flags(gone))} ({why})")
    return preset, dropped


def _flags(names) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names]


def preset_flags(preset: dict[str, Any]) -> str:
    """{'noise': 'lowrank', 'population_batching': True} -> '--noise lowrank --population-batching'."""
    return " ".join(flag + ("" if value is True else f" {value}") for flag, value in zip(_flags(preset), preset.values()))
