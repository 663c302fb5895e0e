"""Engines hold the weights, perturb/restore/update them in place and generate text
(esft.engines.base: the contract). `build_engine` makes the one --engine names."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from esft.engines.base import Engine, NoTrainableParameters

if TYPE_CHECKING:  # settings import esft.engines.registry: this package imports them only when called
    from esft.engines.settings import EngineSettings


def check_device(device: str) -> None:
    """ConfigError when --device names a CUDA device this machine does not have (before loading)."""
    if not device.startswith("cuda"):
        return
    import torch

    from esft.settings.config import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("device", f"{device} asked for, but torch sees no CUDA device (torch {torch.__version__}); "
                          "use --device cpu or auto, or install a CUDA build of torch")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("device", f"{device} asked for, but there are {torch.cuda.device_count()} CUDA devices")


def check_hub_id(path: str) -> None:
    """ConfigError at once when a model name is no path here and, as a hub id, cannot be had (esft.models.hub)."""
    from esft.models.hub import hub_problem
    from esft.settings.config import ConfigError

    if (problem := hub_problem(path)) is not None:
        raise ConfigError("model", problem)


def build_engine(args: EngineSettings, model: Any = None, tokenizer: Any = None) -> Engine:
    """The engine --engine names (esft.engines.registry), loaded from `model` (hub id, directory, 'embedded',
    None = --model), or wrapped around an already loaded model where the engine can (transformers), or
    `model` itself if it is an engine. LoRA-ES (--lora-r, --lora-adapter, an adapter directory or a
    peft.PeftModel as the model): the engine perturbs only the adapter (esft.engines.lora, esft.engines.vllm_lora).
    `args`: the engine's settings (esft.engines.settings), the loader's first argument."""
    from esft.engines.master_weights import resolve_master_weights
    from esft.engines.registry import engine_spec
    from esft.es.optimizers import optimizer_spec
    from esft.settings.config import ConfigError, model_path

    if isinstance(model, Engine):
        return model
    spec = engine_spec(args.engine)
    options = dict(trainable=args.trainable, noise=args.noise, max_tokens=args.max_tokens, mini_batch_size=args.mini_batch_size,
                   optimizer=optimizer_spec(args))
    if model is not None and not isinstance(model, str):
        if (wrap := spec.wrapper()) is None:
            raise ConfigError("engine", f"{args.engine} loads the model itself: pass a model name or directory, not a loaded model")
        if tokenizer is None:
            raise ConfigError("model", "a loaded model needs its tokenizer: pass processing_class=tokenizer")
        args, _ = resolve_master_weights(args, model=model)
        try:
            return wrap(args, model, tokenizer, options)
        except NoTrainableParameters as error:
            raise ConfigError("trainable", str(error)) from None
    path = model_path(args, model)
    check_device(args.device)
    check_hub_id(path)
    args, line = resolve_master_weights(args, path)  # the trainer resolves it first: then nothing to say here
    if line is not None:
        print(f"esft: {line}", file=sys.stderr)
    check_folder(args, path)
    with loading_errors(args, model):
        return spec.loader()(args, path, options)


def check_folder(args: EngineSettings, path: str) -> None:
    """ConfigError before loading a local model folder that cannot be read or fine-tuned here: a damaged config or
    safetensors header, a config that does not describe its weights, weights that do not fit in memory
    (esft.models.footprint, with the flags that would make them fit)."""
    from pathlib import Path

    from esft.engines.base import resolve_device
    from esft.models.footprint import ModelFolderProblem, check_model_folder
    from esft.settings.config import ConfigError

    if not Path(path).is_dir():
        return
    try:
        check_model_folder(Path(path), args.dtype, args.trainable, args.uses_lora(), resolve_device(args.device).type,
                           master=args.master_weights != "none", noise=args.noise)
    except ModelFolderProblem as error:
        raise ConfigError("model", str(error)) from None


@contextmanager
def loading_errors(args: EngineSettings, model: Any = None):
    """Loading a model: a --trainable that matches nothing and a model that does not load (any error of the
    loaders: a damaged tokenizer file is a KeyError, a size mismatch a RuntimeError) become ConfigErrors naming the
    flag (exit 2 in the CLI); the loader's own error stays chained for Python callers."""
    from esft.settings.config import ConfigError

    try:
        yield
    except NoTrainableParameters as error:
        raise ConfigError("trainable", str(error)) from None
    except Exception as error:  # noqa: BLE001 - whatever transformers, tokenizers or safetensors raise on these files
        if isinstance(error, ConfigError):
            raise
        # a load report or a size mismatch is tens of lines: its first line names the problem
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        kind = "" if isinstance(error, (OSError, ValueError)) else f"{type(error).__name__}: "
        raise ConfigError("model", f"could not load {model or args.model!r}: {kind}{first[:300]}") from error
