"""The vLLM engine (`--engine vllm`): weights live inside vLLM's worker processes.

Perturb, restore and update run in place in every worker through the worker extension
(`esft.engines.vllm_worker.ESWorkerExtension`) called with `collective_rpc`: only seeds, scalars
and names cross process boundaries. ES semantics (float32 master, bit-exact restore, float32
accumulation, i.i.d./correlated noise, `--trainable`) and noise are those of the transformers
engine, HF tensor by HF tensor, so the same seed perturbs both engines identically.

Low-rank noise (`--noise lowrank`): the engine starts with LoRA enabled and evaluates a population
as LoRA adapters, every member's requests in one `generate` (`generate_population`, the
PopulationEngine contract of esft.engines.base; esft.engines.vllm_adapters); it perturbs only the
matrices vLLM serves as LoRA (linear layers) and freezes the rest, on the adapter and in-place paths alike.

Checkpoints stay `from_pretrained`-loadable: the float32 master is gathered in Hugging Face layout
(vLLM's fused qkv_proj / gate_up_proj are split back into q/k/v and gate/up) and written into the
original HF model, which is loaded on this process only while saving.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import shutil
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from esft.child_processes import environment, main_module_hidden, new_socket_directory
from esft.engines.base import (
    Generation,
    NoTrainableParameters,
    NonFiniteWeights,
    Sampling,
    check_coefficients,
    check_optimizer_state,
    generation_from_tokens,
    prompt_noise_seed,
    torch_dtype,
)
from esft.engines.vllm_adapters import adapter_trainable, member_request, smallest_lora_rank, unpack_state
from esft.engines.vllm_worker import from_bytes, to_bytes
from esft.es.noise import LOW_RANK_SCHEMES, NOISE_SCHEMES, perturbs
from esft.es.update import UpdateResult

EXTENSION = "esft.engines.vllm_worker.ESWorkerExtension"


def hf_parameter_list(model_path: str) -> list[tuple[int, str, tuple[int, ...]]]:
    """(index, name, shape) of the HF model's named_parameters(), built on the meta device
    (no weights are read): the index is the noise's tensor index in every engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(i, name, tuple(p.shape)) for i, (name, p) in enumerate(model.named_parameters())]


