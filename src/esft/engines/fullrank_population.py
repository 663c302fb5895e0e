"""Population batching with full-rank noise (--noise iid/correlated): members together in batched
generate calls, each member's rows computed with that member's own weights (esft.engines.population
does it for low-rank noise with shared weights and hooks).

Full-rank members share no weights, so batching saves no arithmetic: it saves calls. A member's
32-prompt decoding step is a few hundred small kernel launches whatever its rows; members in one
call pay those launches once (the per-row work is the same). What pays is small per-member batches:
the paper's 32 prompts per iteration on CPU, and GPUs.

While installed, every module that directly owns a perturbed tensor runs per member:
- each perturbed tensor is stacked (N, *shape): member m's slice is `master + σ·ε_m` rounded to the
  model dtype, the very weights the sequential path writes into the model (`engine.perturbed_into`);
- nn.Linear: one batched product `bmm(x_m, W_mᵀ)` for all members; once the decoder has dropped
  finished rows and members hold unequal rows, the rows are scattered into a member-major layout
  padded to the widest member for that product;
- nn.Embedding: one lookup in the stacked tables (each row in its member's table);
- modules whose perturbed tensors are vectors (norm weights, biases): one forward with each row's
  member's vectors in place, shaped to broadcast over the row (the same elementwise products);
- anything else (GPT-2's Conv1D, nn.LayerNorm): the module's own forward once per member on that
  member's rows, its tensors swapped in for the call (`param.data`; nothing is copied).

The model's own weights stay the master's, never written, so restoring is uninstalling. Memory:
N × the perturbed tensors in the model dtype (`member_bytes`), so generate_population runs members in
groups (`members_per_call`). The engine's self-check (population.check_population_batching) compares
the batched logits with the sequential path's once per engine: a model using a perturbed tensor
outside its owning module's forward, or whose module sees no per-row batch, is refused instead of
mis-evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from esft.engines.member_rows import MemberRows, PopulationBatchingError, member_linear
from esft.es.noise import perturbs


WAY_OUT = ("; exclude its tensors from ES with --trainable (a regex without them) or evaluate members one at a "
           "time (no --population-batching)")


def member_bytes(engine) -> int:
    """Bytes one member's perturbed tensors take in the model dtype."""
    return sum(param.numel() * param.element_size() for _, _, param in engine.trainable
               if perturbs(engine.noise, param.shape))


