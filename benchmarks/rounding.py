"""How much of an ES update survives in bfloat16 weights without a float32 master (issue 64, item 1).

On real matrices (a model folder's safetensors, e.g. SmolLM2 from `esft prepare-model smollm2-135m-instruct`;
default: random Llama-shaped matrices with std 0.15, about the size of SmolLM2's weights) in bfloat16, it applies
T seeded ES updates G_t = Σᵢ cᵢεᵢ (esft's own noise and update code: esft.es.lowrank / esft.es.noise), with
coefficients α/N·zᵢ (zᵢ standard normal, as z-scores are), and compares four ways of keeping the weights:

  master      float32 master m += G, weights = m rounded to nearest (what esft does with --master-weights float32)
  nearest     θ ← round_nearest(θ + G) (the reference code's in-place bf16 update)
  stochastic  θ ← round_stochastic(θ + G), seeded (esft.es.rounding: --master-weights none)
  feedback    error feedback (QES, arXiv 2602.03120): x = θ + G + e, θ ← round_nearest(x), e ← x − θ kept in
              bfloat16 beside the weights (2 more bytes per parameter; QES's seed replay recomputes it instead)

and prints, per scheme and T: `survived` = ⟨θ_T − θ_0, m_T − θ_0⟩/‖m_T − θ_0‖² (the share of the master's movement
the weights made, 1 = all), `error` = ‖θ_T − m_T‖/‖m_T − θ_0‖ (distance from the master's trajectory, relative to
its movement) and `cos` of the two movements. Two update sizes: the SmolLM2 recipe (--noise lowrank, rank 4,
N 8, σ 1e-2, α 5e-3) and the paper's defaults (iid, N 30, σ 1e-3, α 5e-4).

    python benchmarks/rounding.py --model "$(esft prepare-model smollm2-135m-instruct)" --steps 12,48
(the run recorded in docs/benchmarks.md, "Updates without a float32 master")
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from esft.es import lowrank
from esft.es.noise import draw_noise
from esft.es.rounding import round_stochastically, rounding_seed

SETTINGS = {
    "recipe": dict(noise="lowrank", rank=4, population=8, alpha=5e-3),
    "paper": dict(noise="iid", rank=1, population=30, alpha=5e-4),
}


def matrices(model: str | None, pattern: str, limit: int) -> dict[str, torch.Tensor]:
    """The model's matrices matching `pattern` (at most `limit`), in bfloat16; random ones without a model."""
    if model is None:
        generator = torch.Generator().manual_seed(0)
        shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)] * 2
        return {f"random.{i}": (torch.randn(shape, generator=generator) * 0.15).bfloat16()
                for i, shape in enumerate(shapes[:limit])}
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model).glob("*.safetensors")):
        for name, tensor in load_file(str(shard)).items():
            if tensor.dim() == 2 and re.search(pattern, name) and len(found) < limit:
                found[name] = tensor.bfloat16()
    if not found:
        raise SystemExit(f"no matrix of {model} matches {pattern!r}")
    return found


def update(shape, index: int, step: int, setting: dict, generator: torch.Generator) -> torch.Tensor:
    """G_t of one matrix: seeded members, coefficients α/N·z (z standard normal, seeded by the step)."""
    count = setting["population"]
    seeds = [1000 * step + i for i in range(count)]
    z = torch.randn(count, generator=torch.Generator().manual_seed(step))
    coefficients = [float(setting["alpha"] / count * value) for value in z]
    out = torch.zeros(shape, dtype=torch.float32)
    if setting["noise"] == "lowrank":
        return lowrank.dense_update(out, index, seeds, coefficients, setting["rank"], generator)
    noise = torch.empty(shape, dtype=torch.float32)
    for seed, coefficient in zip(seeds, coefficients):
        out.add_(draw_noise("iid", seed, index, shape, "cpu", generator, noise), alpha=coefficient)
    return out


def run(weights: dict[str, torch.Tensor], setting: dict, steps: list[int]) -> dict:
    generator = torch.Generator()
    start = {name: w.float() for name, w in weights.items()}
    master = {name: w.clone() for name, w in start.items()}
    kept = {scheme: {name: w.clone() for name, w in weights.items()} for scheme in ("nearest", "stochastic", "feedback")}
    residual = {name: torch.zeros_like(w) for name, w in weights.items()}
    results = {}
    for step in range(1, max(steps) + 1):
        for index, name in enumerate(weights):
            g = update(master[name].shape, index, step, setting, generator)
            master[name] += g
            kept["nearest"][name] = (kept["nearest"][name].float() + g).bfloat16()
            value = kept["stochastic"][name].float() + g
            round_stochastically(value, kept["stochastic"][name],
                                 torch.Generator().manual_seed(rounding_seed([step], index)))
            x = kept["feedback"][name].float() + g + residual[name].float()
            kept["feedback"][name] = x.bfloat16()
            residual[name] = (x - kept["feedback"][name].float()).bfloat16()
        if step in steps:
            moved = torch.cat([(master[n].bfloat16().float() - start[n]).flatten() for n in weights])
            exact = torch.cat([(master[n] - start[n]).flatten() for n in weights])
            row = {"master": _measure(moved, exact)}
            for scheme, values in kept.items():
                row[scheme] = _measure(torch.cat([(values[n].float() - start[n]).flatten() for n in weights]), exact)
            results[step] = row
    return results


def _measure(moved: torch.Tensor, exact: torch.Tensor) -> dict:
    norm = float(exact.norm())
    return {"survived": float(moved @ exact) / norm**2, "error": float((moved - exact).norm()) / norm,
            "cos": float(moved @ exact) / (float(moved.norm()) * norm or 1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder with safetensors (default: random Llama-shaped matrices)")
    parser.add_argument("--pattern", default=r"layers\.(0|14|29)\..*(q_proj|down_proj)\.weight$",
                        help="regex of the matrices to use (default: q_proj and down_proj of layers 0, 14, 29)")
    parser.add_argument("--limit", type=int, default=6, help="at most this many matrices")
    parser.add_argument("--steps", default="12,48", help="comma-separated T to report")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = matrices(args.model, args.pattern, args.limit)
    steps = sorted(int(s) for s in args.steps.split(","))
    print(f"{len(weights)} matrices, {sum(w.numel() for w in weights.values()):,} weights in bfloat16")
    everything = {}
    for label, setting in SETTINGS.items():
        everything[label] = results = run(weights, setting, steps)
        for step, row in results.items():
            print(f"{label:7s} T={step:3d}  " + "  ".join(
                f"{scheme}: survived {m['survived']:.3f} error {m['error']:.3f} cos {m['cos']:.4f}"
                for scheme, m in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
