"""--algorithm randopt's settings (issue 53): how many members are kept, the validation split they are
scored on, and whether they are folded into one model; one documented field each, in the "RandOpt"
section of `esft train --help`, and the rules they must satisfy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from esft.settings.fields import _in
from esft.settings.rules import ConfigError, only_for, randopt_unused
from esft.settings.variants import VariantFields

@dataclass
class RandOptFields(VariantFields):
    """The ES variants and RandOpt's settings (ESConfig adds the GRPO (TRL) section)."""

    randopt_top_k: int = _in(
        "RandOpt", "K: the members with the best validation reward that are kept; held-out answers are their "
        "majority vote (where the task extracts an answer: countdown, arithmetic, times-table, math), else the best member's. Must be "
        "<= --population-size. Neural Thickets (arXiv 2603.12228) keep K = 5 to 10. `esft eval --model RUN_DIR "
        "--randopt-top-k K` votes with the best K of that run's scored members (nothing is scored again).", default=5)
    validation_size: int = _in(
        "RandOpt", "Training rows drawn once (seeded by --seed) as the validation split that scores every member "
        "(greedy, one completion per row) and gates the consolidation: N members cost N x this many completions.",
        default=64)
    randopt_consolidate: bool = _in(
        "RandOpt", "Fold the K kept perturbations into one model, θ + σ·Σ wᵢ·εᵢ with softmax weights of the "
        "members' z-scored validation rewards (CoRP, arXiv 2605.31494), exported as final/ if it beats the base "
        "model on the validation split; else (or --no-randopt-consolidate) final/ is the best single member.",
        default=True)


def check_randopt(config) -> None:
    """ConfigError naming the first invalid RandOpt setting (or one RandOpt does not use) and how to fix it."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    if config.algorithm != "randopt":
        for name in only_for(config, "randopt"):
            if getattr(config, name) != defaults[name]:
                raise ConfigError(name, f"is a setting of --algorithm randopt, which this run does not use "
                                  f"(--algorithm {config.algorithm}); add --algorithm randopt or drop it")
        return
    for name in randopt_unused(config):
        if getattr(config, name) != (config.sigma / 2 if name == "alpha" else defaults[name]):
            instead = "; its members are scored on --validation-size rows" if name == "batch_size" else ""
            raise ConfigError(name, f"is a setting of the ES update, which --algorithm randopt (no update: N members "
                              f"scored once) does not use{instead}; drop it")
    if config.iterations not in (0, defaults["iterations"]):
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
