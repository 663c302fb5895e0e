"""The row bookkeeping of population batching (esft.engines.population): which member each row of a batched
generate call belongs to, as the decoder drops finished rows, and the hooks that give each member's rows their
own perturbation. Shared by low-rank noise's hooks (esft.engines.population), full-rank batching
(esft.engines.fullrank_population) and LoRA-ES (esft.engines.adapter_population)."""

from __future__ import annotations

import torch


class PopulationBatchingError(ValueError):
    """The engine or model cannot evaluate members batched (use the sequential path)."""


class MemberRows:
    """Forward hooks that give each member's rows its own perturbation, and the row bookkeeping behind them
    (shared by LowRankPopulation, FullRankPopulation, which replaces forwards instead, and LoRA-ES's
    AdapterPopulation). A subclass fills `_plan` (entries whose first item is the hooked module) and makes
    each entry's hook in `_hook_for`."""

    def __init__(self, size: int):
        self.size = size
        self._plan: list = []
        self._handles: list = []
        self._member_of_row: torch.Tensor | None = None
        self._rows_version = 0  # bumped when rows are dropped: hooks gather their rows' factors once per version
        self._layout_version = -1
        self._counts: list[int] = []
        self._widest = 0
        self._slots: torch.Tensor | None = None
        self._sources: torch.Tensor | None = None

    def _hook_for(self, entry):
        raise NotImplementedError

    def install(self) -> None:
        for entry in self._plan:
            self._handles.append(entry[0].register_forward_hook(self._hook_for(entry)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
        # The plan holds every member's factors (at 135M and rank 4 about 6 MB per member) in objects that point
        # back here (esft.engines.shared_product.SharedProduct.rows): a cycle that only the cyclic garbage
        # collector frees, so several iterations' populations piled up between its runs (+2 GB at 64 members).
        # Dropping them on exit frees them at once; a population is not entered twice.
        self._plan = []
        self._member_of_row = self._slots = self._sources = None

    def set_rows(self, active: torch.Tensor | None, rows_per_member: int = 0) -> None:
        """The rows still running in the current call (esft.engines.decoding drops finished ones):
        `active` indices into the call's member-major rows, `rows_per_member` prompts per member.
        None (or every row) = the full member-major layout."""
        if active is None or len(active) == self.size * rows_per_member:
            self._member_of_row = None
        else:
            self._member_of_row = torch.div(active, rows_per_member, rounding_mode="floor")
        self._rows_version += 1

    @property
    def ragged(self) -> bool:
        """True after the decoder dropped finished rows: members no longer hold equal row counts."""
        return self._member_of_row is not None

    @property
    def rows_version(self) -> int:
        """Changes whenever set_rows does: what is cached for the running rows is stale."""
        return self._rows_version

    def padded_layout(self) -> tuple[int, torch.Tensor]:
        """After drops (set_rows with a subset): (widest, slots), each running row's slot in a member-major
        layout padded to the member with the most rows (widest), so a ragged batch still takes one batched
        product. Rows stay member-sorted when the decoder drops some; computed once per dropped-rows event."""
        if self._layout_version != self._rows_version:
            members = self._member_of_row
            counts = torch.bincount(members, minlength=self.size)
            starts = torch.cumsum(counts, 0) - counts
            self._counts, self._widest = counts.tolist(), int(counts.max())
            rows = torch.arange(len(members), device=members.device)
            self._slots = members * self._widest + rows - starts[members]
            self._sources = torch.zeros(self.size * self._widest, dtype=torch.long, device=members.device)
            self._sources[self._slots] = rows
            self._layout_version = self._rows_version
        return self._widest, self._slots

    def padded_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x's running rows laid out as padded_layout says, (N·widest, ...): each slot a gather of its row (one
        index_select, several times faster on CPU than scattering into a zeroed buffer); a slot no row has
        repeats row 0, whatever is computed from it is never read back (outputs are taken at `slots`)."""
        self.padded_layout()
        return x.index_select(0, self._sources)

    def members_in(self, tensor: torch.Tensor) -> int:
        """The members whose rows make up `tensor`'s leading dimension (member-major, equal counts): all of them,
        else PopulationBatchingError."""
        if tensor.shape[0] % self.size:
            raise PopulationBatchingError(
                f"a hooked module saw a batch of {tensor.shape[0]} rows, not a multiple of the {self.size} members"
            )
        return self.size

    def _per_row(self, *factors: torch.Tensor):
        """A function giving `factors` gathered for the rows still running (member of each row),
        recomputed only when set_rows changed them: once per dropped-rows event, not per step (index_select:
        2-5× faster than indexing with a tensor at these shapes, docs/benchmarks.md)."""
        cached: list = [None, None]

        def gathered():
            if cached[0] != self._rows_version:
                cached[:] = [self._rows_version, [factor.index_select(0, self._member_of_row) for factor in factors]]
            return cached[1]

        return gathered


def add_rows(output: torch.Tensor, groups: int, low: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """output (groups × positions rows, group-major) += low (groups, positions, r) · right (groups, r, out),
    in place when output is contiguous (rank 1: an outer product, no matrix call)."""
    if not output.is_contiguous():
        return output + torch.bmm(low, right).view(output.shape)
    target = output.view(groups, -1, output.shape[-1])
    if right.shape[1] == 1:
        target.addcmul_(low, right)
    else:
        target.baddbmm_(low, right)
    return output


def member_linear(x: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·W_m (+ bias) with each member's own weights: x's leading dimension is member-major with equal counts,
    weights (N, in, out), bias (out) or (N, 1, out); one batched product, the bias inside it as F.linear's
    addmm has it."""
    members = weights.shape[0]
    grouped = x.reshape(members, -1, x.shape[-1])
    if bias is None:
        out = torch.bmm(grouped, weights)
    else:
        out = torch.baddbmm(bias.expand(members, grouped.shape[1], weights.shape[2]), grouped, weights)
    return out.view(*x.shape[:-1], out.shape[-1])
