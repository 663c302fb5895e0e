"""vLLM's worker process (it runs the forward passes) under glibc's own malloc against esft.allocator's
heap only, which the worker sets at setup: page faults, worker CPU seconds and wall seconds per `generate`
of the Countdown task's prompts, each side a fresh engine in its own process, rounds alternating.

The "glibc" side sets MALLOC_ARENA_MAX to glibc's own limit (8 per core), so esft.allocator sees a
user's choice and leaves malloc alone (esft.allocator); every engine reports what its worker got
(`VLLMEngine.worker_allocator`). The worker's counters are read over `collective_rpc` with a function,
which vLLM allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1: set in the side processes only.

    OMP_NUM_THREADS=1 python benchmarks/vllm_worker_malloc.py --rounds 2 --calls 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_tools import format_ratio, load_average, ratio_summary, run_self  # noqa: E402


def worker_counters(worker) -> dict:
    """Runs inside vLLM's worker process (collective_rpc): its page faults and CPU seconds so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"faults": usage.ru_minflt, "cpu": usage.ru_utime + usage.ru_stime}


def one_side(args) -> dict:
    """In a side process: a fresh engine on the embedded model, untimed calls, then --calls measured ones."""
    from vllm_adapters import task_prompts

    from esft.config import embedded_model_path
    from esft.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(embedded_model_path()), noise="iid", max_tokens=args.max_tokens)
    prompts = task_prompts(args.prompts)
    try:
        for _ in range(3):  # the engine's and the heap's one-off costs
            engine.generate(prompts)
        calls = []
        for _ in range(args.calls):
            before = engine.llm.collective_rpc(worker_counters)[0]
            started = time.perf_counter()
            engine.generate(prompts)
            wall = time.perf_counter() - started
            after = engine.llm.collective_rpc(worker_counters)[0]
            calls.append({"faults": after["faults"] - before["faults"], "cpu": after["cpu"] - before["cpu"], "wall": wall})
        return {"allocator": engine.worker_allocator, "calls": calls}
    finally:
        engine.close()


def run_side(side: str) -> dict:
    """This script again with the run's options as one side's process; what it measured."""
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if side == "glibc":
        env["MALLOC_ARENA_MAX"] = str(8 * os.cpu_count())  # glibc's own limit: esft.allocator stands aside
    proc = run_self(__file__, ["--side", side], env=env)
    if proc.returncode != 0:
        sys.exit(f"the {side} side's process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds, each a glibc and a heap-only process")
    parser.add_argument("--calls", type=int, default=12, help="measured generate calls per process")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--side", choices=("glibc", "heap"), default=None, help=argparse.SUPPRESS)  # a side process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args)))
        return
    median = statistics.median
    sides = {"glibc": [], "heap": []}
    for round_index in range(args.rounds):
        for side in sides:
            sides[side].append(run_side(side))
        print(f"round {round_index + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    print(f"vLLM worker, embedded model, {args.prompts} prompts × up to {args.max_tokens} tokens per generate call; "
          f"{args.calls} calls per process, medians; {args.rounds} processes per side; {load_average()}")
    print("| side | worker's malloc | page faults per call (each process: median, max) | worker CPU s per call | "
          "wall s per call |")
    print("| --- | --- | --- | --- | --- |")
    # each process's medians over its calls, and its largest call's faults (glibc's own come in bursts)
    per_process = {side: [{**{key: median(c[key] for c in run["calls"]) for key in ("faults", "cpu", "wall")},
                           "most_faults": max(c["faults"] for c in run["calls"])} for run in runs]
                   for side, runs in sides.items()}
    for side, processes in per_process.items():
        faults = ", ".join(f"{p['faults']:,.0f} ({p['most_faults']:,})" for p in processes)
        shown = {key: ", ".join(f"{p[key]:.3f}" for p in processes) for key in ("cpu", "wall")}
        print(f"| {side} | {sides[side][0]['allocator']} | {faults} | {shown['cpu']} | {shown['wall']} |")
    ratios = ratio_summary([g["wall"] / h["wall"] for g, h in zip(per_process["glibc"], per_process["heap"])])
    print(f"glibc / heap only, wall seconds per call (median of the rounds' ratios): {format_ratio(ratios)}")


if __name__ == "__main__":
    main()
