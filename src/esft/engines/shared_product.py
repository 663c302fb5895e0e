"""One low-rank product per layer input, shared by the modules that read it (esft.engines.population).

A layer's q/k/v projections (and its gate/up projections) read the same hidden states. Under low-rank
population batching each module needs x_m·B_m for its own factor B_m; at small rank that product is
memory-bound (it reads all rows to produce r numbers per row), so computing x_m·[B_q B_k B_v] once reads
the rows once instead of three times (docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn


class SharedProduct:
    """x·left for each row with its own member's factors (left: (N, in, r·modules)), computed once per input
    tensor for every module that reads it and reused while the same tensor, unchanged, comes back.
    Member-major rows: one batched product (left as (N, r, in) against the rows transposed: the product
    shape CPU kernels run fast at small r; multiplying every row by every member's factors cost up to 90%
    of a 128-wide layer, docs/benchmarks.md). Rows left after the decoder dropped finished ones: the
    same batched product on the rows gathered into a member-major layout padded to the widest member
    (MemberRows.padded_layout, padded_rows), read back at each row's slot. The input is held by a weak reference: a
    layer's prefill activations are not kept alive for the next step."""

    def __init__(self, rows, left: torch.Tensor):  # rows: the MemberRows whose hooks call it
        self.rows = rows
        self.left_by_member = standard_strides(left.transpose(1, 2))  # (N, r·modules, in)
        self._input = None
        self._key = None
        self._low: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (_version(x), self.rows.rows_version)
        if self._input is None or self._input() is not x or self._key != key or key[0] is None:
            self._low = self._product(x)
            self._input, self._key = weakref.ref(x), key
        return self._low

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        members = self.rows.size
        if not self.rows.ragged:  # member-major: (N, rows·positions, in)
            return self._batched(x.reshape(self.rows.members_in(x), -1, x.shape[-1]))  # (N, rows·positions, r·modules)
        padded = self.rows.padded_rows(x)  # (N·widest, positions, in)
        low = self._batched(padded.reshape(members, -1, x.shape[-1]))  # (N, widest·positions, r·modules)
        _, slots = self.rows.padded_layout()
        return low.reshape(padded.shape[0], -1, low.shape[-1]).index_select(0, slots)  # (rows, positions, r·modules)

    def _batched(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.left_by_member, grouped.transpose(1, 2)).transpose(1, 2)


@torch.no_grad()
def input_groups(engine, modules: Sequence[nn.Module]) -> dict[int, int]:
    """Group number by id(module) for `modules` that receive the same input tensor in a forward pass of
    the engine's model (found once per engine and module set, on a 4-token input). Only a speed hint:
    SharedProduct recomputes whenever a module's input is not the tensor it last multiplied."""
    cache = engine.__dict__.setdefault("_esft_input_groups", {})
    key = tuple(id(module) for module in modules)
    if key not in cache:
        inputs: list[torch.Tensor] = []  # strong references for the pass: no id is reused meanwhile
        group_of: dict[int, int] = {}

        def record(module, args):
            for number, seen in enumerate(inputs):
                if seen is args[0]:
                    group_of[id(module)] = number
                    return
            group_of[id(module)] = len(inputs)
            inputs.append(args[0])

        handles = [module.register_forward_pre_hook(record) for module in modules]
        try:
            engine.model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=engine.device))
        finally:
            for handle in handles:
                handle.remove()
        cache[key] = group_of
    return cache[key]


def standard_strides(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with the row-major strides of its shape, size-1 dimensions included: `.contiguous()`
    of a transposed (N, in, 1) factor keeps strides (in, 1, 1), which CPU bmm takes as another layout and runs
    2.3-3.6× slower (docs/benchmarks.md): every single-column product at rank 1 (o_proj, down_proj, the LM
    head) paid it."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _version(x: torch.Tensor) -> int | None:
    """x's in-place version counter; None for an inference-mode tensor, which has none (never reused)."""
    try:
        return x._version
    except RuntimeError:
        return None
