"""Noise schemes: which generator seed tensor k of member i uses. The noise itself is never stored;
it is regenerated from (member seed, tensor index) wherever it is needed.

Low-rank noise (`lowrank`, EGGROLL-style): a matrix W (shape[0] × shape[1]) of member i receives
ε = A·Bᵀ/√r, with A (shape[0] × r) then B (shape[1] × r) drawn standard normal from the generator
seeded like `iid` (member seed + tensor index); each entry of ε then has unit variance, as with
`iid`, so σ means the same. Tensors that are not matrices (norm weights, biases) get no noise under
`lowrank`: they stay frozen. Embedding matrices are matrices: a tied embedding / LM head gets the
same A·Bᵀ in both uses. Population batching (esft.engines.population) applies these same factors
in the forward pass instead of to the weights.

`iid_matrices` is `iid` on matrices only (EGGROLL's choice, with full-rank noise): a matrix gets exactly its `iid`
noise, every other tensor (norm weights, biases) none, and stays frozen, as under `lowrank`.

Mirrored members (--strategy antithetic): a negative member seed s < 0 means the noise of seed ~s
(esft.es.strategies.antithetic.mirror), negated: draw_noise returns −ε(~s), lowrank_factors returns (−A, B) of ~s
(so A·Bᵀ flips sign). Negation is exact in floating point, so θ + σ·ε(~s) is exactly θ − σ·ε(s). Every
noise draw in esft goes through these two functions: engines, population batching, vLLM workers and
adapters, Ray actors all handle mirrored members without knowing of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from esft.es.strategies.antithetic import mirror

# (member seed, tensor index in named_parameters() order) -> torch.Generator seed
NOISE_SCHEMES: dict[str, Callable[[int, int], int]] = {
    # i.i.d. across tensors: the fix for the reference's correlated noise.
    "iid": lambda member_seed, tensor_index: member_seed + tensor_index,
    # the paper's original scheme: every tensor seeded alike, so same-shaped tensors get equal noise.
    "correlated": lambda member_seed, tensor_index: member_seed,
    # i.i.d. on matrices only; other tensors frozen (module docstring).
    "iid_matrices": lambda member_seed, tensor_index: member_seed + tensor_index,
    # low-rank A·Bᵀ/√r per matrix (module docstring); factors seeded as iid.
    "lowrank": lambda member_seed, tensor_index: member_seed + tensor_index,
}
LOW_RANK_SCHEMES = frozenset({"lowrank"})
MATRIX_ONLY_SCHEMES = frozenset({"iid_matrices", "lowrank"})
"""Schemes that perturb matrices only (norm weights, biases and other tensors stay frozen)."""


def perturbs(scheme: str, shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether `scheme` gives a tensor of this shape any noise (iid_matrices, low-rank: matrices only)."""
    return scheme not in MATRIX_ONLY_SCHEMES or len(shape) == 2


def lowrank_factors(
    member_seed: int,
    tensor_index: int,
    shape: torch.Size | tuple[int, ...],
    rank: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 factors (A: shape[0] × rank, B: shape[1] × rank) of a matrix's low-rank noise
    A·Bᵀ/√rank for one member (a mirrored member, seed < 0: −A and B of its partner)."""
    device = torch.device(device)
    if generator is None:
        generator = torch.Generator(device=device)
    mirrored = member_seed < 0
    generator.manual_seed(NOISE_SCHEMES["lowrank"](mirror(member_seed) if mirrored else member_seed, tensor_index))
    a = torch.randn((shape[0], rank), generator=generator, dtype=torch.float32, device=device)
    b = torch.randn((shape[1], rank), generator=generator, dtype=torch.float32, device=device)
    return (a.neg_() if mirrored else a), b


def draw_noise(
    scheme: str,
    member_seed: int,
    tensor_index: int,
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    rank: int = 1,
) -> torch.Tensor:
    """Standard normal float32 noise for one tensor of one member.

    Drawn in float32 on `device` (streams differ between CPU and CUDA generators, so results are
    reproducible per device type). Pass `generator`/`out` to reuse them in hot loops. Low-rank
    schemes return the dense A·Bᵀ/√rank (zeros for tensors they leave frozen). A negative
    `member_seed` (a mirrored member) gets exactly the negated noise of seed ~member_seed.
    """
    device = torch.device(device)
    if generator is None:
        generator = torch.Generator(device=device)
    if scheme in LOW_RANK_SCHEMES:
        if not perturbs(scheme, shape):
            return torch.zeros(shape, dtype=torch.float32, device=device) if out is None else out.zero_()
        a, b = lowrank_factors(member_seed, tensor_index, shape, rank, device, generator)
        return torch.mm(a, b.T, out=out).mul_(1.0 / math.sqrt(rank))
    if not perturbs(scheme, shape):
        return torch.zeros(shape, dtype=torch.float32, device=device) if out is None else out.zero_()
    if member_seed < 0:
        return draw_noise(scheme, mirror(member_seed), tensor_index, shape, device, generator, out, rank).neg_()
    generator.manual_seed(NOISE_SCHEMES[scheme](member_seed, tensor_index))
    if out is None:
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=device, out=out)
