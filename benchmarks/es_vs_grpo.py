"""ES vs GRPO at the same completion budget, on the embedded model and easy Countdown (issue 12).

Every configuration is an ordinary `esft train` command, run as a subprocess, one after another,
with OMP_NUM_THREADS=1, stopped by --budget-completions (--budget, default 3,840: 4 iterations of the ES
demo's 30 members x 32 prompts, 480 GRPO steps of 8 completions; the whole benchmark then took 33 minutes
on this project's shared 2-core CPU, where GRPO trains on ~20 completions/s and ES on 100-200) and
evaluated greedily on the same 500 held-out problems (the seed's) before training, at every quarter
of the budget (GRPO: every eighth) and at the end:

- es-demo        `esft train` (the demo preset: low-rank noise, population batching)
- es-iid         `esft train --noise iid` (the paper's full-rank i.i.d. noise, one member at a time)
- grpo-default   `esft train --algorithm grpo`: TRL's defaults (lr 1e-6, 8 generations, 8 completions
                 per step, dapo loss, beta 0, gradient checkpointing), --iterations = budget / 8
- grpo-lr<LR>    the same with --learning-rate LR: the sweep, seed 0 only; the LR with the best held-out
                 accuracy at the budget (a tie: the first in --lrs) is then run with every seed as grpo-best

Writes <out>.json (every number; out = benchmarks/es_vs_grpo), --plot (held-out accuracy vs completions
and vs training seconds, mean ± std over seeds, one line per method; default docs/images/es_vs_grpo.png,
the picture the docs show) and the tables, printed and written to <runs>/es_vs_grpo.md; the published
figures are in docs/benchmarks.md. Runs live in --runs (default /tmp/es_vs_grpo), named after the
configuration, budget and seed; a run that finished is not run again, so an interrupted benchmark continues
where it stopped. The report is rewritten after every seed; --report-only redraws it from <out>.json.

    OMP_NUM_THREADS=1 python benchmarks/es_vs_grpo.py [--budget 3840] [--seeds 0,1,2] [--lrs 3e-7,1e-6,3e-6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLOT = HERE.parent / "docs" / "images" / "es_vs_grpo.png"
ES_COMPLETIONS_PER_ITERATION = 30 * 32  # the demo: population x prompts
GRPO_COMPLETIONS_PER_STEP = 8  # TRL's per_device_train_batch_size
TRL_LEARNING_RATE = 1e-6  # TRL's default: grpo-default is the sweep's run of it
METHODS = {"es-demo": "ES, demo preset (low-rank, batched)", "es-iid": "ES, paper's i.i.d. noise",
           "grpo-default": "GRPO, TRL defaults (lr 1e-6)", "grpo-best": "GRPO, best swept lr"}


def command(name: str, seed: int, budget: int, runs: Path, lr: float | None = None) -> list[str]:
    """The `esft train` command of one configuration."""
    common = ["--seed", str(seed), "--budget-completions", str(budget), "--save-every", "0", "--logging", "none",
              "--no-progress", "--output-dir", str(runs), "--run-name", run_name(name, seed, budget)]
    if name.startswith("es-"):
        iterations = -(-budget // ES_COMPLETIONS_PER_ITERATION)
        noise = ["--noise", "iid"] if name == "es-iid" else []
        return ["esft", "train", *noise, "--iterations", str(iterations), "--eval-every", str(max(1, iterations // 4)), *common]
    steps = -(-budget // GRPO_COMPLETIONS_PER_STEP)
    return ["esft", "train", "--algorithm", "grpo", "--learning-rate", f"{lr:g}", "--iterations", str(steps),
            "--eval-every", str(max(1, steps // 8)), *common]


def run_name(name: str, seed: int, budget: int) -> str:
    """A configuration's run directory name: runs of another budget are never taken for it."""
    return f"{name}-b{budget}-s{seed}"


