"""RandOpt beside ES and GRPO at the same number of training completions (issue 53), on the embedded model
(`esft train`'s default) and easy Countdown, greedy held-out accuracy on the seed's 500 problems.

- randopt-K1/K5/K10  one population of N members (--population, default 30) scored once on --validation rows
                     (N x validation = the budget: 30 x 32 = 960), read three ways from the same scores: the
                     best member alone and the majority vote of the best 5 and 10 (each member's held-out
                     completions are generated once and reused by every K)
- randopt-corp       the consolidation of the K = 10 kept members (softmax of their z-scored validation
                     rewards, esft.randopt.selection), evaluated whether or not its validation gate accepted it
                     (the gate's verdict is in the JSON and the table)
- es-demo / grpo     `esft train` / `esft train --algorithm grpo` (TRL's defaults) stopped by the same
                     --budget-completions, as benchmarks/es_vs_grpo.py runs them (its `command`)

RandOpt runs in this process through the Python API (RandOptTrainer: the same code as `esft train --algorithm
randopt`); ES and GRPO as subprocesses. Writes <out>.json (every number, the command, date, commit, load) and
<out>.md (the table). --skip-baselines leaves ES and GRPO out (their numbers at this budget are also on
docs/benchmarks.md, "ES against GRPO").

    OMP_NUM_THREADS=1 python benchmarks/randopt.py [--budget 960] [--population 30] [--seeds 0,1] [--eval-size 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KS = (1, 5, 10)
METHODS = {"randopt-K1": "RandOpt, best member (K = 1)", "randopt-K5": "RandOpt, vote of K = 5",
           "randopt-K10": "RandOpt, vote of K = 10", "randopt-corp": "RandOpt consolidated (K = 10, CoRP-style)",
           "es-demo": "ES, demo preset", "grpo-default": "GRPO, TRL's defaults"}


def randopt(seed: int, budget: int, population: int, eval_size: int, runs: Path) -> dict:
    """One RandOpt population, scored once; held-out accuracy of K = 1, 5, 10 and of the consolidation."""
    from esft import ESConfig, RandOptTrainer
    from esft.randopt.selection import consolidation_weights

    validation = budget // population
    args = ESConfig(algorithm="randopt", seed=seed, population_size=population, validation_size=validation,
                    randopt_top_k=max(KS), eval_size=eval_size, logging="none", progress=False,
                    output_dir=str(runs), run_name=f"randopt-b{budget}-n{population}-s{seed}-{int(time.time())}")
    trainer = RandOptTrainer(args=args)
    cache: dict[tuple, object] = {}
    generations = trainer._member_generations

    def cached(seeds, prompts, *rest):  # a member's completions of these prompts, generated once for every K
        key = tuple(prompts)
        missing = [s for s in seeds if (s, key) not in cache]
        for s, g in zip(missing, generations(missing, prompts, *rest) if missing else []):
            cache[s, key] = g
        return [cache[s, key] for s in seeds]

    trainer._member_generations = cached
    started = time.perf_counter()
    final = trainer.train()
    train_s = time.perf_counter() - started
    kept, result = list(trainer.kept), {"seed": seed, "train_s": train_s, "run_dir": str(trainer.run_dir),
                                         "completions": final["budget/completions"],
                                         "training_s": final["budget/seconds"],
                                         "untrained": trainer.initial_metrics["eval/heldout/accuracy"]}
    for k in KS:
        trainer.kept = kept[:k]
        result[f"randopt-K{k}"] = trainer.evaluate(0)["eval/heldout/accuracy"]
    trainer.kept = []
    weights = consolidation_weights([m["reward"] for m in kept])
    base = trainer.engine.master_state()
    trainer.engine.update([m["seed"] for m in kept], [args.sigma * w for w in weights], 1.0)
    result["randopt-corp"] = trainer.evaluate(0)["eval/heldout/accuracy"]
    trainer.engine.load_master_state(base)
    result["corp_accepted"] = bool(trainer.record["consolidation"]["accepted"])
    result["validation"] = {"best": kept[0]["reward"], **{k: trainer.record["consolidation"][k]
                                                         for k in ("validation", "base_validation")}}
    trainer.close()
    return result


def baseline(name: str, seed: int, budget: int, runs: Path) -> dict:
    """ES or GRPO by es_vs_grpo's command, at the same budget: held-out accuracy at the end, wall time."""
    from es_vs_grpo import command, curve, run, run_name

    argv = command(name, seed, budget, runs, lr=1e-6 if name.startswith("grpo") else None)
    argv += ["--eval-size", str(EVAL_SIZE)]
    record = run(argv, runs / run_name(name, seed, budget))
    last = [row for row in curve(runs / run_name(name, seed, budget)) if "accuracy" in row][-1]
    return {"accuracy": last["accuracy"], "wall_s": record["wall_s"], "completions": last["completions"],
            "training_s": last["seconds"]}


