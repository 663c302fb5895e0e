"""ES against GRPO on a real pretrained model: SmolLM2-135M-Instruct (`esft prepare-model`) on `--task times-table`
(products of 2..12 in five phrasings, chat format, 200 held-out problems of 40 pairs never trained on, 16 tokens;
`--task arithmetic` with --task), at the same number of training completions.

Every configuration is an ordinary `esft train` command run as a subprocess with OMP_NUM_THREADS=1, stopped by
--budget-completions (default 1,024: 8 ES iterations of 8 members x 16 prompts; 128 GRPO steps of 8 completions)
and evaluated greedily before training, at half the budget and at the end (each evaluation of 200 problems costs
about as much as 1.5 ES iterations: more points would double the benchmark's time on 2 cores); then the final model
is evaluated once more with 4 samples per problem at temperature 1 (pass@1, pass@4), and its per-token KL to the
base model (k3, on one completion sampled at temperature 1 for each of --kl-prompts held-out problems, as
benchmarks/es_variants.py measures it; KL is scored in memory-sized chunks, esft.engines.logprobs):

- es          the paper's update rule (z-scored rewards, plain step, alpha = sigma/2) with the noise and sigma
              measured to move this model: --noise lowrank --rank 1 --sigma 1e-2 (at the paper's sigma 1e-3
              every member's greedy completions are identical and nothing is learned)
- es-b8       the same with 8 prompts per iteration: the variant that led on the embedded model (more updates
              per completion; docs/benchmarks.md, ES variants)
- randopt     `esft train --algorithm randopt` (issue 53) at ES's noise and sigma: 16 members scored once on
              budget/16 validation rows, held-out answers by the vote of the best 5; from the same members
              the best 1 and the vote of 10 (`esft eval --model RUN --randopt-top-k K`), final/ alone, and pass@k
              of final/ and of the vote (sample j of a problem: the vote of the members' samples j)
- grpo-lr<LR> `esft train --algorithm grpo` with TRL's defaults but --learning-rate LR, swept on the first seed;
              grpo-best, the best, is run on every seed

Held-out accuracy is split by the arithmetic reward's labels into format and correctness: `bare` (the number
alone), `correct` (the right last number among other text), `wrong`, `no_number`. Writes <out>.json, a table
(stdout and <runs>/real_model.md) and --plot. Finished runs are reused, so an interrupted benchmark continues.

    esft prepare-model smollm2-135m-instruct          # once: prints the model folder
    OMP_NUM_THREADS=1 python benchmarks/real_model.py --model FOLDER [--budget 1024] [--seeds 0,1] [--lrs 1e-6,1e-5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from es_variants import geometry, heldout_prompts  # noqa: E402  (KL and weight distance, as measured there)
from es_vs_grpo import mean_std, pm, run  # noqa: E402  (the same subprocess runner and statistics)

PLOT = HERE.parent / "docs" / "images" / "real_model.png"
LIMITS = ["--max-tokens", "16", "--eval-size", "200"]
ES = {"es": ["--noise", "lowrank", "--rank", "1", "--sigma", "1e-2", "--population-size", "8", "--batch-size", "16"],
      "es-b8": ["--noise", "lowrank", "--rank", "1", "--sigma", "1e-2", "--population-size", "8", "--batch-size", "8"]}
GRPO_COMPLETIONS_PER_STEP = 8
RANDOPT_K, RANDOPT_KS = 5, (1, 5, 10)
RANDOPT = ["--algorithm", "randopt", "--noise", "lowrank", "--rank", "1", "--sigma", "1e-2", "--population-size", "16",
           "--randopt-top-k", str(RANDOPT_K)]
"""RandOpt at ES's noise and sigma: 16 members, each scored on budget/16 validation rows, the best 5 vote (and
the best 1 and 10 of the same members, evaluated after)."""
LABELS = ("bare", "correct", "wrong", "no_number")
TITLES = {"es": "ES (low-rank, sigma 1e-2, 16 prompts)", "es-b8": "ES, 8 prompts per iteration", "grpo-best": "GRPO, best lr",
          "randopt": f"RandOpt, vote of the best {RANDOPT_K} of 16"}


def train_command(name: str, model: str, seed: int, budget: int, runs: Path, lr: float | None = None,
                  task: str = "times-table") -> list[str]:
    common = ["--model", model, "--task", task, *LIMITS, "--seed", str(seed), "--budget-completions", str(budget), "--save-every", "0",
              "--logging", "none", "--no-progress", "--output-dir", str(runs), "--run-name", f"{name}-b{budget}-s{seed}"]
    if name in ES:
        flags = ES[name]
        per_iteration = int(flags[flags.index("--population-size") + 1]) * int(flags[flags.index("--batch-size") + 1])
        iterations = -(-budget // per_iteration)
        return ["esft", "train", *flags, "--iterations", str(iterations), "--eval-every", str(max(1, iterations // 2)), *common]
    if name == "randopt":
        return ["esft", "train", *RANDOPT, "--validation-size", str(max(1, budget // 16)), *common]
    steps = -(-budget // GRPO_COMPLETIONS_PER_STEP)
    return ["esft", "train", "--algorithm", "grpo", "--learning-rate", f"{lr:g}", "--no-gradient-checkpointing",
            "--iterations", str(steps), "--eval-every", str(max(1, steps // 2)), *common]


def curve(run_dir: Path) -> list[dict]:
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/heldout/accuracy" in row:
            labels = {label: row.get(f"eval/heldout/rewards/arithmetic_reward/labels/{label}", 0) for label in LABELS}
            points.append({"completions": row.get("budget/completions", 0), "seconds": row.get("budget/seconds", 0.0),
                           "accuracy": row["eval/heldout/accuracy"], "labels": labels})
    return points


def evaluation(run_dir: Path, name: str, weights: Path, *flags: str) -> dict:
    """The metrics row of `esft eval --model WEIGHTS FLAGS`, kept in RUN/<name> (reused when there)."""
    out = run_dir / name
    out.mkdir(exist_ok=True)
    run(["esft", "eval", "--model", str(weights), *flags, "--logging", "none", "--no-progress", "--output-dir", str(out),
         "--run-name", "eval"], out)
    return json.loads((out / "eval" / "metrics.jsonl").read_text().splitlines()[0])


def sampled(run_dir: Path, weights: Path | None = None, name: str = "sampled") -> dict:
    """pass@1 and pass@4 of the final model (or of a RandOpt run's vote, weights = the run directory: sample j
    of a problem is the vote of the members' samples j): 4 samples per held-out problem at temperature 1."""
    row = evaluation(run_dir, name, weights or run_dir / "final", "--eval-samples", "4", "--temperature", "1.0")
    return {"pass@1": row["eval/heldout/pass@1"], "pass@4": row["eval/heldout/pass@4"]}


def final_alone(run_dir: Path) -> float:
    """Greedy held-out accuracy of a RandOpt run's final/ by itself (the consolidated model when its validation
    gate accepted it, else the best member), beside the vote its run reports."""
    return evaluation(run_dir, "final-alone", run_dir / "final")["eval/heldout/accuracy"]


def votes(run_dir: Path, own_vote: float) -> dict[str, float]:
    """Greedy held-out accuracy of the vote of the best K members, K = 1 (the best member alone), RANDOPT_K (the
    run's own vote, `own_vote`: its last held-out accuracy), 10: from the one scored population (`esft eval --model
    RUN --randopt-top-k K` scores nothing again)."""
    found = {str(k): evaluation(run_dir, f"vote-k{k}", run_dir, "--randopt-top-k", str(k))["eval/heldout/accuracy"]
             for k in RANDOPT_KS if k != RANDOPT_K}
    return {str(RANDOPT_K): own_vote} | found  # string keys: as the JSON reads back


def kl(run_dir: Path, model: str, seed: int, prompts: int) -> dict:
    """Per-token KL(final || base) and relative weight distance (es_variants.geometry), kept in the run."""
    path = run_dir / "geometry.json"
    if not path.exists():
        found = geometry(run_dir / "final", Path(model), heldout_prompts(run_dir, prompts), seed, max_new_tokens=16)
        path.write_text(json.dumps(found))
    return json.loads(path.read_text())


def measure(name: str, model: str, seed: int, budget: int, runs: Path, lr: float | None = None,
            task: str = "times-table", kl_prompts: int = 200, vote_sampled: bool = True) -> dict:
    label = f"grpo-lr{lr:g}" if lr is not None else name
    run_dir = runs / f"{label}-b{budget}-s{seed}"
    record = run(train_command(label, model, seed, budget, runs, lr, task), run_dir)
    points, extra = curve(run_dir), {}
    if name == "randopt":
        randopt = json.loads((run_dir / "randopt.json").read_text())
        extra = {"final_alone": final_alone(run_dir), "consolidated": bool((randopt.get("consolidation") or {}).get("accepted")),
                 "votes": votes(run_dir, points[-1]["accuracy"]), "vote_sampled": sampled(run_dir, run_dir, "vote-sampled") if vote_sampled else None}
    return {"method": name, "seed": seed, "lr": lr, **record, "curve": points, "sampled": sampled(run_dir),
            "geometry": kl(run_dir, model, seed, kl_prompts), **extra}


def table(results: list[dict], sweep: list[dict], budget: int, best_lr: float) -> str:
    seeds = sorted({r["seed"] for r in results})
    lines = [f"Held-out accuracy (%, 200 problems, greedy, 16 tokens), mean ± std over seeds {seeds}, at {budget:,} "
             f"training completions; grpo-best = lr {best_lr:g}. Labels: share of the 200 answers at the end (before).", "",
             "| method | before | after | gain | bare | correct | wrong | no number | pass@1 | pass@4 | KL per token | "
             "training s | peak RSS MB |", "| --- " * 13 + "|"]
    for method, title in TITLES.items():
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        first, last = [r["curve"][0] for r in runs], [r["curve"][-1] for r in runs]
        share = {label: pm([p["labels"][label] / 2 for p in last]) + f" ({mean_std([p['labels'][label] / 2 for p in first])[0]:.0f})"
                 for label in LABELS}
        lines.append(f"| {title} | {pm([p['accuracy'] for p in first], 100)} | {pm([p['accuracy'] for p in last], 100)} | "
                     f"{pm([b['accuracy'] - a['accuracy'] for a, b in zip(first, last)], 100)} | "
                     + " | ".join(share[label] for label in LABELS)
                     + f" | {pm([r['sampled']['pass@1'] for r in runs], 100)} | {pm([r['sampled']['pass@4'] for r in runs], 100)}"
                     f" | {mean_std([r['geometry']['kl_per_token'] for r in runs])[0]:.2e}"
                     f" | {pm([p['seconds'] for p in last], digits=0)}"
                     f" | {pm([r['peak_rss_mb'] for r in runs], digits=0)} |")
    if randopt := [r for r in results if r["method"] == "randopt"]:
        lines += ["", "RandOpt from the same 16 scored members (greedy held-out accuracy, %): "
                  + ", ".join(f"{'best member alone' if k == 1 else f'vote of {k}'} {pm([r['votes'][str(k)] for r in randopt], 100)}"
                              for k in RANDOPT_KS)
                  + f"; final/ alone {pm([r['final_alone'] for r in randopt], 100)} "
                  f"(the consolidation passed its validation gate on {sum(r['consolidated'] for r in randopt)} of "
                  f"{len(randopt)} seeds; else final/ is the best member). The table's pass@k, KL and training seconds "
                  f"are final/'s, and include the gate's {2 * max(1, budget // 16)} completions."]
        if voted := [r for r in randopt if r.get("vote_sampled")]:
            lines += [f"pass@1 / pass@4 of the vote of {RANDOPT_K} (sample j of a problem: the vote of the members' samples j), "
                      f"seeds {[r['seed'] for r in voted]}: {pm([r['vote_sampled']['pass@1'] for r in voted], 100)} / "
                      f"{pm([r['vote_sampled']['pass@4'] for r in voted], 100)}; final/'s on the same seeds "
                      f"{pm([r['sampled']['pass@1'] for r in voted], 100)} / {pm([r['sampled']['pass@4'] for r in voted], 100)}."]
    lines += ["", "GRPO learning-rate sweep (seed 0): " + ", ".join(
        f"lr {r['lr']:g} → {100 * r['curve'][-1]['accuracy']:.1f}%" for r in sweep)]
    loads = [load for r in results + sweep for load in (r["load_before"][0], r["load_after"][0])]
    lines += ["", f"Load average (1 min) beside the runs: {min(loads):.2f}–{max(loads):.2f} (2 cores)."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path, task: str = "times-table") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for method, title in TITLES.items():
        runs = [r for r in results if r["method"] == method]
        if runs:
            points = min(len(r["curve"]) for r in runs)
            x = np.mean([[p["completions"] for p in r["curve"][:points]] for r in runs], axis=0)
            y = np.array([[100 * p["accuracy"] for p in r["curve"][:points]] for r in runs])
            line, = axis.plot(x, y.mean(axis=0), marker="o", markersize=3, label=title)
            axis.fill_between(x, y.mean(axis=0) - y.std(axis=0), y.mean(axis=0) + y.std(axis=0), color=line.get_color(), alpha=0.15)
    axis.set_xlabel("training completions generated")
    axis.set_ylabel("held-out accuracy, %")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(f"SmolLM2-135M-Instruct, {task}: ES vs GRPO ({len({r['seed'] for r in results})} seeds)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the prepared SmolLM2 folder (esft prepare-model prints it)")
    parser.add_argument("--budget", type=int, default=1024, help="training completions per run (--budget-completions)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--task", default="times-table", choices=("times-table", "arithmetic"))
    parser.add_argument("--lrs", default="1e-6,1e-5", help="GRPO learning rates swept on the first seed")
    parser.add_argument("--kl-prompts", type=int, default=200, help="held-out problems the final KL is measured on")
    parser.add_argument("--vote-sampled-seeds", default=None,
                        help="seeds on which pass@k of RandOpt's vote is measured (default: every seed; each costs 5 "
                             "sampled evaluations, one per voting member)")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/real_model"))
    parser.add_argument("--out", type=Path, default=HERE / "real_model", help="<out>.json: every number")
    parser.add_argument("--plot", type=Path, default=PLOT)
    options = parser.parse_args()
    seeds, lrs = [int(s) for s in options.seeds.split(",")], [float(x) for x in options.lrs.split(",")]
    vote_seeds = seeds if options.vote_sampled_seeds is None else [int(s) for s in options.vote_sampled_seeds.split(",")]
    options.runs.mkdir(parents=True, exist_ok=True)
    command_line = "OMP_NUM_THREADS=1 python benchmarks/real_model.py " + " ".join(sys.argv[1:])
    results = []
    for seed in seeds:  # ES first: the report after the first seed already compares
        common = {"task": options.task, "kl_prompts": options.kl_prompts}
        results += [measure(name, options.model, seed, options.budget, options.runs, **common) for name in ES]
        if seed == seeds[0]:
            sweep = [measure("grpo-sweep", options.model, seed, options.budget, options.runs, lr, **common) for lr in lrs]
            best_lr = max(sweep, key=lambda r: r["curve"][-1]["accuracy"])["lr"]
        results.append(measure("grpo-best", options.model, seed, options.budget, options.runs, best_lr, **common))
        results.append(measure("randopt", options.model, seed, options.budget, options.runs, **common,
                               vote_sampled=seed in vote_seeds))
        text = f"Command: `{command_line}`\n\n" + table(results, sweep, options.budget, best_lr)
        options.out.with_suffix(".json").write_text(json.dumps({"command": command_line, "budget": options.budget,
                                                                "best_lr": best_lr, "results": results, "sweep": sweep}, indent=1))
        (options.runs / "real_model.md").write_text(text)
        options.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, options.plot, options.task)
        print(text, flush=True)


if __name__ == "__main__":
    main()
