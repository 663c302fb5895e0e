"""Population batching (--population-batching): every ES member in ONE batched generate call.

With low-rank noise (esft.es.noise `lowrank`), member m's weights are W + σ·A_m·B_mᵀ/√r for every
perturbed matrix W. The model keeps its unperturbed weights; forward hooks add each member's
low-rank term to that member's rows, so the dense product with W (the expensive part) is computed
once for the whole population:

    nn.Linear     (y = x·Wᵀ, W: out × in)       y_m += σ/√r · (x_m·B_m)·A_mᵀ
    Conv1D (GPT-2) (y = x·W, W: in × out)        y_m += σ/√r · (x_m·A_m)·B_mᵀ
    nn.Embedding  (y = W[ids], W: vocab × dim)   y_m += σ/√r · A_m[ids]·B_mᵀ

Rows are member-major: generate call rows [m·P, (m+1)·P) are member m's copies of the P prompts, and
every hooked module must see the batch as the leading dimension of its input (true of HF decoder
models, in prefill and in every KV-cached decoding step). A parameter used by several modules (a
tied embedding / LM head) is one tensor index and gets the same factors in every use. Non-matrix
tensors (norms, biases) are frozen under low-rank noise, as in the sequential path. Restoring is
removing the hooks: the weights are never written. Modules that read the same input tensor (a
layer's q/k/v projections, its gate/up projections) share one product x_m·[B_q B_k B_v]: the rows,
memory-bound at small r, are read once per layer input instead of once per module.

The prompt pass is the exception (float32 nn.Linear on CPU): there each member brings more token rows than
the layer has inputs, and its own weights W + σ/√r·A_m·B_mᵀ, built for the call and multiplied in one
batched product, cost less memory traffic than two extra passes over every row's input and output
(`_per_member_pays`; the demo's 960-row prompt pass: the hooks' cost from +102 to +56 ms).

`check_population_batching` compares the batched forward with the sequential path (weights
perturbed in place) once per engine: a model whose perturbed matrices are also used outside these
modules, or whose modules see a different row layout, is refused instead of silently mis-evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from esft.engines.base import Generation, PopulationEngine, Sampling, generation_from_tokens, perturbed
from esft.engines.member_rows import MemberRows, PopulationBatchingError, add_rows, member_linear
from esft.engines.shared_product import SharedProduct, input_groups, standard_strides
from esft.es.lowrank import stacked_factors
from esft.es.noise import LOW_RANK_SCHEMES, perturbs


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return None
    return Conv1D


class LowRankPopulation(MemberRows):
    """While installed (a context manager), the engine's model evaluates `member_seeds` at once:
    rows of member m get member m's low-rank perturbation (module docstring)."""

    def __init__(self, engine, member_seeds: Sequence[int], sigma: float):
        super().__init__(len(member_seeds))
        self._replaced: list[nn.Module] = []
        if engine.noise not in LOW_RANK_SCHEMES:
            raise PopulationBatchingError(f"population batching needs --noise lowrank (got {engine.noise})")
        self.engine = engine
        model = engine.model
        dtype = next(model.parameters()).dtype
        scale = sigma / math.sqrt(engine.rank)
        perturbed = {id(param): (index, name, param) for index, name, param in engine.trainable
                     if perturbs(engine.noise, param.shape)}
        conv1d = _conv1d_type()
        used: set[int] = set()
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or id(weight) not in perturbed:
                continue
            index, name, param = perturbed[id(weight)]
            # (N, shape[0], r), (N, shape[1], r) in float32, generated for each module (a tied weight twice, the
            # same values): the plan keeps them in the model's dtype only, so its memory per member is r·(in+out)
            # in that dtype, not that and a float32 copy besides
            a, b = stacked_factors(member_seeds, index, param.shape, engine.rank, engine.device, engine._generator)
            if isinstance(module, nn.Linear):  # W: out × in -> x·B, then ·(σ/√r)·Aᵀ
                self._plan.append((module, "matmul", b.to(dtype), standard_strides((a * scale).transpose(1, 2).to(dtype))))
            elif conv1d is not None and isinstance(module, conv1d):  # W: in × out -> x·A, then ·(σ/√r)·Bᵀ
                self._plan.append((module, "matmul", a.to(dtype), standard_strides((b * scale).transpose(1, 2).to(dtype))))
            elif isinstance(module, nn.Embedding):  # W: vocab × dim -> A[ids], then ·(σ/√r)·Bᵀ
                if module.max_norm is not None:
                    raise PopulationBatchingError(f"{module_name}: nn.Embedding with max_norm is not supported")
                table = a.reshape(-1, a.shape[-1]).to(dtype)  # (N·vocab, r): member m's rows at m·vocab
                right = (b * scale * _embedding_output_scale(module, module_name)).transpose(1, 2)
                self._plan.append((module, "lookup", table, standard_strides(right.to(dtype))))
            else:
                raise PopulationBatchingError(
                    f"{name} is the weight of {module_name} ({type(module).__name__}); population batching "
                    "handles nn.Linear, nn.Embedding and Conv1D weights: exclude it with --trainable or "
                    "evaluate members one at a time (no --population-batching)"
                )
            used.add(id(weight))
        unused = [name for key, (_, name, _) in perturbed.items() if key not in used]
        if unused:
            raise PopulationBatchingError(
                f"{unused[0]} is not the weight of an nn.Linear, nn.Embedding or Conv1D module; exclude it "
                "with --trainable or evaluate members one at a time (no --population-batching)"
            )
        self._share_inputs(engine)

    def _share_inputs(self, engine) -> None:
        """Matmul entries become (module, "matmul", shared product, its columns, right): modules that read
        one input tensor (input_groups) get one SharedProduct over their concatenated left factors."""
        matmuls = [entry for entry in self._plan if entry[1] == "matmul"]
        group_of = input_groups(engine, [entry[0] for entry in matmuls])
        groups: dict = {}
        for entry in matmuls:
            alone = ("alone", id(entry[0]))  # not seen in input_groups' pass: a product of its own
            groups.setdefault((group_of.get(id(entry[0]), alone), entry[2].shape[1]), []).append(entry)
        shared_entries = {}
        for entries in groups.values():
            product = SharedProduct(self, torch.cat([entry[2] for entry in entries], dim=2))
            start = 0
            for module, _, left, right in entries:
                shared_entries[id(module)] = (module, "matmul", product, slice(start, start + left.shape[2]), right)
                start += left.shape[2]
        self._plan = [shared_entries.get(id(entry[0]), entry) if entry[1] == "matmul" else entry for entry in self._plan]

    def install(self) -> None:
        """Forward hooks, except on float32 nn.Linear modules on CPU, whose forward is replaced (an instance
        attribute shadows the class's) so that the prompt pass can skip the shared product (_linear_forward)."""
        for entry in self._plan:
            module = entry[0]
            if entry[1] == "matmul" and type(module) is nn.Linear and "forward" not in module.__dict__ \
                    and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
                module.forward = self._linear_forward(module, *entry[2:])
                self._replaced.append(module)
            else:
                self._handles.append(module.register_forward_hook(self._hook_for(entry)))

    def remove(self) -> None:
        super().remove()
        for module in self._replaced:
            module.__dict__.pop("forward", None)
        self._replaced.clear()

    def _linear_forward(self, module: nn.Linear, product: SharedProduct, columns: slice, right: torch.Tensor):
        """The module's product plus each member's low-rank term (the hook's), or where _per_member_pays, each
        member's rows against its own perturbed weights: Wᵀ + B_m·(σ/√r·A_mᵀ), built for this call."""
        hook = self._matmul_hook(product, columns, right)
        left = product.left_by_member[:, columns, :].transpose(1, 2)  # (N, in, r)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if self._member_of_row is None and _per_member_pays(x, self.size, module.out_features):
                weights = torch.baddbmm(module.weight.t().unsqueeze(0), left, right)  # (N, in, out)
                return member_linear(x, weights, module.bias)
            return hook(module, (x,), nn.functional.linear(x, module.weight, module.bias))

        return forward

    def _hook_for(self, entry):
        if entry[1] == "matmul":
            return self._matmul_hook(*entry[2:])
        module, _, table, right = entry
        return self._lookup_hook(table, right, module.num_embeddings)

    def _matmul_hook(self, product: SharedProduct, columns: slice, right: torch.Tensor):
        """Adds (x·left)·right to each row with its own member's factors; x·left is this module's columns of
        the product shared with the modules reading the same input."""
        per_row = self._per_row(right)

        def hook(module, args, output):
            low = product(args[0])[..., columns]  # (N or rows, positions, r)
            if self._member_of_row is None:
                return add_rows(output, self.size, low, right)
            (right_rows,) = per_row()  # (rows, r, out): each running row's member's factor
            return add_rows(output, len(right_rows), low, right_rows)

        return hook

    def _lookup_hook(self, table: torch.Tensor, right: torch.Tensor, vocab: int):
        offsets = torch.arange(self.size, device=table.device).unsqueeze(1) * vocab
        per_row = self._per_row(offsets, right)

        def hook(module, args, output):
            ids = args[0]
            members = self._member_of_row
            if members is None:
                n = self.members_in(ids)
                low = nn.functional.embedding(ids.reshape(n, -1) + offsets, table)  # (N, rows·positions, r)
                return add_rows(output, n, low, right)
            row_offsets, right_rows = per_row()
            rows = ids.reshape(len(members), -1) + row_offsets
            return add_rows(output, len(members), nn.functional.embedding(rows, table), right_rows)

        return hook


