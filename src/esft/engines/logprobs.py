"""Log-probabilities of given completions under a transformers model, and KL(fine-tuned || base).

KL is estimated per generated token with the k3 estimator exp(Δ) − Δ − 1, Δ = log p_base − log p_ft,
on completions sampled from the fine-tuned model (unbiased for KL(p_ft || p_base) when they are
sampled at temperature 1, always ≥ 0). The base model is loaded once from a path or hub id (or given
as a loaded model) and placed on the fine-tuned model's device in its dtype: the same kernels on the
same weights, so KL is exactly 0 before training (a CPU base beside a CUDA policy gave 1.6e-12).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


@torch.no_grad()
def completion_logprobs(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                        batch_size: int | None = None, pad_id: int = 0) -> list[torch.Tensor]:
    """log p(completion token | prompt, previous tokens) for every completion token (float32, CPU), in
    forward passes of `batch_size` rows (None: as many as fit in memory, esft.engines.sizing.logprob_rows):
    only one pass's full-vocabulary logits exist at a time (a sampled evaluation of 200 prompts × 8
    samples would need ~19 GB for SmolLM2's at once)."""
    device = next(model.parameters()).device
    if batch_size is None:
        from esft.engines.sizing import logprob_rows

        longest = max((len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), default=1)
        batch_size = logprob_rows(model, longest)
    result: list[torch.Tensor] = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts, completions = prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("log-probabilities need a non-empty prompt before each completion")
        sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
        length = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, sequence in enumerate(sequences):  # right padding: real tokens keep positions 0..n-1
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            p, c = len(prompt), len(completion)
            scores = torch.log_softmax(logits[row, p - 1 : p + c - 1].float(), dim=-1)
            targets = torch.tensor(list(completion), dtype=torch.long, device=scores.device)
            result.append(scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu())
        del logits, scores  # freed before the next pass, which would otherwise run beside them
    return result


def k3(logp_ft: torch.Tensor, logp_base: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(ft || base): exp(Δ) − Δ − 1 with Δ = log p_base − log p_ft."""
    delta = logp_base.double() - logp_ft.double()
    return torch.expm1(delta) - delta


class KLScorer:
    """Per-token KL(fine-tuned || base) of completions; the fine-tuned model is used as it is now.
    `batch_size`: rows per forward pass (None: sized from free memory, completion_logprobs)."""

    def __init__(self, model, tokenizer, base: Any, batch_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.base_source = base
        self.batch_size = batch_size
        self._base = None

    def base(self):
        if self._base is None:
            if isinstance(self.base_source, torch.nn.Module):
                self._base = self.base_source
            else:
                from transformers import AutoModelForCausalLM

                self._base = AutoModelForCausalLM.from_pretrained(str(self.base_source), dtype=torch.float32)
            reference = next(p for p in self.model.parameters() if p.is_floating_point())
            self._base = self._base.to(device=reference.device, dtype=reference.dtype)
            self._base.eval().requires_grad_(False)
        return self._base

    def __call__(self, prompts: Sequence[str], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """k3 values per generated token of each completion (prompt tokenized as the engine does)."""
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        pad = self.tokenizer.pad_token_id or 0
        finetuned = completion_logprobs(self.model, prompt_ids, completion_ids, self.batch_size, pad)
        base = completion_logprobs(self.base(), prompt_ids, completion_ids, self.batch_size, pad)
        return [k3(ft, b).tolist() for ft, b in zip(finetuned, base)]


def cpu_float32_copy(model: Any) -> Any:
    """A float32 CPU copy of a model object's weights (KL's base for a model passed as an object: taken
    before training, moved to the model's device and dtype at the first KL evaluation)."""
    import copy

    return copy.deepcopy(model).to(device="cpu", dtype=torch.float32)
