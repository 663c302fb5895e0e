"""throughput.py's memory measurements: each in a fresh process, since a process's heap keeps what its
earlier phases freed. Peak RSS (sampled every 2 ms) against a budget of what must be resident: runtime
(RSS once loaded and warmed up, minus weights and master) + 1.1 × (weights + float32 master + KV cache)."""

from __future__ import annotations

import json

from throughput_tools import MB, RSSSampler, run_self


def memory_probe(make_bench, label: str) -> None:
    """In the probe process: one measurement (`limit@ROWS` or a path), RSS before and at its peak, as one
    JSON line. make_bench(sampler) builds throughput.py's Bench with that sampler."""
    sampler = RSSSampler(0.002)
    bench = make_bench(sampler)
    sampler.phase(label)
    bench.limit(bench.rows_per_call(label)) if label.startswith("limit@") else bench.iteration(label, 0)
    sampler.phase("idle")
    sampler.stop()
    print(json.dumps({"label": label, "rows": bench.rows_per_call(label), "rss_libraries": bench.rss_libraries,
                      "rss_ready": bench.rss_ready, "peak": sampler.peaks[label], "weights": bench.weights_bytes,
                      "master": bench.master_bytes, "kv": bench.kv_bytes(bench.rows_per_call(label))}))


def memory_report(script: str, labels: list[str]) -> dict:
    """Runs `script` with this run's arguments and --memory-probe LABEL for each label (the probe branch
    comes first in the script, so the run's --rounds, --memory and --json do not reach it); prints and
    returns what they measured."""
    probes = {}
    for label in labels:
        result = run_self(script, ["--memory-probe", label])
        if result.returncode != 0:
            raise SystemExit(f"memory probe {label} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        probes[label] = json.loads(result.stdout.strip().splitlines()[-1])
    print("\nmemory, each measurement in a fresh process (RSS; 'runtime' = RSS once loaded and warmed up, minus "
          "weights and master; budget = runtime + 1.1 × (weights + float32 master + KV cache)):")
    for label, p in probes.items():
        runtime = p["rss_ready"] - p["weights"] - p["master"]
        budget = runtime + 1.1 * (p["weights"] + p["master"] + p["kv"])
        print(f"  {label:<16} {p['rows']:>4} rows/call: peak {p['peak'] / MB:6.0f} MiB = runtime {runtime / MB:.0f} + "
              f"{(p['peak'] - runtime) / MB:.0f} MiB; budget {budget / MB:.0f} MiB (weights {p['weights'] / MB:.1f}, "
              f"master {p['master'] / MB:.1f}, KV {p['kv'] / MB:.0f}); {'within' if p['peak'] <= budget else 'OVER'}")
    return probes
