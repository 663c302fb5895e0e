"""Greedy decoding for the transformers engine, leaner than `model.generate` for ES rollouts.

ES generates N × batch completions per iteration greedily, so the decoding loop is where time goes.
This loop calls the model's own forward (any Hugging Face causal LM) with three differences from
`generate`, all exact:

- the key/value cache of full-attention layers is preallocated (prompt + max_new_tokens) and
  written in place: no concatenation of the whole cache at every step (a third of `generate`'s CPU
  time, measured in docs/benchmarks.md);
- rows that have produced EOS are dropped from the running batch once they are a quarter of it
  (their cache rows with them), so a call no longer computes finished rows until its slowest one
  ends; `on_rows(active)` tells the caller which of the original rows are still running (population
  batching maps rows to members with it);
- nothing else runs per step: no logits processors, stopping criteria or mask rebuilding beyond the
  model's own.

Completions are those of greedy `generate` (argmax at every step, EOS ends a row, left padding
with position ids from the attention mask); tests compare the two token for token. With a `pick`
(CommonNoise: ES's sampled rollouts with common random numbers) each step's token is sampled instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DROP_FRACTION = 0.25
"""Finished rows are dropped from the running batch once they are this share of it (each drop
copies the live cache once)."""


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for `capacity` positions, written in place. Keys and
    values are stored (batch, position, head, dim) and returned as (batch, head, position, dim) views."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        self._keys = torch.empty((batch, self.capacity, heads, key_dim), dtype=key_states.dtype, device=key_states.device)
        self._values = torch.empty((batch, self.capacity, heads, value_states.shape[-1]), dtype=value_states.dtype,
                                   device=value_states.device)
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"decoding cache holds {self.capacity} positions, {end} needed")
        self._keys[:, self.length : end] = key_states.transpose(1, 2)
        self._values[:, self.length : end] = value_states.transpose(1, 2)
        self.length = end
        self.keys, self.values = self._views()
        return self.keys, self.values

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[:, : self.length].transpose(1, 2), self._values[:, : self.length].transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows `indices`, copying their live positions once: index_select straight into a new
        buffer's live part (1.9-3.6× faster than indexing the whole buffer, free positions included, at the
        demo's drops: docs/benchmarks.md)."""
        if not self.is_initialized:
            return
        self._keys = _select_live(self._keys, indices, self.length)
        self._values = _select_live(self._values, indices, self.length)
        self.keys, self.values = self._views()


def _select_live(buffer: torch.Tensor, indices: torch.Tensor, length: int) -> torch.Tensor:
    kept = buffer.new_empty((len(indices),) + tuple(buffer.shape[1:]))
    torch.index_select(buffer[:, :length], 0, indices, out=kept[:, :length])
    return kept


def decoding_cache(model, capacity: int) -> DynamicCache:
    """The model's own DynamicCache with its full-attention layers preallocated (sliding-window and
    other special layers keep their own kind)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _accepts(model, name: str) -> bool:
    key = f"_esft_accepts_{name}"
    if not hasattr(model, key):
        setattr(model, key, name in inspect.signature(model.forward).parameters)
    return getattr(model, key)


def _cache_argument(model) -> str:
    """transformers >= 5.24 renamed forward's past_key_values to cache (the old name warns, and goes in
    5.40); a PEFT model passes either through to its base model, whose signature decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if _accepts(base, "cache") else "past_key_values"


@contextmanager
def contiguous_head_input(model):
    """While installed, the model's output head reads a contiguous input. With logits_to_keep, transformers hands
    the head the prompt pass's last position as a strided slice of the hidden states, and torch's CPU matmul then
    expands the head's weight once per row (rows × hidden × vocab: 432 MB for 8 rows of SmolLM2 in bfloat16)
    instead of one matrix product; a contiguous copy of the slice (rows × hidden) avoids it, the values the same."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


class CommonNoise:
    """Sampling at `temperature` (and nucleus `top_p`) by the Gumbel-max trick, argmax(logits/T + g), whose
    Gumbel noise g for row i at step t is the t-th draw of a generator seeded with `seeds[i]`
    (esft.engines.base.prompt_noise_seed of the row's prompt): rows of one prompt draw the same numbers whatever
    their member, position, call or batch, so under the same logits they write the same tokens, and members of a
    population differ only by their perturbations (common random numbers). One draw over the vocabulary per row
    and step, on the CPU (the same numbers on every device)."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"CommonNoise samples at a temperature > 0, got {temperature}")
        self.generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The token of each of `rows` (indices into `seeds`) from its `logits` (rows × vocabulary)."""
        vocab = logits.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=self.generators[row]) for row in rows.tolist()])
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
        scores = logits.float() / self.temperature
        if self.top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p (the first always)
            ordered, order = scores.sort(-1, descending=True)
            probabilities = ordered.softmax(-1)
            before = probabilities.cumsum(-1) - probabilities
            scores = scores.scatter(-1, order, ordered.masked_fill(before >= self.top_p, float("-inf")))
        return (scores + gumbel.to(scores.device)).argmax(-1)


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    min_new_tokens: int = 0,
    on_rows: Callable[[torch.Tensor], None] | None = None,
    pick: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[list[int]]:
    """Greedy completions of a left-padded batch: per row, the generated token ids up to and
    including its first EOS (or `max_new_tokens` of them). `min_new_tokens` forbids EOS before that
    many tokens (benchmarks use it to force equal lengths). `pick(logits, rows)` (CommonNoise), when
    given, chooses each step's tokens instead of the argmax: `rows` are the original indices of the
    rows still running."""
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    cache = decoding_cache(model, prompt_length + max_new_tokens)
    padded = not bool(attention_mask.all())
    mask = torch.ones((batch, prompt_length + max_new_tokens), dtype=attention_mask.dtype, device=device)
    mask[:, :prompt_length] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    active = torch.arange(batch, device=device)
    if on_rows is not None:
        on_rows(active)
    tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    inputs = {"input_ids": input_ids, _cache_argument(model): cache, "use_cache": True}
    if _accepts(model, "position_ids"):
        inputs["position_ids"] = positions
    if _accepts(model, "logits_to_keep"):
        inputs["logits_to_keep"] = 1
    last = positions[:, -1]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    with contiguous_head_input(model):  # the prompt pass: one matrix product for the head, not one per row
        for step in range(max_new_tokens):
            if padded:
                inputs["attention_mask"] = mask[:, : prompt_length + step]
            logits = model(**inputs).logits[:, -1]
            if step < min_new_tokens:
                logits[:, eos] = float("-inf")
            chosen = logits.argmax(-1) if pick is None else pick(logits, active)
            tokens[active, step] = torch.where(finished, tokens[active, step], chosen)
            ended = torch.isin(chosen, eos) & ~finished
            lengths[active[ended]] = step + 1
            finished |= ended
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if int(finished.sum()) >= max(1, int(DROP_FRACTION * len(active))):
                keep = (~finished).nonzero().squeeze(1)
                active, chosen, last, finished = active[keep], chosen[keep], last[keep], finished[keep]
                mask = mask[keep]
                padded = padded and not bool(mask[:, : prompt_length].all())
                cache.batch_select_indices(keep)
                if on_rows is not None:
                    on_rows(active)
            last = last + 1
            inputs["input_ids"] = chosen[:, None]
            if "position_ids" in inputs:
                inputs["position_ids"] = last[:, None]
    return [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist())]