PER_MEMBER_WEIGHTS_BYTES = 256 * 2**20
"""At most this many bytes of per-member weights for one module's call (the prompt pass of a large layer keeps
the hooks)."""


def _per_member_pays(x: torch.Tensor, members: int, outputs: int) -> bool:
    """Per-member weights for this call of a linear layer (in → out): when each member brings more token rows
    than the layer has inputs. Their traffic is about members·in·out written and read once; the hooks' is a read
    and a write of every row's output (rows·out each) plus a read of its input: the weights win once rows per
    member exceed `in` (the prompt pass of a 128-wide model: 800 token rows per member; a decoding step: 32)."""
    inputs = x.shape[-1]
    rows = x.numel() // inputs
    fits = members * inputs * outputs * x.element_size() <= PER_MEMBER_WEIGHTS_BYTES
    return fits and rows > members * inputs and x.shape[0] % members == 0


def _embedding_output_scale(module: nn.Embedding, module_name: str) -> float:
    """What the module multiplies its looked-up rows by: 1 for nn.Embedding, `embed_scale` for the
    scaled word embeddings of Gemma-like models (forward = lookup · embed_scale). Any other subclass
    may feed the lookup something other than token ids (OPT's learned positions take the attention
    mask): refused, the self-check could not vouch for it."""
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    embed_scale = getattr(module, "embed_scale", None)
    if embed_scale is not None and "Scaled" in type(module).__name__:
        return float(embed_scale)
    raise PopulationBatchingError(
        f"{module_name} ({type(module).__name__}) computes its own embedding lookup; exclude its weight from ES "
        "with --trainable (e.g. a regex without it) or evaluate members one at a time (no --population-batching)"
    )


