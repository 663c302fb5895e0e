"""Held-out accuracy with and without a float32 master (issue 64, item 2): SmolLM2-135M-Instruct in bfloat16 on the
times-table recipe as it was measured (examples/smollm2-times-table.yaml's task, noise and budget: low-rank noise
rank 4, σ 1e-2, 12 iterations, 200 held-out problems evaluated every 4; with 8 members × 16 prompts and the paper's
step, RECIPE_DESIGN, pinned so the recorded numbers stay reproducible after the recipe moved to 64 × 2), `--master-weights float32` against `--master-weights none`
(updates rounded stochastically into the bfloat16 weights), on --seeds.

Each run is an ordinary `esft train` subprocess with OMP_NUM_THREADS=1 (benchmarks/es_vs_grpo.run: wall time, peak
RSS, load) and --mini-batch-size 8 --eval-batch-size 32 (at most 64 rows per call), two side by side; finished runs
are reused. Prints, per mode, the held-out accuracy before training and
at each evaluation (mean ± std over seeds), the per-seed difference none − float32 at the end, the mean
es/update_survival, the peak RSS, and writes <runs>/master_quality.json.

    esft prepare-model smollm2-135m-instruct          # once: prints the model folder
    python benchmarks/master_quality.py --model FOLDER --seeds 0,1,2,3 --runs runs/master-quality
(the run recorded in docs/benchmarks.md, "Updates without a float32 master")
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from es_vs_grpo import mean_std, pm, run  # noqa: E402  (the same subprocess runner and statistics)

RECIPE = HERE.parent / "examples" / "smollm2-times-table.yaml"
RECIPE_DESIGN = ["--population-size", "8", "--batch-size", "16", "--step-rule", "paper", "--alpha", "0.005"]
"""The design these runs were measured with (the recipe until issue 63)."""
MODES = ("float32", "none")


def command(model: str, mode: str, seed: int, runs: Path, iterations: int | None) -> tuple[list[str], Path]:
    name = f"bf16-{mode}-s{seed}"
    argv = ["esft", "train", "--config", str(RECIPE), *RECIPE_DESIGN, "--model", model, "--dtype", "bfloat16", "--master-weights", mode,
            "--seed", str(seed), "--output-dir", str(runs), "--run-name", name, "--logging", "none", "--no-progress",
            "--mini-batch-size", "8", "--eval-batch-size", "32"]
    # memory only (the same completions): seeds 0-2 were measured so, when bfloat16 generation took ~55 MB per row
    # here (before esft.engines.decoding.contiguous_head_input) and two runs of 128-row calls overran 24 GB
    if iterations is not None:
        argv += ["--iterations", str(iterations)]
    return argv, runs / name


def measure(model: str, mode: str, seed: int, runs: Path, iterations: int | None) -> dict:
    argv, run_dir = command(model, mode, seed, runs, iterations)
    if not (run_dir / "benchmark.json").exists() and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # an interrupted run: start it again
    record = run(argv, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracy = {str(row["iteration"]): row["eval/heldout/accuracy"] for row in rows if "eval/heldout/accuracy" in row}
    survival = [row["es/update_survival"] for row in rows if "es/update_survival" in row]
    return {"mode": mode, "seed": seed, "accuracy": accuracy, "survival": survival, **record}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the SmolLM2 folder (esft prepare-model smollm2-135m-instruct)")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--runs", default="runs/master-quality")
    parser.add_argument("--iterations", type=int, default=None, help="fewer iterations than the recipe's 12")
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each)")
    args = parser.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    jobs = [(mode, int(seed)) for seed in args.seeds.split(",") for mode in MODES]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: measure(args.model, job[0], job[1], runs, args.iterations), jobs))
    (runs / "master_quality.json").write_text(json.dumps(results, indent=1))
    marks = sorted({int(k) for r in results for k in r["accuracy"]})
    print(f"Held-out accuracy (%, 200 problems, greedy), mean ± std over seeds {args.seeds}, bfloat16 weights:")
    print("| --master-weights | " + " | ".join(f"iteration {m}" for m in marks)
          + " | es/update_survival | peak RSS MB | wall s |")
    print("| --- | " + " | ".join("---" for _ in marks) + " | --- | --- | --- |")
    for mode in MODES:
        mine = [r for r in results if r["mode"] == mode]
        cells = [pm([r["accuracy"][str(m)] for r in mine], 100) for m in marks]
        survival = [v for r in mine for v in r["survival"]]
        print(f"| {mode} | " + " | ".join(cells) + f" | {pm(survival, digits=4) if survival else '—'} | "
              f"{pm([r['peak_rss_mb'] for r in mine], digits=0)} | {pm([r['wall_s'] for r in mine], digits=0)} |")
    last = str(marks[-1])
    by_seed = {(r["mode"], r["seed"]): r["accuracy"][last] for r in results}
    differences = [100 * (by_seed[("none", seed)] - by_seed[("float32", seed)]) for mode, seed in jobs if mode == "none"]
    mean, std = mean_std(differences)
    print(f"none − float32 at iteration {last}, per seed: {', '.join(f'{d:+.1f}' for d in differences)} "
          f"(mean {mean:+.1f} ± {std:.1f} points)")


if __name__ == "__main__":
    main()
