"""The settings an engine is built from: what `build_engine` (esft.engines) and every engine's loader
(esft.engines.registry) receive, never the whole ESConfig."""

from __future__ import annotations

from dataclasses import dataclass

from esft.settings.config import settings_for
from esft.settings.rules import uses_lora


@dataclass(frozen=True)
class EngineSettings:
    """ESConfig's fields of these names (esft.settings.fields, where each is documented), defaults as there;
    take them from a config (`EngineSettings.of(config)`: validated, with its defaults resolved, e.g. --lora-alpha)."""

    model: str = "embedded"
    engine: str = "transformers"
    dtype: str = "float32"
    master_weights: str = "auto"
    device: str = "auto"
    trainable: str | None = None
    seed: int = 0
    max_tokens: int = 64
    mini_batch_size: int | str | None = "auto"
    noise: str = "iid"
    rank: int = 1
    population_size: int = 30
    optimizer: str = "sgd"
    adam_betas: str = "0.9,0.999"
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    lora_r: int = 0
    lora_alpha: float | None = None
    lora_target_modules: str | None = None
    lora_adapter: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    vllm_cpu_gemm: str = "plain"
    vllm_max_loras: int | None = None

    @classmethod
    def of(cls, config) -> EngineSettings:
        """Taken from an ESConfig (esft.settings.config.settings_for)."""
        return settings_for(cls, config)

    def uses_lora(self) -> bool:
        """LoRA-ES (esft.engines.lora): the same rule as ESConfig.uses_lora (esft.settings.rules.uses_lora)."""
        return uses_lora(self)
