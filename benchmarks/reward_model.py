"""Completions scored per second by a reward model in-process vs over HTTP (`esft serve-reward`).

    OMP_NUM_THREADS=1 python benchmarks/reward_model.py [--completions 256] [--batch-size 64] [--request-size 16] [--clients 4]

Builds a Llama sequence-classification reward model from a config (no download; --hidden-size and
--layers set its size), then scores the same completions, side by side in one run:
1. in-process: esft.rewards.models.RewardModel called on --request-size completions at a time (as
   the trainer calls it: one ES member's batch per call), one forward pass per call;
2. over HTTP, one client: esft.rewards.remote_reward against a server started here on loopback
   (same model), requests of --request-size completions, one at a time: the same forward passes,
   plus HTTP;
3. over HTTP, `--clients` clients at once (each a remote_reward in its own thread scoring its share,
   requests of --request-size), as several trainers sharing one server: the server coalesces their
   requests into forward passes of up to --batch-size.
Prints completions per second of each (best of --repeats rounds, the three measured in alternation)
and the ratios HTTP / in-process; HTTP and in-process scores are checked equal.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' byte-level tokenizer

from throughput_tools import scratch_directory  # noqa: E402


def build_model(path: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=2048, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         architectures=["LlamaForSequenceClassification"])
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def completions(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Prompts of ~40 bytes and completions of 60-200 bytes (= tokens for this byte-level tokenizer)."""
    rng = random.Random(seed)
    words = "the a reward model scores each answer with one number while the policy learns to write better".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))[:n * 5]  # noqa: E731
    return [f"Question {i}: {text(8)}?" for i in range(count)], [" " + text(rng.randint(12, 40)) for _ in range(count)]


def rates(ways: dict, prompts, completions, repeats: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Completions per second of each way of scoring, measured in alternation (way 1, way 2, way 3,
    way 1, ...) so that load from other processes affects all alike; the best of `repeats` rounds."""
    for score in ways.values():
        score(prompts[:8], completions[:8])  # warm-up (first forward pass, connections)
    best = dict.fromkeys(ways, 0.0)
    rewards = {}
    for _ in range(repeats):
        for name, score in ways.items():
            started = time.perf_counter()
            rewards[name] = score(prompts, completions)
            best[name] = max(best[name], len(prompts) / (time.perf_counter() - started))
    return best, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="the server's --batch-size")
    parser.add_argument("--request-size", type=int, default=16, help="completions per call / request (one member's batch)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from esft.rewards.models import RewardModel
    from esft.rewards import remote_reward

    directory = build_model(scratch_directory("esft-rm-bench-"), args.hidden_size, args.layers)
    prompts, texts = completions(args.completions)
    local = RewardModel(str(directory), device="cpu", batch_size=args.request_size)

    def per_member(prompts_, texts_):  # the trainer's calls: one member's batch at a time
        size = args.request_size
        return [r for i in range(0, len(prompts_), size) for r in local(prompts_[i : i + size], texts_[i : i + size])]

    server = subprocess.Popen([sys.executable, "-m", "esft.cli", "serve-reward", "--model", str(directory), "--port", "0",
                               "--device", "cpu", "--batch-size", str(args.batch_size)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        url = server.stdout.readline().rsplit(" on ", 1)[1].strip()
        one = remote_reward(url, batch_size=args.request_size, concurrency=1)
        clients = [remote_reward(url, batch_size=args.request_size, concurrency=1) for _ in range(args.clients)]
        pool = ThreadPoolExecutor(args.clients)

        def all_clients(prompts_, texts_):  # each client scores its share, all at once
            shares = [(prompts_[i :: args.clients], texts_[i :: args.clients]) for i in range(args.clients)]
            list(pool.map(lambda pair: pair[0](*pair[1]), zip(clients, shares)))

        best, rewards = rates({"in-process": per_member, "http": one, "http-clients": all_clients}, prompts, texts, args.repeats)
        assert max(abs(a - b) for a, b in zip(rewards["http"], rewards["in-process"])) < 1e-3, "HTTP and in-process differ"
        batches = one.health()
        pool.shutdown()
    finally:
        server.terminate()
        server.wait(timeout=30)
    in_process, http_one, http_many = best["in-process"], best["http"], best["http-clients"]
    print(f"model: Llama classifier, hidden {args.hidden_size}, {args.layers} layers; {args.completions} completions "
          f"of 60-200 tokens, {args.request_size} per call/request, server --batch-size {args.batch_size}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"in-process:            {in_process:8.1f} completions/s")
    print(f"HTTP, 1 client:        {http_one:8.1f} completions/s  (ratio HTTP/in-process {http_one / in_process:.2f})")
    print(f"HTTP, {args.clients} clients at once: {http_many:8.1f} completions/s  (ratio {http_many / in_process:.2f}; "
          f"server: {batches['batches']} batches, largest {batches['max_batch_requests']} requests / "
          f"{batches['max_batch_completions']} completions)")


if __name__ == "__main__":
    main()
