"""How the ES gradient estimate moves the float32 master (--optimizer, issue 22): one step per tensor.

Per trainable tensor the engine accumulates G = Σᵢ coefficients[i]·εᵢ in float32 and calls
`ESOptimizer.step(key, master, G, learning_rate)`:

- sgd (the paper): master += G. The trainer's coefficients already hold α (α·zᵢ/N), so
  `learning_rate` is not applied to G; with --weight-decay wd > 0 the master first decays,
  master ← master·(1 − learning_rate·wd), learning_rate being α. Engines keep their in-place
  `master += G` path when `plain` (sgd without decay), so the paper's rule stays bit for bit.
- adam: G is the gradient estimate g (the trainer passes coefficients zᵢ/N, i.e. α = 1, and
  learning_rate = α), and the master takes torch.optim.Adam's step with maximize=True, element for
  element: m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g², master += lr·m̂/(√v̂ + eps); with wd > 0 the
  decoupled decay of torch.optim.AdamW first, master ← master·(1 − lr·wd).

Adam's state is two float32 tensors the shape of the master (exp_avg m and exp_avg_sq v of the
ascent gradient g: 8 bytes per trainable scalar) and a step count, per key, created at the key's
first step. Keys are the caller's (Hugging Face tensor names; the vLLM worker: name and block).
Pure torch: no model, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OPTIMIZERS = ("sgd", "adam")
LEARNING_RATE_IN_STEP = ("adam",)
"""Optimizers that apply α themselves (as Adam's learning rate): the strategy's coefficients are then zᵢ/N, so
that G = Σ cᵢεᵢ is the gradient estimate g. The others take α inside the coefficients (α/N·zᵢ, the paper's)."""


def coefficient_alpha(kind: str, alpha: float) -> float:
    """The α a strategy's tell puts into the coefficients under optimizer `kind` (LEARNING_RATE_IN_STEP)."""
    return 1.0 if kind in LEARNING_RATE_IN_STEP else alpha


@dataclass
class AdamState:
    """Adam's state of one tensor: float32 moments of the ascent gradient and the steps taken."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


class ESOptimizer:
    """sgd or adam on the ES gradient estimate, tensor by tensor (module docstring)."""

    def __init__(self, kind: str = "sgd", betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
        self.kind, self.betas, self.eps, self.weight_decay = kind, (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)
        self.state: dict[str, AdamState] = {}
        self._undo: dict[str, AdamState | None] | None = None
        """During an update (begin_update): each stepped key's state from before it, for rollback."""

    @property
    def plain(self) -> bool:
        """The paper's rule (sgd, no decay): master += G, which engines do in place."""
        return self.kind == "sgd" and self.weight_decay == 0.0

    @torch.no_grad()
    def step(self, key: str, master: torch.Tensor, gradient: torch.Tensor, learning_rate: float = 1.0) -> None:
        """Move `master` (float32, in place) by the accumulated G = `gradient` of tensor `key`.
        `gradient` is scratch: adam overwrites it."""
        if self.weight_decay:
            master.mul_(1.0 - learning_rate * self.weight_decay)
        if self.kind == "sgd":
            master.add_(gradient)
            return
        state = self.state.get(key)
        if self._undo is not None and key not in self._undo:  # adam's moments as they were, should the update fail
            self._undo[key] = None if state is None else AdamState(state.exp_avg.clone(), state.exp_avg_sq.clone(),
                                                                   state.step)
        if state is None:
            state = self.state[key] = AdamState(torch.zeros_like(master, dtype=torch.float32),
                                                torch.zeros_like(master, dtype=torch.float32))
        state.step += 1
        beta1, beta2 = self.betas
        state.exp_avg.lerp_(gradient, 1.0 - beta1)
        state.exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1.0 - beta2)
        # torch.optim.Adam's arithmetic, in this order (its maximize negates g, m and the step: exact)
        step_size = learning_rate / (1.0 - beta1 ** state.step)
        denominator = torch.sqrt(state.exp_avg_sq, out=gradient).div_((1.0 - beta2 ** state.step) ** 0.5).add_(self.eps)
        master.addcdiv_(state.exp_avg, denominator, value=step_size)

    def begin_update(self) -> None:
        """Steps from here on can be undone (rollback) until commit: adam keeps a copy of each stepped
        key's moments (8 bytes per trainable scalar while the update runs); sgd has no state."""
        self._undo = {} if self.kind == "adam" else None

    def rollback(self) -> None:
        """Put back the state of every key stepped since begin_update (the master is the engine's to restore)."""
        for key, state in (self._undo or {}).items():
            if state is None:
                self.state.pop(key, None)
            else:
                self.state[key] = state
        self._undo = None

    def commit(self) -> None:
        """Keep the steps since begin_update."""
        self._undo = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state as flat CPU tensors: exp_avg.<key>, exp_avg_sq.<key>, step.<key> (int64 scalar)."""
        out: dict[str, torch.Tensor] = {}
        for key, state in self.state.items():
            out[f"exp_avg.{key}"] = state.exp_avg.detach().cpu().clone()
            out[f"exp_avg_sq.{key}"] = state.exp_avg_sq.detach().cpu().clone()
            out[f"step.{key}"] = torch.tensor(state.step, dtype=torch.int64)
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        """Replace the state with `tensors` (as state_dict writes them); ValueError if malformed."""
        state: dict[str, AdamState] = {}
        for name, tensor in tensors.items():
            kind, _, key = name.partition(".")
            if kind not in ("exp_avg", "exp_avg_sq", "step") or not key:
                raise ValueError(f"optimizer state holds {name!r}, which is not exp_avg.*, exp_avg_sq.* or step.*")
            if kind == "step":
                continue
            if f"step.{key}" not in tensors or f"exp_avg.{key}" not in tensors or f"exp_avg_sq.{key}" not in tensors:
                raise ValueError(f"optimizer state of {key!r} is incomplete (exp_avg, exp_avg_sq and step are needed)")
            if key not in state:
                state[key] = AdamState(tensors[f"exp_avg.{key}"].to(device, torch.float32).clone(),
                                       tensors[f"exp_avg_sq.{key}"].to(device, torch.float32).clone(),
                                       int(tensors[f"step.{key}"]))
        self.state = state


def beta_pair(text: str) -> tuple[float, float]:
    """--adam-betas ("0.9,0.999", validated by esft.settings.rules) as two floats."""
    first, second = (float(part) for part in text.split(","))
    return first, second


def optimizer_spec(settings) -> dict:
    """ESOptimizer's keyword arguments from the settings' --optimizer, --adam-betas, --adam-eps, --weight-decay
    (plain values: they travel to Ray actors and vLLM workers)."""
    return {"kind": settings.optimizer, "betas": beta_pair(settings.adam_betas), "eps": float(settings.adam_eps),
            "weight_decay": float(settings.weight_decay)}
