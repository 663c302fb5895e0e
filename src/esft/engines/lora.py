"""LoRA-ES: ES over the tensors of a PEFT LoRA adapter only (--lora-r, --lora-adapter, an adapter
directory as --model, or a peft.PeftModel passed as the model).

The engine is the ordinary TransformersEngine holding the PeftModel, so every guarantee of full ES
holds unchanged (float32 master, bit-exact restore, the noise schemes, determinism, checkpoints):
- **What ES perturbs**: exactly the tensors PEFT marks trainable (lora_A and lora_B of every adapted
  module; `modules_to_save` copies if the adapter has them), narrowed by --trainable if given. The
  base weights are never written.
- **Tensor index** (the noise seed of tensor k is member seed + k): the position in the PeftModel's
  own `named_parameters()`, base weights included (e.g. `base_model.model.model.layers.0.self_attn.
  q_proj.lora_A.default.weight`), so a tensor's noise never depends on what else is trainable.
- **Initialisation**: PEFT draws A at random and sets B = 0 (the adapter starts as the identity).
  As in the reference, A and B are perturbed alike: a member's change of W is
  s·(B + σε_B)(A + σε_A) = s·σ·ε_B·A + s·σ²·ε_B·ε_A at B = 0 (s = lora_alpha / r), so the first
  iterations move B along ε_B·A and A follows once B is non-zero. A is drawn under
  torch.manual_seed(--seed) with the global RNG state restored afterwards: every process (Ray
  actors, a resumed run) builds the same adapter.
- **Precision**: PEFT keeps adapter tensors in float32 even in bfloat16/float16 models, so the
  master *is* the adapter, bit for bit; only the base model runs in --dtype.

Exports: the engine's save_pretrained writes the PEFT adapter (PeftModel.save_pretrained:
adapter_config.json + adapter_model.safetensors) and the tokenizer; `export_merged` writes the adapter
merged into the base model (PEFT's merge_and_unload on a CPU copy: the engine's model is untouched).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from esft.files import SETTINGS_LIMIT, read_regular_text
from esft.engines.master_weights import built_with
from esft.engines.settings import EngineSettings
from esft.settings.config import EMBEDDED_MODEL, ConfigError, embedded_model_path, model_path, split_list
from esft.settings.rules import is_adapter_dir
from esft.engines.base import NoTrainableParameters, optional, resolve_device, torch_dtype
from esft.es.noise import LOW_RANK_SCHEMES

if TYPE_CHECKING:  # torch and the engine load only when LoRA is used: the trainer imports this module
    import torch

    from esft.engines.transformers_engine import TransformersEngine

ALL_LINEAR = "all-linear"


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a peft.PeftModel (without importing peft when nothing has)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def uses_adapter(engine: Any, args: EngineSettings) -> bool:
    """Whether a run's engine trains a LoRA adapter (its saves are adapters; final-merged/ is written)."""
    return args.uses_lora() or is_peft_model(optional(engine, "model"))


def base_of(adapter_dir: str | Path) -> str:
    """The base model of an adapter directory: the --model of the esft run that wrote it (its
    trainer_state.json), else PEFT's base_model_name_or_path."""
    adapter_dir = Path(adapter_dir).expanduser()
    try:
        config = json.loads(read_regular_text(adapter_dir / "trainer_state.json", SETTINGS_LIMIT))["config"]
        base = str(embedded_model_path()) if config["model"] == EMBEDDED_MODEL else config["model"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        base = json.loads(read_regular_text(adapter_dir / "adapter_config.json", SETTINGS_LIMIT)).get("base_model_name_or_path")
    if not base:
        raise ConfigError("model", f"{adapter_dir} does not say which base model it adapts (no base_model_name_or_path "
                          "in adapter_config.json); pass the base as --model and the adapter as --lora-adapter")
    return base_of(base) if is_adapter_dir(base) and Path(base).resolve() != adapter_dir.resolve() else base


def lora_engine(args: EngineSettings, model: Any, tokenizer: Any, options: dict[str, Any]) -> TransformersEngine | None:
    """A TransformersEngine over a PEFT LoRA model when this run uses LoRA, else None. `model` is a
    loaded model (with `tokenizer`), or a name/directory (None: --model) loaded here in --dtype on
    --device; `options` are the TransformersEngine's keyword arguments."""
    adapter = args.lora_adapter
    loaded = model is not None and not isinstance(model, str)
    path = None if loaded else model_path(args, model)
    if not (args.uses_lora() or is_peft_model(model) or is_adapter_dir(path)):
        return None
    _require_peft()  # before the model loads
    if not loaded:
        if is_adapter_dir(path):  # --model run/final: the adapter of a LoRA run, on its base
            adapter, path = path, base_of(path)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # our own progress bar is the one that matters
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(args.dtype)).to(resolve_device(args.device))
    elif is_peft_model(model):
        if args.uses_lora():
            raise ConfigError("lora_r" if args.lora_r else "lora_adapter", "the model is already a PeftModel: ES trains "
                              "its adapter; drop lora_r/lora_adapter")
        _refuse_dropout(model)
    from esft.engines.transformers_engine import TransformersEngine

    peft_model = model if is_peft_model(model) else _with_adapter(model, args, adapter)
    names = adapter_tensor_names(peft_model, args.trainable)
    pattern = "^(?:" + "|".join(re.escape(name) for name in names) + ")$"
    engine = TransformersEngine(peft_model, tokenizer, rank=args.rank, **{**options, "trainable": pattern},
                                master_weights=built_with(args))
    if engine.noise not in LOW_RANK_SCHEMES:  # --population-batching: each member's own adapter noise on its rows
        from esft.engines.adapter_population import AdapterPopulation

        engine.population_class = AdapterPopulation
    return engine