def run(argv: list[str], run_dir: Path) -> dict:
    """Run one configuration (unless it already finished); its record: wall time, peak memory, load."""
    record_file = run_dir / "benchmark.json"
    if record_file.exists():
        return json.loads(record_file.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    print(f"$ OMP_NUM_THREADS=1 {' '.join(argv)}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "esft.cli", *argv[1:]], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this run's own peak resident memory
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({process.returncode}):\n{output[-3000:]}")
    record = {"command": "OMP_NUM_THREADS=1 " + " ".join(argv), "wall_s": time.perf_counter() - started,
              "peak_rss_mb": usage.ru_maxrss / 1024, "load_before": load_before, "load_after": os.getloadavg()}
    (run_dir / "benchmark.json").write_text(json.dumps(record, indent=1))
    return record


def curve(run_dir: Path) -> list[dict]:
    """The run's evaluations: completions, tokens and training seconds spent, held-out accuracy."""
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/heldout/accuracy" in row:
            points.append({"iteration": row["iteration"], "completions": row.get("budget/completions", 0),
                           "tokens": row.get("budget/tokens", 0), "seconds": row.get("budget/seconds", 0.0),
                           "accuracy": row["eval/heldout/accuracy"]})
    return points


def measure(name: str, seed: int, budget: int, runs: Path, lr: float | None = None) -> dict:
    """One configuration's record and curve (GRPO runs are named after their learning rate, so the
    default's and the best's seed-0 runs are the sweep's)."""
    label = f"grpo-lr{lr:g}" if name.startswith("grpo") else name
    run_dir = runs / run_name(label, seed, budget)
    return {"method": name, "seed": seed, "lr": lr, **run(command(label, seed, budget, runs, lr), run_dir), "curve": curve(run_dir)}


def mean_std(values: list[float]) -> tuple[float, float]:
    import numpy as np

    return float(np.mean(values)), float(np.std(values))


def pm(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    mean, std = mean_std([scale * v for v in values])
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def tables(results: list[dict], sweep: list[dict], budget: int, best_lr: float) -> str:
    marks = sorted({p["completions"] for r in results for p in r["curve"] if p["completions"] and p["completions"] % (budget // 4) == 0})
    lines = [f"Held-out accuracy (%, 500 problems, greedy) at equal training budgets, mean ± std over seeds "
             f"{sorted({r['seed'] for r in results})}; grpo-best = lr {best_lr:g}.", "",
             "| method | before | " + " | ".join(f"{m:,} compl." for m in marks) + " | training s | tokens | whole run s | peak RSS MB |",
             "| --- | --- | " + " | ".join("---" for _ in marks) + " | --- | --- | --- | --- |"]
    for method, title in METHODS.items():
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        at = {m: [p["accuracy"] for r in runs for p in r["curve"] if p["completions"] == m] for m in marks}
        lines.append(f"| {title} (`{method}`) | {pm([r['curve'][0]['accuracy'] for r in runs], 100)} | "
                     + " | ".join(pm(at[m], 100) if len(at[m]) == len(runs) else "—" for m in marks)
                     + f" | {pm([r['curve'][-1]['seconds'] for r in runs], digits=0)} | {pm([r['curve'][-1]['tokens'] for r in runs], digits=0)}"
                     f" | {pm([r['wall_s'] for r in runs], digits=0)} | {pm([r['peak_rss_mb'] for r in runs], digits=0)} |")
    lines += ["", "Learning-rate sweep (GRPO, TRL's defaults otherwise, seed 0): held-out accuracy at the budget.", "",
              "| learning rate | held-out accuracy % | training s |", "| --- | --- | --- |"]
    lines += [f"| {r['lr']:g} | {100 * r['curve'][-1]['accuracy']:.1f} | {r['curve'][-1]['seconds']:.0f} |" for r in sweep]
    loads = [load for r in results + sweep for load in (r["load_before"][0], r["load_after"][0])]
    lines += ["", f"Load average (1 min) beside the runs: {min(loads):.2f}–{max(loads):.2f} (2-core machine shared with "
              "other jobs). Training seconds exclude evaluations (budget/seconds); whole run = the command's wall time."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, title in METHODS.items():
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        points = min(len(r["curve"]) for r in runs)
        accuracy = np.array([[100 * p["accuracy"] for p in r["curve"][:points]] for r in runs])
        for axis, key in zip(axes, ("completions", "seconds")):
            x = np.mean([[p[key] for p in r["curve"][:points]] for r in runs], axis=0)
            line, = axis.plot(x, accuracy.mean(axis=0), marker="o", markersize=3, label=title)
            axis.fill_between(x, accuracy.mean(axis=0) - accuracy.std(axis=0), accuracy.mean(axis=0) + accuracy.std(axis=0),
                              color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("training completions generated")
    axes[1].set_xlabel("training wall time, s (evaluations excluded)")
    for axis in axes:
        axis.set_ylabel("held-out accuracy, %")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"Embedded model, easy Countdown: ES vs GRPO (mean ± std over {len({r['seed'] for r in results})} seeds)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=4 * ES_COMPLETIONS_PER_ITERATION,
                        help="training completions per run, every method (--budget-completions)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lrs", default="3e-7,1e-6,3e-6", help="GRPO learning rates swept on the first seed")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/es_vs_grpo"))
    parser.add_argument("--out", type=Path, default=HERE / "es_vs_grpo", help="<out>.json: every number")
    parser.add_argument("--plot", type=Path, default=PLOT, help="the picture (default: the one docs/ shows)")
    parser.add_argument("--report-only", action="store_true", help="redraw the table and plot from finished runs")
    options = parser.parse_args()
    seeds, lrs = [int(s) for s in options.seeds.split(",")], [float(x) for x in options.lrs.split(",")]
    if options.report_only:
        saved = json.loads(options.out.with_suffix(".json").read_text())
        report(options, saved["budget"], saved["results"], saved["sweep"], saved["best_lr"], saved["command"])
        return
    command_line = "OMP_NUM_THREADS=1 python benchmarks/es_vs_grpo.py " + " ".join(sys.argv[1:])
    options.runs.mkdir(parents=True, exist_ok=True)
    sweep = [measure("grpo-sweep", seeds[0], options.budget, options.runs, lr) for lr in lrs]
    best_lr = max(sweep, key=lambda r: r["curve"][-1]["accuracy"])["lr"]
    results = []
    for seed in seeds:  # the report is rewritten after every seed: an interrupted benchmark leaves one
        results += [measure(name, seed, options.budget, options.runs) for name in ("es-demo", "es-iid")]
        results += [measure(name, seed, options.budget, options.runs, lr)
                    for name, lr in (("grpo-default", TRL_LEARNING_RATE), ("grpo-best", best_lr))]
        report(options, options.budget, results, sweep, best_lr, command_line)


def report(options, budget: int, results: list[dict], sweep: list[dict], best_lr: float, command_line: str) -> None:
    """<out>.json (every number), <runs>/es_vs_grpo.md (the tables, headed by the command) and the plot."""
    options.out.with_suffix(".json").write_text(json.dumps({"command": command_line, "budget": budget, "best_lr": best_lr,
                                                            "results": results, "sweep": sweep}, indent=1))
    text = f"Command: `{command_line}` (budget: {budget:,} training completions per run)\n\n" + tables(results, sweep, budget, best_lr)
    options.runs.mkdir(parents=True, exist_ok=True)
    (options.runs / "es_vs_grpo.md").write_text(text)
    options.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, options.plot)
    print(text, flush=True)

if __name__ == "__main__":
    main()
