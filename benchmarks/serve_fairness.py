"""Latency of small `/score` requests to `esft serve-reward`, alone and beside one large request.

    OMP_NUM_THREADS=1 python benchmarks/serve_fairness.py [--large 1000] [--large-chars 300] [--rounds 3]

Starts `esft serve-reward` on loopback (a tiny Llama reward model built from a config: the tests'
2-layer model, byte-level tokenizer, --batch-size 16) and, in each round:
1. alone: a client sends `--small` 1-item requests one after another (a pause of --gap seconds
   between them) and times each;
2. beside a large one: a second client sends one request of --large completions of about
   --large-chars characters; while it is in flight the first client sends its 1-item requests as in
   1 (until the large one is answered, at least one). The large request's own time is timed too.
Prints p50 / p99 small-request latency of both per round, then the median over rounds and their
spread (min-max), the large request's seconds and the machine's load average. With few samples a
round's p99 is its slowest request or nearly.

Run with PYTHONPATH pointing at another checkout's src/ to measure that version's server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tiny reward model


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_server(model: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "esft.cli", "serve-reward", "--model", str(model), "--port", "0",
                             "--batch-size", "16", *flags], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on http://" not in line:
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.rsplit(" on ", 1)[1].strip()


def small_stream(http, url: str, count: int | None, gap: float, until: threading.Event | None) -> list[float]:
    """1-item requests one after another: `count` of them, or until `until` is set (at least one)."""
    latencies: list[float] = []
    while (count is None or len(latencies) < count) and not (until is not None and until.is_set() and latencies):
        started = time.monotonic()
        response = http.post(f"{url}/score", json={"prompts": [f"small {len(latencies)}"], "completions": ["!"]})
        latencies.append(time.monotonic() - started)
        if response.status_code != 200:
            raise SystemExit(f"a small request got {response.status_code}: {response.text}")
        time.sleep(gap)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", type=int, default=1000, help="completions in the large request")
    parser.add_argument("--large-chars", type=int, default=300, help="characters per completion of the large request")
    parser.add_argument("--small", type=int, default=30, help="1-item requests per round when alone")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between two small requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-flag", action="append", default=[], help="extra serve-reward flag (repeatable), "
                        "e.g. --server-flag=--max-request-seconds=300")
    args = parser.parse_args()
    import httpx

    from tiny_model import build_tiny_reward_model

    model = build_tiny_reward_model(Path(tempfile.mkdtemp(prefix="esft-fairness-")))
    proc, url = start_server(model, args.server_flag)
    text = ("long text " * (args.large_chars // 10 + 1))[: args.large_chars]
    large = {"prompts": [f"{i} {text}" for i in range(args.large)], "completions": [""] * args.large}
    rows = []
    try:
        with httpx.Client(timeout=600) as http:
            small_stream(http, url, 3, 0, None)  # warm-up
            for round_ in range(args.rounds):
                alone = small_stream(http, url, args.small, args.gap, None)
                finished, result = threading.Event(), {}

                def post_large() -> None:
                    started = time.monotonic()
                    result["status"] = httpx.post(f"{url}/score", json=large, timeout=600).status_code
                    result["seconds"] = time.monotonic() - started
                    finished.set()

                big = threading.Thread(target=post_large)
                big.start()
                time.sleep(0.3)  # the large request is in
                beside = small_stream(http, url, None, args.gap, finished)
                big.join()
                row = dict(alone_p50=percentile(alone, 50), alone_p99=percentile(alone, 99), beside_p50=percentile(beside, 50),
                           beside_p99=percentile(beside, 99), beside_n=len(beside), large_s=result["seconds"],
                           large_status=result["status"], load=os.getloadavg()[0])
                rows.append(row)
                print(f"round {round_ + 1}: small alone p50 {row['alone_p50'] * 1000:.0f} ms p99 {row['alone_p99'] * 1000:.0f} ms "
                      f"({len(alone)}); beside the large one p50 {row['beside_p50'] * 1000:.0f} ms p99 "
                      f"{row['beside_p99'] * 1000:.0f} ms ({len(beside)}); large {row['large_s']:.1f} s "
                      f"(HTTP {row['large_status']}); load {row['load']:.1f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"\n{args.large} x {args.large_chars} characters, {args.rounds} rounds: median (min-max) over rounds")
    for key, unit in (("alone_p50", "ms"), ("alone_p99", "ms"), ("beside_p50", "ms"), ("beside_p99", "ms"), ("large_s", "s")):
        values = [row[key] * (1000 if unit == "ms" else 1) for row in rows]
        print(f"  {key:11} {statistics.median(values):8.1f} {unit}  ({min(values):.1f}-{max(values):.1f})")
    loads = [row["load"] for row in rows]
    print(f"  load        {min(loads):.1f}-{max(loads):.1f} (1-minute average, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
