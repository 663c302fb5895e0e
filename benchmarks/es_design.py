"""ES designs on SmolLM2-135M-Instruct at one budget (issue 63): stage (a), on times-table, how members and prompts
share an iteration's 128 completions and how their fitness is shaped; stage (b), mirrored pairs and σ (3e-3, or
chosen by --sigma auto) for the designs stage (a) put first; stage (c), the best designs on several seeds
(--seeds) and tasks (--tasks: times-table, arithmetic, word-problems); stage (d), GRPO and the default side by side
(--against-grpo, on each of --tasks); stage (e), a larger step (variants step2x, step4x), sampled rollouts
(sampled) and more prompts per iteration on arithmetic; stage (f), a step that decays over the run (alpha_cosine),
at --iterations 40 and 12; stage (g), batches of the prompts the model misses (candidates4, candidates8) or of
both ends (extremes8).

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
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from es_vs_grpo import curve, run  # noqa: E402  (a sibling script, not a package)
from real_model import LABELS, evaluation, kl, sampled  # noqa: E402  (pass@k, KL and labels, as measured there)

RECIPE = ["--noise", "lowrank", "--rank", "4", "--sigma", "0.01", "--eval-every", "4"]
"""examples/smollm2-times-table.yaml, but for its task, population and batch (each cell's own), --iterations and
--eval-size (this script's, 12 and 200 by default)."""
TASKS = {"times-table": ["--max-tokens", "16"], "arithmetic": ["--max-tokens", "16"],
         "word-problems": ["--max-tokens", "32"]}
"""--task: its own flags. Word problems get 32 tokens: SmolLM2 answers 4% of them within 16 (mostly cut short while
explaining), 22% within 32 (esft eval, 200 held-out rows, 2026-12-06)."""
ALPHA = 5e-3 / math.sqrt(8)
"""Under --step-rule sqrt_n, the recipe's step: α = σ/2 = 5e-3 under the paper's α/N at N = 8."""
SHAPES = {"8x16": (8, 16, 1), "32x4": (32, 4, 1), "64x2": (64, 2, 1), "128x1": (128, 1, 1), "64x16g8": (64, 16, 8)}
"""name: (members N, prompts per iteration B, prompt groups G); N·B/G = 128 completions per iteration each."""
SHAPINGS = {"zscore": "z-score", "per_prompt": "per-prompt z", "per_prompt_centered": "centred"}
"""--reward-shaping: its name in the table."""
VARIANTS = {"": [], "antithetic": ["--strategy", "antithetic"], "sigma3e-3": ["--sigma", "3e-3"],
            "auto": ["--sigma", "auto"], **{f"step{k}x": ["--alpha", f"{k * ALPHA:.6g}"] for k in (2, 4)},
            "sampled": ["--rollout-temperature", "1.0"], "sampled0.5": ["--rollout-temperature", "0.5"],
            "alpha_cosine": ["--alpha-schedule", "cosine"],
            **{f"candidates{k}": ["--prompt-candidates", str(k)] for k in (4, 8)},
            "extremes8": ["--prompt-candidates", "8", "--prompt-choice", "extremes"]}
"""Stage (b): what a cell changes from stage (a)'s settings (a cell's third part, shape/shaping/variant; α stays the
matched one): mirrored pairs, a smaller σ, σ chosen by --sigma auto's ladder. step2x, step4x (after stage (c)): twice,
four times the matched α at the recipe's σ 1e-2 (the σ that --sigma auto picks on SmolLM2's three tasks); sampled,
sampled0.5: members sample at temperature 1 or 0.5 with common random numbers (--rollout-temperature; evaluations
stay greedy). alpha_cosine (stage f): α decays along a cosine to a tenth of itself at the last iteration
(--alpha-schedule cosine). candidates4, candidates8 (stage g): the batch is the P prompts of 4P or 8P candidates
that the unperturbed model scores lowest (--prompt-candidates; the candidates' greedy completions count in the
budget: 8 or 16 more per iteration at P = 2); extremes8: of 8P candidates, half the lowest-scored and half the
highest (--prompt-choice extremes)."""


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


def run_name(task: str, shape: str, shaping: str, variant: str, seed: int) -> str:
    """times-table runs keep stage (a)'s names; other tasks' are prefixed with the task."""
    prefix = "" if task == "times-table" else f"{task}-"
    return f"{prefix}{shape}-{shaping}{'-' + variant if variant else ''}-s{seed}"


def command(options, task: str, shape: str, shaping: str, variant: str, seed: int) -> list[str]:
    members, prompts, groups = SHAPES[shape]
    runs = options.runs
    return ["esft", "train", "--model", options.model, "--task", task, *TASKS[task], *RECIPE, "--iterations",
            str(options.iterations), "--eval-size",
            str(options.eval_size), "--population-size", str(members), "--batch-size", str(prompts),
            "--prompt-groups", str(groups), "--reward-shaping", shaping, "--step-rule", "sqrt_n", "--alpha", f"{ALPHA:.6g}",
            "--seed", str(seed), "--save-every", "0", "--logging", "none", "--no-progress", "--output-dir", str(runs),
            "--run-name", run_name(task, shape, shaping, variant, seed), *VARIANTS[variant]]


def update_ratios(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["es/update_ratio"] for row in rows if "es/update_ratio" in row]


def measure(options, task: str, shape: str, shaping: str, variant: str, seed: int) -> dict:
    run_dir = options.runs / run_name(task, shape, shaping, variant, seed)
    try:
        record = run(command(options, task, shape, shaping, variant, seed), run_dir)
    except SystemExit as failed:  # in a worker thread: said here, the other cells go on
        print(f"es_design: {run_dir.name} failed: {failed}", file=sys.stderr, flush=True)
        raise
    ratios = update_ratios(run_dir)
    sigma = yaml.safe_load((run_dir / "config.yaml").read_text())["sigma"]  # --sigma auto's choice
    result = {"task": task, "shape": shape, "shaping": shaping, "variant": variant, "sigma": sigma, "seed": seed,
              **record, "curve": curve(run_dir), "update_ratio": sum(ratios) / len(ratios)}
    if seed in options.extras_seeds:
        result["extras"] = extras(options, task, run_dir)
    return result


def extras(options, task: str, run_dir: Path) -> dict:
    """What the final model does beyond its greedy held-out accuracy (each kept in the run directory, reused):
    correct given the format (the right number among completions that give a number: labels bare, correct,
    wrong), pass@1 and pass@4 at temperature 1 (4 samples per held-out problem), per-token KL to the base model
    and the relative weight distance (on one sample per held-out problem), and the greedy held-out accuracy on the
    other tasks (what was forgotten, beside the base model's own)."""
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    labels = {label: last.get(f"eval/heldout/rewards/arithmetic_reward/labels/{label}", 0) for label in LABELS}
    numbered = labels["bare"] + labels["correct"] + labels["wrong"]
    other = {name: evaluation(run_dir, f"on-{name}", run_dir / "final", "--task", name, *TASKS[name], "--eval-size",
                              str(options.eval_size))["eval/heldout/accuracy"] for name in TASKS if name != task}
    return {"labels": labels, "correct_given_format": (labels["bare"] + labels["correct"]) / numbered if numbered else 0.0,
            "sampled": sampled(run_dir), "geometry": geometry(options, run_dir),
            "other_tasks": other, "other_tasks_base": {name: base_accuracy(options, name) for name in other}}


BASE_LOCK, IN_PROCESS_LOCK = threading.Lock(), threading.Lock()
"""Cells side by side ask for the same base evaluation: one evaluates it, the others read it. KL loads models in
this process, where transformers' loading is not thread-safe (its default dtype is process-wide): one at a time."""


def geometry(options, run_dir: Path) -> dict:
    """Per-token KL to the base model and relative weight distance of the run's final model (real_model.kl)."""
    with IN_PROCESS_LOCK:
        return kl(run_dir, options.model, 0, options.eval_size)


def base_accuracy(options, task: str) -> float:
    """The untrained model's greedy held-out accuracy on `task` (evaluated once, kept under --runs)."""
    out = options.runs / "base"
    out.mkdir(parents=True, exist_ok=True)
    with BASE_LOCK:
        return evaluation(out, task, Path(options.model), "--task", task, *TASKS[task], "--eval-size",
                          str(options.eval_size))["eval/heldout/accuracy"]


def design(r: dict) -> str:
    """A cell's design as the tables name it: N × P (groups), shaping, variant."""
    members, prompts, groups = SHAPES[r["shape"]]
    shape = f"{members} × {prompts}" + (f" ({groups} groups)" if groups > 1 else "")
    return f"{shape} | {SHAPINGS[r['shaping']]} | {r['variant'] or '—'}"


def table(results: list[dict], eval_size: int) -> str:
    """Per task, a row per run (accuracy at every evaluation); with more than one seed, then the mean gain over
    seeds of every design on every task."""
    marks = sorted({p["iteration"] for r in results for p in r["curve"] if p["iteration"]})
    lines = []
    for task in TASKS:
        runs = [r for r in results if r.get("task", "times-table") == task]
        if not runs:
            continue
        lines += [f"Held-out {task} accuracy (%, {eval_size} rows, greedy) by iteration (128 training completions "
                  "each, and the candidates' of --prompt-candidates: completions is the run's total), seed "
                  + ", ".join(sorted({str(r["seed"]) for r in runs})) + f"; --step-rule sqrt_n, α = {ALPHA:.4g}.", "",
                  "| N × P (groups) | shaping | variant | seed | σ | before | " + " | ".join(str(m) for m in marks)
                  + " | gain | completions | mean update ratio | training s | peak RSS MB |",
                  "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in marks) + " | --- | --- | --- | --- | --- |"]
        for r in runs:
            at = {p["iteration"]: 100 * p["accuracy"] for p in r["curve"]}
            lines.append(f"| {design(r)} | {r['seed']} | {r['sigma']:g} | {at[0]:.1f} | "
                         + " | ".join(f"{at.get(m, math.nan):.1f}" for m in marks)
                         + f" | {at[max(at)] - at[0]:+.1f} | {r['curve'][-1]['completions']:,} | {r['update_ratio']:.2e} | "
                         f"{r['curve'][-1]['seconds']:.0f} | {r['peak_rss_mb']:.0f} |")
        lines.append("")
    if len({r["seed"] for r in results}) > 1:
        lines += seed_means(results)
    if any("extras" in r for r in results):
        lines += extras_table([r for r in results if "extras" in r])
    loads = [load for r in results for load in (r["load_before"][0], r["load_after"][0])] or [math.nan]
    lines += [f"Load average (1 min) beside the runs: {min(loads):.2f}–{max(loads):.2f}. Training seconds exclude "
              "evaluations (budget/seconds)."]
    return "\n".join(lines) + "\n"


def extras_table(results: list[dict]) -> list[str]:
    """extras() of each run: beyond greedy accuracy after the last iteration, and the other tasks (base → after)."""
    lines = ["After the last iteration (extras): greedy held-out accuracy, correct given the format (of completions "
             "that give a number), pass@1 / pass@4 at temperature 1 (4 samples per problem), per-token KL to the base "
             "and relative weight distance (one sample per problem at temperature 1), greedy accuracy on the other "
             "tasks, untrained → trained (%):", "",
             "| task | N × P (groups) | shaping | variant | seed | accuracy | correct given format | pass@1 / pass@4 (T = 1) "
             "| KL per token | weight distance | other tasks |", "| --- " * 11 + "|"]
    for r in results:
        x = r["extras"]
        others = "; ".join(f"{name} {100 * x['other_tasks_base'][name]:.1f} → {100 * value:.1f}"
                           for name, value in x["other_tasks"].items())
        lines.append(f"| {r['task']} | {design(r)} | {r['seed']} | {100 * r['curve'][-1]['accuracy']:.1f} | "
                     f"{100 * x['correct_given_format']:.1f} | {100 * x['sampled']['pass@1']:.1f} / "
                     f"{100 * x['sampled']['pass@4']:.1f} | {x['geometry']['kl_per_token']:.4f} | "
                     f"{x['geometry']['relative_weight_distance']:.2e} | {others} |")
    return lines + [""]


def seed_means(results: list[dict]) -> list[str]:
    """Mean ± std (over seeds, ddof 0) of the final accuracy's gain over the untrained model, per design and task."""
    designs = list(dict.fromkeys(design(r) for r in results))
    tasks = [task for task in TASKS if any(r.get("task", "times-table") == task for r in results)]
    lines = ["Gain in held-out accuracy after the last iteration (points; mean ± std over seeds, seeds run):", "",
             "| N × P (groups) | shaping | variant | " + " | ".join(tasks) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in tasks) + " |"]
    for name in designs:
        cells = []
        for task in tasks:
            gains = [100 * (r["curve"][-1]["accuracy"] - r["curve"][0]["accuracy"]) for r in results
                     if design(r) == name and r.get("task", "times-table") == task]
            mean = sum(gains) / len(gains) if gains else math.nan
            spread = (sum((g - mean) ** 2 for g in gains) / len(gains)) ** 0.5 if gains else math.nan
            cells.append(f"{mean:+.1f} ± {spread:.1f} ({len(gains)})" if gains else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


GRPO_LEARNING_RATE = 1e-5
"""The learning rate real_model.py's sweep found best for GRPO on SmolLM2 times-table (90.5% at 1,024 completions)."""


def against_grpo(options, task: str, seed: int) -> dict:
    """Stage (d): GRPO (TRL's, lr 1e-5, --grpo-steps steps of 8 completions) and the default design (64 × 2, z-scored, √N step,
    σ by --sigma auto; --grpo-es-iterations iterations) on `task`, started together, one thread each, so both
    see the same load; each evaluated every 1/8 of its run. Returns both curves (accuracy over training seconds)."""
    named = "" if task == "times-table" else f"{task}-"  # times-table's run names as stage (d) first wrote them
    common = ["--model", options.model, "--task", task, *TASKS[task], "--eval-size",
              str(options.eval_size), "--seed", str(seed), "--save-every", "0", "--logging", "none", "--no-progress",
              "--output-dir", str(options.runs)]
    grpo = ["esft", "train", "--algorithm", "grpo", "--learning-rate", f"{GRPO_LEARNING_RATE:g}",
            "--no-gradient-checkpointing", "--iterations", str(options.grpo_steps), "--eval-every",
            str(max(1, options.grpo_steps // 8)), *common,
            "--run-name", f"{named}grpo-lr{GRPO_LEARNING_RATE:g}-s{seed}"]
    iterations = options.grpo_es_iterations
    es = [*command(options, task, "64x2", "zscore", "", seed), "--sigma", options.grpo_es_sigma]
    es[es.index("--iterations") + 1] = str(iterations)
    es[es.index("--eval-every") + 1] = str(max(1, iterations // 8))
    es[es.index("--run-name") + 1] = f"{named}default-i{iterations}-s{seed}"
    with ThreadPoolExecutor(max_workers=2) as pool:  # side by side: the same load on both
        done = {name: pool.submit(run, argv, options.runs / argv[argv.index("--run-name") + 1])
                for name, argv in (("grpo", grpo), ("es", es))}
        records = {name: future.result() for name, future in done.items()}
    dirs = {name: options.runs / argv[argv.index("--run-name") + 1] for name, argv in (("grpo", grpo), ("es", es))}
    return {"task": task, "seed": seed,
            **{name: {**records[name], "curve": curve(run_dir), "wrong_answers": wrong_answers(run_dir)}
               for name, run_dir in dirs.items()}}


def wrong_answers(run_dir: Path) -> dict:
    """The wrong held-out answers of a run's first and last evaluations (eval/iteration-N/heldout.jsonl): how many,
    and how many the token limit cut short; the rest ended on their own (on times-table, a wrong product stated)."""
    max_tokens = yaml.safe_load((run_dir / "config.yaml").read_text())["max_tokens"]
    evaluations = sorted((int(path.parent.name.removeprefix("iteration-")), path)
                         for path in (run_dir / "eval").glob("iteration-*/heldout.jsonl"))
    counts = {}
    for when, (iteration, path) in (("first", evaluations[0]), ("last", evaluations[-1])):
        wrong = [row for row in map(json.loads, path.read_text().splitlines()) if not row["reward"]]
        counts[when] = {"iteration": iteration, "wrong": len(wrong),
                        "cut_short": sum(row["num_tokens"] >= max_tokens for row in wrong)}
    return counts


def at_seconds(points: list[dict], seconds: float) -> dict:
    """The last evaluation at or before `seconds` of training."""
    return [p for p in points if p["seconds"] <= seconds * 1.0001][-1]


def against_grpo_table(pairs: list[dict]) -> str:
    lines = ["Held-out accuracy (%, greedy) over training seconds, GRPO and ES side by side (one thread each, "
             "started together):", "",
             "| task | seed | GRPO: accuracy at its end (completions, training s) | "
             "ES at GRPO's training s (completions, s) | ES at 3× GRPO's training s (completions, s) | "
             "ES at its end (completions, s) |", "| --- " * 6 + "|"]
    for pair in pairs:
        grpo, es = pair["grpo"]["curve"], pair["es"]["curve"]
        end = grpo[-1]

        def cell(point):
            return f"{100 * point['accuracy']:.1f} ({point['completions']:,}, {point['seconds']:.0f})"

        tripled = (cell(at_seconds(es, 3 * end["seconds"])) if es[-1]["seconds"] >= 0.95 * 3 * end["seconds"]
                   else f"— (ES ended at {es[-1]['seconds']:.0f} s)")  # not run that long: no number to give
        lines.append(f"| {pair['task']} | {pair['seed']} | {cell(end)} | {cell(at_seconds(es, end['seconds']))} | "
                     f"{tripled} | {cell(es[-1])} |")
    lines += ["", "Curves (accuracy % at training seconds):", ""]
    for pair in pairs:
        for name in ("grpo", "es"):
            lines.append(f"- {pair['task']}, seed {pair['seed']}, {name}: " + ", ".join(
                f"{100 * p['accuracy']:.1f} @ {p['seconds']:.0f} s" for p in pair[name]["curve"]))
    lines += ["", "Wrong held-out answers, before and at the end (of them cut short by the token limit; the rest "
              "ended on their own):", ""]
    for pair in pairs:
        for name in ("grpo", "es"):
            if "wrong_answers" in pair[name]:  # recorded since stage (e)
                lines.append(f"- {pair['task']}, seed {pair['seed']}, {name}: " + ", ".join(
                    f"{w['wrong']} at iteration {w['iteration']} ({w['cut_short']} cut short)"
                    for w in pair[name]["wrong_answers"].values()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the SmolLM2 folder (esft prepare-model smollm2-135m-instruct)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, each cell run at every one")
    parser.add_argument("--tasks", default="times-table", help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--iterations", type=int, default=12, help="ES iterations of 128 completions per cell")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out rows (evaluated every 4 iterations)")
    parser.add_argument("--cells", default=None, help="shape/shaping,... (default: the whole grid)")
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--extras-seeds", default="", help="comma-separated seeds whose runs also get extras(): "
                        "correct given the format, pass@k at temperature 1, KL to the base, accuracy on the other tasks")
    parser.add_argument("--against-grpo", action="store_true", help="stage (d): GRPO and the default design side by "
                        "side on each of --tasks, per seed (writes <runs>/against_grpo.md)")
    parser.add_argument("--grpo-steps", type=int, default=128, help="with --against-grpo: GRPO's steps (8 completions "
                        "each: 1,024 completions, where it reached 90.5%% on times-table)")
    parser.add_argument("--grpo-es-sigma", default="auto", help="with --against-grpo: the default design's σ (auto, "
                        "the default's, or a number)")
    parser.add_argument("--grpo-es-iterations", type=int, default=96,
                        help="with --against-grpo: the default design's iterations (96: about 3x GRPO's seconds here)")
    parser.add_argument("--order", choices=("seed", "cell"), default="seed",
                        help="seed: every cell at a seed before the next seed; cell: a cell at every seed before the next")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/es_design"))
    parser.add_argument("--out", type=Path, default=HERE / "es_design", help="<out>.json: every number")
    options = parser.parse_args()
    options.extras_seeds = {int(seed) for seed in options.extras_seeds.split(",") if seed}
    command_line = "python benchmarks/es_design.py " + " ".join(sys.argv[1:])
    options.runs.mkdir(parents=True, exist_ok=True)
    tasks = options.tasks.split(",")
    if unknown := [task for task in tasks if task not in TASKS]:
        sys.exit(f"unknown tasks {unknown}; of {', '.join(TASKS)}")
    seeds = [int(seed) for seed in options.seeds.split(",")]
    if options.against_grpo:  # stage (d), seed after seed
        pairs = []
        for task, seed in [(task, seed) for seed in seeds for task in tasks]:
            pairs.append(against_grpo(options, task, seed))
            options.out.with_suffix(".json").write_text(json.dumps({"command": command_line, "pairs": pairs}, indent=1))
            (options.runs / "against_grpo.md").write_text(f"Command: `{command_line}`\n\n" + against_grpo_table(pairs))
        print((options.runs / "against_grpo.md").read_text(), flush=True)
        return
    if options.order == "seed":  # seed by seed, task by task: a run stopped early has every cell's first seeds
        todo = [(task, *cell, seed) for seed in seeds for task in tasks for cell in cells(options.cells)]
    else:  # cell by cell: the first cell's seeds on every task, then the next cell's
        todo = [(task, *cell, seed) for cell in cells(options.cells) for seed in seeds for task in tasks]
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
