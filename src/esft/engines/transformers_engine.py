"""The in-process engine: a transformers causal LM whose trainable tensors ES perturbs in place.

Weights (--master-weights): with `float32`, a float32 master copy of every trainable tensor is the source of
truth. A member's weights are `master + σ·ε` rounded once to the model dtype; restoring copies the master back,
which is bit-exact in any dtype (subtracting σ·ε again would not be, in bfloat16/float16). Updates accumulate
in float32 on the master, so small steps are not rounded away in low-precision models.

With `none` the weights are their own master: no copy is kept. A member's weights are computed as above (the
same numbers), and restoring computes θ − σ·ε back, rounded to the weights' dtype, and puts back the few elements
where that differs from what was there (`_Perturbation`: kept from the perturb, a few percent of the elements at
σ 1e-2 in bfloat16, fewer at smaller σ). Low-rank noise on bfloat16/float16 weights is added and taken away a
block of rows at a time, so no float32 copy of a whole matrix is made. Updates land through esft.es.update's path
without a master (float32 weights: the master's numbers bit for bit; bfloat16/float16: seeded stochastic
rounding). Population batching never writes the weights, so it needs neither.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from esft.es import lowrank
from esft.engines.decoding import CommonNoise, contiguous_head_input, decode
from esft.engines.base import (
    Generation,
    NoTrainableParameters,
    NonFiniteWeights,
    Sampling,
    check_coefficients,
    check_optimizer_state,
    generation_from_tokens,
    master_checksum,
    prompt_noise_seed,
    resolve_device,
    torch_dtype,
)
from esft.es.noise import LOW_RANK_SCHEMES, draw_noise, lowrank_factors, perturbs
from esft.es.optimizers import ESOptimizer
from esft.es.update import Piece, UpdateRule, UpdateTensor, apply_update
from esft.engines.registry import MASTER_WEIGHTS


@dataclass
class _Perturbation:
    """A member's perturbation held by weights without a master: its seed and σ, and per tensor the original values
    of the elements θ − σ·ε would not give back exactly, as parts (start, indices from start, values): one per
    block of rows (int32 indices within it), or one for the whole tensor."""

    member_seed: int
    sigma: float
    fixes: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]


class TransformersEngine:
    """Holds one transformers model; member evaluation = perturb → generate → restore."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        trainable: str | None = None,
        noise: str = "iid",
        max_tokens: int = 64,
        mini_batch_size: int | None = None,
        rank: int = 1,
        optimizer: dict | None = None,
        master_weights: str = "float32",
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.noise = noise
        self.rank = rank
        """Rank r of low-rank noise (--noise lowrank: matrices get σ·A·Bᵀ/√r, other tensors stay frozen)."""
        self.max_tokens = max_tokens
        self.mini_batch_size = mini_batch_size
        """Prompts per generate call: an int, "auto" (esft.engines.sizing) or None (all of them)."""
        self.min_new_tokens = 0
        """Benchmarks only: EOS is forbidden before this many new tokens (forces equal lengths)."""
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device=self.device)
        pattern = re.compile(trainable) if trainable else None
        # Tensor index = position among ALL parameters, so restricting --trainable never changes
        # the noise any tensor receives.
        self.trainable = [
            (index, name, param)
            for index, (name, param) in enumerate(model.named_parameters())
            if pattern is None or pattern.search(name)
        ]
        if not self.trainable:
            raise NoTrainableParameters(
                f"{trainable!r} matches no parameter of the model; names look like {next(iter(dict(model.named_parameters())))!r}"
            )
        if master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}, got {master_weights!r}")
        self.master_weights = master_weights
        """--master-weights, resolved: float32 (a master beside the weights) or none (the weights are the master)."""
        own = master_weights == "none"
        self.master = {name: param.data if own else param.detach().to(torch.float32).clone()
                       for _, name, param in self.trainable}
        """The truth of each trainable tensor: its float32 master, or (none) the weights themselves."""
        self._perturbation: _Perturbation | None = None
        # Noise scratch: views of ONE float32 buffer the size of the largest tensor (tensors are
        # perturbed one at a time), not a second float32 copy of every trainable tensor.
        flat = torch.empty(max(m.numel() for m in self.master.values()), dtype=torch.float32, device=self.device)
        self._scratch = {name: flat[: m.numel()].view(m.shape) for name, m in self.master.items()}
        self.optimizer = ESOptimizer(**(optimizer or {}))
        """How G moves the master (--optimizer: esft.es.optimizers.optimizer_spec); adam's state beside the master."""
        self._noise_buffer = flat
        self._update_tensors = [  # the master's tensors, updated in place
            UpdateTensor(index, tuple(param.shape), [Piece(name, self.master[name], name, param.dtype, own_weights=own)])
            for index, name, param in self.trainable]
        self.last_update_ratio: float | None = None
        """‖Δθ‖/‖θ‖ of the last update (the trainable float32 master; None before the first)."""
        self.last_update_survival: float | None = None
        """How much of the last update survived rounding into bfloat16/float16 weights without a master (1: all of
        it on average; esft.es.update.UpdateResult.survival); None with a master or float32 weights."""
        self._encoded: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self._prepare_tokenizer_and_generation()
        if noise not in LOW_RANK_SCHEMES:  # --population-batching with full-rank noise: each member's own weights
            from esft.engines.fullrank_population import FullRankPopulation

            self.population_class = FullRankPopulation

    @classmethod
    def from_pretrained(
        cls, model_name_or_path: str, *, dtype: str = "float32", device: str = "auto", **kwargs
    ) -> TransformersEngine:
        """Load a causal LM and its tokenizer from a hub id or a local directory."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # our own progress bar is the one that matters
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=torch_dtype(dtype))
        return cls(model.to(resolve_device(device)), tokenizer, **kwargs)

    def _prepare_tokenizer_and_generation(self) -> None:
        from transformers import GenerationConfig

        tokenizer = self.tokenizer
        tokenizer.padding_side = "left"  # decoder-only batches must end where generation starts
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model_config = self.model.generation_config
        eos = model_config.eos_token_id if model_config is not None else None
        eos_ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_ids.discard(None)
        self.eos_token_ids = sorted(eos_ids)
        # generate() fills every unset field from model.generation_config (a checkpoint's sampling,
        # temperature, repetition penalty...). Replace it so nothing leaks into greedy rollouts; the
        # original is put back whenever the model is saved.
        self._saved_generation_config = model_config
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_token_ids, pad_token_id=tokenizer.pad_token_id
        )
        self.greedy = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=self.max_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id,
            repetition_penalty=1.0,
            temperature=None,
            top_p=None,
            top_k=None,
        )

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def perturb(self, member_seed: int, sigma: float) -> None:
        """θ ← master + σ·ε(member_seed), tensor by tensor, in the model dtype."""
        if self.master_weights == "none":
            self._perturb_own_weights(member_seed, sigma)
            return
        for index, name, param in self.trainable:
            if perturbs(self.noise, param.shape):  # else frozen under this scheme (low-rank: non-matrix tensors)
                self.perturbed_into(index, name, member_seed, sigma, param)

    def _perturb_own_weights(self, member_seed: int, sigma: float) -> None:
        """perturb without a master: θ ← θ + σ·ε (perturbed_into's numbers), keeping for each tensor the elements
        that (θ + σ·ε) − σ·ε would not give back exactly (module docstring)."""
        if self._perturbation is not None:
            raise RuntimeError("perturb called twice without restore: the weights hold a member's perturbation")
        fixes = {}
        for index, name, param in self.trainable:
            if not perturbs(self.noise, param.shape):
                continue
            if self._by_row_blocks(param):
                fixes[name] = self._shift_rows(index, param, member_seed, sigma, keep=True)
                continue
            member = torch.empty(param.shape, dtype=torch.float32, device=self.device)
            self.perturbed_into(index, name, member_seed, sigma, member)
            member = member.to(param.dtype)
            back = self._minus_noise(index, name, member_seed, sigma, member)
            wrong = (back != param).view(-1).nonzero().squeeze(1)
            fixes[name] = [(0, wrong, param.view(-1)[wrong].clone())]
            param.copy_(member)
            del member, back
        self._perturbation = _Perturbation(member_seed, sigma, fixes)

    def _by_row_blocks(self, param: torch.Tensor) -> bool:
        """Low-rank noise on low-precision weights without a master is added and taken away a block of rows at a
        time (`_shift_rows`): no float32 copy of a whole matrix (a 3B Llama's embedding: 1.6 GB) is ever made."""
        return self.noise in LOW_RANK_SCHEMES and param.dtype != torch.float32

    def _shift_rows(self, index: int, param: torch.Tensor, member_seed: int, sigma: float,
                    keep: bool) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """param ← param + σ·A·Bᵀ/√r (rounded to its dtype), block of rows by block (esft.es.lowrank.row_blocks);
        keep: the parts (`_Perturbation.fixes`) of the elements that the same shift by −σ would not give back."""
        a, b = lowrank_factors(member_seed, index, param.shape, self.rank, self.device, self._generator)
        scale = sigma / math.sqrt(self.rank)
        blocks = lowrank.row_blocks(param.shape)
        # the same few buffers for every block (the noise scratch's first pages, two blocks in param's dtype): blocks
        # allocated anew would leave the allocator's heap holding many of them between the parts kept
        size = (blocks[0].stop - blocks[0].start) * param.shape[1]
        exact, moved, back = self._noise_buffer[:size], param.new_empty(size), param.new_empty(size)
        parts = []
        for rows in blocks:
            block = param[rows]
            count = block.numel()
            work = exact[:count].view(block.shape).copy_(block).addmm_(a[rows], b.T, alpha=scale)
            moved_block = moved[:count].view(block.shape).copy_(work)
            if keep:
                work.copy_(moved_block).addmm_(a[rows], b.T, alpha=-scale)
                wrong = torch.ne(back[:count].view(block.shape).copy_(work), block).view(-1).nonzero().squeeze(1)
                parts.append((rows.start * param.shape[1], wrong.to(torch.int32), block.view(-1)[wrong].clone()))
            block.copy_(moved_block)
        return parts

    def _minus_noise(self, index: int, name: str, member_seed: int, sigma: float, weights: torch.Tensor) -> torch.Tensor:
        """weights − σ·ε(member_seed) of tensor `index`, computed in float32 and rounded to weights' dtype."""
        out = weights.to(torch.float32, copy=True)
        if self.noise in LOW_RANK_SCHEMES:
            lowrank.perturbed_matrix(out, member_seed, index, -sigma, self.rank, self._generator, out)
        else:
            noise = draw_noise(self.noise, member_seed, index, weights.shape, self.device, self._generator, self._scratch[name])
            out.add_(noise, alpha=-sigma)
        return out.to(weights.dtype)

    @torch.no_grad()
    def perturbed_into(self, index: int, name: str, member_seed: int, sigma: float, out: torch.Tensor) -> None:
        """out ← master + σ·ε(member_seed) of trainable tensor `index`, rounded once to out's dtype: a
        member's weights, written into the model (perturb) or into a population's stack
        (esft.engines.fullrank_population), the same values either way."""
        direct = out.dtype == torch.float32  # one fused pass into `out` itself, else via scratch and a copy
        target = out if direct else self._scratch[name]
        master = self.master[name]
        if master.dtype != torch.float32:  # without a master: the low-precision weights in float32, in the target
            if not direct:  # (not in the scratch the noise is drawn into)
                target = torch.empty(out.shape, dtype=torch.float32, device=self.device)
            master = target.copy_(master)
        if self.noise in LOW_RANK_SCHEMES:
            lowrank.perturbed_matrix(master, member_seed, index, sigma, self.rank, self._generator, target)
        else:
            noise = draw_noise(self.noise, member_seed, index, out.shape, self.device, self._generator, self._scratch[name])
            torch.add(master, noise, alpha=sigma, out=target)
        if not direct:
            out.copy_(target)

    @torch.no_grad()
    def restore(self) -> None:
        """θ ← master (rounded to the model dtype): bit-exact, whatever was done to θ. Without a master: the
        weights from before the last perturb, bit-exact (θ − σ·ε and the elements kept for it)."""
        if self.master_weights == "float32":
            for _, name, param in self.trainable:
                param.copy_(self.master[name])
            return
        perturbation, self._perturbation = self._perturbation, None
        if perturbation is None:
            return  # the weights are the master: nothing was done to them
        for index, name, param in self.trainable:
            if name not in perturbation.fixes:
                continue
            if self._by_row_blocks(param):
                self._shift_rows(index, param, perturbation.member_seed, -perturbation.sigma, keep=False)
            else:
                param.copy_(self._minus_noise(index, name, perturbation.member_seed, perturbation.sigma, param))
            for start, where, values in perturbation.fixes[name]:
                param.view(-1)[start:][where] = values

    @torch.no_grad()
    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """master ← the optimizer's step on G = Σᵢ coefficients[i]·ε(member_seeds[i]), accumulated in float32
        per tensor (esft.es.update.apply_update: sgd master += G; adam, weight decay: `learning_rate` = α),
        then θ ← master. The weights θ are written only once every new master tensor is known to be finite
        (also after rounding to the model dtype): otherwise NonFiniteWeights, the master is put back from θ
        (exact in float32; in bfloat16/float16 the master then holds θ's rounded values) and adam's state
        as it was."""
        check_coefficients(coefficients)
        stepped = [(name, param) for _, name, param in self.trainable if perturbs(self.noise, param.shape)]

        def put_back() -> None:
            for name, param in stepped:
                self.master[name].copy_(param)

        # the rule from the engine's noise and rank now (benchmarks switch them on a built engine)
        rule = UpdateRule(self.noise, self.rank, self.optimizer, self._generator, self._noise_buffer, self.device)
        if self._perturbation is not None:
            self.restore()  # without a master: a member's perturbation is never what is updated
        result = apply_update(self._update_tensors, member_seeds, coefficients, rule, learning_rate, put_back)
        if result.bad:
            kept = ("weights unchanged" if not result.stepped else
                    f"{result.stepped} tensor(s) before it took the update: without a master (--master-weights none) "
                    "nothing is kept to undo them, so train on from the last checkpoint, not from these weights")
            raise NonFiniteWeights(f"the update would make {len(result.bad)} tensor(s) non-finite "
                                   f"({', '.join(result.bad[:3])}) ({kept})")
        if self.master_weights == "float32":
            for name, param in stepped:
                param.copy_(self.master[name])
        self.last_update_ratio = result.ratio
        self.last_update_survival = result.survival

    def master_state(self) -> dict[str, torch.Tensor]:
        """The float32 master of the trainable tensors (for checkpoints); without a master, the weights in their
        own dtype (the model file holds them exactly)."""
        if self._perturbation is not None:
            self.restore()
        return {name: tensor.detach().cpu().clone() for name, tensor in self.master.items()}

    @torch.no_grad()
    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the float32 master (and θ) from a checkpoint's master state."""
        missing = set(self.master) - set(state)
        if missing:
            raise ValueError(f"checkpoint master state lacks tensors: {sorted(missing)[:5]}")
        self._perturbation = None  # the state replaces the weights, perturbed or not
        for name in self.master:
            self.master[name].copy_(state[name])
        self.restore()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state on CPU, keyed by Hugging Face names (esft.es.optimizers; {} for sgd)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the optimizer's state from a checkpoint's (ValueError if it does not fit the trainable tensors)."""
        check_optimizer_state(state, {name: tensor.shape for name, tensor in self.master.items()})
        self.optimizer.load_state_dict(state, self.device)

    def checksum(self) -> str:
        """A digest of the master weights (without a master: of the weights, as float32, tensor by tensor: a
        float32 model's digest is the one a master would have); equal digests mean bit-identical replicas."""
        if self._perturbation is not None:
            self.restore()
        return master_checksum((name, self.master[name].float()) for _, name, _ in self.trainable)

    def num_trainable(self) -> int:
        """Count of trainable scalars."""
        return sum(param.numel() for _, _, param in self.trainable)

    def trainable_names(self) -> list[str]:
        """Names of the trainable tensors, in tensor-index order."""
        return [name for _, name, _ in self.trainable]

    def max_length(self) -> int | None:
        """The model's position limit (max_position_embeddings or its equivalent), None if it has none."""
        config = self.model.config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def embedding_rows(self) -> int | None:
        """The rows of the model's input embedding (after any resize_token_embeddings)."""
        return self.model.get_input_embeddings().num_embeddings

    def feeds_padding(self) -> bool:
        """True: every batch is left-padded with at least one pad column (_encode)."""
        return True

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    # ------------------------------------------------------------- generation
    def _encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tokenize a prompt batch once (every member of an iteration reuses it)."""
        key = tuple(prompts)
        if key not in self._encoded:
            if len(self._encoded) > 64:
                self._encoded.clear()
            # Pad the WHOLE batch to one length, so mini-batches see exactly the same rows, plus one
            # padding column for every row: every call then has padding, so attention always takes the
            # same masked kernel (a call without padding would take another, whose last bits differ, and
            # a row's greedy tokens would depend on which rows share its call or remain in it).
            batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            pad = torch.full((len(prompts), 1), self.tokenizer.pad_token_id, dtype=ids.dtype)
            self._encoded[key] = {"input_ids": torch.cat([pad, ids], 1).to(self.device),
                                  "attention_mask": torch.cat([torch.zeros_like(pad, dtype=mask.dtype), mask], 1).to(self.device)}
        return self._encoded[key]

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[str], mini_batch_size: int | None = None, sampling: Sampling | None = None
    ) -> Generation:
        """Completions (decoded without the prompt) for every prompt: greedy by default, else sampled
        per `sampling`; `mini_batch_size` (default: the engine's) prompts per generate call."""
        from transformers import GenerationConfig

        sampling = sampling or Sampling()
        if sampling.common_noise and not sampling.greedy:  # ES's sampled rollouts: through esft's decoder
            rows = [row for chunk in self.generated_chunks(prompts, mini_batch_size, sampling=sampling) for row in chunk]
            return generation_from_tokens(rows, self.eos_token_ids, self.tokenizer)
        config = self.greedy
        if not sampling.greedy:
            config = GenerationConfig(**{**self.greedy.to_dict(), "do_sample": True, "temperature": sampling.temperature,
                                         "top_p": sampling.top_p, "top_k": 0})
        if sampling.n > 1:
            config = GenerationConfig(**{**config.to_dict(), "num_return_sequences": sampling.n})
        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        greedy = sampling.greedy and sampling.n == 1
        rows = [row for chunk in self.generated_chunks(prompts, mini_batch_size, None if greedy else config) for row in chunk]
        return generation_from_tokens(rows, self.eos_token_ids, self.tokenizer)

    @torch.no_grad()
    def generated_chunks(self, prompts: Sequence[str], mini_batch_size: int | None = None, config=None, copies: int = 1,
                         on_rows=None, sampling: Sampling | None = None):
        """Per call of `mini_batch_size` (default: the engine's) prompts, the generated token rows
        (prompt cut off). Greedy (`config` None) through esft.engines.decoding, which drops finished
        rows as it goes and tells `on_rows(active rows)`, or sampled there with common random numbers
        (`sampling` with common_noise: esft.engines.decoding.CommonNoise); other sampling through
        `model.generate`. With `copies` > 1 each call holds that many copies of its prompts, copy-major
        (rows [c·P, (c+1)·P) are copy c): population batching's layout."""
        common = sampling is not None and sampling.common_noise and not sampling.greedy
        encoded = self._encode(prompts)
        prompt_length = encoded["input_ids"].shape[1]
        # a sampled call returns num_return_sequences rows per prompt copy: auto sizes for all of them
        rows_per_prompt = copies * (getattr(config, "num_return_sequences", None) or 1)
        size = self.prompts_per_call(len(prompts), rows_per_prompt, mini_batch_size, prompt_length)
        for start in range(0, len(prompts), size):
            ids = encoded["input_ids"][start : start + size]
            mask = encoded["attention_mask"][start : start + size]
            if copies > 1:
                ids, mask = ids.repeat(copies, 1), mask.repeat(copies, 1)
            if config is None:
                pick = None
                if common:  # each row's noise from its prompt's text: the same for every copy (member) of a prompt
                    seeds = [prompt_noise_seed(sampling.seed, prompt) for prompt in prompts[start : start + size]]
                    pick = CommonNoise(seeds * copies, sampling.temperature, sampling.top_p)
                yield decode(self.model, ids, mask, self.max_tokens, self.eos_token_ids, self.min_new_tokens,
                                    on_rows=None if on_rows is None else lambda active, n=len(ids) // copies: on_rows(active, n),
                                    pick=pick)
            else:
                with contiguous_head_input(self.model):  # as decode: the head's product once, not per row
                    rows = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                yield rows[:, prompt_length:].tolist()

    def prompts_per_call(self, prompts: int, copies: int = 1, mini_batch_size: int | str | None = None,
                         prompt_length: int = 0) -> int:
        """Prompts per generate call: `mini_batch_size`, else the engine's (--mini-batch-size), else all;
        "auto" picks it from the model and the device (esft.engines.sizing)."""
        size = mini_batch_size or self.mini_batch_size or prompts
        if size == "auto":
            from esft.engines.sizing import auto_prompts_per_call

            size = auto_prompts_per_call(self.model, prompts, copies, prompt_length + self.max_tokens)
        return max(1, min(int(size), prompts))

    # ----------------------------------------------------------------- saving
    def save_pretrained(self, path: str | Path) -> None:
        """Write the current master weights (model dtype) + tokenizer, loadable by from_pretrained."""
        self.restore()
        greedy_only = self.model.generation_config
        if self._saved_generation_config is not None:
            self.model.generation_config = self._saved_generation_config
        try:
            self.model.save_pretrained(path)
        finally:
            self.model.generation_config = greedy_only
        self.tokenizer.save_pretrained(path)
