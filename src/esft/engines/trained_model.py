"""An engine over a model that another trainer (TRL's GRPOTrainer, esft.grpo.baseline) updates in place.

Text comes from esft's own TransformersEngine.generate, so evaluations decode exactly as ES's and
`esft eval`'s do (greedy by default, the model's generation_config kept out of it). The weights are
the model's parameters themselves: there is no float32 master and nothing to perturb, so the ES
calls (perturb, restore, update) refuse.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from esft.engines.base import Generation, NoTrainableParameters, Sampling, resolve_device, torch_dtype
from esft.engines.transformers_engine import TransformersEngine


class TrainedModelEngine:
    """The Engine contract on a transformers model trained by gradient steps elsewhere. Parameters
    matching `trainable` (a regex; None = all) require gradients, the others are frozen."""

    def __init__(self, model: Any, tokenizer: Any, *, max_tokens: int = 64, trainable: str | None = None):
        pattern = re.compile(trainable) if trainable else None
        self._trainable = [(name, param) for name, param in model.named_parameters() if pattern is None or pattern.search(name)]
        if not self._trainable:
            raise NoTrainableParameters(f"{trainable!r} matches no parameter of the model; names look like "
                                        f"{next(iter(dict(model.named_parameters())))!r}")
        own_config = model.generation_config
        # TransformersEngine keeps a float32 master of the tensors it may perturb; generation never reads
        # it, so it is given only the smallest tensor (no second copy of the model).
        smallest = min(model.named_parameters(), key=lambda item: item[1].numel())[0]
        self._text = TransformersEngine(model, tokenizer, trainable=f"^{re.escape(smallest)}$", max_tokens=max_tokens)
        self._greedy_config = model.generation_config  # what TransformersEngine installed for greedy decoding
        model.generation_config = own_config  # the trainer's rollouts and saved models keep the model's own
        trainable_names = {name for name, _ in self._trainable}
        for name, param in model.named_parameters():  # TransformersEngine froze everything
            param.requires_grad_(name in trainable_names)
        model.train()
        self.model = model
        self.tokenizer = self._text.tokenizer

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "float32", device: str = "auto", **kwargs) -> TrainedModelEngine:
        """Load a causal LM and its tokenizer from a hub id or a local directory."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
        return cls(model.to(resolve_device(device)), tokenizer, **kwargs)

    # ------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[str], mini_batch_size: int | None = None,
                 sampling: Sampling | None = None) -> Generation:
        """TransformersEngine.generate on the current weights, in eval mode (dropout off) and with the
        greedy-only generation config; the model's training mode and config are put back after."""
        training, config = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = self._greedy_config
        try:
            return self._text.generate(prompts, mini_batch_size, sampling)
        finally:
            self.model.generation_config = config
            self.model.train(training)

    def max_length(self) -> int | None:
        """The model's position limit, None if it has none."""
        return self._text.max_length()

    def embedding_rows(self) -> int | None:
        """The rows of the model's input embedding."""
        return self._text.embedding_rows()

    def feeds_padding(self) -> bool:
        """True: its text engine left-pads batches."""
        return self._text.feeds_padding()

    # ---------------------------------------------------------------- weights
    def perturb(self, member_seed: int, sigma: float) -> None:
        """Not available: the weights are trained by gradient steps, not perturbed."""
        raise NotImplementedError("a TrainedModelEngine is trained by gradient steps (esft.grpo.baseline), not by ES")

    def restore(self) -> None:
        """Not available (nothing is ever perturbed)."""
        raise NotImplementedError("a TrainedModelEngine is trained by gradient steps (esft.grpo.baseline), not by ES")

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """Not available: updates are the gradient trainer's."""
        raise NotImplementedError("a TrainedModelEngine is trained by gradient steps (esft.grpo.baseline), not by ES")

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Nothing: the gradient trainer keeps its own optimizer (TRL's, saved by it)."""
        return {}

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to load (optimizer_state)."""

    def checksum(self) -> str:
        """A digest of the trainable parameters (as float32): equal digests mean identical weights."""
        digest = hashlib.blake2b(digest_size=16)
        for name, tensor in self.master_state().items():
            digest.update(name.encode())
            digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    def master_state(self) -> dict[str, torch.Tensor]:
        """The trainable parameters as float32 CPU tensors (there is no separate master)."""
        return {name: param.detach().to("cpu", torch.float32).clone() for name, param in self._trainable}

    @torch.no_grad()
    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the trainable parameters from Hugging Face-named tensors (every one must be present)."""
        missing = [name for name, _ in self._trainable if name not in state]
        if missing:
            raise ValueError(f"checkpoint state lacks tensors: {missing[:5]}")
        for name, param in self._trainable:
            param.copy_(state[name])

    def trainable_names(self) -> list[str]:
        """Names of the parameters that require gradients, in model order."""
        return [name for name, _ in self._trainable]

    def num_trainable(self) -> int:
        """Count of trainable scalars."""
        return sum(param.numel() for _, param in self._trainable)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the current weights (model dtype) and the tokenizer, loadable with from_pretrained; the
        model's own generation_config is kept."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""
