"""The ES update, written once for every engine: the transformers engine, the vLLM workers and LoRA-ES on
vLLM all call `apply_update`.

Per trainable tensor (its index k in the model's named_parameters(), its Hugging Face shape) the
members' noise is regenerated and accumulated in float32 into G = Σᵢ cᵢ·εᵢ before one step, as in
the reference; nothing of the population's noise is held at once:

- iid / correlated noise: G summed member by member into a float32 buffer, then the optimizer's step
  (esft.es.optimizers; sgd: master += G) on each piece of the master;
- low-rank noise: one matmul of the members' concatenated factors per matrix (esft.es.lowrank): added
  to the master directly under the paper's rule (sgd, no decay), else the dense G into the scratch
  buffer and the optimizer's step on it; tensors that are not matrices stay frozen.

An engine holds a tensor's float32 master as one or more `Piece`s: the transformers engine one per
tensor; a vLLM worker the blocks of vLLM's fused, sharded parameters that the tensor landed in
(`where`: the block's place in the HF-shaped tensor). Every piece's new master must be finite, also
after rounding to the live weights' dtype; otherwise the update is undone (the engine's `put_back`
restores the master, the optimizer's state of the stepped tensors is put back) and the names of the
offending tensors are returned. The engine then writes its live weights from the master (a commit it
does itself: in place, on a GPU, as vLLM repacks).

Without a master (--master-weights none: `Piece.own_weights`) the piece is the live weights themselves, in their
own dtype. Tensor by tensor (a low-precision matrix under low-rank noise and sgd: block of rows by block), the step
is taken on a float32 copy of them, by the same arithmetic as on a master (a float32 model's weights come out bit
for bit as a master's would), checked, and written back: float32 as it is, bfloat16/float16 by seeded stochastic
rounding (esft.es.rounding), which also measures how much of the step survived (`UpdateResult.survival`). A
tensor that would not be finite is left as it was and the update stops there: the tensors before it keep their
step (`UpdateResult.stepped`), as nothing is kept to undo them with.
Pure torch on seeds and tensors: no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import math

import torch

from esft.es import lowrank
from esft.es.noise import LOW_RANK_SCHEMES, draw_noise, perturbs
from esft.es.optimizers import ESOptimizer
from esft.es.rounding import round_stochastically, rounding_seed


@dataclass
class Piece:
    """A contiguous part of one trainable tensor's float32 master, updated in place."""

    key: str
    """The optimizer's key of this piece (its state is kept per key)."""
    master: torch.Tensor
    """float32: a view into the engine's master; with `own_weights`, the live weights (any dtype)."""
    name: str
    """What an error names: the tensor (or the vLLM parameter) the piece belongs to."""
    dtype: torch.dtype = torch.float32
    """The live weights' dtype: the master must stay finite after rounding to it."""
    where: tuple[slice, ...] | None = None
    """The piece's block of the HF-shaped tensor; None: the whole tensor, same shape."""
    own_weights: bool = False
    """No master behind it (--master-weights none): `master` is the weights, written tensor by tensor."""


@dataclass
class UpdateTensor:
    """One trainable tensor: its index (which seeds its noise), its HF shape and the pieces holding it."""

    index: int
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class UpdateRule:
    """How G is drawn and applied: the noise scheme and rank, the optimizer, the generator and the float32
    scratch buffer (at least the size of the largest tensor) an engine keeps for its noise."""

    noise: str
    rank: int
    optimizer: ESOptimizer
    generator: torch.Generator
    scratch: torch.Tensor
    device: torch.device | str = "cpu"


