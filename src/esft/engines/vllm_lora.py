"""LoRA-ES on vLLM (`--lora-r R --engine vllm`, or --lora-adapter / an adapter directory as --model).

The trained adapter and every member are LoRA adapters of one vLLM engine, built in memory inside
the workers (esft.engines.vllm_adapters, `LoRAESWorker`): member i's adapter is the trained one plus
σ·εᵢ on each of its tensors (A and B alike, --noise iid or correlated), exactly the weights the
transformers engine's LoRA-ES writes into its PeftModel for that seed (same tensor indices: positions
in the PeftModel's `named_parameters()`). Evaluation serves the trained adapter itself. The float32
adapter master lives in the workers and is updated there (only seeds and coefficients cross
processes); the base weights are never written. Every adapter served gets a fresh id and name.

A CPU PeftModel of the base is kept in this process for the tensor names, the initial adapter (the
same seeded initialisation as the transformers engine) and saving: `final/` is a PEFT adapter
(`PeftModel.from_pretrained`), `final-merged/` the merged model (esft.engines.lora.export_merged).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from esft.engines.base import (Generation, NonFiniteWeights, Sampling, check_coefficients, check_optimizer_state,
                               generation_from_tokens, master_checksum)
from esft.engines.vllm_adapters import lora_es_request, pack_state, unpack_state
from esft.engines.vllm_engine import VLLMEngine
from esft.es.noise import LOW_RANK_SCHEMES


def served_name(peft_name: str, adapter_name: str = "default") -> str:
    """The name vLLM's LoRA loader reads (PEFT's file layout: no adapter name)."""
    return peft_name.replace(f".{adapter_name}.weight", ".weight")


class VLLMLoRAEngine(VLLMEngine):
    """A vLLM engine whose trainable tensors are a LoRA adapter's (module docstring)."""

    def __init__(self, model_path: str, peft_model: Any, *, adapter_names: Sequence[str], **kwargs):
        from esft.engines.lora import _refuse_dropout

        _refuse_dropout(peft_model)
        self.peft_model = peft_model
        config = peft_model.peft_config["default"]
        if getattr(config, "use_rslora", False) or getattr(config, "use_dora", False) or config.modules_to_save:
            raise ValueError("LoRA-ES on vLLM serves plain LoRA adapters (no rsLoRA, DoRA or modules_to_save)")
        self.adapter_rank = max([config.r, *(config.rank_pattern or {}).values()])
        self._alpha = config.lora_alpha
        names = set(adapter_names)
        self._spec = [(index, name, tuple(param.shape)) for index, (name, param) in enumerate(peft_model.named_parameters())
                      if name in names]
        self._initial = {name: param.detach().to(torch.float32).contiguous().numpy().tobytes()
                         for name, param in peft_model.named_parameters() if name in names}
        self._member = None
        self._trained = None
        super().__init__(model_path, **kwargs)

    def configure(self, *, trainable: str | None = None, noise: str = "iid", optimizer: dict | None = None) -> None:
        """The adapter tensors are the trainable ones (chosen at construction); full-rank noise only;
        `optimizer` as VLLMEngine.configure's (its state, in the worker, starts fresh)."""
        if noise in LOW_RANK_SCHEMES:
            raise ValueError("LoRA-ES on vLLM perturbs the adapter with --noise iid or correlated, not lowrank")
        self.noise, self.trainable_pattern, self.trainable = noise, trainable, list(self._spec)
        spec = [(index, name, served_name(name), shape) for index, name, shape in self._spec]
        self.optimizer = dict(self.optimizer if optimizer is None else optimizer)
        self._rpc("esft_lora_es_setup", spec, self._initial, noise, self.adapter_rank, self._alpha, self.optimizer)
        self._trained = None

    def _fresh(self, seed: int | None = None, sigma: float = 0.0):
        request = lora_es_request(self._next_adapter_id, seed, sigma)
        self._next_adapter_id += 1
        return request

    # ---------------------------------------------------------------- weights
    def perturb(self, member_seed: int, sigma: float) -> None:
        """The next generate serves member `member_seed` (the trained adapter + σ·ε) as a fresh adapter."""
        self._member = self._fresh(member_seed, sigma)

    def restore(self) -> None:
        self._member = None

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        check_coefficients(coefficients)
        bad = self._rpc("esft_lora_es_update", [int(s) for s in member_seeds], [float(c) for c in coefficients],
                        float(learning_rate))[0]
        if bad:
            raise NonFiniteWeights(f"the update would make {len(bad)} adapter tensor(s) non-finite ({', '.join(bad[:3])}) "
                                   "(weights unchanged)")
        self._trained = None  # the trained adapter changed: a new id next time

    def master_state(self) -> dict[str, torch.Tensor]:
        shapes = {name: shape for _, name, shape in self._spec}
        return {name: torch.frombuffer(bytearray(data), dtype=torch.float32).view(shapes[name]).clone()
                for name, data in self._rpc("esft_lora_es_master")[0].items()}

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = {name for _, name, _ in self._spec} - set(state)
        if missing:
            raise ValueError(f"checkpoint master state lacks tensors: {sorted(missing)[:5]}")
        self._rpc("esft_lora_es_load", {name: state[name].to(torch.float32).contiguous().numpy().tobytes()
                                         for _, name, _ in self._spec})
        self._trained = None

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The worker's optimizer state of the adapter tensors, PEFT-named."""
        return unpack_state(self._rpc("esft_lora_es_optimizer")[0])

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        check_optimizer_state(state, {name: shape for _, name, shape in self._spec})
        self._rpc("esft_lora_es_load_optimizer", pack_state(state))

    def checksum(self) -> str:
        return master_checksum(sorted(self.master_state().items()))

    def current_weights(self) -> dict[str, torch.Tensor]:
        return self.master_state()

    # ------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[str], mini_batch_size: int | None = None,
                 sampling: Sampling | None = None) -> Generation:
        """Completions of the perturbed member (between perturb and restore), else of the trained adapter."""
        if self._member is None and self._trained is None:
            self._trained = self._fresh()
        return self._generate_with(prompts, [self._member or self._trained], sampling or Sampling())[0]

    def population_problem(self) -> str | None:
        return None

    def generate_population(self, prompts: Sequence[str], member_seeds: Sequence[int], sigma: float,
                            mini_batch_size: int | None = None, sampling: Sampling | None = None) -> list[Generation]:
        """Every member's adapter (trained + σ·εᵢ) in ONE generate over members × prompts (greedy unless `sampling`)."""
        return self._generate_with(prompts, [self._fresh(seed, sigma) for seed in member_seeds], sampling or Sampling())

    def _generate_with(self, prompts, requests, sampling: Sampling) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        rows = [TokensPrompt(prompt_token_ids=row) for _ in requests for row in ids]
        outputs = self._llm_generate(rows, self._sampling_params(sampling, list(prompts) * len(requests)),
                                     [request for request in requests for _ in ids])
        per_request = len(ids) * sampling.n
        tokens = [completion.token_ids for output in outputs for completion in output.outputs]
        return [generation_from_tokens(tokens[k * per_request:(k + 1) * per_request], self.eos_token_ids, self.tokenizer)
                for k in range(len(requests))]

    # ----------------------------------------------------------------- saving
    def save_pretrained(self, path: str | Path) -> None:
        """The trained adapter as a PEFT adapter directory (PeftModel.from_pretrained) with the tokenizer."""
        master = self.master_state()
        params = dict(self.peft_model.named_parameters())
        with torch.no_grad():
            for name, tensor in master.items():
                params[name].copy_(tensor)
        self.peft_model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def vllm_lora_engine(args, path: str, vllm_options: dict[str, Any], options: dict[str, Any]) -> VLLMLoRAEngine:
    """The LoRA-ES engine on vLLM for this run: the base `path` (or the base of an adapter directory)
    wrapped in PEFT on CPU exactly as the transformers engine's LoRA-ES does (esft.engines.lora)."""
    from transformers import AutoModelForCausalLM

    from esft.settings.rules import is_adapter_dir
    from esft.engines.lora import _require_peft, _with_adapter, adapter_tensor_names, base_of

    _require_peft()
    adapter = args.lora_adapter
    if is_adapter_dir(path):
        adapter, path = path, base_of(path)
    peft_model = _with_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), args, adapter)
    names = adapter_tensor_names(peft_model, options.get("trainable"))
    return VLLMLoRAEngine(str(path), peft_model, adapter_names=names, **{**vllm_options, **options, "trainable": None})
