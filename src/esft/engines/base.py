"""What an engine is: the contract every engine (transformers, vLLM, the Ray proxy) keeps, and the
types they share. An engine is where the weights live and where text is generated.

A third engine implements `Engine`; `tests/test_architecture.py` checks every engine against it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

def resolve_device(device: str):
    """The torch device of a --device setting: "auto" picks CUDA when available, else CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def torch_dtype(name: str):
    """The torch dtype of a --dtype name (settings' CHOICES["dtype"], the one list of them: torch's own names)."""
    import torch

    from esft.settings.rules import CHOICES

    if name not in CHOICES["dtype"]:
        raise KeyError(f"dtype must be one of {', '.join(CHOICES['dtype'])}, got {name!r}")
    return getattr(torch, name)


@dataclass
class Generation:
    """Completions of a prompt batch, in prompt order (n consecutive entries per prompt when sampling n)."""

    texts: list[str]
    num_tokens: list[int]
    """Generated tokens per completion, EOS included, padding excluded."""
    token_ids: list[list[int]] | None = None
    """The generated token ids (EOS included, padding excluded), when the engine provides them."""

    def fingerprints(self) -> tuple[int, ...]:
        """A digest of each completion's text, equal in every process (str's hash() is salted per
        process): members' completions are compared by these (esft.loop.learning_signal)."""
        return tuple(int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                    "little") for text in self.texts)


@dataclass(frozen=True)
class Sampling:
    """How to decode. The default (temperature 0) is greedy, as ES rollouts are in the paper."""

    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    """Completions per prompt; Generation lists them prompt by prompt (n consecutive entries)."""
    seed: int = 0
    """Seeds the sampler, so sampled evaluations are reproducible."""
    common_noise: bool = False
    """Common random numbers (ES's sampled rollouts, --rollout-temperature): a completion's sampling noise is a
    function of (seed, its prompt's text, the step) alone (`prompt_noise_seed`), so every member, copy, call and
    engine draws the same numbers on a prompt and members' completions differ only by their perturbations.
    One completion per prompt (n = 1)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def prompt_noise_seed(seed: int, prompt: str) -> int:
    """The seed of a prompt's sampling noise under Sampling.common_noise: a digest of (seed, the prompt's text),
    equal in every process and engine (63 bits: vLLM's and torch's generators take it)."""
    digest = hashlib.blake2b(f"{seed}\0{prompt}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class NoTrainableParameters(ValueError):
    """The --trainable pattern matches no parameter name."""


class NonFiniteWeights(ArithmeticError):
    """An update would make weights NaN/inf; the engine kept the weights from before it."""


def master_checksum(named_tensors) -> str:
    """The one digest of trainable weights: blake2b over each (name, float32 tensor) pair in the order given
    (each engine keeps its own order, so digests written into earlier checkpoints still match); equal
    digests mean bit-identical weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@contextmanager
def perturbed(engine: Any, member_seed: int, sigma: float):
    """`with perturbed(engine, seed, σ):` the engine holds θ + σ·ε(seed) inside, its master θ again after,
    however the block ends: the one perturb → restore of every caller (members one at a time, the sigma
    scan, RandOpt's members, population batching's self-check)."""
    engine.perturb(member_seed, sigma)
    try:
        yield engine
    finally:
        engine.restore()


def check_coefficients(coefficients: Sequence[float]) -> None:
    """NonFiniteWeights unless every update coefficient is a finite float32 (a larger one would
    overflow the float32 accumulation, whatever the noise)."""
    largest = max((abs(float(c)) for c in coefficients), default=0.0)
    if not largest < 3.4e38:
        raise NonFiniteWeights(f"an update coefficient of {largest:g} is not a finite float32 (weights unchanged)")


def check_optimizer_state(state: dict[str, Any], shapes: dict[str, Any]) -> None:
    """ValueError unless every tensor of an optimizer state (exp_avg.<name>, exp_avg_sq.<name>, step.<name>:
    esft.es.optimizers) belongs to a trainable tensor of `shapes` ({name: shape}) and has its shape."""
    for key, tensor in state.items():
        kind, _, name = key.partition(".")
        if name not in shapes:
            raise ValueError(f"optimizer state for {name!r}, which is not a trainable tensor of this model")
        if kind != "step" and tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(f"optimizer state {key} has shape {tuple(tensor.shape)}, the tensor {tuple(shapes[name])}")


def generation_from_tokens(rows: Sequence[Sequence[int]], eos_token_ids: Sequence[int], tokenizer) -> Generation:
    """Generated token rows cut after their first EOS (padding dropped) and decoded without
    special tokens: the one place every engine turns tokens into completions."""
    texts, counts, token_ids = [], [], []
    for row in rows:
        row = list(row)
        length = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        counts.append(length)
        token_ids.append(row[:length])
        texts.append(tokenizer.decode(row[:length], skip_special_tokens=True))
    return Generation(texts=texts, num_tokens=counts, token_ids=token_ids)