class VLLMEngine:
    """One vLLM `LLM` (tensor_parallel_size workers) whose weights ES perturbs in place."""

    def __init__(
        self,
        model_path: str,
        *,
        trainable: str | None = None,
        noise: str = "iid",
        max_tokens: int = 64,
        mini_batch_size: int | None = None,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        cpu_gemm: str = "plain",
        seed: int = 0,
        rank: int = 1,
        max_loras: int | None = None,
        optimizer: dict | None = None,
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_path = str(model_path)
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.mini_batch_size = mini_batch_size  # vLLM schedules its own batches: results do not depend on it
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.last_update_ratio: float | None = None
        """‖Δθ‖/‖θ‖ of the last update over the trainable float32 master, all ranks (None before the first)."""
        self.hf_params = hf_parameter_list(self.model_path)
        on_gpu = torch.cuda.is_available()
        # Low-rank noise: members are LoRA adapters of this engine (esft.engines.vllm_adapters), as
        # many per scheduler step as max_loras (default 8), rank slots sized to the smallest that fits.
        self.rank, self._next_adapter_id = rank, 1
        self.generate_log: list[tuple[int, int]] = []
        """(rows, distinct LoRA adapters) of every vLLM `generate` call this engine made: a population
        served as adapters shows as one call carrying all its members (tests, benchmarks)."""
        self.optimizer = dict(optimizer or {})  # esft.es.optimizers.ESOptimizer's arguments: the workers hold it
        # LoRA-ES (esft.engines.vllm_lora) sets adapter_rank, the trained adapter's rank, beforehand.
        served_rank = getattr(self, "adapter_rank", None) or (rank if noise in LOW_RANK_SCHEMES else None)
        lora = dict(enable_lora=True, max_loras=max_loras or 8, max_lora_rank=smallest_lora_rank(served_rank)) \
            if served_rank else {}
        # vLLM starts its engine core process with spawn (always on CPU, on a GPU once CUDA is initialized):
        # without this, an unguarded user script would run again in that process (esft.child_processes).
        children = set(multiprocessing.active_children())
        with main_module_hidden(), environment(**self._socket_environment()):
            self.llm = LLM(
                model=self.model_path,
                dtype=dtype,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
                # Worker processes on this node (also inside a Ray actor, which already holds the GPUs
                # Ray gave it: vLLM's Ray backend would ask the cluster for them again).
                distributed_executor_backend="mp",
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                # A KV-cache block computed under one perturbation must never serve another member
                # (or the unperturbed model): with prefix caching, members sharing the prompt batch
                # would reuse the first member's cached prompt keys/values and all score alike.
                enable_prefix_caching=False,
                worker_extension_cls=EXTENSION,
                # Ignore the checkpoint's generation_config.json (sampling defaults, penalties):
                # ES rollouts are greedy, exactly as SamplingParams below says.
                generation_config="vllm",
                # CUDA graphs are fine (weights change in place, addresses stay); on CPU stay eager.
                enforce_eager=not on_gpu,
                **lora,
            )
        self._processes = [child for child in multiprocessing.active_children() if child not in children]
        summaries = self._rpc("esft_setup", self.hf_params, cpu_gemm)
        self._unmapped = set(summaries[0]["unmapped"])
        self.worker_allocator = summaries[0]["allocator"]
        """The malloc of vLLM's worker process, which runs the forward passes (esft.allocator), in words."""
        self.adapter_indices = set(self._rpc("esft_adapter_setup")[0])  # HF matrices vLLM serves as LoRA
        self.eos_token_ids = _eos_ids(self.model_path, self.tokenizer)
        self.configure(trainable=trainable, noise=noise)

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, **kwargs) -> VLLMEngine:
        return cls(model_name_or_path, **kwargs)

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)

    def configure(self, *, trainable: str | None = None, noise: str = "iid", optimizer: dict | None = None) -> None:
        """Select the trainable tensors (regex on HF names, as --trainable), the noise scheme and the
        optimizer (None: the engine's; its state starts fresh); the float32 master is rebuilt from the current weights. Low-rank noise on an engine with
        LoRA: the matrices vLLM serves as LoRA (linear layers) by default, and only those
        (esft.engines.vllm_adapters.adapter_trainable); its one line says what is frozen."""
        if noise not in NOISE_SCHEMES:
            raise ValueError(f"the vLLM engine supports --noise {', '.join(NOISE_SCHEMES)}, not {noise!r}")
        pattern = re.compile(trainable) if trainable else None
        self.trainable = [
            (index, name, shape) for index, name, shape in self.hf_params
            if pattern is None or pattern.search(name)
        ]
        if noise in LOW_RANK_SCHEMES and self.adapter_indices:
            self.trainable = adapter_trainable(self.trainable, self.hf_params, self.adapter_indices, trainable)
        if not self.trainable:
            raise NoTrainableParameters(
                f"{trainable!r} matches no parameter of the model; names look like {self.hf_params[0][1]!r}"
            )
        self.noise, self.trainable_pattern = noise, trainable
        self.optimizer = dict(self.optimizer if optimizer is None else optimizer)
        indices = [index for index, _, _ in self.trainable]
        self._rpc("esft_configure", indices, noise, self.rank, self.optimizer)
        if noise in LOW_RANK_SCHEMES and self.adapter_indices:
            self._rpc("esft_adapter_configure", [i for i, _, shape in self.trainable if perturbs(noise, shape)], self.rank)

    # ---------------------------------------------------------------- weights
    def perturb(self, member_seed: int, sigma: float) -> None:
        """θ ← master + σ·ε(member_seed) in every worker."""
        self._rpc("esft_perturb", int(member_seed), float(sigma))

    def restore(self) -> None:
        """θ ← master: bit-exact."""
        self._rpc("esft_restore")

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """master ← master + Σᵢ coefficients[i]·ε(member_seeds[i]) in float32 (or the optimizer's step
        on it: Engine.update), then θ ← master (NonFiniteWeights, weights unchanged, if that would not be finite)."""
        check_coefficients(coefficients)
        results = self._rpc("esft_update", [int(s) for s in member_seeds], [float(c) for c in coefficients],
                            float(learning_rate))
        bad = sorted({name for names, _, _ in results for name in names})
        if bad:
            raise NonFiniteWeights(f"the update would make {len(bad)} tensor(s) non-finite ({', '.join(bad[:3])}) "
                                   "(weights unchanged)")
        self.last_update_ratio = UpdateResult([], sum(r[1] for r in results), sum(r[2] for r in results)).ratio

    def checksum(self) -> str:
        """Digest of the float32 master over all workers; equal digests = bit-identical replicas."""
        digest = hashlib.blake2b(digest_size=16)
        for rank_digest in self._rpc("esft_checksum"):
            digest.update(rank_digest.encode())
        return digest.hexdigest()

    def _gather(self, current: bool = False) -> dict[str, torch.Tensor]:
        return self._collect(self._rpc("esft_master_blocks", current))

    def _collect(self, blocks_per_rank) -> dict[str, torch.Tensor]:
        """HF tensors from the (HF name, HF slices, bytes) blocks every worker sent."""
        shapes = {name: shape for _, name, shape in self.trainable}
        sent = {name for blocks in blocks_per_rank for name, _, _ in blocks}
        out = {name: torch.full(shape, float("nan")) for name, shape in shapes.items() if name in sent}
        for blocks in blocks_per_rank:
            for name, bounds, data in blocks:
                where = tuple(slice(a, b) for a, b in bounds)
                out[name][where] = from_bytes(data, out[name][where].shape)
        for name, tensor in out.items():
            if torch.isnan(tensor).any():
                raise RuntimeError(f"vLLM workers do not hold all of {name}")
        return out

    def master_state(self) -> dict[str, torch.Tensor]:
        """The float32 master of the trainable tensors, HF-named and HF-shaped (for checkpoints)."""
        return self._gather()

    def current_weights(self) -> dict[str, torch.Tensor]:
        """The live (possibly perturbed) trainable weights in HF layout, as float32 (for tests)."""
        return self._gather(current=True)

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the float32 master (and θ) from HF-named tensors."""
        missing = {name for _, name, _ in self.trainable} - set(state)
        if missing:
            raise ValueError(f"checkpoint master state lacks tensors: {sorted(missing)[:5]}")
        wanted = {name: to_bytes(state[name]) for _, name, _ in self.trainable}
        self._rpc("esft_load_master", wanted)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The workers' optimizer state, HF-named and HF-shaped (exp_avg.<name>, exp_avg_sq.<name>, step.<name>)."""
        shapes = {name: shape for _, name, shape in self.trainable}
        out: dict[str, torch.Tensor] = {}
        for blocks in self._rpc("esft_optimizer_blocks"):
            for name, bounds, packed in blocks:
                where = tuple(slice(a, b) for a, b in bounds)
                for key, value in unpack_state(packed).items():
                    kind = key.partition(".")[0]
                    if kind == "step":
                        out[f"step.{name}"] = value
                    else:
                        out.setdefault(f"{kind}.{name}", torch.zeros(shapes[name]))[where] = value
        return out

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the workers' optimizer state from HF-named tensors (optimizer_state's)."""
        check_optimizer_state(state, {name: shape for _, name, shape in self.trainable})
        steps = {key.partition(".")[2]: int(value) for key, value in state.items() if key.startswith("step.")}
        self._rpc("esft_load_optimizer", {key: to_bytes(value) for key, value in state.items()
                                           if not key.startswith("step.")}, steps)

    def num_trainable(self) -> int:
        return sum(torch.Size(shape).numel() for _, _, shape in self.trainable)

    def trainable_names(self) -> list[str]:
        """Hugging Face names of the trainable tensors, in tensor-index order."""
        return [name for _, name, _ in self.trainable]

    def max_length(self) -> int | None:
        """vLLM's max_model_len: the longest prompt + completion this engine accepts."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def embedding_rows(self) -> int | None:
        """The model's vocabulary size as vLLM loaded it (its embedding's rows)."""
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def feeds_padding(self) -> bool:
        """False: vLLM takes each prompt's own token ids, never a pad token."""
        return False

    # ------------------------------------------------------------- generation
    def generate(
        self, prompts: Sequence[str], mini_batch_size: int | None = None, sampling: Sampling | None = None
    ) -> Generation:
        """Completions for every prompt: greedy (temperature 0, top-p 1, one sample) unless
        `sampling` says otherwise. `mini_batch_size` is accepted for interface parity; vLLM
        batches requests itself."""
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(sampling or Sampling(), prompts)
        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        outputs = self._llm_generate([TokensPrompt(prompt_token_ids=row) for row in ids], params)
        rows = [completion.token_ids for output in outputs for completion in output.outputs]
        return generation_from_tokens(rows, self.eos_token_ids, self.tokenizer)

    def _llm_generate(self, rows, params, lora_requests=None):
        """vLLM's generate over `rows` (one LoRARequest per row, or none), logged in generate_log."""
        adapters = len({request.lora_int_id for request in lora_requests}) if lora_requests else 0
        self.generate_log.append((len(rows), adapters))
        return self.llm.generate(rows, params, use_tqdm=False, lora_request=lora_requests)

    def _sampling_params(self, sampling: Sampling, row_prompts: Sequence[str]):
        """vLLM's SamplingParams for rows of `row_prompts`: one for all, or with common random numbers
        (Sampling.common_noise) one per row, seeded from its prompt's text (vLLM then draws each row's noise
        from a generator of that seed: the same numbers for every member on a prompt)."""
        from vllm import SamplingParams

        def params(seed: int | None):
            return SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0 if sampling.greedy else -1,
                seed=seed,
                max_tokens=self.max_tokens,
                stop_token_ids=list(self.eos_token_ids),
                repetition_penalty=1.0,
                detokenize=False,
            )

        if sampling.common_noise and not sampling.greedy:
            return [params(prompt_noise_seed(sampling.seed, prompt)) for prompt in row_prompts]
        return params(None if sampling.greedy else sampling.seed)

    # ------------------------------------------------------------- population
    def population_problem(self) -> str | None:
        """Why members cannot be served as LoRA adapters of this engine, or None when they can."""
        if self.noise not in LOW_RANK_SCHEMES:
            return (f"--noise {self.noise} gives every member its own full weights: vLLM evaluates them one at a "
                    "time (--noise lowrank serves the population as LoRA adapters)")
        if not self.adapter_indices:
            return "this vLLM engine was started without LoRA (start it with noise='lowrank')"
        return None

    def generate_population(self, prompts: Sequence[str], member_seeds: Sequence[int], sigma: float,
                            mini_batch_size: int | None = None, sampling: Sampling | None = None) -> list[Generation]:
        """Greedy completions of `prompts` for every member (sampled with common random numbers where
        `sampling` says so), members served as LoRA adapters built in the workers from their seeds
        (esft.engines.vllm_adapters): ONE generate over members × prompts; vLLM's scheduler runs up to
        max_loras adapters per step. The base weights are the master (no perturb/restore). Each member
        gets a fresh adapter id and name, never reused."""
        problem = self.population_problem()
        if problem:
            raise ValueError(problem)
        requests, self._last_population = [], len(member_seeds)
        for seed in member_seeds:
            requests.append(member_request(self._next_adapter_id, seed, sigma))
            self._next_adapter_id += 1
        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        from vllm.inputs import TokensPrompt

        rows = [TokensPrompt(prompt_token_ids=row) for _ in member_seeds for row in ids]
        outputs = self._llm_generate(rows, self._sampling_params(sampling or Sampling(), list(prompts) * len(member_seeds)),
                                     [request for request in requests for _ in ids])
        tokens = [output.outputs[0].token_ids for output in outputs]
        return [generation_from_tokens(tokens[m * len(ids):(m + 1) * len(ids)], self.eos_token_ids, self.tokenizer)
                for m in range(len(member_seeds))]

    def adapter_weights(self, member_position: int) -> dict[str, torch.Tensor]:
        """What vLLM's LoRA kernels compute with for a member of the last generate_population
        (0 = its first member), if its adapter still holds a slot: master + lora_B·lora_A, HF layout (tests)."""
        adapter_id = self._next_adapter_id - self._last_population + member_position
        return self._collect(self._rpc("esft_adapter_weights", adapter_id))

    # ----------------------------------------------------------------- saving
    def save_pretrained(self, path: str | Path) -> None:
        """Write the master weights (rounded to the model dtype) into the original HF model and save
        it with its tokenizer: loadable with AutoModelForCausalLM.from_pretrained."""
        from transformers import AutoModelForCausalLM

        master = self.master_state()
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype(self.dtype))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in master.items():
                params[name].copy_(tensor)
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        del model

    def _socket_environment(self) -> dict[str, str]:
        """Where vLLM's processes put their zmq socket files: vLLM leaves them behind (7 per engine in
        the temporary directory, shut down or not), so each engine gets a directory of its own, removed
        by close() or at exit. A VLLM_RPC_BASE_PATH of the user's is kept as it is."""
        if os.environ.get("VLLM_RPC_BASE_PATH") or (directory := new_socket_directory()) is None:
            return {}
        self._remove_sockets = weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)
        return {"VLLM_RPC_BASE_PATH": directory}

    def close(self) -> None:
        """Stop the vLLM engine, returning once its core and worker processes have exited (their memory is
        free), and remove its socket files."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None
        for process in getattr(self, "_processes", []):  # vLLM may SIGKILL its engine core and not wait for it
            process.join(timeout=30)
        if getattr(self, "_remove_sockets", None) is not None:
            self._remove_sockets()


def _eos_ids(model_path: str, tokenizer) -> list[int]:
    """End-of-sequence ids as the transformers engine uses them: the tokenizer's EOS plus the
    model's generation_config EOS ids."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        from transformers import AutoConfig

        eos = AutoConfig.from_pretrained(model_path).eos_token_id
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids.discard(None)
    return sorted(ids)
