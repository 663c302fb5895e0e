"""The ES variants' settings (issue 22): the strategy (esft.es.strategies: the paper's, mirrored pairs, ...),
an optimizer on the ES gradient and schedules of σ and α; one documented field each, in the "ES" section of `esft train --help`, and
the rules they must satisfy. Every default is the paper's rule: one-sided seeds, θ += α·g (sgd),
constant σ and α."""

from __future__ import annotations

import re
from dataclasses import dataclass

from esft.es.strategies import STRATEGIES
from esft.settings.fields import ES_MEMBERS, ES_UPDATE, RunFields, _in
from esft.settings.rules import ConfigError, shown

SCHEDULE = re.compile(r"(constant)|(linear|cosine)(?::([0-9]*\.?[0-9]+(?:e-?[0-9]+)?))?")
"""constant, or linear/cosine with an optional ':final fraction' (of the initial value, default 0.1)."""


@dataclass
class VariantFields(RunFields):
    """RunFields and the ES variants (ESConfig adds the GRPO (TRL) section)."""

    strategy: str = _in(
        "ES", "The ES strategy, how members are asked for and their fitness becomes the update (esft.es.strategies): "
        + "; ".join(f"{name}: {strategy.summary}" for name, strategy in STRATEGIES.items()) + ".",
        algorithms=ES_MEMBERS, default="paper")
    antithetic: bool | None = _in(
        "ES", "The same as --strategy antithetic: the spelling of commands and configs written before --strategy "
        "(read, never written: a run's config.yaml records the strategy).", algorithms=ES_MEMBERS, default=None)
    optimizer: str = _in(
        "ES", "How the ES gradient estimate g = (1/N)·Σ zᵢ·εᵢ moves the weights: sgd (the paper: θ += α·g) or adam "
        "(torch.optim.Adam's step on g with learning rate α, maximizing: θ += α·m̂/(√v̂ + --adam-eps); float32 moments "
        "beside the master, tensor by tensor: 8 extra bytes per trainable parameter, saved in checkpoints as "
        "optimizer/optimizer.safetensors). Typical --alpha for adam is far below the paper's (every weight moves by about α per "
        "step). With --noise lowrank adam steps on each matrix's dense update. Not for --algorithm grpo (TRL's AdamW).",
        algorithms=ES_UPDATE, default="sgd")
    adam_betas: str = _in("ES", "Adam's β₁,β₂ (two numbers in [0, 1), comma-separated); with --algorithm grpo, TRL's "
                          "adam_beta1, adam_beta2.", default="0.9,0.999")
    adam_eps: float = _in("ES", "Adam's ε, added to √v̂; with --algorithm grpo, TRL's adam_epsilon.", default=1e-8)
    weight_decay: float = _in(
        "ES", "Decoupled weight decay (AdamW-style): θ ← θ·(1 − α·wd) before each step, with either optimizer (sgd: "
        "then θ += α·g; adam: torch.optim.AdamW's step). 0: none (the paper). With --algorithm grpo, TRL's "
        "weight_decay.", algorithms=("es", "grpo"), default=0.0)
    sigma_schedule: str = _in(
        "ES", "σ per iteration: constant, or linear / cosine from --sigma down to a final fraction of it "
        "(e.g. cosine:0.1; default fraction 0.1), over --iterations. Logged as es/sigma.", algorithms=ES_UPDATE, default="constant")
    alpha_schedule: str = _in(
        "ES", "α per iteration, as --sigma-schedule (e.g. linear:0.0 decays to 0). Logged as es/alpha.",
        algorithms=ES_UPDATE, default="constant")

    def adam_beta_pair(self) -> tuple[float, float]:
        """--adam-betas as two floats (validated by check_variants)."""
        first, second = (float(part) for part in self.adam_betas.split(","))
        return first, second


def check_variants(config) -> None:
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
        match = SCHEDULE.fullmatch(str(value))
        if match is None or (match.group(3) is not None and not 0 <= float(match.group(3)) <= 1):
            raise ConfigError(name, f"must be constant, linear, cosine, or linear:F / cosine:F with a final fraction F "
                              f"in [0, 1] (e.g. cosine:0.1); got {shown(value)}")
