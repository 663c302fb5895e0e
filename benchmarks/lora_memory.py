"""The memory of the ES state, full-parameter ES against LoRA-ES, on one model (issue 11).

ES state = the float32 master of the trainable tensors + the noise buffers the engine keeps: the
sequential path's noise scratch (one float32 buffer the size of the largest trainable tensor), and
with --population-batching the per-member noise the hooks hold for one population (low-rank factors
for full-parameter ES with --noise lowrank; each member's full noise of the adapter for LoRA-ES with
--noise iid). Counted from the tensors themselves (exact bytes), plus the process's resident memory
after each engine is built.

    OMP_NUM_THREADS=1 python benchmarks/lora_memory.py --model 30m --lora-r 4 --population 30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from throughput_tools import MB, RSSSampler, build_model  # noqa: E402


def unique_bytes(tensors) -> int:
    """Bytes of distinct storages (views of one buffer count once)."""
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(path: str, model_name: str, lora_r: int, population: int) -> dict:
    """Build one engine (in this process) and count its ES state."""
    import torch

    from esft.settings.config import ESConfig
    from esft.engines.lora import lora_engine
    from esft.engines.population import _population_class
    from esft.engines.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    sampler = RSSSampler()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, description = build_model(model_name, Path(tmp))
        before = sampler.rss()
        if path == "full":
            engine = TransformersEngine(model, tokenizer, noise="lowrank")
        else:
            options = {"trainable": None, "noise": "iid", "max_tokens": 8, "mini_batch_size": None}
            engine = lora_engine(ESConfig(lora_r=lora_r, device="cpu"), model, tokenizer, options)
        built = sampler.rss()
        plan = _population_class(engine)(engine, list(range(population)), 1e-3)._plan
    sampler.stop()
    return {"description": description, "trainable": engine.num_trainable(), "master": unique_bytes(engine.master.values()),
            "scratch": unique_bytes(engine._scratch.values()), "rss_model": before, "rss_engine": built - before,
            "population": unique_bytes(t for entry in plan for t in entry[1:] if isinstance(t, torch.Tensor))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="30m", help="embedded, 30m or a model directory")
    parser.add_argument("--lora-r", type=int, default=4)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--only", choices=("full", "lora"), help=argparse.SUPPRESS)  # one path, in a fresh process
    options = parser.parse_args()
    if options.only:
        print(json.dumps(measure(options.only, options.model, options.lora_r, options.population)))
        return
    rows = {}
    for path in ("full", "lora"):  # each in a fresh process, so resident memory is its own
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", path], check=True, capture_output=True, text=True)
        rows[path] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model: {rows['full']['description']}; population {options.population}")
    print("| ES | trainable | master | noise scratch (sequential) | **ES state** | population-batching noise "
          "| RSS: model loaded | RSS added by the engine |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path, label in (("full", "full-parameter (population: --noise lowrank --rank 1 factors)"),
                        ("lora", f"LoRA r={options.lora_r} all-linear (population: --noise iid, N × adapter)")):
        row = rows[path]
        print(f"| {label} | {row['trainable'] / 1e6:.3f}M | {row['master'] / MB:.2f} MiB | {row['scratch'] / MB:.3f} MiB "
              f"| **{(row['master'] + row['scratch']) / MB:.2f} MiB** | {row['population'] / MB:.2f} MiB "
              f"| {row['rss_model'] / MB:.0f} MiB | {row['rss_engine'] / MB:.0f} MiB |")


if __name__ == "__main__":
    main()
