"""Low-rank ES members served as vLLM LoRA adapters (`--engine vllm --noise lowrank`).

Member i's matrix W gets σ·AᵢBᵢᵀ/√r (esft.es.noise `lowrank`): that is a LoRA adapter with
lora_A = Bᵢᵀ (r × in), lora_B = Aᵢ (out × r) and scaling σ/√r, so one vLLM engine serves the whole
population the way it serves any multi-adapter traffic, every member's requests in one `generate`.

In memory, no files. vLLM 0.32's `LoRARequest` carries a path only, but its worker-side loader
(`WorkerLoRAManager._load_adapter`) is one method that turns a request into a `LoRAModel`, and
`LoRAModel.from_lora_tensors` builds one from tensors. The worker extension replaces that method on
its own manager instance: a request whose path starts with `esft-member://` is rebuilt from the seed
and σ written in the path (factors regenerated from the seed, as everywhere in esft); any other
request goes to vLLM's loader. Only the seed and σ cross processes.

Names. Every member of every iteration gets a fresh adapter id and name (a counter that only goes
up): vLLM caches adapters by id, and its prefix cache keys blocks by (lora_name, lora_path), so a
reused name could serve another member's weights or KV cache (vLLM issue #42125).

What vLLM serves as LoRA here: the weights of linear layers (`BaseLinearLayerWithLoRA`: q/k/v, o,
gate/up, down). Embeddings, the LM head, norms and biases are frozen on this path (vLLM's embedding
and LM-head LoRA do not take a full-vocabulary A·Bᵀ in every version).

`lora_unwrapped` lets the ES worker map HF tensors with vLLM's weight loaders although LoRA wraps
the linear layers (their parameters are then named `...qkv_proj.base_layer.weight`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from esft.es.noise import lowrank_factors

MEMBER_SCHEME = "esft-member://"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The sizes vLLM 0.32 accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks)."""


def smallest_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank-`rank` adapters (buffers are sized by it)."""
    for size in LORA_RANKS:
        if size >= rank:
            return size
    raise ValueError(f"--rank {rank} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]})")


def member_request(adapter_id: int, seed: int, sigma: float):
    """The LoRARequest of one member: a fresh id and name, its seed and σ in the path."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"esft-member-{adapter_id}", lora_int_id=adapter_id,
                       lora_path=f"{MEMBER_SCHEME}{int(seed)}/{float(sigma)!r}/{adapter_id}")


def parse_member_path(path: str) -> tuple[int, float]:
    """(seed, σ) of a member_request path."""
    seed, sigma, _ = path[len(MEMBER_SCHEME):].split("/")
    return int(seed), float(sigma)


@contextmanager
def lora_unwrapped(runner):
    """The model with vLLM's LoRA wrappers swapped for the layers they wrap (HF-like parameter names)."""
    manager = getattr(runner, "lora_manager", None)
    modules = {} if manager is None else {
        name: module for name, module in manager._adapter_manager.modules.items()
        if hasattr(module, "base_layer") and _submodule(runner.model, name) is module}  # (lm_head's wrapper sits elsewhere)
    if not modules:
        yield
        return
    from vllm.lora.utils import replace_submodule

    for name, module in modules.items():
        replace_submodule(runner.model, name, module.base_layer)
    try:
        yield
    finally:
        for name, module in modules.items():
            replace_submodule(runner.model, name, module)


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


