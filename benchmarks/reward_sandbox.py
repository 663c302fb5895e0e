"""Per-sample cost of running a fast reward function in the sandbox vs in-process.

    OMP_NUM_THREADS=1 python benchmarks/reward_sandbox.py [batch_size] [repeats]

Prints both costs, measured side by side in one run, and their ratio.

A member's batch is one call into a worker process, so the sandbox adds a fixed cost per call
(pickling the prompts, completions and columns through a pipe, and waking the worker) that is spread
over the batch.
"""

from __future__ import annotations

import sys
import time

from esft.rewards.runner import RewardRunner


def length_reward(prompts, completions, answer, **kwargs):
    return [-abs(len(c.strip()) - len(a)) for c, a in zip(completions, answer)]


def per_sample_seconds(runner: RewardRunner, rows, completions, repeats: int) -> float:
    runner.score(rows, completions)  # start-up (worker spawn) is paid once, not per call
    started = time.perf_counter()
    for _ in range(repeats):
        runner.score(rows, completions)
    return (time.perf_counter() - started) / (repeats * len(rows))


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    rows = [{"prompt": f"Question {i}: what is the capital of France?", "answer": "Paris"} for i in range(batch)]
    completions = ["The capital of France is Paris, a city on the Seine." for _ in range(batch)]
    sandboxed = RewardRunner([length_reward], sandbox=True)
    in_process = RewardRunner([length_reward], sandbox=False)
    assert sandboxed.score(rows, completions).total == in_process.score(rows, completions).total
    box = per_sample_seconds(sandboxed, rows, completions, repeats)
    local = per_sample_seconds(in_process, rows, completions, repeats)
    sandboxed.close()
    print(f"batch {batch}: sandbox {box * 1e6:.1f} µs/sample, in-process {local * 1e6:.1f} µs/sample, "
          f"overhead {(box - local) * 1e6:.1f} µs/sample ({(box - local) * batch * 1e3:.2f} ms per call); "
          f"ratio sandbox/in-process {box / local:.1f}")


if __name__ == "__main__":
    main()