def _require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError as error:
        raise ConfigError("lora_r", f"LoRA-ES needs peft ({error}); pip install 'esft[lora]'") from None


def _with_adapter(model: Any, args: EngineSettings, adapter: str | None) -> Any:
    """`model` wrapped in PEFT: the adapter directory's LoRA, or a new one of --lora-r (A seeded by --seed)."""
    import torch
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # PEFT draws A from the global RNG: seeded,
        torch.manual_seed(args.seed)  # then put back; PEFT reads transformers' deprecated is_gradient_checkpointing:
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)  # not the user's to act on
        if adapter is not None:
            config = PeftConfig.from_pretrained(adapter)
            if getattr(config, "lora_dropout", 0):
                print(f"esft: {adapter}: its lora_dropout {config.lora_dropout} is turned off (ES uses no gradients); "
                      "saved adapters say 0", file=sys.stderr)
                config.lora_dropout = 0.0
            return PeftModel.from_pretrained(model, adapter, config=config, is_trainable=True)
        targets = split_list(args.lora_target_modules) or [ALL_LINEAR]
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                            target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets)
        try:
            return get_peft_model(model, config)
        except ValueError as error:
            raise ConfigError("lora_target_modules", f"{error}; name modules of the model (e.g. q_proj,v_proj) or "
                              "all-linear") from None


def _refuse_dropout(peft_model: Any) -> None:
    for name, config in peft_model.peft_config.items():
        if getattr(config, "lora_dropout", 0):
            raise ConfigError("lora_dropout", f"the PeftModel's adapter {name!r} has lora_dropout={config.lora_dropout}: "
                              "ES uses no gradients, so dropout would only add noise to the rollouts' rewards; build "
                              "it with LoraConfig(lora_dropout=0)")


def adapter_tensor_names(peft_model: Any, trainable: str | None = None) -> list[str]:
    """Names of the tensors PEFT marks trainable (the adapter), matching --trainable if given, in
    named_parameters() order."""
    pattern = re.compile(trainable) if trainable else None
    names = [name for name, param in peft_model.named_parameters()
             if param.requires_grad and (pattern is None or pattern.search(name))]
    if not names:
        example = next((n for n, p in peft_model.named_parameters() if p.requires_grad), None)
        raise NoTrainableParameters(
            f"no adapter tensor matches {trainable!r} (names look like {example!r})" if example else
            "the PeftModel has no trainable adapter tensor (loaded with is_trainable=False?)"
        )
    return names


# --------------------------------------------------------------------------------------- merged export
def export_merged(engine: Any, path: str | Path, base: str | None = None, dtype: str = "float32") -> None:
    """Write the engine's adapter merged into its base model to `path` (AutoModelForCausalLM.from_pretrained
    loads it; model dtype, the base's generation_config) with the tokenizer. An in-process engine's
    model is copied to CPU and merged there (PEFT merge_and_unload): its own weights are untouched. An
    engine elsewhere (Ray) saves its adapter, which is merged into `base` (a name or directory) loaded
    on CPU in `dtype`. Needs a CPU copy of the model in memory while it runs."""
    path = Path(path)
    model = optional(engine, "model")
    if is_peft_model(model):
        engine.restore()
        merged = _cpu_copy(model).merge_and_unload()
        merged.generation_config = copy.deepcopy(engine._saved_generation_config) or merged.generation_config
        merged.save_pretrained(path)
        engine.tokenizer.save_pretrained(path)
        return
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base is None:
        raise ValueError("export_merged: an engine outside this process needs the base model's name or directory")
    with tempfile.TemporaryDirectory() as adapter:
        engine.save_pretrained(adapter)
        loaded = AutoModelForCausalLM.from_pretrained(base_of(base) if is_adapter_dir(base) else base, dtype=torch_dtype(dtype))
        PeftModel.from_pretrained(loaded, adapter).merge_and_unload().save_pretrained(path)
        AutoTokenizer.from_pretrained(adapter).save_pretrained(path)


def _cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers are CPU copies (made one tensor at a time:
    no second copy on the model's device; tied parameters stay tied)."""
    import torch

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        clone = tensor.detach().to("cpu", copy=True)
        memo[id(tensor)] = torch.nn.Parameter(clone, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else clone
    return copy.deepcopy(model, memo)