@runtime_checkable
class Engine(Protocol):
    """The calls the trainer, the executors, evaluation and checkpoints make on an engine.

    Weights: the engine keeps a float32 *master* of every trainable tensor, the source of truth (the
    transformers engine with --master-weights none keeps none: the weights are their own master).
    Trainable tensors are numbered by their position in the Hugging Face model's
    `named_parameters()`: noise of tensor k of a member is a function of (member seed, k) alone, so
    every engine perturbs alike (esft.es.noise)."""

    tokenizer: Any
    """The model's Hugging Face tokenizer (prompts are rendered and checked with it)."""

    def perturb(self, member_seed: int, sigma: float) -> None:
        """θ ← master + σ·ε(member_seed) for every trainable tensor, rounded once to the model dtype.
        Must be followed by restore() before the next perturb or update."""

    def restore(self) -> None:
        """θ ← master, bit-exact in every dtype (a copy, never a subtraction)."""

    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """Per trainable tensor G = Σᵢ coefficients[i]·ε(member_seeds[i]), accumulated in float32; the
        engine's optimizer (--optimizer, esft.es.optimizers) moves the master by it: sgd master += G
        (`learning_rate` only scales --weight-decay), adam its step on g = G with lr = `learning_rate`;
        then θ ← master. If the result would not be finite, raise NonFiniteWeights and keep the
        weights from before the call (without a master: those of the tensors from the offending one on,
        the message says how many took the update)."""

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state (adam: exp_avg.<name>, exp_avg_sq.<name>, step.<name>), Hugging Face
        names and shapes, on CPU; {} for sgd (stateless)."""

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Set the optimizer's state from optimizer_state()'s tensors (ValueError if they do not fit)."""

    def generate(self, prompts: Sequence[str], mini_batch_size: int | None = None,
                 sampling: Sampling | None = None) -> Generation:
        """Completions of the current weights for every prompt, greedy unless `sampling` says
        otherwise; results do not depend on `mini_batch_size` (prompts per call)."""

    def checksum(self) -> str:
        """A digest of the float32 master: equal digests mean bit-identical weights."""

    def master_state(self) -> dict[str, Any]:
        """The float32 master of the trainable tensors, Hugging Face names and shapes, on CPU."""

    def load_master_state(self, state: dict[str, Any]) -> None:
        """Set the master (and θ) from Hugging Face-named float32 tensors; every trainable tensor
        must be present (ValueError naming the missing ones)."""

    def trainable_names(self) -> list[str]:
        """Hugging Face names of the trainable tensors, in tensor-index order."""

    def num_trainable(self) -> int:
        """Count of trainable scalars."""

    def max_length(self) -> int | None:
        """Longest sequence (prompt + completion, in tokens) the model takes; None if unbounded."""

    def embedding_rows(self) -> int | None:
        """How many token ids the model's input embedding has rows for (ids 0 to rows-1); None if
        unknown. A tokenizer with more tokens than this does not match the weights."""

    def feeds_padding(self) -> bool:
        """Whether the tokenizer's pad token id goes into the model (left-padded batches do)."""

    def save_pretrained(self, path: str | Path) -> None:
        """Write the master weights (rounded to the model dtype) and the tokenizer to `path`, loadable
        with AutoModelForCausalLM.from_pretrained; the model's own generation_config is kept. An
        engine over a PEFT model (LoRA-ES) writes its adapter, loadable with PeftModel.from_pretrained."""

    def close(self) -> None:
        """Release processes and devices the engine holds (idempotent)."""


OPTIONAL_MEMBERS: dict[str, tuple[Any, str]] = {
    "model": (None, "the transformers model in this process (KL's base, LoRA exports, population batching); None "
                    "where the weights live elsewhere (vLLM workers, Ray actors, an engine of your own)"),
    "last_update_ratio": (None, "‖Δθ‖/‖θ‖ of the last update over the trainable float32 master (es/update_ratio); "
                                "None where the engine does not measure it"),
    "last_update_survival": (None, "how much of the last update survived rounding into bfloat16/float16 weights "
                                   "without a master (es/update_survival); None with a master, float32 weights, or "
                                   "where the engine does not measure it"),
    "generate_log": ((), "(rows, adapters) of each generate call, where the engine keeps one (vLLM)"),
}
"""What an engine may have beyond the Engine protocol: name -> (the value when it has none, what it is).
Callers read these through `optional`, never by probing attributes themselves. Population batching in
this process needs an in-process model besides (esft.engines.population.IN_PROCESS_MODEL), or an engine
that batches its own members (PopulationEngine); any other engine evaluates members one at a time."""


def optional(engine: Any, name: str) -> Any:
    """An optional member of `engine` (OPTIONAL_MEMBERS), or its default when the engine has none."""
    return getattr(engine, name, OPTIONAL_MEMBERS[name][0])


@runtime_checkable
class PopulationEngine(Protocol):
    """An engine that evaluates a whole population itself, in its own batched way (the vLLM engine
    with low-rank noise: every member a LoRA adapter of one engine). esft.engines.population hands
    such an engine the population instead of hooking its model; members' results are those of
    perturb → generate → restore with the same seeds."""

    def population_problem(self) -> str | None:
        """Why this engine cannot evaluate its members batched now (noise, set-up), or None."""

    def generate_population(self, prompts: Sequence[str], member_seeds: Sequence[int], sigma: float,
                            mini_batch_size: int | None = None, sampling: Sampling | None = None) -> list[Generation]:
        """Greedy completions of `prompts` for every member (one Generation per member, prompts in order), or
        sampled with common random numbers where `sampling` says so (Sampling.common_noise)."""
