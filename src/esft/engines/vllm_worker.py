"""The ES worker extension: runs inside each vLLM worker process (one per tensor-parallel rank).

vLLM imports this module in every worker before the model loads (`worker_extension_cls`), and
mixes `ESWorkerExtension` into the worker class; the engine calls its methods with
`LLM.collective_rpc("esft_<name>", args=...)`. Only seeds, scalars and names cross processes
during training; weights move only to save a checkpoint or to resume.

Weights and noise. The noise of a member is defined per Hugging Face tensor: HF tensor k (its
position in the HF model's `named_parameters()`) receives `draw_noise(scheme, seed, k, hf_shape)`,
exactly as in the transformers engine. vLLM fuses tensors (qkv_proj = q, k, v stacked; gate_up_proj
= gate, up stacked), shards them across tensor-parallel ranks and pads the vocabulary. Rather than
hard-coding those layouts, `esft_setup` asks vLLM's own weight loaders where every HF element goes:
it loads a probe tensor (1 + flat index, in float64) for each HF tensor and reads back which block
of which vLLM parameter it landed in. Each rank then draws the full HF noise tensor and writes the
block it owns, so the same seed gives the same perturbation, element for element, as the
transformers engine.

ES semantics are the transformers engine's: a float32 master of every vLLM parameter that holds
trainable elements; perturb = master + σ·ε rounded once to the model dtype; restore = copy of the
master (bit-exact); update = Σ cᵢ·εᵢ accumulated in float32 per HF tensor, added to the master
(--optimizer adam: adam's step on it, esft.es.optimizers, its state beside the master, block by block).
Low-rank noise: perturb and update are esft.es.lowrank's on each HF matrix (the transformers
engine's arithmetic), and members can be served as LoRA adapters instead (esft.engines.vllm_adapters).

CPU repacking. On CPU, vLLM repacks every linear weight for oneDNN (or its small-GEMM kernel) after
loading, and drops `layer.weight`; a forward pass then never reads the parameter we change. This
module wraps that dispatch (at import, i.e. before the model loads) so the weight is kept, then
either replaces the packed kernel with `torch.nn.functional.linear` on the live weight ("plain",
the default) or packs again after every weight change ("repack"). Measured per ES member (perturb +
generate + restore), the two are within noise of each other, plain slightly ahead, and plain skips
the packing work and the packed copy of every weight (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from esft.engines import vllm_cpu_lora
from esft.engines.base import master_checksum
from esft.engines.vllm_adapters import AdapterWorker, LoRAESWorker, lora_unwrapped, pack_state
from esft.es import lowrank
from esft.es.noise import LOW_RANK_SCHEMES, draw_noise, perturbs
from esft.es.optimizers import AdamState, ESOptimizer
from esft.es.update import Piece, UpdateRule, UpdateTensor, apply_update, gathered

# ------------------------------------------------------------ CPU GEMM dispatch
_PACKED_LAYERS: list[torch.nn.Module] = []


def _install_cpu_dispatch_patch() -> None:
    """Keep linear weights on CPU (vLLM would drop them after packing) and remember the layers."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:  # pragma: no cover - vLLM not installed: nothing to patch
        return
    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_esft_patched", False):
        return

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)
        if not layer.weight.is_meta and layer.weight.ndim == 2:
            layer._esft_dispatch = original
            _PACKED_LAYERS.append(layer)

    dispatch_keeping_weight._esft_patched = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


_install_cpu_dispatch_patch()
vllm_cpu_lora.install()  # CPU LoRA: esft's ops for vLLM's reference ones (same results, see that module)


def to_bytes(tensor: torch.Tensor) -> bytes:
    """A float32 tensor as raw bytes (vLLM's RPC returns untyped values: tensors as bytes survive)."""
    return tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes()


def from_bytes(data: bytes, shape) -> torch.Tensor:
    """Inverse of to_bytes."""
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(tuple(shape))


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


# -------------------------------------------------------------- the extension
Block = tuple[str, tuple[slice, ...], tuple[slice, ...]]  # (vLLM param, its slices, HF slices)


def _bounding_block(mask: torch.Tensor) -> tuple[slice, ...]:
    """Smallest box of `mask` holding all its True elements."""
    slices = []
    for dim in range(mask.ndim):
        others = [d for d in range(mask.ndim) if d != dim]
        present = mask.any(dim=others) if others else mask
        where = torch.nonzero(present).flatten()
        slices.append(slice(int(where[0]), int(where[-1]) + 1))
    return tuple(slices)