# ------------------------------------------------------------------ generation
def _population_class(engine):
    """The hooks that batch this engine's members: low-rank noise's, unless the engine names its own
    (full-rank noise: esft.engines.fullrank_population; a LoRA engine with full-rank noise:
    esft.engines.adapter_population)."""
    return getattr(engine, "population_class", LowRankPopulation)


def members_per_call(engine, members: int, prompts: Sequence[str]) -> int:
    """Members batched in one generate call: all of them, unless each holds its own weights (full-rank
    noise: esft.engines.fullrank_population, as many as fit and fill a call). 1 means batching gains
    nothing here: the executor then evaluates members one at a time, weights in place."""
    if isinstance(engine, PopulationEngine):  # it batches its own members (the vLLM engine: LoRA adapters)
        return members
    population_class = _population_class(engine)
    if hasattr(population_class, "members_per_call"):
        return population_class.members_per_call(engine, members, prompts)
    return members


@torch.no_grad()
def generate_population(
    engine, prompts: Sequence[str], member_seeds: Sequence[int], sigma: float, mini_batch_size: int | None = None,
    group: int | None = None, sampling: Sampling | None = None,
) -> list[Generation]:
    """Greedy completions of `prompts` for every member (one Generation per member, prompts in
    order), `group` members (default: members_per_call) in each generate call; `mini_batch_size`
    prompts (× members rows) per call; sampled with common random numbers where `sampling` says so
    (Sampling.common_noise). An engine that batches its own members (PopulationEngine) is handed the
    whole population."""
    if isinstance(engine, PopulationEngine):
        if sampling is None:  # greedy: the call an engine written before sampled rollouts takes
            return engine.generate_population(prompts, member_seeds, sigma, mini_batch_size)
        return engine.generate_population(prompts, member_seeds, sigma, mini_batch_size, sampling)
    check_population_batching(engine)
    population_class = _population_class(engine)
    results = [Generation(texts=[], num_tokens=[], token_ids=[]) for _ in member_seeds]
    group = group or members_per_call(engine, len(member_seeds), prompts)
    for first in range(0, len(member_seeds), group):
        seeds = member_seeds[first : first + group]
        with population_class(engine, seeds, sigma) as population:
            for rows in engine.generated_chunks(prompts, mini_batch_size, copies=len(seeds), on_rows=population.set_rows,
                                                sampling=sampling):
                population.set_rows(None)
                chunk = len(rows) // len(seeds)
                for member, result in enumerate(results[first : first + group]):
                    part = generation_from_tokens(rows[member * chunk : (member + 1) * chunk], engine.eos_token_ids,
                                                  engine.tokenizer)
                    result.token_ids.extend(part.token_ids)
                    result.num_tokens.extend(part.num_tokens)
                    result.texts.extend(part.texts)
    return results


