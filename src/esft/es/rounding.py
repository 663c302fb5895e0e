"""Writing a float32 result into low-precision weights without a float32 master (--master-weights none, issue 64).

With a master, an update lands in float32 and the weights are the master rounded to nearest: a step smaller than
half a unit in the last place (ulp) of a bfloat16 weight (2⁻⁹ of its size) survives in the master and adds up over
iterations. Without one, rounding θ + G to nearest would drop every such step for good. Stochastic rounding keeps
them on average: x goes to the representable neighbour above it with probability (x − below)/(above − below), else
to the one below, so E[round(x)] = x and a step of a tenth of an ulp moves a tenth of the weights by one ulp.

Its uniforms are drawn from a generator seeded by the update's member seeds and the tensor index (`rounding_seed`),
so a seeded run rounds alike every time, on every Ray actor, and after a resume. Float32 weights are never rounded
here (θ + G in float32 is what the master would hold). benchmarks/rounding.py measured this against rounding to
nearest and against error feedback (QES, arXiv 2602.03120) on SmolLM2's matrices: docs/benchmarks.md,
"Updates without a float32 master". Pure torch: no model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def rounding_seed(member_seeds: Sequence[int], tensor_index: int) -> int:
    """The seed of one update's rounding of tensor `tensor_index`: a digest of the update's member seeds (they
    differ every iteration) and the index, so it is shared by every replica and never equals a noise seed's stream."""
    text = f"esft-rounding:{tensor_index}:" + ",".join(map(str, member_seeds))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@torch.no_grad()
def round_stochastically(value: torch.Tensor, out: torch.Tensor, generator: torch.Generator,
                         uniforms: torch.Tensor | None = None) -> None:
    """out ← `value` (float32) rounded to out's dtype, up or down with the probabilities that make it unbiased
    (module docstring); a float32 `out` takes `value` as it is. `uniforms`: a float32 scratch of value's shape."""
    if out.dtype == torch.float32:
        out.copy_(value)
        return
    nearest = value.to(out.dtype)
    near = nearest.float()
    toward = torch.where(near < value, torch.inf, -torch.inf).to(out.dtype)
    other = torch.nextafter(nearest, toward).float()  # the neighbour on value's other side
    gap = (other - near).abs_()
    chance = (value - near).abs_().div_(gap.clamp_min_(torch.finfo(torch.float32).tiny))
    if uniforms is None:
        uniforms = torch.empty_like(value)
    uniforms.uniform_(generator=generator)
    out.copy_(torch.where(uniforms < chance, other, near))
