"""Executors run population members on engines: `local` (one engine in this process) or `ray`
(--workers actors, one engine each). `build_executor` makes the one --executor names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from esft.config import ConfigError, ESConfig
from esft.engines.base import Engine
from esft.executors.local import LocalExecutor, MemberResult, Scorer

__all__ = ["LocalExecutor", "MemberResult", "Scorer", "build_executor"]


def build_executor(args: ESConfig, task, scorer: Scorer, engine_builder: Callable[[], Engine], model: Any = None):
    """The executor --executor names. Local: one engine here (`engine_builder()`); ray: --workers
    actors, each building its own engine from `model` (a name or directory) and holding `task`."""
    if args.executor == "ray":
        if model is not None and not isinstance(model, str):
            raise ConfigError("executor", "ray actors load the model themselves: pass a model name or directory")
        try:
            from esft.executors.ray_executor import RayExecutor
        except ImportError as error:
            raise ConfigError("executor", f"ray is not installed ({error}); pip install 'esft[ray]'") from None
        return RayExecutor(args, task, model)
    engine = engine_builder()
    if args.population_batching:  # refuse a model the batched path would mis-evaluate, before training
        from esft.engines.population import population_batching_problem

        problem = population_batching_problem(engine)
        if problem:
            raise ConfigError("population_batching", problem)
    return LocalExecutor(engine, scorer, args.sigma, population_batching=args.population_batching)