# ------------------------------------------------------------------ self-check
_CHECKED = "_esft_population_checked"
IN_PROCESS_MODEL = ("model", "master", "trainable", "noise", "generated_chunks", "perturb", "restore")
"""What batching members in this process reads of an engine (the transformers engine has all of it): an
engine without these (a user's own engine, the Ray proxy of actors that hold the model) runs members
one at a time unless it batches its own members (PopulationEngine)."""


def _lacks_model(engine) -> str | None:
    """Why members of `engine` cannot be batched here because it holds no in-process model, or None."""
    missing = [name for name in IN_PROCESS_MODEL if getattr(engine, name, None) is None]
    if not missing:
        return None
    return (f"the {type(engine).__name__} engine holds no in-process model to batch members on (it has no "
            f"{', '.join(missing)}); evaluate members one at a time (no --population-batching)")


def population_batching_problem(engine) -> str | None:
    """Why `engine`'s model cannot evaluate members batched (check_population_batching's message),
    or None when it can: for callers that report it their own way (a ConfigError, a Ray reply)."""
    if isinstance(engine, PopulationEngine):
        return engine.population_problem()
    try:
        check_population_batching(engine)
    except PopulationBatchingError as error:
        return str(error)
    return None


@torch.no_grad()
def check_population_batching(engine, seeds: Sequence[int] = (11, 12)) -> None:
    """Once per engine: the batched forward's logits must match the sequential path's (weights
    perturbed in place) on a short input, else PopulationBatchingError. σ is 0.3 × the matrices'
    RMS, so every perturbed matrix is visible in the logits and a missed use shows (tolerance: 0.1%
    of the perturbation's effect in float32; 15% in bfloat16/float16, whose rounding alone reaches
    a few percent: there a missed use of a minor matrix can pass unnoticed). In bfloat16/float16 a
    failure is measured again at 0.1 × RMS: at 0.3 a deep model's perturbed forward is chaotic and the
    two paths' different rounding grows to the size of the effect itself (SmolLM2-135M, 30 layers:
    error/effect 1.13 at 0.3, 0.06 at 0.1), while a missed use scales with σ as the effect does.
    Without a master a large model's matrices are checked in groups (`_check_groups`)."""
    if getattr(engine, _CHECKED, False):
        return
    if (reason := _lacks_model(engine)) is not None:
        raise PopulationBatchingError(reason)
    model = engine.model
    matrices = [engine.master[name] for _, name, param in engine.trainable if perturbs(engine.noise, param.shape)]
    if not matrices:
        raise PopulationBatchingError(f"no trainable matrix: {engine.noise} noise perturbs matrices only")
    # in the weights' dtype: with dtype=float32 torch makes a float32 copy of each matrix first (SmolLM2 in bfloat16:
    # +250 MB resident for the rest of the run), and a rounded RMS is all that σ needs
    rms = float(torch.stack([torch.linalg.vector_norm(m).float() / math.sqrt(m.numel()) for m in matrices]).mean())
    float32 = next(model.parameters()).dtype == torch.float32
    tolerance = 1e-3 if float32 else 0.15
    whole = engine.trainable
    try:
        for group in _check_groups(engine):
            engine.trainable = group  # what perturb, restore and the population hooks perturb, for this group
            for scale in (0.3,) if float32 else (0.3, 0.1):
                error, effect = _batched_against_sequential(engine, seeds, scale * rms if rms > 0 else scale)  # all-zero: a fresh LoRA B
                if error <= tolerance * max(effect, 1e-6):
                    break
            else:
                raise PopulationBatchingError(
                    f"batched logits differ from the sequential path's by {error:.3g} (perturbation effect {effect:.3g}): "
                    "this model uses a perturbed tensor outside the module that owns it (for low-rank noise: outside "
                    "nn.Linear/nn.Embedding/Conv1D) or lays out its batch differently; evaluate members one at a time "
                    "(no --population-batching)"
                )
    finally:
        engine.trainable = whole
    setattr(engine, _CHECKED, True)


