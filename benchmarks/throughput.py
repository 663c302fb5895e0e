"""ES throughput against its physical limit, side by side in one run (issue 5).

On ONE transformers engine (same model, prompts and token counts) it measures, per round:
  1. limit: unperturbed batched greedy generation of all population × batch prompts (tokens/s);
  2. one ES iteration's evaluation phase (noise, perturb, generate, restore for every member);
  3. the full iteration (2 + reward scoring + fitness shaping + update);
for each requested path:
  seq-iid          one member at a time, i.i.d. full-rank Gaussian noise (the paper's scheme, fixed)
  seq-lowrank      one member at a time, low-rank noise (weights = master + σ·A·Bᵀ/√r)
  batched-lowrank  --population-batching: all members in one generate call, low-rank forward hooks
  PATH+overlap     the sequential PATH scoring member i while member i+1 generates (only the full
                   iteration, 3, is meaningful then; the others wait for each member's scores)
and prints the ratio 2/1 and 3/1 and a time breakdown (noise, perturb, generate, restore, reward,
update), on two clocks (wall, and this process's CPU time: with --threads 1 the latter is much
less disturbed by other jobs on a shared machine), then peak resident memory (RSS sampled every
2 ms) of the limit and of each path, each in a fresh process, against weights + float32 master +
KV cache. --profile ROWS adds torch.profiler tables; --reward-cost-ms simulates an expensive
sandboxed reward (for the +overlap paths).

Generation is esft's greedy decoder (esft.engines.decoding) everywhere, the limit included.
Completion lengths are forced equal on every side (benchmark-only: min_new_tokens = max_new_tokens,
so EOS never ends a row early): tokens = population × batch × max_tokens everywhere; with
--natural-lengths EOS ends completions as in training. Every measurement repeats the same work (the
same prompts, iteration 0's member seeds, the weights reset after each update, untimed). Rounds
alternate the measurements, --repeats times each inside a round, so a slow spell hits all of them
alike; a round's figure is its repeats' tokens over their seconds; the limit is the rows-per-call
setting with the best median; a ratio is the median over rounds of (path / the same round's limit),
printed with its spread (min–max), the load average and the host's steal (throughput_tools.load_average),
and "noisy: rerun" instead of a ratio when a round strays beyond ±10% (no best-round figure: it cannot be
reproduced). Each round runs in a fresh process after one untimed pass of every side, so the spread holds
what differs between processes, as between two runs (--no-round-processes: every round in this process).
Timing runs with glibc's malloc set as `esft train` sets it (esft.allocator; --default-allocator to skip), the
memory probes with the defaults. Before 2026-11-25 the "batched-lowrank" path silently timed full-rank
batching (the engine kept the population hooks of the noise it was built with): figures of
2026-11-23/24 (git history of benchmarks/RESULTS.md) are of that path.

    python benchmarks/throughput.py --threads 1 --natural-lengths --limit-rows 240,960 --memory ""      # 5 rounds
    python benchmarks/throughput.py --model 30m --threads 1 --batch 16 --max-tokens 32 \
        --limit-rows 240 --paths seq-iid,batched-lowrank --memory ""
(the runs recorded in docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_memory import memory_probe, memory_report  # noqa: E402
from throughput_tools import (MB, Instrumented, RSSSampler, Timings, build_model, format_ratio, kv_cache_bytes,  # noqa: E402
                              cpu_description, load_average, now, ratio_summary, round_in_fresh_process,
                              scratch_directory)
from esft.allocator import steady_allocator  # noqa: E402  (what esft train sets: the same process conditions)

# --------------------------------------------------------------------- setup
PHASES = ("noise", "perturb", "generate", "restore", "reward", "update", "other")


class Bench:
    """Model, engine, executor, prompts and the path switch: everything a measurement needs."""

    def __init__(self, args, sampler: RSSSampler):
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from transformers import LlamaForCausalLM  # noqa: F401  (import cost belongs to the libraries)

        import esft.engines.transformers_engine as te
        from esft.executors import LocalExecutor
        from esft.rewards.runner import RewardRunner
        from esft.tasks.countdown_task import make_countdown_task
        from esft.es.batches import prompt_batch

        self.args = args
        self.rss_libraries = sampler.rss()
        model, tokenizer, self.description = build_model(args.model, scratch_directory("esft-bench-"))
        self.model = model
        self.engine = engine = te.TransformersEngine(model, tokenizer, noise="iid", max_tokens=args.max_tokens)
        if not args.natural_lengths:
            engine.min_new_tokens = args.max_tokens  # benchmark only: every completion is max_tokens long
        task = make_countdown_task(seed=0, difficulty="easy")
        if args.reward_cost_ms:  # an expensive user reward: sandboxed, burning CPU in its worker process
            os.environ["ESFT_BENCH_REWARD_COST_MS"] = str(args.reward_cost_ms)
            self.rewards = RewardRunner([slow_countdown_reward], sandbox=True, workers=1)
        else:
            self.rewards = RewardRunner(task.reward_funcs, task.reward_weights, sandbox=False)
        self.batch = prompt_batch(task.train_dataset, 0, args.batch, 0)
        self.rows, self.prompts = self.batch.rows, self.batch.prompts
        self.all_prompts = self.prompts * args.population  # member-major, as the batched path lays out its rows
        self.seq_size = args.seq_mini_batch_size or args.batch
        self.batched_size = args.batched_mini_batch_size or engine.prompts_per_call(args.batch, args.population, "auto")
        self.prompt_length = engine._encode(self.prompts)["input_ids"].shape[1]
        engine._encode(self.all_prompts)  # tokenize outside the timed region, as the ES paths do once per iteration
        self.tokens = args.population * args.batch * args.max_tokens
        params = list({id(p): p for p in model.parameters()}.values())
        self.weights_bytes = sum(p.numel() * p.element_size() for p in params)
        self.master_bytes = sum(m.numel() * m.element_size() for m in engine.master.values())
        self.n_params = sum(p.numel() for p in params)
        engine.generate(self.prompts[:1])  # warm-up (lazy kernels, thread pools)
        self.rewards.score(self.rows, [""] * len(self.rows))  # warm-up (sandbox workers start)
        self.rss_ready = sampler.rss()
        self.executor = LocalExecutor(engine, self.rewards.score)
        self.timings = Timings()
        self.instrumented = Instrumented(engine, self.executor, self.timings)
        self.initial_weights = engine.master_state()  # every round starts from these (the same workload)

    def rows_per_call(self, label: str) -> int:
        if label.startswith("limit@"):
            return int(label.split("@")[1])
        return self.args.population * self.batched_size if label.startswith("batched") else self.seq_size

    def kv_bytes(self, rows: int) -> int:
        return kv_cache_bytes(self.model, rows, self.prompt_length + self.args.max_tokens)

    def configure(self, path: str) -> None:
        engine, executor = self.engine, self.executor
        self.instrumented.bind(path)
        engine.noise = path.split("-")[1].split("+")[0]
        # the engine chose its population hooks from the noise it was built with (iid: each member's own
        # weights): follow the switch, else "batched-lowrank" would time full-rank batching
        from esft.engines.fullrank_population import FullRankPopulation
        from esft.engines.population import LowRankPopulation, _population_class

        if engine.noise == "lowrank":
            vars(engine).pop("population_class", None)
        else:
            engine.population_class = FullRankPopulation
        assert (_population_class(engine) is LowRankPopulation) == (engine.noise == "lowrank"), path
        engine.rank = self.args.rank
        executor.population_batching = path.startswith("batched")
        # scoring waits for each member (clean attribution) unless the path says "+overlap"
        executor.overlap_rewards = path.endswith("+overlap")
        engine.mini_batch_size = self.batched_size if executor.population_batching else self.seq_size
        if executor.population_batching:
            from esft.engines.population import check_population_batching

            check_population_batching(engine)  # once per engine, as the factory does before training

    def limit(self, rows_per_call: int) -> dict:
        started = now()
        generation = self.engine.generate(self.all_prompts, mini_batch_size=rows_per_call)
        ended = now()
        count = sum(generation.num_tokens)
        assert self.args.natural_lengths or count == self.tokens, (count, self.tokens)
        return {"wall": ended[0] - started[0], "cpu": ended[1] - started[1], "tokens": count}

    def iteration(self, path: str, iteration: int) -> dict:
        import numpy as np

        from esft.es.strategies.base import ESState
        from esft.es.strategies.paper import STRATEGY as PAPER

        self.configure(path)
        self.timings.clear()
        state = ESState(0, iteration)
        started = now()
        seeds = PAPER.ask(state, self.args.population)
        members = self.executor.evaluate_population(seeds, self.batch, self.args.sigma)
        evaluated = now()
        _, coefficients = PAPER.tell(state, [m.reward for m in members], self.args.sigma / 2)
        self.executor.update(seeds, coefficients)
        finished = now()
        self.engine.load_master_state(self.initial_weights)  # untimed: the next round measures the same work
        count = sum(m.num_tokens for m in members)
        assert self.args.natural_lengths or count == self.tokens, (count, self.tokens)
        record = {"mean_reward": float(np.mean([m.reward for m in members])), "tokens": count}
        for clock, name, book in ((0, "wall", self.timings.wall), (1, "cpu", self.timings.cpu)):
            breakdown = {k: book.get(k, 0.0) for k in PHASES[:-1]}
            total = finished[clock] - started[clock]
            breakdown["other"] = total - sum(breakdown.values())  # decoding, shaping, bookkeeping
            record[name] = {"evaluation": evaluated[clock] - started[clock] - breakdown["reward"],
                            "iteration": total, "breakdown": breakdown}
        return record


def summed(records: list[dict]) -> dict:
    """Repeated measurements of one side as one: numbers added up, nested records field by field."""
    first = records[0]
    if isinstance(first, dict):
        return {key: first[key] if key == "mean_reward" else summed([record[key] for record in records]) for key in first}
    return sum(records) if isinstance(first, (int, float)) else first


# --------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, 30m, or a model directory")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seq-mini-batch-size", type=int, default=None,
                        help="prompts per generate call of the sequential paths (default: the whole batch)")
    parser.add_argument("--batched-mini-batch-size", type=int, default=None,
                        help="prompts per generate call of the batched path, × population rows (default: --mini-batch-size auto)")
    parser.add_argument("--limit-rows", default=None,
                        help="comma-separated rows per generate call for the limit; the best is the limit "
                             "(default: the rows per call of the sequential and of the batched path)")
    parser.add_argument("--paths", default="seq-iid,seq-lowrank,batched-lowrank")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--reward-cost-ms", type=float, default=0.0,
                        help="simulate an expensive user reward: sandboxed, burning this many ms of CPU per member")
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements of each side per round, alternating; a round's figure sums them (a "
                             "single ~4 s measurement varies by ±8%% on this machine, so one per round is noisy)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (ratios: medians over them); 0: only the memory measurements")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--memory", default="limit,seq-iid,batched-lowrank",
                        help="what to measure memory of, each in a fresh process ('limit' = at the batched path's "
                             "rows per call); empty: skip")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--natural-lengths", action="store_true",
                        help="let completions end at EOS (realistic seconds per iteration; token counts then "
                             "differ slightly between paths, and tokens/s are each path's own)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after the rounds, profile (torch.profiler) the limit at ROWS rows per call and one "
                             "iteration of each path; print the top operators by self CPU time")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default malloc thresholds (noisier: see esft.allocator)")
    parser.add_argument("--round-processes", action=argparse.BooleanOptionalAction, default=True,
                        help="each round in a fresh process after one untimed pass of every side (default), so the "
                             "spread includes what differs between processes; --no-round-processes: all in this one")
    parser.add_argument("--one-round-json", default=None, help=argparse.SUPPRESS)  # set for the per-round processes
    args = parser.parse_args()
    if args.memory_probe:  # one measurement in this fresh process, for memory_report
        memory_probe(lambda sampler: Bench(args, sampler), args.memory_probe)
        return

    if args.rounds == 0:  # memory only
        batched_size = args.batched_mini_batch_size or args.batch
        memory_report(__file__, [f"limit@{args.population * batched_size}" if m == "limit" else m
                                 for m in args.memory.split(",") if m])
        return
    allocator = "allocator: the system's defaults (--default-allocator)" if args.default_allocator else steady_allocator()
    sampler = RSSSampler()
    import torch

    bench = Bench(args, sampler)
    sampler.stop()  # its thread would share the timed process's CPU clock and GIL (memory is probed apart)
    paths = []
    for path in (p for p in args.paths.split(",") if p):
        if "lowrank" in path and not _has_lowrank():
            print(f"skipping {path}: this esft has no lowrank noise", file=sys.stderr)
            continue
        paths.append(path)
    limit_rows = sorted({int(r) for r in args.limit_rows.split(",")} if args.limit_rows
                        else {bench.seq_size, args.population * bench.batched_size})
    tokens = bench.tokens
    results: dict[str, list[dict]] = defaultdict(list)
    if args.one_round_json:  # a per-round process: one untimed pass first (a new process's one-off costs)
        for count in limit_rows:
            bench.limit(count)
        for path in paths:
            bench.iteration(path, 0)
    for round_index in range(args.rounds):
        if args.round_processes:
            one = round_in_fresh_process(__file__, round_index, [])
            for label, records in one["results"].items():
                results[label] += records
            print(f"round {round_index + 1}/{args.rounds} done in process {one['pid']} (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr)
            continue
        samples = defaultdict(list)
        for _ in range(args.repeats):  # alternating inside the round too: a slow spell hits every side alike
            for count in limit_rows:  # 1. the limit, at every rows-per-call setting
                samples[f"limit@{count}"].append(bench.limit(count))
            for path in paths:  # 2 + 3. one ES iteration per path
                samples[path].append(bench.iteration(path, 0))  # the same seeds and weights every time
        for label, records in samples.items():  # a round's figure: its repeats' tokens over their seconds
            results[label].append(summed(records))
        print(f"round {round_index + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    sampler.stop()
    if args.one_round_json:
        Path(args.one_round_json).write_text(json.dumps({"results": dict(results), "pid": os.getpid()}))
        return
    if args.profile:
        profile(bench, paths)

    # ---------------------------------------------------------------- report
    median = statistics.median
    print(f"\nmodel: {bench.description}: {bench.n_params / 1e6:.2f}M parameters, {bench.weights_bytes / MB:.1f} MiB weights")
    lengths = "natural lengths (EOS ends a completion)" if args.natural_lengths else "lengths forced equal"
    print(f"population {args.population} × batch {args.batch} × {args.max_tokens} tokens = "
          f"{'up to ' if args.natural_lengths else ''}{tokens} tokens per iteration ({lengths}); prompts {bench.prompt_length} tokens (padded); rows per generate call: "
          f"sequential {bench.seq_size}, batched {args.population * bench.batched_size}; torch threads "
          f"{torch.get_num_threads()}; rank {args.rank}; {args.rounds} rounds, medians; {allocator}")
    summary = {"args": vars(args), "tokens": tokens, "limit": {}, "paths": {}, "rounds": dict(results)}
    best = {}
    print("\n1. limit: unperturbed batched greedy generation of all population × batch prompts")
    for clock in ("wall", "cpu"):
        for count in limit_rows:
            summary["limit"].setdefault(clock, {})[count] = median([r["tokens"] / r[clock] for r in results[f"limit@{count}"]])
        best[clock] = max(summary["limit"][clock], key=summary["limit"][clock].get)
    for count in limit_rows:
        print(f"   {count:>5} rows per call: {summary['limit']['wall'][count]:>8,.0f} tokens/s wall, "
              f"{summary['limit']['cpu'][count]:>8,.0f} tokens per CPU-second")
    print(f"   limit = best: {summary['limit']['wall'][best['wall']]:,.0f} tokens/s wall ({best['wall']} rows), "
          f"{summary['limit']['cpu'][best['cpu']]:,.0f} per CPU-s ({best['cpu']} rows)")

    def round_limit(clock, round_index):  # the best setting by its median, this round's sample of it (the
        # best of several noisy samples per round would bias every ratio low)
        measured = results[f"limit@{best[clock]}"][round_index]
        return measured["tokens"] / measured[clock]

    for clock in ("cpu", "wall"):
        print(f"\n2/3. ES iteration, {clock} clock: tokens/s of the evaluation phase (2) and the full iteration (3); "
              f"ratios: median over rounds of (path / the same round's limit) with min–max, 'noisy: rerun' beyond "
              f"±10%; seconds per iteration and their breakdown: the median round's, over its {args.repeats} repeats; "
              f"{load_average()}")
        print(f"{'path':<16} {'eval tok/s':>10} {'2/1 (median, min–max)':>40} {'iter s':>7} {'3/1 (median, min–max)':>40}  "
              + "".join(f"{k:>9}" for k in PHASES))
        for path in paths:
            rounds = results[path]
            ratio2 = ratio_summary([r["tokens"] / r[clock]["evaluation"] / round_limit(clock, i) for i, r in enumerate(rounds)])
            ratio3 = ratio_summary([r["tokens"] / r[clock]["iteration"] / round_limit(clock, i) for i, r in enumerate(rounds)])
            chosen = sorted(rounds, key=lambda r: r[clock]["evaluation"])[(len(rounds) - 1) // 2]
            b = {k: v / args.repeats for k, v in chosen[clock]["breakdown"].items()}  # per iteration
            seconds = chosen[clock]["iteration"] / args.repeats
            summary["paths"].setdefault(path, {})[clock] = {"ratio_eval": ratio2, "ratio_iteration": ratio3,
                                                            "median_round": chosen[clock]}
            shown3 = format_ratio(ratio3, percent=True)
            if path.endswith("+overlap"):  # scoring overlaps generation: only the full iteration is measured
                print(f"{path:<16} {'-':>10} {'-':>40} {seconds:>7.2f} {shown3:>40}  "
                      + "".join(f"{b[k]:>8.2f}s" if k != "other" else f"{'-':>9}" for k in PHASES))
                continue
            print(f"{path:<16} {chosen['tokens'] / chosen[clock]['evaluation']:>10,.0f} {format_ratio(ratio2, percent=True):>40}"
                  f" {seconds:>7.2f} {shown3:>40}  "
                  + "".join(f"{b[k]:>8.2f}s" for k in PHASES))
    for path in paths:
        summary["paths"][path]["rounds"] = results[path]
    summary["limit_rounds"] = {k: v for k, v in results.items() if k.startswith("limit@")}
    summary["machine"] = {"cpu": cpu_description(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "load_at_end": os.getloadavg(),
                          "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"\nmachine: {summary['machine']['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} at the end of the rounds, {summary['machine']['date']}")
    if args.memory:
        labels = [f"limit@{args.population * bench.batched_size}" if m == "limit" else m
                  for m in args.memory.split(",") if m]
        summary["memory"] = memory_report(__file__, labels)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=float))


def profile(bench: Bench, paths: list[str]) -> None:
    """Top operators by self CPU time: the limit at --profile rows per call, then one iteration per path."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def show(label, run):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            run()
            elapsed = time.perf_counter() - started
        print(f"\n== profile: {label} ({elapsed:.1f} s under the profiler)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))

    rows = bench.args.profile
    show(f"limit, {rows} rows per call", lambda: bench.limit(rows))
    for path in paths:
        show(path, lambda: bench.iteration(path, 99))


def slow_countdown_reward(prompts, completions, **columns):
    """Countdown's reward after burning ESFT_BENCH_REWARD_COST_MS of CPU (runs in a sandbox worker)."""
    from esft.tasks.countdown import countdown_reward

    deadline = time.process_time() + float(os.environ.get("ESFT_BENCH_REWARD_COST_MS", "0")) / 1000
    while time.process_time() < deadline:
        pass
    return countdown_reward(prompts, completions, **columns)


def _has_lowrank() -> bool:
    from esft.es import noise

    return "lowrank" in noise.NOISE_SCHEMES


if __name__ == "__main__":
    main()