@dataclass
class UpdateResult:
    """What an update did: the tensors that would have become non-finite (then nothing changed), and
    ‖Δθ‖² and ‖θ‖² over the pieces it moved (the update ratio's terms; summed over vLLM's ranks)."""

    bad: list[str]
    moved_sq: float = 0.0
    weights_sq: float = 0.0
    stepped: int = 0
    """Without a master: the tensors written before the one that would not be finite."""
    kept_dot: float = 0.0
    rounded_sq: float = 0.0
    """Without a master, over the rounded (low-precision) pieces: ⟨Δθ written, Δθ in float32⟩ and ‖Δθ in float32‖²."""

    @property
    def ratio(self) -> float:
        """‖Δθ‖/‖θ‖ of the update (0 for weights that are all zero)."""
        return (self.moved_sq / self.weights_sq) ** 0.5 if self.weights_sq else 0.0

    @property
    def survival(self) -> float | None:
        """How much of the float32 step the rounded weights took, ⟨written, step⟩/‖step‖² (1: all of it, on
        average, as stochastic rounding keeps it; 0: nothing); None where nothing was rounded (a master, float32)."""
        return self.kept_dot / self.rounded_sq if self.rounded_sq else None


@torch.no_grad()
def apply_update(tensors: Iterable[UpdateTensor], member_seeds: Sequence[int], coefficients: Sequence[float],
                 rule: UpdateRule, learning_rate: float, put_back: Callable[[], None]) -> UpdateResult:
    """master ← the optimizer's step on G = Σᵢ coefficients[i]·ε(member_seeds[i]), tensor by tensor (module
    docstring; `learning_rate`: α under adam or weight decay, else unused: the coefficients hold α). If any
    piece would not be finite, `put_back()` restores the master, the optimizer's state is put back, and the
    result names the offending tensors."""
    if len(member_seeds) != len(coefficients):
        raise ValueError(f"{len(member_seeds)} member seeds for {len(coefficients)} coefficients")
    optimizer = rule.optimizer
    optimizer.begin_update()
    moved, result = [], UpdateResult([])
    try:
        for tensor in tensors:
            if not perturbs(rule.noise, tensor.shape):
                continue  # frozen under this scheme (low-rank: tensors that are not matrices)
            if any(piece.own_weights for piece in tensor.pieces):
                if not _step_own_weights(tensor, member_seeds, coefficients, rule, learning_rate, result):
                    optimizer.rollback()
                    return result
                continue
            before = [piece.master.clone() for piece in tensor.pieces]  # one tensor at a time: ‖Δθ‖
            _step(tensor, member_seeds, coefficients, rule, learning_rate)
            for piece, old in zip(tensor.pieces, before):
                result.moved_sq += float(old.sub_(piece.master).square().sum(dtype=torch.float64))
                result.weights_sq += float(piece.master.square().sum(dtype=torch.float64))
            moved += tensor.pieces
            del before
        result.bad = list(dict.fromkeys(piece.name for piece in moved
                                        if not torch.isfinite(piece.master.to(piece.dtype)).all()))
    except BaseException:
        put_back()
        optimizer.rollback()
        raise
    if result.bad:
        put_back()
        optimizer.rollback()
        return UpdateResult(result.bad)
    optimizer.commit()
    return result


def _step(tensor: UpdateTensor, member_seeds, coefficients, rule: UpdateRule, learning_rate: float) -> None:
    """One tensor's G and step (apply_update)."""
    shape, index, optimizer = torch.Size(tensor.shape), tensor.index, rule.optimizer
    if rule.noise in LOW_RANK_SCHEMES and optimizer.plain:  # the paper's rule: one addmm into the master
        whole = gathered(tensor)
        lowrank.accumulate_update(whole, index, member_seeds, coefficients, rule.rank, rule.generator)
        _scatter(tensor, whole)
        return
    if rule.noise in LOW_RANK_SCHEMES:
        total = lowrank.dense_update(rule.scratch[: shape.numel()].view(shape), index, member_seeds, coefficients,
                                     rule.rank, rule.generator)
    else:
        total = torch.zeros(shape, dtype=torch.float32, device=rule.device)
        noise = rule.scratch[: shape.numel()].view(shape)
        for member_seed, coefficient in zip(member_seeds, coefficients, strict=True):
            draw_noise(rule.noise, member_seed, index, shape, rule.device, rule.generator, noise)
            total.add_(noise, alpha=coefficient)
    for piece in tensor.pieces:  # sgd: master += G
        gradient = total if piece.where is None else total[piece.where].contiguous()
        optimizer.step(piece.key, piece.master, gradient, learning_rate)