class FullRankPopulation(MemberRows):
    """While installed (a context manager), the engine's model evaluates `member_seeds` at once: rows of
    member m run with member m's full-rank perturbed weights (module docstring)."""

    def __init__(self, engine, member_seeds: Sequence[int], sigma: float):
        super().__init__(len(member_seeds))
        perturbed = {id(param): (index, name, param) for index, name, param in engine.trainable
                     if perturbs(engine.noise, param.shape)}
        # A Linear's weight is stored (N, in, out): bmm with contiguous right factors runs 1.6-4× faster
        # than with transposed views (measured: docs/benchmarks.md). Every use sees (N, out, in) views.
        linear_weights = {id(module.weight) for module in engine.model.modules() if type(module) is nn.Linear}
        stacks: dict[int, torch.Tensor] = {}
        for index, name, param in perturbed.values():
            count = len(member_seeds)
            if id(param) in linear_weights:
                stack = torch.empty((count, param.shape[1], param.shape[0]), dtype=param.dtype,
                                    device=param.device).transpose(1, 2)
            else:
                stack = torch.empty((count, *param.shape), dtype=param.dtype, device=param.device)
            for member, seed in enumerate(member_seeds):
                engine.perturbed_into(index, name, seed, sigma, stack[member])
            stacks[id(param)] = stack
        for module_name, module in engine.model.named_modules():
            own = {local: param for local, param in module.named_parameters(recurse=False) if id(param) in stacks}
            if not own:
                continue
            if "forward" in module.__dict__:  # already wrapped (e.g. accelerate's offloading hooks): not ours to replace
                raise PopulationBatchingError(f"{module_name} ({type(module).__name__}) has a wrapped forward{WAY_OUT}")
            self._plan.append((module, module_name, {local: (param, stacks[id(param)]) for local, param in own.items()}))

    @staticmethod
    def members_per_call(engine, members: int, prompts: Sequence[str]) -> int:
        """Members batched at once: enough for about a call's worth of rows with all of `prompts` each,
        no more than fit in memory (esft.engines.sizing.full_rank_members_per_call). Each member's
        weights are read at every decoding step, so a call is better filled with more prompts per
        member than with more members."""
        from esft.engines.sizing import full_rank_members_per_call

        prompt_length = engine._encode(prompts)["input_ids"].shape[1]
        return min(members, full_rank_members_per_call(engine.model, member_bytes(engine), len(prompts),
                                                       prompt_length + engine.max_tokens))

    # Forwards are replaced (an instance attribute shadows the class's forward) instead of hooked:
    # a hook would run the unperturbed product first and waste it.
    def install(self) -> None:
        for module, module_name, tensors in self._plan:
            module.forward = self._forward_for(module, module_name, tensors)

    def remove(self) -> None:
        for module, _, _ in self._plan:
            module.__dict__.pop("forward", None)

    def _member_counts(self, rows: int) -> list[int]:
        """Rows of each member in the running batch (member-major, so each member's rows are contiguous)."""
        if self._member_of_row is None:
            return [self._members_rows(rows)] * self.size
        self.padded_layout()
        return self._counts

    def _members_rows(self, rows: int) -> int:
        if rows % self.size:
            raise PopulationBatchingError(f"saw {rows} rows, not a multiple of the {self.size} members (it is not "
                                          f"called per row){WAY_OUT}")
        return rows // self.size

    def _forward_for(self, module: nn.Module, module_name: str, tensors: dict):
        original = type(module).forward
        linear = type(module) is nn.Linear
        embedding = type(module) is nn.Embedding and module.max_norm is None and set(tensors) == {"weight"}
        vectors = not linear and not embedding and all(stack.dim() == 2 for _, stack in tensors.values())

        def per_member(x: torch.Tensor, *args, **kwargs):
            nonlocal vectors
            if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() == 0:
                raise PopulationBatchingError(f"{module_name} ({type(module).__name__}) takes more than one tensor{WAY_OUT}")
            try:
                if linear:
                    return self._batched_linear(x, module, tensors)
                if embedding:
                    return self._batched_lookup(x, module, tensors["weight"][1])
                if vectors:
                    try:
                        return self._per_row_vectors(x, module, original, tensors)
                    except RuntimeError:  # the module needs its vectors' own shape (nn.LayerNorm): one call per member
                        vectors = False
                return self._member_by_member(x, module, original, tensors)
            except PopulationBatchingError as error:
                raise PopulationBatchingError(f"{module_name} ({type(module).__name__}) {error}") from None

        return per_member

    def _row_members(self, rows: int, device) -> torch.Tensor:
        """The member of each row of the running batch."""
        if self._member_of_row is None:
            return torch.arange(self.size, device=device).repeat_interleave(self._members_rows(rows))
        return self._member_of_row

    @staticmethod
    def _put(pairs) -> list:
        """Set each (parameter, data) pair; returns the pairs that put the previous data back."""
        previous = [(param, param.data) for param, _ in pairs]
        for param, data in pairs:
            param.data = data
        return previous

    def _member_by_member(self, x, module, original, tensors: dict) -> torch.Tensor:
        """The module's own forward once per member on its rows, its tensors swapped in (nothing copied)."""
        outputs, start = [], 0
        for member, count in enumerate(self._member_counts(x.shape[0])):
            if count:
                saved = self._put([(param, stack[member]) for param, stack in tensors.values()])
                try:
                    outputs.append(original(module, x[start : start + count]))
                finally:
                    self._put(saved)
            start += count
        return torch.cat(outputs)

    def _per_row_vectors(self, x, module, original, tensors: dict) -> torch.Tensor:
        """A module whose perturbed tensors are vectors along the last dimension (norm weights, biases):
        one forward with each row's member's vector in place, shaped to broadcast over its row (the same
        elementwise products as one member's call)."""
        members = self._row_members(x.shape[0], x.device)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2)
        saved = self._put([(param, stack[members].view(*shape, stack.shape[-1])) for param, stack in tensors.values()])
        try:
            return original(module, x)
        finally:
            self._put(saved)

    def _batched_linear(self, x: torch.Tensor, module: nn.Linear, tensors: dict) -> torch.Tensor:
        """y_m = x_m·W_mᵀ + b_m for every member in one batched product. Rows member-major and equal per
        member, or (finished rows dropped) scattered into a layout padded to the widest member."""
        weight = tensors["weight"][1] if "weight" in tensors else module.weight.expand(self.size, *module.weight.shape)
        right = weight.transpose(1, 2)  # (N, in, out): contiguous when the weight is perturbed (see __init__)
        bias = tensors["bias"][1][:, None, :] if "bias" in tensors else module.bias
        if self.ragged:
            return member_linear(self.padded_rows(x), right, bias).index_select(0, self._slots)
        self._members_rows(x.shape[0])  # equal counts per member, else a clear error
        return member_linear(x, right, bias)

    def _batched_lookup(self, ids: torch.Tensor, module: nn.Embedding, stack: torch.Tensor) -> torch.Tensor:
        """Each row's ids looked up in its member's table: one lookup in the stacked tables."""
        members = self._row_members(ids.shape[0], ids.device)
        return stack[members.view(-1, *([1] * (ids.dim() - 1))), ids]  # a tied LM head's stack is a transposed view