class AdapterWorker:
    """Mixed into the ES worker extension (esft.engines.vllm_worker): members as in-memory adapters."""

    def esft_adapter_setup(self) -> list[int]:
        """Install the in-memory member loader; returns the HF tensor indices vLLM serves as LoRA
        (matrices all of whose elements live in a LoRA-wrapped linear layer). [] without LoRA."""
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            return []
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

        linear = {name for name, module in manager._adapter_manager.modules.items()
                  if isinstance(module, BaseLinearLayerWithLoRA)}
        covered = [index for index, (name, shape) in self._esft_hf.items()
                   if len(shape) == 2 and name.endswith(".weight") and self._esft_blocks.get(index)
                   and all(block[0].rsplit(".", 1)[0] in linear for block in self._esft_blocks[index])]
        self._esft_lora_manager = manager
        if not hasattr(manager, "_esft_vllm_load"):
            manager._esft_vllm_load = manager._load_adapter
            manager._load_adapter = self._esft_load_adapter
        return covered

    def esft_adapter_configure(self, indices: Sequence[int], rank: int) -> None:
        """The HF matrices (by index) each member adapter perturbs, and the noise rank r."""
        self._esft_adapter_tensors = [(i, self._esft_hf[i][0][: -len(".weight")], self._esft_hf[i][1]) for i in indices]
        self._esft_adapter_rank = int(rank)

    def _esft_load_adapter(self, request):
        if request.lora_path.startswith(LORA_ES_SCHEME):
            return self._esft_lora_es_adapter(request)
        if not request.lora_path.startswith(MEMBER_SCHEME):
            return self._esft_lora_manager._esft_vllm_load(request)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        seed, sigma = parse_member_path(request.lora_path)
        rank, manager = self._esft_adapter_rank, self._esft_lora_manager
        generator = torch.Generator(device="cpu")
        tensors = {}
        for index, module, shape in self._esft_adapter_tensors:
            a, b = lowrank_factors(seed, index, shape, rank, "cpu", generator)
            tensors[f"base_model.model.{module}.lora_A.weight"] = b.T.contiguous()  # r × in
            tensors[f"base_model.model.{module}.lora_B.weight"] = a  # out × r
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": sorted(
            {module.rsplit(".", 1)[-1] for _, module, _ in self._esft_adapter_tensors})})
        mapper = getattr(manager._adapter_manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            request.lora_int_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size, weights_mapper=None if mapper is None else mapper.get_rename_mapper())
        for layer in lora.loras.values():
            layer.scaling = sigma / math.sqrt(rank)  # vLLM folds it into lora_B when the adapter is added
        return lora

    def esft_adapter_weights(self, adapter_id: int) -> list[tuple[str, list, bytes]]:
        """The weights vLLM's LoRA kernels compute with for adapter `adapter_id` (loaded in a slot):
        master + Σ_slices lora_B·lora_A in HF layout, as esft_master_blocks returns (for tests)."""
        manager = self._esft_lora_manager._adapter_manager
        slot = manager.lora_index_to_id.index(adapter_id)
        out = []
        for index, module, _ in self._esft_adapter_tensors:
            for name, vslices, hslices in self._esft_blocks[index]:
                layer = manager.modules[name.rsplit(".", 1)[0]]
                delta = torch.cat([b[slot, 0].float() @ a[slot, 0].float()
                                   for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked)])
                values = (self._esft_master[name] + delta)[vslices]
                out.append((self._esft_hf[index][0], [[s.start, s.stop] for s in hslices], values.detach().cpu().contiguous().numpy().tobytes()))
        return out


def servable_pattern(hf_params, indices) -> str:
    """A --trainable regex that selects exactly the HF matrices `indices` (by their module names,
    e.g. `\\.(down_proj|...)\\.weight$`; every name spelled out if module names alone are ambiguous)."""
    import re

    names = [name for index, name, _ in hf_params if index in indices]
    leaves = sorted({name.rsplit(".", 2)[-2] for name in names})
    pattern = r"\.(" + "|".join(map(re.escape, leaves)) + r")\.weight$"
    if {name for _, name, _ in hf_params if re.search(pattern, name)} == set(names):
        return pattern
    return "^(" + "|".join(map(re.escape, names)) + ")$"


def adapter_trainable(selected, hf_params, indices, trainable: str | None):
    """The trainable tensors of `--engine vllm --noise lowrank`: the matrices vLLM serves as LoRA
    (`indices`) among `selected` (the --trainable match). Says in one line (stderr) what is frozen;
    a --trainable that picks a matrix vLLM cannot serve is refused (NoTrainableParameters, exit 2)."""
    import re
    import sys

    from esft.engines.base import NoTrainableParameters

    pattern = servable_pattern(hf_params, indices)
    unservable = [name for index, name, shape in selected if len(shape) == 2 and index not in indices]
    if trainable and unservable:
        raise NoTrainableParameters(
            f"--trainable {trainable!r} picks {unservable[0]} ({len(unservable)} matrices), which vLLM cannot serve as "
            f"LoRA: with --engine vllm --noise lowrank ES perturbs linear-layer matrices only; use --trainable '{pattern}'")
    chosen = [entry for entry in selected if entry[0] in indices]
    frozen = sorted({re.sub(r"\.\d+\.", ".*.", name) for index, name, _ in hf_params if index not in indices
                     or index not in {entry[0] for entry in chosen}})
    print(f"esft: --engine vllm --noise lowrank perturbs the {len(chosen)} linear-layer matrices vLLM serves as LoRA "
          f"(same as --trainable '{pattern}' on --engine transformers); frozen: {', '.join(frozen)}", file=sys.stderr)
    return chosen


# ------------------------------------------------------------------ LoRA-ES (esft.engines.vllm_lora)
LORA_ES_SCHEME = "esft-lora://"


def pack_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An optimizer state (esft.es.optimizers.ESOptimizer.state_dict) for vLLM's RPC, which returns untyped
    values: step counts as ints, moments as (shape, float32 bytes)."""
    return {key: int(tensor) if key.startswith("step.") else
            (list(tensor.shape), tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
            for key, tensor in tensors.items()}


def unpack_state(packed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of pack_state."""
    return {key: torch.tensor(value, dtype=torch.int64) if key.startswith("step.") else
            torch.frombuffer(bytearray(value[1]), dtype=torch.float32).view(tuple(value[0])).clone()
            for key, value in packed.items()}