class ESWorkerExtension(AdapterWorker, LoRAESWorker):
    """Mixed into vLLM's worker class; every public name starts with esft_ (no clash with vLLM)."""

    # ------------------------------------------------------------- set-up
    def esft_setup(
        self, hf_params: Sequence[tuple[int, str, tuple[int, ...]]], cpu_gemm: str = "plain"
    ) -> dict:
        """Map every HF tensor (index, name, shape) onto the vLLM parameters; returns a summary.
        With LoRA enabled, mapped on the unwrapped layers (HF-like names, the same tensors)."""
        with lora_unwrapped(self.model_runner):
            return self._esft_setup(hf_params, cpu_gemm)

    def _esft_setup(self, hf_params, cpu_gemm: str) -> dict:
        from esft.allocator import steady_allocator

        # This worker process runs the forward passes: malloc as `esft train` sets it (esft.allocator),
        # else glibc's defaults give generate calls a varying number of fresh page faults (demo model,
        # 32 prompts: a process's median from 4 to 1,800 per call; heap only: 3-5).
        allocator = steady_allocator()
        model = self.model_runner.model
        self._esft_model = model
        self._esft_params = dict(model.named_parameters())
        self._esft_device = next(iter(self._esft_params.values())).device
        self._esft_generator = torch.Generator(device=self._esft_device)
        self._esft_hf = {index: (name, tuple(shape)) for index, name, shape in hf_params}
        self._esft_blocks: dict[int, list[Block]] = {}
        for index, name, shape in hf_params:
            self._esft_blocks[index] = self._esft_probe(model, name, tuple(shape))
        # Layers whose packed kernel reads a given parameter (tied lm_head reads embed_tokens).
        self._esft_layers: dict[str, list[torch.nn.Module]] = {}
        by_storage = {id(p): n for n, p in self._esft_params.items()}
        for layer in _PACKED_LAYERS:
            name = by_storage.get(id(layer.weight))
            if name is not None:
                self._esft_layers.setdefault(name, []).append(layer)
        self.esft_set_cpu_gemm(cpu_gemm)
        unmapped = [self._esft_hf[i][0] for i, blocks in self._esft_blocks.items() if not blocks]
        return {"unmapped": unmapped, "packed_layers": len(_PACKED_LAYERS), "allocator": allocator}

    def esft_set_cpu_gemm(self, mode: str) -> None:
        """CPU only: "repack" (vLLM's packed kernels, packed again after each weight change) or
        "plain" (torch linear on the live weights). Either way forward passes see the current weights."""
        if mode not in ("repack", "plain"):
            raise ValueError(f"cpu_gemm must be repack or plain, got {mode!r}")
        self._esft_cpu_gemm = mode
        for layers in self._esft_layers.values():
            for layer in layers:
                if mode == "plain":
                    layer.cpu_linear = _plain_linear
                else:
                    layer._esft_dispatch(layer, remove_weight=False)

    def esft_cpu_lora_ops(self, fast: bool | None = None) -> dict:
        """CPU LoRA ops of this worker (esft.engines.vllm_cpu_lora): switch them (True: esft's, False:
        vLLM's reference) unless None; returns whether esft's are in effect and how often each ran."""
        if fast is not None:
            vllm_cpu_lora.use(fast)
        return {"esft": vllm_cpu_lora.active(), "calls": dict(vllm_cpu_lora.CALLS)}

    def _esft_probe(self, model, hf_name: str, shape: tuple[int, ...]) -> list[Block]:
        """Where vLLM's loaders put each element of HF tensor `hf_name` (on this rank)."""
        parent = hf_name.rsplit(".", 2)[0] if hf_name.count(".") >= 2 else ""
        siblings = [
            n for n in self._esft_params
            if (n.rsplit(".", 2)[0] if n.count(".") >= 2 else "") == parent
        ]
        for candidates in (siblings, list(self._esft_params)):
            blocks = self._esft_probe_in(model, hf_name, shape, candidates)
            if blocks:
                return blocks
        return []

    def _esft_probe_in(self, model, hf_name, shape, candidates) -> list[Block]:
        numel = 1
        for size in shape:
            numel *= size
        probe = torch.arange(1, numel + 1, dtype=torch.float64).view(shape)
        saved = {}
        try:
            for n in candidates:
                param = self._esft_params[n]
                saved[n] = param.data
                param.data = torch.zeros(param.shape, dtype=torch.float64)
            try:
                model.load_weights([(hf_name, probe)])
            except (KeyError, ValueError, AssertionError, RuntimeError, IndexError):
                return []
            blocks = []
            for n in candidates:
                written = self._esft_params[n].data
                mask = written > 0
                if not bool(mask.any()):
                    continue
                vslices = _bounding_block(mask)
                box = written[vslices]
                if not bool((box > 0).all()) or int(mask.sum()) != box.numel() or box.ndim != len(shape):
                    raise RuntimeError(f"esft: vLLM stores {hf_name} in {n} in a layout ES cannot map")
                first = int(box.flatten()[0]) - 1
                start = []
                for size in reversed(shape):
                    start.append(first % size)
                    first //= size
                hslices = tuple(slice(s, s + b) for s, b in zip(reversed(start), box.shape))
                if not torch.equal(box, probe[hslices]):
                    raise RuntimeError(f"esft: vLLM stores {hf_name} in {n} in a layout ES cannot map")
                blocks.append((n, vslices, hslices))
            return blocks
        finally:
            for n, data in saved.items():
                self._esft_params[n].data = data

    def esft_configure(self, trainable: Sequence[int], noise: str, rank: int = 1, optimizer: dict | None = None) -> int:
        """Choose the trainable HF tensors (by index), the noise scheme, low-rank noise's rank and the
        optimizer (esft.es.optimizers.ESOptimizer's arguments, fresh state: keyed "<HF index>/<block>");
        (re)builds the float32 master from the current weights. Returns the number of trainable
        scalars on this rank. Low-rank noise leaves non-matrix tensors frozen, as everywhere."""
        self._esft_scheme, self._esft_rank = noise, int(rank)
        self._esft_optimizer = ESOptimizer(**(optimizer or {}))
        missing = [self._esft_hf[i][0] for i in trainable if not self._esft_blocks.get(i)]
        if missing:
            raise RuntimeError(f"esft: vLLM has no parameter for {missing[:5]}")
        self._esft_trainable = [(i, self._esft_hf[i][1], self._esft_blocks[i]) for i in trainable]
        names = sorted({block[0] for _, _, blocks in self._esft_trainable for block in blocks})
        self._esft_master = {n: self._esft_params[n].detach().to(torch.float32).clone() for n in names}
        largest = max(torch.Size(shape).numel() for _, shape, _ in self._esft_trainable)
        self._esft_scratch = torch.empty(largest, dtype=torch.float32, device=self._esft_device)
        self._esft_out = torch.empty(largest, dtype=torch.float32, device=self._esft_device)
        self._esft_rule = UpdateRule(noise, int(rank), self._esft_optimizer, self._esft_generator, self._esft_scratch,
                                     self._esft_device)
        # each HF tensor's pieces: views of the master just built (updated in place, never replaced)
        self._esft_tensors = [UpdateTensor(index, tuple(shape), [
            Piece(f"{index}/{number}", self._esft_master[name][vslices], name, self._esft_params[name].dtype, hslices)
            for number, (name, vslices, hslices) in enumerate(blocks)]) for index, shape, blocks in self._esft_trainable]
        return sum(
            torch.Size(shape).numel() for _, shape, _ in self._esft_trainable
        )

    # ------------------------------------------------------------ weights
    def _esft_draw(self, seed: int, index: int, shape, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = self._esft_scratch[: torch.Size(shape).numel()].view(shape)
        return draw_noise(self._esft_scheme, seed, index, shape, self._esft_device, self._esft_generator, out)

    def _esft_repack(self, names) -> None:
        if self._esft_cpu_gemm != "repack":
            return
        for name in names:
            for layer in self._esft_layers.get(name, ()):
                layer._esft_dispatch(layer, remove_weight=False)

    @torch.no_grad()
    def esft_perturb(self, seed: int, sigma: float) -> None:
        """θ ← master + σ·ε(seed) on the trainable elements, rounded once to the model dtype."""
        # The transformers engine's arithmetic, on contiguous HF-shaped pieces (a whole HF tensor
        # unless tensor parallelism splits it): torch.add(master, ε, alpha=σ), then rounding.
        if self._esft_scheme in LOW_RANK_SCHEMES:
            return self._esft_perturb_lowrank(seed, sigma)
        for index, shape, blocks in self._esft_trainable:
            noise = self._esft_draw(seed, index, shape)
            for name, vslices, hslices in blocks:
                piece = noise[hslices].contiguous()
                out = self._esft_out[: piece.numel()].view(piece.shape)
                torch.add(self._esft_master[name][vslices].contiguous(), piece, alpha=sigma, out=out)
                self._esft_params[name].data[vslices].copy_(out)
        self._esft_repack(self._esft_master)

    def _esft_perturb_lowrank(self, seed: int, sigma: float) -> None:
        """θ ← master + σ·A·Bᵀ/√r per matrix (esft.es.lowrank.perturbed_matrix); other tensors frozen."""
        for tensor, (_, _, blocks) in zip(self._esft_tensors, self._esft_trainable):
            if perturbs(self._esft_scheme, tensor.shape):  # the HF-shaped master (other ranks' elements 0: elementwise)
                whole = lowrank.perturbed_matrix(gathered(tensor), seed, tensor.index, sigma, self._esft_rank,
                                                 self._esft_generator)
                for name, vslices, hslices in blocks:
                    self._esft_params[name].data[vslices].copy_(whole[hslices])
        self._esft_repack(self._esft_master)

    @torch.no_grad()
    def esft_restore(self) -> None:
        """θ ← master: bit-exact."""
        for name, master in self._esft_master.items():
            self._esft_params[name].data.copy_(master)
        self._esft_repack(self._esft_master)

    @torch.no_grad()
    def esft_update(self, seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0
                    ) -> tuple[list[str], float, float]:
        """The transformers engine's update (esft.es.update.apply_update) on this rank's blocks of each HF
        tensor: G accumulated in float32 per HF tensor, so both engines compute the same float32 numbers,
        the optimizer's step block by block (elementwise, as on the whole tensor), then θ ← master. If a
        tensor would not be finite, θ is left alone, the master is put back from it, the optimizer's state
        is put back, and the names of the offending vLLM tensors are returned. Returns (those names,
        ‖Δθ‖², ‖θ‖² of this rank's blocks)."""
        def put_back() -> None:  # θ still holds the weights from before this update
            for name, master in self._esft_master.items():
                master.copy_(self._esft_params[name].data)

        result = apply_update(self._esft_tensors, seeds, coefficients, self._esft_rule, learning_rate, put_back)
        if not result.bad:
            self.esft_restore()
        return result.bad, result.moved_sq, result.weights_sq

    def esft_optimizer_blocks(self) -> list[tuple[str, list, dict]]:
        """This rank's optimizer state in HF layout: (HF name, HF slices as [start, stop] pairs, the
        block's packed state (esft.engines.vllm_adapters.pack_state, keys exp_avg, exp_avg_sq, step))."""
        out = []
        for index, _, blocks in self._esft_trainable:
            for number, (_, _, hslices) in enumerate(blocks):
                state = self._esft_optimizer.state.get(f"{index}/{number}")
                if state is not None:
                    packed = pack_state({"exp_avg.x": state.exp_avg, "exp_avg_sq.x": state.exp_avg_sq,
                                         "step.x": torch.tensor(state.step)})
                    out.append((self._esft_hf[index][0], [[s.start, s.stop] for s in hslices], packed))
        return out

    def esft_load_optimizer(self, state: dict[str, bytes], steps: dict[str, int]) -> None:
        """Set the optimizer state from HF-named float32 moments (bytes: exp_avg.<name>, exp_avg_sq.<name>)
        and step counts; tensors without a state start fresh."""
        self._esft_optimizer.state = {}
        for index, shape, blocks in self._esft_trainable:
            name = self._esft_hf[index][0]
            if name not in steps:
                continue
            moments = [from_bytes(state[f"{kind}.{name}"], shape).to(self._esft_device) for kind in ("exp_avg", "exp_avg_sq")]
            for number, (_, _, hslices) in enumerate(blocks):
                self._esft_optimizer.state[f"{index}/{number}"] = AdamState(
                    moments[0][hslices].contiguous(), moments[1][hslices].contiguous(), int(steps[name]))

    def esft_checksum(self) -> str:
        """Digest of this rank's float32 master (vLLM names, sorted)."""
        return master_checksum((name, self._esft_master[name]) for name in sorted(self._esft_master))

    def esft_master_blocks(self, current: bool = False) -> list[tuple[str, list, bytes]]:
        """This rank's trainable elements in HF layout: (HF name, HF slices as [start, stop] pairs,
        float32 values as bytes). `current` reads the live (possibly perturbed) weights instead of the master."""
        out = []
        for index, _, blocks in self._esft_trainable:
            for name, vslices, hslices in blocks:
                source = self._esft_params[name].data if current else self._esft_master[name]
                values = source[vslices].detach().to(torch.float32).cpu().contiguous()
                out.append((self._esft_hf[index][0], [[s.start, s.stop] for s in hslices], to_bytes(values)))
        return out

    @torch.no_grad()
    def esft_load_master(self, state: dict[str, bytes]) -> None:
        """Set the master's trainable elements from HF-named float32 tensors (as bytes), then θ ← master."""
        for index, shape, blocks in self._esft_trainable:
            tensor = from_bytes(state[self._esft_hf[index][0]], shape).to(self._esft_device)
            for name, vslices, hslices in blocks:
                self._esft_master[name][vslices].copy_(tensor[hslices])
        self.esft_restore()