CHECK_GROUPS = 8
"""Without a master, the check perturbs a model's matrices in place in this many groups, one after the other
(`_check_groups`) ..."""
CHECK_GROUP_BYTES = 32 << 20
"""... of at least this many bytes of weights each (a smaller model is checked in one group)."""


def _check_groups(engine) -> list[list]:
    """The trainable tensors in the groups the check perturbs one after the other: all at once, except without a
    master (--master-weights none), where restoring an in-place perturbation keeps the elements that θ − σ·ε would
    not give back (esft.engines.transformers_engine; at the check's σ, 0.3 × RMS, about 15% of them in bfloat16, 10
    bytes each: 0.75× the weights' own memory). There the perturbed matrices, in the model's order, are split into
    up to CHECK_GROUPS groups of about equal bytes, so what is kept is a group's share. A missed use of a matrix
    outside its module shows in its group's logits as it would among all of them."""
    if getattr(engine, "master_weights", None) != "none":
        return [engine.trainable]
    perturbed_tensors = [entry for entry in engine.trainable if perturbs(engine.noise, entry[2].shape)]
    nbytes = [param.numel() * param.element_size() for _, _, param in perturbed_tensors]
    share = sum(nbytes) / max(1, min(CHECK_GROUPS, sum(nbytes) // CHECK_GROUP_BYTES))
    groups, done = [[]], 0
    for entry, size in zip(perturbed_tensors, nbytes):
        if groups[-1] and done >= len(groups) * share:  # this group has its share: start the next
            groups.append([])
        groups[-1].append(entry)
        done += size
    return groups


def _batched_against_sequential(engine, seeds: Sequence[int], sigma: float) -> tuple[float, float]:
    """(largest logit difference between the batched and the sequential path, largest effect of the
    perturbation on the logits) at `sigma`, on two rows of six random tokens."""
    model = engine.model
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0)).to(engine.device)
    base = model(input_ids=ids).logits.float()
    sequential = []
    for seed in seeds:
        with perturbed(engine, seed, sigma):
            sequential.append(model(input_ids=ids).logits.float())
    expected = torch.cat(sequential)
    with _population_class(engine)(engine, seeds, sigma):
        batched = model(input_ids=ids.repeat(len(seeds), 1)).logits.float()
    return float((batched - expected).abs().max()), float((expected - base.repeat(len(seeds), 1, 1)).abs().max())
