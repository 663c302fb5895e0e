"""--master-weights auto, resolved once per run before any engine is built (the trainer passes the resolved value to
every engine, Ray actors included, so that every replica keeps its weights alike):

- an engine that keeps a master anyway (vLLM: esft.engines.registry, master_free) and LoRA-ES (the master is the
  adapter's, a few MB): float32;
- float32 weights: none. The weights are then their own master: the same numbers, every perturbation, update and
  checkpoint bit for bit, without a second float32 copy (tests/test_master_weights.py);
- bfloat16/float16 weights: float32 while a float32 master fits in the memory available here (esft.models.footprint),
  else none, said in one line: updates are then rounded stochastically into the weights (esft.es.rounding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from esft.engines.registry import engine_spec


def built_with(settings) -> str:
    """--master-weights as an engine is built with it: as resolved, or float32 for a loader called on its own with
    auto still in its settings (as before --master-weights)."""
    return "float32" if settings.master_weights == "auto" else settings.master_weights


def resolve_master_weights(settings, path: str | None = None, model: Any = None) -> tuple[Any, str | None]:
    """(`settings` with master_weights auto resolved, the line saying why when memory chose none). `path`: the model
    folder (where its size is read from), `model`: a model loaded in this process (its dtype is the weights')."""
    if settings.master_weights != "auto":
        return settings, None
    chosen, line = "float32", None
    if engine_spec(settings.engine).master_free and not settings.uses_lora():
        loaded = hasattr(model, "parameters")  # a model object (an engine passed in keeps its own weights)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if loaded else settings.dtype
        if dtype == "float32":
            chosen = "none"
        elif path is not None:
            from esft.engines.base import resolve_device
            from esft.models.footprint import master_fits

            fits = master_fits(path, dtype, settings.trainable, resolve_device(settings.device).type)
            if fits is not None and not fits[0]:
                chosen = "none"
                line = (f"master weights: none ({fits[1]}): each update is rounded stochastically into the {dtype} "
                        "weights (es/update_survival says how much of it survived); --master-weights float32 insists "
                        "on the master")
    return dataclasses.replace(settings, master_weights=chosen), line
