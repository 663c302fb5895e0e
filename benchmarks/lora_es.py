"""LoRA-ES against full-parameter ES on the embedded model (issue 11): whole `esft train` runs, one
after another, each reported with its held-out accuracy before/after, the median seconds per
iteration (metrics.jsonl's perf/iteration_s), the process's peak RSS (wait4) and the load average
at its start and end (the machine is shared: read timings with the load).

    OMP_NUM_THREADS=1 python benchmarks/lora_es.py --runs sweep          # σ/α sweep of LoRA-ES r=4
    OMP_NUM_THREADS=1 python benchmarks/lora_es.py --runs seeds --sigma 1e-2 --alpha 5e-3
    OMP_NUM_THREADS=1 python benchmarks/lora_es.py --runs compare --sigma 1e-2 --alpha 5e-3

Extra arguments after `--` go to every run (e.g. `-- --iterations 5`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LORA = ["--lora-r", "4"]  # on the embedded model the demo preset adds --population-batching --mini-batch-size 8


def sweep(_options) -> list[tuple[str, list[str]]]:
    """σ at α = σ/2 (the paper's ratio), then α = σ at the two σ around the best."""
    runs = [(f"LoRA r=4, σ={s}, α={a}", [*LORA, "--sigma", s, "--alpha", a])
            for s, a in (("1e-3", "5e-4"), ("3e-3", "1.5e-3"), ("1e-2", "5e-3"), ("3e-2", "1.5e-2"),
                         ("3e-3", "3e-3"), ("1e-2", "1e-2"))]
    return runs


def seeds(options) -> list[tuple[str, list[str]]]:
    return [(f"LoRA r=4, σ={options.sigma}, α={options.alpha}, seed {seed}",
             [*LORA, "--sigma", options.sigma, "--alpha", options.alpha, "--seed", str(seed)]) for seed in options.seeds]


def compare(options) -> list[tuple[str, list[str]]]:
    """Full-parameter ES (at its own σ/α, the demo's 1e-3/5e-4, and at LoRA's) and LoRA-ES, one member
    at a time and batched, and LoRA-ES perturbing B only."""
    lora = [*LORA, "--sigma", options.sigma, "--alpha", options.alpha]
    same = ["--sigma", options.sigma, "--alpha", options.alpha]
    return [
        ("full ES, demo preset (lowrank r=1, batched), its own σ/α", []),
        ("full ES, --noise iid (paper, sequential), its own σ/α", ["--noise", "iid"]),
        ("full ES, --noise iid, LoRA's σ/α", ["--noise", "iid", *same]),
        ("LoRA-ES, batched (iid)", lora),
        ("LoRA-ES, sequential (iid)", [*lora, "--no-population-batching"]),
        ("LoRA-ES, B only (--trainable lora_B), batched", [*lora, "--trainable", "lora_B"]),
    ]


RUNS = {"sweep": sweep, "seeds": seeds, "compare": compare}


def load() -> str:
    return "{:.2f}".format(os.getloadavg()[0])


def run(label: str, flags: list[str], out: Path) -> dict:
    """One `esft train` in a fresh process: its numbers from metrics.jsonl, wall time and peak RSS."""
    name = f"run{len(list(out.iterdir()))}"
    command = [sys.executable, "-m", "esft.cli", "train", *flags, "--logging", "none", "--no-progress",
               "--output-dir", str(out), "--run-name", name]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start_load, started = load(), time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{label}: exit status {status}\n{output}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracy = [row["eval/heldout/accuracy"] for row in rows if "eval/heldout/accuracy" in row]
    train = [row for row in rows if "perf/iteration_s" in row]
    return {"label": label, "flags": " ".join(flags), "before": accuracy[0], "after": accuracy[-1], "wall": wall,
            "s_per_it": statistics.median(row["perf/iteration_s"] for row in train),
            "tok_s": statistics.median(row["perf/tokens_per_s"] for row in train),
            "length": statistics.mean(row["completions/mean_length"] for row in train),
            "peak_mib": usage.ru_maxrss / 1024, "load": f"{start_load}→{load()}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", choices=sorted(RUNS), default="sweep")
    parser.add_argument("--sigma", default="1e-2")
    parser.add_argument("--alpha", default="5e-3")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for every run")
    options = parser.parse_args()
    extra = [flag for flag in options.extra if flag != "--"]
    print("| run | flags | held-out before → after | gain | s/iteration (median) | tokens/s (median) | mean completion "
          "| wall s | peak RSS | load (start→end) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in RUNS[options.runs](options):
            r = run(label, [*flags, *extra], Path(tmp))
            print(f"| {r['label']} | `{r['flags'] or '(none)'}` | {100 * r['before']:.1f}% → {100 * r['after']:.1f}% "
                  f"| {100 * (r['after'] - r['before']):+.1f} | {r['s_per_it']:.2f} | {r['tok_s']:.0f} "
                  f"| {r['length']:.1f} tokens | {r['wall']:.0f} "
                  f"| {r['peak_mib']:.0f} MiB | {r['load']} |", flush=True)


if __name__ == "__main__":
    main()
