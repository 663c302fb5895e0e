"""Issue 21: seconds per ES iteration on one vLLM engine (CPU wheel, float32), three ways of
evaluating the same members × prompts rows, rounds alternating:

- one member at a time: perturb in place (low-rank), generate the member's prompts, restore;
- the adapter population: every member a LoRA adapter, ONE generate (esft's --engine vllm --noise lowrank);
- plain batched generation of the same members × prompts rows without adapters (this engine's limit);
- with --reference-lora-ops, also the adapter population on vLLM's reference CPU LoRA ops (vllm/lora/ops/
  torch_ops) instead of esft's (esft.engines.vllm_cpu_lora), same engine, same rounds, and whether both
  gave the same completions.

Also the agreement of the adapter members' completions with the transformers engine's low-rank
population path (same seeds), as tests/test_vllm_lowrank.py checks at a smaller scale.

    OMP_NUM_THREADS=2 python benchmarks/vllm_adapters.py --model embedded --prompts 32 --population 30 --rounds 3
    OMP_NUM_THREADS=2 python benchmarks/vllm_adapters.py --prompts 32 --population 30 --rounds 5 --max-tokens 32 --reference-lora-ops
    OMP_NUM_THREADS=2 python benchmarks/vllm_adapters.py --model 30m --prompts 200 --population 30 --rounds 3

`--model 30m` is benchmarks/throughput.py's 30M-parameter Llama built from a config (throughput_tools.build_model),
saved to a temporary directory for vLLM to load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def model_directory(name: str, tmp: Path) -> str:
    """A directory vLLM loads: the embedded model's, benchmarks/throughput.py's '30m' model saved
    under `tmp` (random weights from a config, the embedded model's tokenizer), or `name` itself."""
    from esft.settings.config import embedded_model_path

    if name == "embedded":
        return str(embedded_model_path())
    if name == "30m":
        from throughput_tools import build_model

        model, tokenizer, _ = build_model(name, tmp)
        path = tmp / "30m"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)
    return name


def task_prompts(count: int) -> list[str]:
    """The Countdown task's own first `count` training prompts, as training sees them (hand-written strings
    made the embedded model answer EOS at once: one-token completions measured per-request costs, not
    generation)."""
    from esft.es.batches import prompt_batch
    from esft.tasks.countdown_task import make_countdown_task

    return prompt_batch(make_countdown_task(seed=0, difficulty="easy").train_dataset, 0, count, 0).prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="embedded, 30m (throughput.py's 30M-parameter model), "
                        "or a model directory")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--reference-lora-ops", action="store_true",
                        help="also time the adapters on vLLM's reference CPU LoRA ops (CPU only)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="esft-vllm-adapters-") as tmp:
        measure(opts, model_directory(opts.model, Path(tmp)))


def measure(opts, path: str) -> None:
    from esft.engines.population import generate_population
    from esft.engines.transformers_engine import TransformersEngine
    from esft.engines.vllm_adapters import servable_pattern
    from esft.engines.vllm_engine import VLLMEngine
    from throughput_tools import ratio_summary

    prompts = task_prompts(opts.prompts)
    engine = VLLMEngine(path, noise="lowrank", rank=1, max_tokens=opts.max_tokens, max_loras=min(opts.population, 64),
                        gpu_memory_utilization=0.2)
    seeds = list(range(1000, 1000 + opts.population))
    times: dict[str, list[float]] = {"one_at_a_time": [], "adapters": [], "plain_batched": []}
    ops = engine._rpc("esft_cpu_lora_ops", None)[0]
    if opts.reference_lora_ops:
        if not ops["esft"]:
            raise SystemExit("esft's CPU LoRA ops are not in effect in this engine (not CPU, or another vLLM)")
        times["adapters_reference_ops"] = []
    reference_members = None
    for _ in range(opts.rounds):
        start = time.perf_counter()
        for seed in seeds:
            engine.perturb(seed, opts.sigma)
            engine.generate(prompts)
            engine.restore()
        times["one_at_a_time"].append(time.perf_counter() - start)
        start = time.perf_counter()
        members = engine.generate_population(prompts, seeds, opts.sigma)
        times["adapters"].append(time.perf_counter() - start)
        if opts.reference_lora_ops:
            engine._rpc("esft_cpu_lora_ops", False)
            start = time.perf_counter()
            reference_members = engine.generate_population(prompts, seeds, opts.sigma)
            times["adapters_reference_ops"].append(time.perf_counter() - start)
            engine._rpc("esft_cpu_lora_ops", True)
        start = time.perf_counter()
        engine.generate(prompts * len(seeds))
        times["plain_batched"].append(time.perf_counter() - start)
    reference = TransformersEngine.from_pretrained(path, device="cpu", noise="lowrank", rank=1, max_tokens=opts.max_tokens,
                                                   trainable=servable_pattern(engine.hf_params, engine.adapter_indices))
    expected = generate_population(reference, prompts, seeds, opts.sigma)
    same = sum(a == b for m, e in zip(members, expected) for a, b in zip(m.token_ids, e.token_ids))
    engine.close()
    median = {name: statistics.median(values) for name, values in times.items()}
    def spread(numerators, denominators):  # per-round ratios: median, min–max, "noisy" beyond ±10%
        return ratio_summary([a / b for a, b in zip(numerators, denominators)])

    report = {
        "model": opts.model, "prompts": opts.prompts, "population": opts.population, "rounds": opts.rounds,
        "max_tokens": opts.max_tokens, "esft_cpu_lora_ops": ops["esft"], "seconds": times, "median": median,
        "min": {name: min(values) for name, values in times.items()},
        "max": {name: max(values) for name, values in times.items()},
        "speedup_adapters_vs_one_at_a_time": median["one_at_a_time"] / median["adapters"],
        "speedup_per_round": spread(times["one_at_a_time"], times["adapters"]),
        "adapters_over_plain_batched": spread(times["adapters"], times["plain_batched"]),
        "completions_identical_to_transformers": f"{same}/{len(seeds) * len(prompts)}",
    }
    if opts.reference_lora_ops:
        report["reference_ops"] = {
            "speedup_vs_one_at_a_time": median["one_at_a_time"] / median["adapters_reference_ops"],
            "speedup_per_round": spread(times["one_at_a_time"], times["adapters_reference_ops"]),
            "over_esft_ops_per_round": spread(times["adapters_reference_ops"], times["adapters"]),
            "completions_identical_to_esft_ops": sum(
                a == b for m, e in zip(members, reference_members) for a, b in zip(m.token_ids, e.token_ids)),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
