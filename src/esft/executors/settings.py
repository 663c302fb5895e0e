"""The settings an executor is built from: where members run (`PoolSettings`) plus what each engine and
reward runner there is built from (ExecutorSettings), never the whole ESConfig. A Ray actor receives them too."""

from __future__ import annotations

from dataclasses import dataclass

from esft.engines.settings import EngineSettings
from esft.rewards.runner import SandboxSettings
from esft.settings.config import settings_for


@dataclass(frozen=True)
class PoolSettings:
    """ESConfig's fields of these names (esft.settings.fields, where each is documented), defaults as there."""

    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None
    ray_cpus_per_worker: float = 1.0
    ray_gpus_per_worker: float = 0.0
    population_batching: bool | str = "auto"
    algorithm: str = "es"
    iterations: int = 20
    seed: int = 0
    batch_size: int = 32
    """seed and batch_size: a Ray actor rebuilds the iteration's prompt batch from them (esft.es.batches)."""


@dataclass(frozen=True)
class ExecutorSettings:
    """An executor's settings: its pool's, its engines' and its reward runners'."""

    pool: PoolSettings
    engine: EngineSettings
    sandbox: SandboxSettings

    @classmethod
    def of(cls, config) -> ExecutorSettings:
        """Taken from an ESConfig (esft.settings.config.settings_for, room by room)."""
        return cls(settings_for(PoolSettings, config), EngineSettings.of(config), settings_for(SandboxSettings, config))
