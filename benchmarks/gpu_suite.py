"""The GPU table in one command (issue 23): esft's ES paths against the paper's loop and against plain
batched generation, on a model of Qwen2-0.5B's shape in bfloat16, then the demo end to end.

For each prompts-per-iteration setting (default 32 and 200), population N = 30, up to 64 new tokens
(natural lengths: EOS ends a completion; a model with random weights rarely emits it, so almost every
completion is 64 tokens), rounds alternating the paths, each path on its own copy of the model:
  reference   the paper's loop (benchmarks/vs_reference.py: in-place perturbation, one HF `generate`
              over the iteration's prompts per member, subtract, then the update)
  sequential  esft, one member at a time (--no-population-batching, i.i.d. full-rank noise)
  default     esft's defaults: i.i.d. full-rank noise, population batching auto (each member's own
              weights, several members per call; `auto` falls back to one member at a time where the
              batched forward disagrees with the sequential one, which the table says)
  preset      low-rank noise rank 1, population batching (the demo preset)
  limit       plain batched greedy generation of the same N × prompts rows by esft's decoder, no
              perturbation: no exact ES path can beat it
Round 0 warms up and is not counted (the batched paths at the full population, whose call shapes depend
on it; the one-member-at-a-time paths with 2 members). Seconds per iteration are wall seconds
(synchronised); each ratio is the median over rounds of the same round's (reference / path) or
(limit / path), printed with its spread (min–max) and refused ("noisy: rerun") beyond ±10%. Rows per call are esft's `--mini-batch-size auto` (from free GPU
memory); peak GPU memory is torch's max_memory_allocated during the path's iterations (all copies
of the model stay resident, so it includes the other paths' weights: read the differences).
Then `esft train --dtype bfloat16 --device cuda` (the demo: embedded model, its preset) runs as a
subprocess and its wall time and accuracies are recorded.

Writes OUT/gpu_suite.json and OUT/gpu_suite.md (the table for docs/benchmarks.md) after every timed round,
so a run cut short (a device lease ending, a time limit) keeps the rounds it finished and its table says so.

    python benchmarks/gpu_suite.py --out /tmp/gpu                  # one H100: about 14 minutes (--budget-minutes)
    python benchmarks/gpu_suite.py --prompts 32 --paths reference,default,preset,limit --no-demo --out /tmp/gpu
    python benchmarks/gpu_suite.py --device cpu --model embedded --prompts 4 --population 4 --max-tokens 8 \\
        --rounds 2 --no-demo --out /tmp/gpu-smoke                   # the same code on a CPU, in seconds

The one-member-at-a-time paths take most of the time: the paper's loop ran 41-48 s per iteration on one H100 and
67-75 s on two others (launch-bound: it follows the host's CPU), esft's sequential path 59-61 s on the last, the
batched paths 2-9 s (docs/benchmarks.md). So the whole default run would take well over 15 minutes; instead it
keeps to --budget-minutes (default 14): each prompt size gets an equal share of the time left, and a timed round
that would end after its share is not started, which the table says ("only k of 3 timed rounds: the next would have
ended after ..."). On the H100s seen so far that leaves about 2 timed rounds per size with all five paths; leave out
reference and sequential (--paths default,preset,limit) for more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import format_ratio, load_average, ratio_summary  # noqa: E402
from vs_reference import PATHS, build_runners, refuse_unknown_paths  # noqa: E402

from esft.files import write_text_atomic  # noqa: E402

DEMO_RESERVE_S = 90  # the demo's share of --budget-minutes: it took 57 s on an H100 (docs/benchmarks.md)


def rows_per_call(name: str, runner, prompts: list[str], population: int) -> str:
    """What --mini-batch-size auto chose for this path, said as rows (and members) per generate call."""
    if name == "reference":
        return f"{len(prompts)} (one HF generate per member)"
    engine = runner.engine
    length = engine._encode(prompts)["input_ids"].shape[1]
    if name == "limit":
        return str(engine.prompts_per_call(len(prompts) * population, 1, "auto", length))
    if not runner.executor.population_batching:
        return f"{engine.prompts_per_call(len(prompts), 1, None, length)} (one member at a time)"
    from esft.engines.population import members_per_call

    members = members_per_call(engine, population, prompts)
    per_call = engine.prompts_per_call(len(prompts), members, None, length)
    return f"{members * per_call} ({members} members × {per_call} prompts)"


def measure(args, size: int, task, after_round=None, deadline: float | None = None) -> dict:
    """Every path's rounds at `size` prompts; `after_round` gets the result so far after each timed round (so a
    run cut short, by a device lease say, keeps the rounds it finished). With a `deadline` (a perf_counter
    time), a timed round starts only if a round as long as the last one ends before it; the warm-up and the
    first timed round always run."""
    import torch

    from esft.es.strategies.base import ESState
    from esft.es.strategies.paper import STRATEGY as PAPER
    from esft.es.batches import prompt_batch

    runners, described = build_runners(args, args.paths)
    cuda = args.device.startswith("cuda")
    seconds: dict[str, list[float]] = {name: [] for name in args.paths}
    peak: dict[str, int] = {name: 0 for name in args.paths}
    rows = {}
    last_round, stopped_by_budget = 0.0, False
    for round_ in range(args.rounds + 1):  # round 0 warms up every path (kernels, allocator), not counted
        if round_ > 1 and deadline is not None and time.perf_counter() + last_round > deadline:
            stopped_by_budget = True
            print(f"  {size} prompts: round {round_} not started: at {last_round:.1f} s a round, it would end after "
                  f"this size's share of --budget-minutes", file=sys.stderr, flush=True)
            break
        round_started = time.perf_counter()
        batch = prompt_batch(task.train_dataset, 0, size, round_)
        for name in args.paths:
            runner = runners[name]
            # The batched paths warm up at the full population (their call shapes depend on N); the
            # one-member-at-a-time paths see the same shapes with 2 members, at a fifteenth of the cost.
            warm_members = 2 if name in ("reference", "sequential") else args.population
            seeds = PAPER.ask(ESState(0, round_), args.population if round_ else warm_members)
            if name not in rows:
                rows[name] = rows_per_call(name, runner, list(batch.prompts), args.population)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            if name == "reference":
                from esft.tasks.countdown import countdown_reward

                runner.iteration(seeds, batch.prompts, batch.rows, countdown_reward)
            else:
                runner.iteration(seeds, batch)
            if cuda:
                torch.cuda.synchronize()
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
            elapsed = time.perf_counter() - started
            if round_:
                seconds[name].append(elapsed)
            print(f"  {size} prompts, round {round_}: {name} {elapsed:.2f} s", file=sys.stderr, flush=True)
        last_round = time.perf_counter() - round_started
        print(f"  {size} prompts: round {round_}/{args.rounds} "
              f"{'(warm-up) ' if not round_ else ''}done, {load_average()}", file=sys.stderr, flush=True)
        if round_ and after_round is not None:
            after_round(summarise(args, size, described, seconds, peak, rows, runners))
    result = summarise(args, size, described, seconds, peak, rows, runners)
    result["stopped_by_budget"] = stopped_by_budget
    del runners
    if cuda:
        torch.cuda.empty_cache()
    return result


def summarise(args, size: int, described: str, seconds: dict, peak: dict, rows: dict, runners: dict) -> dict:
    """The result of the timed rounds so far: seconds, ratios round by round, rows per call, peak memory."""
    batched = {name: getattr(getattr(runners[name], "executor", None), "population_batching", None) for name in args.paths}
    result = {"prompts": size, "model": described, "rounds_timed": len(seconds[args.paths[0]]),
              "seconds": {name: list(times) for name, times in seconds.items()}, "peak_bytes": dict(peak),
              "rows_per_call": dict(rows), "population_batching": batched, "vs_reference": {}, "of_limit": {}}
    for name in args.paths:
        if "reference" in seconds and name != "reference":
            result["vs_reference"][name] = ratio_summary([r / p for r, p in zip(seconds["reference"], seconds[name])])
        if "limit" in seconds and name not in ("limit", "reference"):
            result["of_limit"][name] = ratio_summary([lim / p for lim, p in zip(seconds["limit"], seconds[name])])
    return result


def run_demo(args) -> dict:
    """The demo end to end (`esft train` on the embedded model, its preset) in bf16 on the device."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="esft-gpu-demo-") as out:  # only its printed figures are kept
        command = [sys.executable, "-m", "esft.cli", "train", "--dtype", args.dtype, "--device", args.device,
                   "--output-dir", out, "--run-name", "demo", "--no-progress"]
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
    found = re.search(r"accuracy: ([\d.]+)% \(before training ([\d.]+)%", proc.stdout)
    return {"command": "esft train --dtype " + args.dtype + " --device " + args.device, "exit": proc.returncode,
            "wall_seconds": wall, "accuracy_after": float(found.group(1)) if found else None,
            "accuracy_before": float(found.group(2)) if found else None,
            "tail": (proc.stdout + proc.stderr)[-1500:]}


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [f"GPU table, {machine['date']}, commit {machine['commit']}, {machine['gpu']}, torch {machine['torch']}, "
             f"{report['args']['dtype']}; `{report['command']}`", ""]
    for result in report["results"]:
        why = (f"the next would have ended after this size's share of --budget-minutes {report['args']['budget_minutes']:g}"
               if result.get("stopped_by_budget") else "the run stopped before the others")
        cut = (f" **only {result['rounds_timed']} of {report['args']['rounds']} timed rounds: {why}**"
               if result["rounds_timed"] < report["args"]["rounds"] else "")
        lines += [f"**{result['prompts']} prompts per iteration**, N = {report['args']['population']}, up to "
                  f"{report['args']['max_tokens']} new tokens; {result['model']}{cut}", "",
                  "| path | s / iteration (median, min–max) | reference / path | limit / path (fraction of the limit) "
                  "| rows per call | peak GPU memory |", "| --- | --- | --- | --- | --- | --- |"]
        for name, values in result["seconds"].items():
            label = name
            if result["population_batching"].get(name) is False and name == "default":
                label += " (auto chose one member at a time)"
            vs_ref = format_ratio(result["vs_reference"][name]) if name in result["vs_reference"] else "—"
            of_limit = format_ratio(result["of_limit"][name], percent=True) if name in result["of_limit"] else "—"
            lines.append(f"| {label} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) | {vs_ref} "
                         f"| {of_limit} | {result['rows_per_call'][name]} | {result['peak_bytes'][name] / 2**30:.1f} GiB |")
        lines.append("")
    demo = report.get("demo")
    if demo:
        accuracy = (f"{demo['accuracy_before']}% → {demo['accuracy_after']}%" if demo["accuracy_after"] is not None
                    else "no accuracy line (see the JSON's tail)")
        lines += [f"Demo end to end: `{demo['command']}`: exit {demo['exit']}, {demo['wall_seconds']:.0f} s wall, "
                  f"held-out accuracy {accuracy}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2-0.5b", help="qwen2-0.5b (default), 30m, embedded or a model directory")
    parser.add_argument("--prompts", default="32,200", help="prompts per iteration, comma-separated")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mini-batch", default="auto", help=argparse.SUPPRESS)  # vs_reference's EsftPath reads it
    parser.add_argument("--demo", action=argparse.BooleanOptionalAction, default=True, help="also run the demo end to end")
    parser.add_argument("--out", default=".", help="directory for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse, where .git is)")
    parser.add_argument("--budget-minutes", type=float, default=14.0,
                        help="wall time for the whole run (default 14: one 15-minute GPU lease less its start): each "
                             "prompt size gets an equal share of what is left (less %d s for the demo), and a round "
                             "that would end after it is not started (each size keeps its warm-up and one timed "
                             "round); 0: no limit" % DEMO_RESERVE_S)
    args = parser.parse_args()
    args.paths = [p for p in args.paths.split(",") if p]
    refuse_unknown_paths(parser, args.paths)
    if args.budget_minutes < 0:
        parser.error(f"--budget-minutes {args.budget_minutes:g}: give minutes for the whole run, or 0 for no limit")

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.exit(2, "gpu_suite: no CUDA device here; run it on a GPU machine, or --device cpu for a smoke test\n")
    from esft.tasks.countdown_task import make_countdown_task

    started = time.perf_counter()
    task = make_countdown_task(seed=0, difficulty="easy")
    commit = args.commit or subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()
    report = {"command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:]), "args": vars(args), "results": [],
              "machine": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit or "unknown",
                          "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU",
                          "torch": torch.__version__}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(results: list[dict]) -> None:  # after every timed round and step: a run cut short keeps its rounds
        report["machine"]["load"] = load_average()
        write_text_atomic(out / "gpu_suite.json", json.dumps({**report, "results": results}, indent=1, default=float))
        write_text_atomic(out / "gpu_suite.md", markdown({**report, "results": results}))

    sizes = [int(s) for s in args.prompts.split(",")]
    for index, size in enumerate(sizes):
        deadline = None
        if args.budget_minutes > 0:  # an equal share of what is left, so the first size cannot take the others' time
            now = time.perf_counter()
            left = started + args.budget_minutes * 60 - (DEMO_RESERVE_S if args.demo else 0) - now
            deadline = now + left / (len(sizes) - index)
        report["results"].append(measure(args, size, task, lambda partial: write([*report["results"], partial]),
                                         deadline))
        write(report["results"])
    if args.demo:
        report["demo"] = run_demo(args)
    report["total_seconds"] = time.perf_counter() - started
    write(report["results"])
    print("\n" + markdown(report))
    print(f"total {report['total_seconds']:.0f} s (budget {args.budget_minutes:g} min); wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'}")


if __name__ == "__main__":
    main()
