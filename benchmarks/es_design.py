"""ES designs on SmolLM2-135M-Instruct at one budget (issue 63), on times-table: stage (a), how members and prompts
share an iteration's 128 completions and how their fitness is shaped; stage (b), mirrored pairs and σ (3e-3, or
chosen by --sigma auto) for the designs stage (a) put first.

Every cell is an ordinary `esft train` command run as a subprocess (es_vs_grpo.run: OMP_NUM_THREADS=1, its own
peak RSS from wait4, a finished run is not run again), --parallel at a time. All share the SmolLM2 recipe's other
settings (examples/smollm2-times-table.yaml: rank-4 low-rank noise, σ 1e-2, 16 new tokens, 200 held-out rows,
an evaluation every 4 iterations) and 12 iterations of 128 completions:

- members × prompts N × P ∈ 8 × 16 (the recipe's), 32 × 4, 64 × 2, 128 × 1: every member on the same P prompts;
- 64 × 16 in 8 prompt groups (--prompt-groups 8: 8 members on each pair of prompts, EGGROLL's shape);
- shaping zscore (the paper's), per_prompt (z-scores per prompt), per_prompt_centered (centred per prompt, not
  divided by the spread: the step shrinks with the signal; called "centred" in the table).

The step is matched across N with --step-rule sqrt_n (θ += (α/√N)·Σ cᵢ·εᵢ) at α = 5e-3/√8: the recipe's step at
N = 8 (α = σ/2 under the paper's α/N), so a z-scored update has about the same norm at every N. Centred fitness is
not unit-spread, so its step is smaller by the rewards' spread: the table gives each run's mean es/update_ratio
(‖Δθ‖/‖θ‖ per iteration) beside its accuracy. One seed per cell: a screen, not a result. A stage (b) cell
adds a variant (VARIANTS) to a stage (a) cell: shape/shaping/variant.

Writes <out>.json (every number; out = benchmarks/es_design) and the table, printed and written to
<runs>/es_design.md, headed by the command.

    esft prepare-model smollm2-135m-instruct        # once: prints the model folder
    python benchmarks/es_design.py --model <that folder> [--seed 0] [--parallel 2] [--cells 8x16/zscore,...]
        [--iterations 12] [--eval-size 200]
    python benchmarks/es_design.py --model <that folder> --cells 64x2/zscore/antithetic,64x2/zscore/auto,...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from es_vs_grpo import curve, run  # noqa: E402  (a sibling script, not a package)

RECIPE = ["--task", "times-table", "--max-tokens", "16", "--noise", "lowrank", "--rank", "4", "--sigma", "0.01",
          "--eval-every", "4"]
"""examples/smollm2-times-table.yaml, but for its population and batch (each cell's own), --iterations and
--eval-size (this script's, 12 and 200 by default)."""
ALPHA = 5e-3 / math.sqrt(8)
"""Under --step-rule sqrt_n, the recipe's step: α = σ/2 = 5e-3 under the paper's α/N at N = 8."""
SHAPES = {"8x16": (8, 16, 1), "32x4": (32, 4, 1), "64x2": (64, 2, 1), "128x1": (128, 1, 1), "64x16g8": (64, 16, 8)}
"""name: (members N, prompts per iteration B, prompt groups G); N·B/G = 128 completions per iteration each."""
SHAPINGS = {"zscore": "z-score", "per_prompt": "per-prompt z", "per_prompt_centered": "centred"}
"""--reward-shaping: its name in the table."""
VARIANTS = {"": [], "antithetic": ["--strategy", "antithetic"], "sigma3e-3": ["--sigma", "3e-3"],
            "auto": ["--sigma", "auto"]}
"""Stage (b): what a cell changes from stage (a)'s settings (a cell's third part, shape/shaping/variant; α stays the
matched one): mirrored pairs, a smaller σ, σ chosen by --sigma auto's ladder."""


def cells(spec: str | None) -> list[tuple[str, str, str]]:
    """(shape, shaping, variant) of every cell to run, stage (a)'s grid by default; per_prompt needs shared prompts,
    so the prompt-groups shape runs only the other two. A cell is named shape/shaping[/variant]."""
    grid = [(shape, shaping) for shape in SHAPES for shaping in SHAPINGS
            if not (SHAPES[shape][2] > 1 and shaping == "per_prompt")]
    if spec is None:
        return [(*cell, "") for cell in grid]
    wanted = [(*cell.split("/"), "")[:3] for cell in spec.split(",")]
    unknown = [cell for cell, parts in zip(spec.split(","), wanted) if parts[:2] not in grid or parts[2] not in VARIANTS]
    if unknown:
        sys.exit(f"unknown cells {unknown}; the grid: {', '.join('/'.join(cell) for cell in grid)}, each with an "
                 f"optional /{'|'.join(v for v in VARIANTS if v)}")
    return wanted


def run_name(shape: str, shaping: str, variant: str, seed: int) -> str:
    return f"{shape}-{shaping}{'-' + variant if variant else ''}-s{seed}"


def command(options, shape: str, shaping: str, variant: str) -> list[str]:
    members, prompts, groups = SHAPES[shape]
    seed, runs = options.seed, options.runs
    return ["esft", "train", "--model", options.model, *RECIPE, "--iterations", str(options.iterations), "--eval-size",
            str(options.eval_size), "--population-size", str(members), "--batch-size", str(prompts),
            "--prompt-groups", str(groups), "--reward-shaping", shaping, "--step-rule", "sqrt_n", "--alpha", f"{ALPHA:.6g}",
            "--seed", str(seed), "--save-every", "0", "--logging", "none", "--no-progress", "--output-dir", str(runs),
            "--run-name", run_name(shape, shaping, variant, seed), *VARIANTS[variant]]


def update_ratios(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["es/update_ratio"] for row in rows if "es/update_ratio" in row]


def measure(options, shape: str, shaping: str, variant: str) -> dict:
    run_dir = options.runs / run_name(shape, shaping, variant, options.seed)
    record = run(command(options, shape, shaping, variant), run_dir)
    ratios = update_ratios(run_dir)
    sigma = yaml.safe_load((run_dir / "config.yaml").read_text())["sigma"]  # --sigma auto's choice
    return {"shape": shape, "shaping": shaping, "variant": variant, "sigma": sigma, "seed": options.seed, **record,
            "curve": curve(run_dir), "update_ratio": sum(ratios) / len(ratios)}


def table(results: list[dict], eval_size: int) -> str:
    marks = sorted({p["iteration"] for r in results for p in r["curve"] if p["iteration"]})
    lines = [f"Held-out times-table accuracy (%, {eval_size} rows, greedy) by iteration (128 training completions "
             "each), seed " + ", ".join(sorted({str(r["seed"]) for r in results})) + "; --step-rule sqrt_n, α = "
             f"{ALPHA:.4g}.", "",
             "| N × P (groups) | shaping | variant | σ | before | " + " | ".join(str(m) for m in marks)
             + " | gain | mean update ratio | training s | peak RSS MB |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in marks) + " | --- | --- | --- | --- |"]
    for r in results:
        members, prompts, groups = SHAPES[r["shape"]]
        at = {p["iteration"]: 100 * p["accuracy"] for p in r["curve"]}
        shape = f"{members} × {prompts}" + (f" ({groups} groups)" if groups > 1 else "")
        lines.append(f"| {shape} | {SHAPINGS[r['shaping']]} | {r['variant'] or '—'} | {r['sigma']:g} | {at[0]:.1f} | "
                     + " | ".join(f"{at.get(m, math.nan):.1f}" for m in marks)
                     + f" | {at[max(at)] - at[0]:+.1f} | {r['update_ratio']:.2e} | {r['curve'][-1]['seconds']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    loads = [load for r in results for load in (r["load_before"][0], r["load_after"][0])]
    lines += ["", f"Load average (1 min) beside the runs: {min(loads):.2f}–{max(loads):.2f}. Training seconds exclude "
              "evaluations (budget/seconds)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the SmolLM2 folder (esft prepare-model smollm2-135m-instruct)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=12, help="ES iterations of 128 completions per cell")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out rows (evaluated every 4 iterations)")
    parser.add_argument("--cells", default=None, help="shape/shaping,... (default: the whole grid)")
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/es_design"))
    parser.add_argument("--out", type=Path, default=HERE / "es_design", help="<out>.json: every number")
    options = parser.parse_args()
    command_line = "python benchmarks/es_design.py " + " ".join(sys.argv[1:])
    options.runs.mkdir(parents=True, exist_ok=True)
    todo = cells(options.cells)
    with ThreadPoolExecutor(max_workers=options.parallel) as pool:  # the report is rewritten as each cell ends
        futures = [pool.submit(measure, options, *cell) for cell in todo]
        for _ in as_completed(futures):
            report(options, command_line, [f.result() for f in futures if f.done() and not f.exception()])
    print((options.runs / "es_design.md").read_text(), flush=True)


def report(options, command_line: str, results: list[dict]) -> None:
    """<out>.json (every number) and <runs>/es_design.md (the table, headed by the command)."""
    options.out.with_suffix(".json").write_text(json.dumps({"command": command_line, "results": results}, indent=1))
    (options.runs / "es_design.md").write_text(f"Command: `{command_line}`\n\n" + table(results, options.eval_size))


if __name__ == "__main__":
    main()