CHUNK = 1 << 20
"""Elements rounded at once without a master: the rounding's temporaries stay a few MB whatever the tensor."""


def _step_own_weights(tensor: UpdateTensor, member_seeds, coefficients, rule: UpdateRule, learning_rate: float,
                      result: UpdateResult) -> bool:
    """One tensor without a master (module docstring): its step on a float32 copy of the weights, then written
    back; False (and the tensor named in result.bad, its weights as they were) when the step would not be finite.
    A low-precision matrix under the paper's rule (low-rank noise, sgd) is stepped a block of rows at a time
    (esft.es.lowrank.row_blocks): its float32 copy is never made whole, and every block is checked before any is
    written, so each block's step is computed twice (a matmul of inner dimension N·r: cheap beside generation)."""
    (piece,) = tensor.pieces  # a vLLM worker's pieces keep a master: only whole tensors come here
    weights = piece.master
    if weights.dtype != torch.float32 and rule.noise in LOW_RANK_SCHEMES and rule.optimizer.plain:
        left, right = lowrank.concatenated_factors(weights.shape, weights.device, tensor.index, member_seeds,
                                                   coefficients, rule.rank, rule.generator)
        blocks = [(rows, lambda rows=rows: weights[rows].float().addmm_(left[rows], right.T))
                  for rows in lowrank.row_blocks(weights.shape)]
    else:
        work = weights.to(torch.float32, copy=True)
        _step(UpdateTensor(tensor.index, tensor.shape, [Piece(piece.key, work, piece.name)]), member_seeds,
              coefficients, rule, learning_rate)
        blocks = [(slice(None), lambda: work)]
    largest = torch.finfo(weights.dtype).max
    for _, stepped in blocks:
        low, high = torch.aminmax(stepped())
        if not (math.isfinite(float(low)) and math.isfinite(float(high)) and -largest <= float(low)
                and float(high) <= largest):
            result.bad = [piece.name]
            return False
    if weights.dtype == torch.float32:  # the master's own arithmetic and sums: its ratio, bit for bit
        result.moved_sq += float((weights - work).square().sum(dtype=torch.float64))
        result.weights_sq += float(work.square().sum(dtype=torch.float64))
        weights.copy_(work)
        result.stepped += 1
        return True
    # one stream of uniforms over the tensor's elements in order (its draws do not depend on the blocks' sizes)
    generator = rule.generator.manual_seed(rounding_seed(member_seeds, tensor.index))
    uniforms = rule.scratch[: min(CHUNK, weights.numel())]
    for rows, stepped in blocks:
        flat_work, flat_weights = stepped().view(-1), weights[rows].view(-1)
        for start in range(0, flat_work.numel(), CHUNK):
            new, old = flat_work[start : start + CHUNK], flat_weights[start : start + CHUNK]
            step = new - old.float()
            written = old.float().neg_()
            round_stochastically(new, old, generator, uniforms[: new.numel()])
            written.add_(old.float())  # round(new) − old
            result.moved_sq += float(written.square().sum(dtype=torch.float64))
            result.weights_sq += float(old.float().square().sum(dtype=torch.float64))
            result.kept_dot += float((written * step).sum(dtype=torch.float64))
            result.rounded_sq += float(step.square().sum(dtype=torch.float64))
    result.stepped += 1
    return True


def gathered(tensor: UpdateTensor) -> torch.Tensor:
    """The HF-shaped float32 master of a tensor (the update's, and a vLLM worker's low-rank perturbation): the
    piece itself when it is the whole tensor, else a copy assembled from the pieces (elements other vLLM ranks
    hold: 0; the arithmetic is elementwise in the master, so each piece's elements come out exact)."""
    if len(tensor.pieces) == 1 and tensor.pieces[0].where is None:
        return tensor.pieces[0].master
    whole = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.pieces[0].master.device)
    for piece in tensor.pieces:
        whole[piece.where] = piece.master
    return whole


def _scatter(tensor: UpdateTensor, whole: torch.Tensor) -> None:
    for piece in tensor.pieces:
        if piece.master is not whole:
            piece.master.copy_(whole[piece.where])
