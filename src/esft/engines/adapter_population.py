"""Population batching of LoRA-ES with full-rank noise (--noise iid/correlated): every member in ONE
batched generate call (esft.engines.population; low-rank noise has its own hooks there).

An adapter is small, so each member's full noise of every adapter tensor fits in memory at once
(N × the adapter). Every trainable tensor must be the weight W (out × in) of a bias-free nn.Linear,
as PEFT's lora_A and lora_B are; a forward hook adds member m's perturbation to its own rows:

    y_m = x_m·Wᵀ + σ·x_m·ε_mᵀ        (rows member-major, as in esft.engines.population)

so the base model's matmuls are shared by the population and only the adapter's (rank r) products
are per member. With a LoRA layer, lora_B's input already carries member m's perturbed lora_A
output, so member m computes exactly s·(B + σε_B)(A + σε_A)·x, the sequential path's weights.
Restoring is removing the hooks: the weights are never written. A LoRA engine names this class as
its `population_class` (esft.engines.lora), which esft.engines.population uses instead of its
low-rank hooks; the batched path is compared with the sequential one once per engine there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from esft.engines.member_rows import MemberRows, PopulationBatchingError, add_rows
from esft.es.noise import draw_noise


class AdapterPopulation(MemberRows):
    """While installed (a context manager), the engine's model evaluates `member_seeds` at once: rows
    of member m get member m's full-rank noise on every adapter tensor (module docstring)."""

    def __init__(self, engine, member_seeds: Sequence[int], sigma: float):
        super().__init__(len(member_seeds))
        peft = sys.modules.get("peft")
        if peft is None or not isinstance(engine.model, peft.PeftModel):
            raise PopulationBatchingError(
                f"population batching with --noise {engine.noise} is for LoRA adapters only (each member holds its "
                "own copy of the trainable tensors); use --noise lowrank, or LoRA-ES (--lora-r)"
            )
        owners = {id(module.weight): module for module in engine.model.modules()
                  if isinstance(module, nn.Linear) and module.bias is None}
        for index, name, param in engine.trainable:
            module = owners.get(id(param))
            if module is None:
                raise PopulationBatchingError(
                    f"{name} is not the weight of a bias-free nn.Linear (as lora_A/lora_B are); evaluate members one "
                    "at a time (no --population-batching)"
                )
            noise = torch.stack([draw_noise(engine.noise, seed, index, param.shape, engine.device, engine._generator)
                                 for seed in member_seeds])  # (N, out, in)
            self._plan.append((module, (noise * sigma).transpose(1, 2).to(param.dtype).contiguous()))  # (N, in, out)

    def _hook_for(self, entry):
        right = entry[1]
        per_row = self._per_row(right)

        def hook(module, args, output):
            x = args[0]
            if self._member_of_row is None:  # member-major: (N, rows·positions, in)
                return add_rows(output, self.size, x.reshape(self.members_in(x), -1, x.shape[-1]), right)
            (right_rows,) = per_row()  # rows still running (finished ones dropped): each row's member's noise
            return add_rows(output, len(right_rows), x.reshape(len(right_rows), -1, x.shape[-1]), right_rows)

        return hook
