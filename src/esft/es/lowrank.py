"""Low-rank (EGGROLL-style) perturbations and updates of one matrix; the noise itself is defined in
esft.es.noise (`lowrank`: ε = A·Bᵀ/√r, A and B regenerated from the member seed and tensor index).

Nothing here ever forms a member's dense noise on its own: a perturbed matrix is one addmm on the
float32 master, and the update (α/N)·Σᵢ zᵢ·AᵢBᵢᵀ/√r of a matrix is ONE matmul of the concatenated
factors, [c₁A₁ … c_NA_N]·[B₁ … B_N]ᵀ/√r (inner dimension N·r), accumulated in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from esft.es.noise import lowrank_factors


def perturbed_matrix(
    master: torch.Tensor,
    member_seed: int,
    tensor_index: int,
    sigma: float,
    rank: int,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """master + σ·A·Bᵀ/√rank in float32 (into `out` if given)."""
    a, b = lowrank_factors(member_seed, tensor_index, master.shape, rank, master.device, generator)
    return torch.addmm(master, a, b.T, alpha=sigma / math.sqrt(rank), out=out)


ROW_BLOCK = 1 << 20
"""Elements computed at once where a low-precision matrix is perturbed or updated without a float32 master
(`row_blocks`): a few MB of float32 at a time, whatever the matrix (a 3B Llama's embedding is 1.6 GB in float32)."""


def row_blocks(shape: torch.Size | tuple[int, ...]) -> list[slice]:
    """Consecutive blocks of a matrix's rows, about ROW_BLOCK elements each (at least one row)."""
    rows, cols = shape
    step = max(1, ROW_BLOCK // max(cols, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def accumulate_update(
    master: torch.Tensor,
    tensor_index: int,
    member_seeds: Sequence[int],
    coefficients: Sequence[float],
    rank: int,
    generator: torch.Generator | None = None,
) -> None:
    """master += Σᵢ coefficients[i]·Aᵢ·Bᵢᵀ/√rank, as one float32 matmul with inner dimension N·rank."""
    left, right = concatenated_factors(master.shape, master.device, tensor_index, member_seeds, coefficients, rank,
                                        generator)
    master.addmm_(left, right.T)


def dense_update(
    out: torch.Tensor,
    tensor_index: int,
    member_seeds: Sequence[int],
    coefficients: Sequence[float],
    rank: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """out ← Σᵢ coefficients[i]·Aᵢ·Bᵢᵀ/√rank (the dense G of one matrix, for an optimizer that needs
    it: esft.es.optimizers), the same one matmul as accumulate_update, into a float32 scratch."""
    left, right = concatenated_factors(out.shape, out.device, tensor_index, member_seeds, coefficients, rank, generator)
    return torch.mm(left, right.T, out=out)


def concatenated_factors(shape, device, tensor_index, member_seeds, coefficients, rank, generator):
    """[c₁A₁/√r … c_NA_N/√r] and [B₁ … B_N]: G = left·rightᵀ."""
    count = len(member_seeds)
    if count != len(coefficients):
        raise ValueError(f"{count} member seeds for {len(coefficients)} coefficients")
    rows, cols = shape
    left = torch.empty((rows, count * rank), dtype=torch.float32, device=device)
    right = torch.empty((cols, count * rank), dtype=torch.float32, device=device)
    scale = 1.0 / math.sqrt(rank)
    for i, (member_seed, coefficient) in enumerate(zip(member_seeds, coefficients)):
        a, b = lowrank_factors(member_seed, tensor_index, shape, rank, device, generator)
        torch.mul(a, coefficient * scale, out=left[:, i * rank : (i + 1) * rank])
        right[:, i * rank : (i + 1) * rank] = b
    return left, right


def stacked_factors(
    member_seeds: Sequence[int],
    tensor_index: int,
    shape: torch.Size | tuple[int, ...],
    rank: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's factors of one matrix, stacked: A (N × shape[0] × rank), B (N × shape[1] × rank)."""
    count = len(member_seeds)
    a_all = torch.empty((count, shape[0], rank), dtype=torch.float32, device=device)
    b_all = torch.empty((count, shape[1], rank), dtype=torch.float32, device=device)
    for i, member_seed in enumerate(member_seeds):
        a_all[i], b_all[i] = lowrank_factors(member_seed, tensor_index, shape, rank, device, generator)
    return a_all, b_all
