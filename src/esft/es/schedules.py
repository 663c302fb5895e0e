"""Schedules of σ and α over a run (--sigma-schedule, --alpha-schedule): pure functions of the
iteration and --iterations, so a resumed run gets exactly the values an uninterrupted one gets.

`scheduled(spec, initial, t, T)` is the value for iteration t (0-based: the iteration about to run,
t = 0 … T−1) of a run of T = --iterations iterations. With progress p = t / (T − 1) (p = 0 when T = 1;
clamped to [0, 1]) and F the final fraction of `spec` (default 0.1):

- `constant`: initial, at every iteration (the paper).
- `linear[:F]`: initial · (F + (1 − F)·(1 − p)): initial at t = 0, F·initial at the last iteration t = T − 1.
- `cosine[:F]`: initial · (F + (1 − F)·(1 + cos(π·p)) / 2): the same end points, flat at both ends.

At t = 0 (p = 0) the value is `initial` exactly, and at p = 1 exactly initial·F.

σ_t is the noise scale members are perturbed with in iteration t; α_t the step of its update (the
trainer logs both as es/sigma and es/alpha). The two are scheduled independently: α's default of σ/2
is taken from --sigma once, not from σ_t.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_FINAL_FRACTION = 0.1


def parse(spec: str) -> tuple[str, float]:
    """(kind, final fraction) of a schedule such as `constant`, `linear`, `cosine:0.2`; ValueError for anything
    else (a final fraction outside [0, 1] too)."""
    kind, colon, fraction = str(spec).partition(":")
    if kind not in ("constant", "linear", "cosine") or (colon and (kind == "constant" or not fraction)):
        raise ValueError(f"unknown schedule {spec!r}: use constant, linear[:F] or cosine[:F]")
    final = float(fraction) if fraction else DEFAULT_FINAL_FRACTION
    if not 0 <= final <= 1:
        raise ValueError(f"schedule {spec!r}: the final fraction F must be in [0, 1]")
    return kind, final


def scheduled(spec: str, initial: float, iteration: int, iterations: int) -> float:
    """The value of `initial` under schedule `spec` at 0-based `iteration` of `iterations` (module docstring)."""
    kind, final = parse(spec)
    if kind == "constant":
        return float(initial)
    progress = min(max(iteration / (iterations - 1), 0.0), 1.0) if iterations > 1 else 0.0
    if progress == 0.0:
        return float(initial)
    weight = 1.0 - progress if kind == "linear" else (1.0 + math.cos(math.pi * progress)) / 2.0
    return float(initial) * (final + (1.0 - final) * weight)


def step_sizes(args: Any, iteration: int) -> tuple[float, float]:
    """(σ_t, α_t) of an ESConfig's run at 0-based `iteration`: --sigma and --alpha under
    --sigma-schedule and --alpha-schedule over --iterations."""
    return (scheduled(args.sigma_schedule, args.sigma, iteration, args.iterations),
            scheduled(args.alpha_schedule, args.alpha, iteration, args.iterations))
