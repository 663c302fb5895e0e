"""Noise schemes: which generator seed tensor k of member i uses. The noise itself is never stored;
it is regenerated from (member seed, tensor index) wherever it is needed."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (member seed, tensor index in named_parameters() order) -> torch.Generator seed
NOISE_SCHEMES: dict[str, Callable[[int, int], int]] = {
    # i.i.d. across tensors: the fix for the reference's correlated noise.
    "iid": lambda member_seed, tensor_index: member_seed + tensor_index,
    # the paper's original scheme: every tensor seeded alike, so same-shaped tensors get equal noise.
    "correlated": lambda member_seed, tensor_index: member_seed,
}


def draw_noise(
    scheme: str,
    member_seed: int,
    tensor_index: int,
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard normal float32 noise for one tensor of one member.

    Drawn in float32 on `device` (streams differ between CPU and CUDA generators, so results are
    reproducible per device type). Pass `generator`/`out` to reuse them in hot loops.
    """
    device = torch.device(device)
    if generator is None:
        generator = torch.Generator(device=device)
    generator.manual_seed(NOISE_SCHEMES[scheme](member_seed, tensor_index))
    if out is None:
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=device, out=out)
