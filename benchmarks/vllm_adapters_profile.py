"""Issue 21: where the adapter population's time goes on vLLM's CPU wheel. One engine in this process
(uni executor, VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profilers see the model), the embedded model,
members × prompts rows: scheduler steps and tokens per step, then the torch profiler's op table and
cProfile's Python view of one population, with esft's CPU LoRA ops and with vLLM's reference ops
(esft.engines.vllm_cpu_lora), and the plain batched generation of the same rows.

    OMP_NUM_THREADS=2 python benchmarks/vllm_adapters_profile.py --prompts 32 --population 30 --max-tokens 32
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def in_process_llm() -> None:
    """Make esft's VLLMEngine start vLLM with the in-process executor (it asks for "mp" workers)."""
    import vllm

    class LLM(vllm.LLM):
        def __init__(self, *args, **kwargs):
            kwargs["distributed_executor_backend"] = "uni"
            super().__init__(*args, **kwargs)

    vllm.LLM = LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    opts = parser.parse_args()
    in_process_llm()
    from torch.profiler import ProfilerActivity, profile
    from vllm.v1.core.sched import scheduler

    from esft.config import embedded_model_path
    from esft.engines.vllm_engine import VLLMEngine

    from vllm_adapters import task_prompts

    prompts = task_prompts(opts.prompts)  # the task's own (hand-written ones got one-token completions)
    engine = VLLMEngine(str(embedded_model_path()), noise="lowrank", rank=1, max_tokens=opts.max_tokens,
                        max_loras=min(opts.population, 64), gpu_memory_utilization=0.2)
    seeds = list(range(1000, 1000 + opts.population))
    steps: list[tuple[int, int]] = []  # (tokens, requests) of every scheduler step
    schedule = scheduler.Scheduler.schedule

    def logged(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        steps.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    scheduler.Scheduler.schedule = logged
    runs = {"adapters": lambda: engine.generate_population(prompts, seeds, 1e-3),
            "plain batched": lambda: [engine.generate(prompts * len(seeds))]}
    for name, run in runs.items():
        run()
        steps.clear()
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for generation in out for ids in generation.token_ids)
        print(f"{name}: {seconds:.3f} s, {len(steps)} steps, {tokens} tokens generated, (tokens, requests) per "
              f"step: {steps[:5]} ... {steps[-3:]}", flush=True)
    for fast in (True, False):
        engine._rpc("esft_cpu_lora_ops", fast)
        print(f"=== adapters, {'esft' if fast else 'vLLM reference'} CPU LoRA ops: torch profiler")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runs["adapters"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print("=== cProfile")
        python = cProfile.Profile()
        python.enable()
        runs["adapters"]()
        python.disable()
        pstats.Stats(python).sort_stats("cumulative").print_stats(40)
    engine._rpc("esft_cpu_lora_ops", True)
    print("=== plain batched: torch profiler")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runs["plain batched"]()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    engine.close()


if __name__ == "__main__":
    main()