def pm(values: list[float]) -> str:
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{mean:.1f}"


def table(results: dict) -> str:
    lines = ["| method | held-out accuracy % | training completions | training s | whole run s |",
             "| --- | --- | --- | --- | --- |"]
    seeds = results["randopt"]
    lines.append(f"| untrained | {pm([r['untrained'] for r in seeds])} | 0 | — | — |")
    for key in ("randopt-K1", "randopt-K5", "randopt-K10", "randopt-corp"):
        note = ""
        if key == "randopt-corp":
            note = f" (gate accepted {sum(r['corp_accepted'] for r in seeds)} of {len(seeds)})"
        lines.append(f"| {METHODS[key]}{note} | {pm([r[key] for r in seeds])} | "
                     f"{statistics.fmean(r['completions'] for r in seeds):.0f} | "
                     f"{statistics.fmean(r['training_s'] for r in seeds):.0f} | "
                     f"{statistics.fmean(r['train_s'] for r in seeds):.0f} (one run, every K) |")
    for key, runs in results.get("baselines", {}).items():
        lines.append(f"| {METHODS[key]} | {pm([r['accuracy'] for r in runs])} | "
                     f"{statistics.fmean(r['completions'] for r in runs):.0f} | "
                     f"{statistics.fmean(r['training_s'] for r in runs):.0f} | "
                     f"{statistics.fmean(r['wall_s'] for r in runs):.0f} |")
    return "\n".join(lines) + "\n"


EVAL_SIZE = 500


def main() -> None:
    global EVAL_SIZE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=960, help="training completions of every method")
    parser.add_argument("--population", type=int, default=30, help="RandOpt's N (validation rows = budget / N)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--skip-baselines", action="store_true", help="RandOpt only (ES and GRPO take minutes)")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/randopt_bench"))
    parser.add_argument("--out", type=Path, default=HERE / "randopt")
    options = parser.parse_args()
    EVAL_SIZE = options.eval_size
    if options.budget // options.population < 1 or options.population < max(KS):
        parser.error(f"--population must be >= {max(KS)} and <= --budget")
    options.runs.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in options.seeds.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    results: dict = {"command": "OMP_NUM_THREADS=1 python benchmarks/randopt.py " + " ".join(sys.argv[1:]),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                     "load_before": os.getloadavg(), "budget": options.budget, "population": options.population,
                     "validation_size": options.budget // options.population, "randopt": [], "baselines": {}}
    for seed in seeds:
        results["randopt"].append(randopt(seed, options.budget, options.population, options.eval_size, options.runs))
        print(json.dumps(results["randopt"][-1]), file=sys.stderr, flush=True)
    if not options.skip_baselines:
        for name in ("es-demo", "grpo-default"):
            results["baselines"][name] = [baseline(name, seed, options.budget, options.runs) for seed in seeds]
    results["load_after"] = os.getloadavg()
    options.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    options.out.with_suffix(".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
