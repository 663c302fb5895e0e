"""Executors run population members on engines: `local` (one engine in this process) or `ray`
(--workers actors, one engine each). `build_executor` makes the one --executor names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from esft.settings.config import ConfigError
from esft.engines.base import Engine
from esft.executors.local import LocalExecutor, MemberResult, Scorer, resolve_population_batching
from esft.executors.settings import ExecutorSettings, PoolSettings

__all__ = ["ExecutorSettings", "LocalExecutor", "MemberResult", "PoolSettings", "Scorer", "build_executor",
           "resolve_population_batching"]


def build_executor(settings: ExecutorSettings, task, scorer: Scorer, engine_builder: Callable[[], Engine],
                   model: Any = None):
    """The executor --executor names. Local: one engine here (`engine_builder()`); ray: --workers
    actors, each building its own engine from `model` (a name or directory) and holding `task`."""
    if settings.pool.executor == "ray":
        if model is not None and not isinstance(model, str):
            raise ConfigError("executor", "ray actors load the model themselves: pass a model name or directory")
        try:
            from esft.executors.ray_executor import RayExecutor
        except ImportError as error:
            raise ConfigError("executor", f"ray is not installed ({error}); pip install 'esft[ray]'") from None
        return RayExecutor(settings, task, model)
    engine = engine_builder()

    def problem():  # the batched path's self-check, before training: a model it would mis-evaluate is not batched
        from esft.engines.population import population_batching_problem

        return population_batching_problem(engine)

    return LocalExecutor(engine, scorer, population_batching=resolve_population_batching(settings, problem))