def lora_es_request(adapter_id: int, seed: int | None, sigma: float = 0.0):
    """A LoRA-ES request: member `seed` (trained adapter + σ·its noise), or the trained adapter (seed None)."""
    from vllm.lora.request import LoRARequest

    what = "trained/0.0" if seed is None else f"{int(seed)}/{float(sigma)!r}"
    return LoRARequest(lora_name=f"esft-lora-{adapter_id}", lora_int_id=adapter_id,
                       lora_path=f"{LORA_ES_SCHEME}{what}/{adapter_id}")


class LoRAESWorker:
    """Mixed into the ES worker extension: LoRA-ES's float32 adapter master lives in the worker; a
    member's adapter is master + σ·ε(seed) per adapter tensor (the transformers engine's arithmetic),
    built in memory on request; updates are applied here (only seeds and coefficients arrive)."""

    def esft_lora_es_setup(self, spec, master: dict[str, bytes], noise: str, rank: int, alpha: float,
                           optimizer: dict | None = None) -> None:
        """spec: (tensor index, PEFT name, vLLM LoRA tensor name, shape) per adapter tensor; `optimizer`:
        esft.es.optimizers.ESOptimizer's arguments (a fresh state)."""
        from esft.es.optimizers import ESOptimizer

        self._esft_les_optimizer = ESOptimizer(**(optimizer or {}))
        self._esft_les_spec = [tuple(entry) for entry in spec]
        self._esft_les_master = {name: torch.frombuffer(bytearray(master[name]), dtype=torch.float32).view(shape).clone()
                                 for _, name, _, shape in self._esft_les_spec}
        self._esft_les_noise, self._esft_les_rank, self._esft_les_alpha = noise, int(rank), float(alpha)

    def _esft_lora_es_adapter(self, request):
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        from esft.es.noise import draw_noise

        seed, sigma, _ = request.lora_path[len(LORA_ES_SCHEME):].split("/")
        generator = torch.Generator(device="cpu")
        tensors = {}
        for index, name, served, shape in self._esft_les_spec:
            master = self._esft_les_master[name]
            tensors[served] = master.clone() if seed == "trained" else torch.add(
                master, draw_noise(self._esft_les_noise, int(seed), index, shape, "cpu", generator), alpha=float(sigma))
        helper = PEFTHelper.from_dict({"r": self._esft_les_rank, "lora_alpha": self._esft_les_alpha, "target_modules": sorted(
            {served.split(".lora_")[0].rsplit(".", 1)[-1] for _, _, served, _ in self._esft_les_spec})})
        manager = self._esft_lora_manager
        return LoRAModel.from_lora_tensors(request.lora_int_id, tensors, helper, device="cpu",
                                           dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)

    @torch.no_grad()
    def esft_lora_es_update(self, seeds, coefficients, learning_rate: float = 1.0) -> list[str]:
        """The update of every engine (esft.es.update.apply_update) on the adapter's float32 master: the
        optimizer's step on G = Σᵢ cᵢ·εᵢ per adapter tensor (sgd: master += G); names that would not be finite
        (then the master and the optimizer's state are as before)."""
        from esft.es.update import Piece, UpdateRule, UpdateTensor, apply_update

        masters = self._esft_les_master
        tensors = [UpdateTensor(index, tuple(shape), [Piece(name, masters[name], name)])
                   for index, name, _, shape in self._esft_les_spec]
        before = {name: tensor.clone() for name, tensor in masters.items()}  # adapters are small: a copy undoes a step
        largest = max((torch.Size(shape).numel() for *_, shape in self._esft_les_spec), default=1)
        rule = UpdateRule(self._esft_les_noise, self._esft_les_rank, self._esft_les_optimizer,
                          torch.Generator(device="cpu"), torch.empty(largest, dtype=torch.float32))

        def put_back() -> None:
            for name, tensor in before.items():
                masters[name].copy_(tensor)

        return apply_update(tensors, seeds, coefficients, rule, learning_rate, put_back).bad

    def esft_lora_es_optimizer(self) -> dict:
        """The optimizer's state, PEFT-named (pack_state)."""
        return pack_state(self._esft_les_optimizer.state_dict())

    def esft_lora_es_load_optimizer(self, packed: dict) -> None:
        self._esft_les_optimizer.load_state_dict(unpack_state(packed))

    def esft_lora_es_master(self) -> dict[str, bytes]:
        return {name: tensor.contiguous().numpy().tobytes() for name, tensor in self._esft_les_master.items()}

    def esft_lora_es_load(self, master: dict[str, bytes]) -> None:
        for _, name, _, shape in self._esft_les_spec:
            self._esft_les_master[name] = torch.frombuffer(bytearray(master[name]), dtype=torch.float32).view(shape).clone()
