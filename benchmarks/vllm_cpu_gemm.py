"""vLLM on CPU: ES iteration time with the two ways of handling vLLM's repacked linear weights.

"repack": keep vLLM's packed oneDNN kernels and pack again after every weight change;
"plain": torch.nn.functional.linear on the live weights. Prints seconds per ES member
(perturb + greedy generate + restore) and generated tokens/s for each, on a ~4M-parameter
Qwen2-architecture model built from a config (no download).

    python benchmarks/vllm_cpu_gemm.py [--prompts 32] [--tokens 32] [--members 4] [--rounds 3]

One engine; the modes alternate round by round (esft_set_cpu_gemm), so load from other processes
on a shared machine hits both alike; medians are reported.
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


def build_model(path: Path, hidden: int = 256, layers: int = 4) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def member_seconds(engine, batch: list[str], members: int, first_seed: int) -> tuple[float, float, int]:
    """(s per member for perturb + generate + restore, s per perturb + restore alone, tokens)."""
    started = time.perf_counter()
    generated = 0
    for seed in range(first_seed, first_seed + members):
        engine.perturb(seed, 1e-3)
        generated += sum(engine.generate(batch).num_tokens)
        engine.restore()
    per_member = (time.perf_counter() - started) / members
    started = time.perf_counter()
    for seed in range(first_seed, first_seed + members):
        engine.perturb(seed, 1e-3)
        engine.restore()
    return per_member, (time.perf_counter() - started) / members, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--members", type=int, default=4, help="members per round")
    parser.add_argument("--hidden", type=int, default=256, help="model width (256: ~4M parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, modes alternating (shared CPUs are noisy)")
    args = parser.parse_args()
    from esft.engines.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(str(build_model(Path(tmp) / "model", args.hidden, args.layers)), max_tokens=args.tokens, max_model_len=512)
        batch = [f"Q{i}: what is {i} + {2 * i}? Answer:" for i in range(args.prompts)]
        engine.generate(batch)  # warm-up
        rounds: dict[str, list[tuple[float, float, int]]] = {"repack": [], "plain": []}
        for round_ in range(args.rounds):
            for mode in rounds:
                engine._rpc("esft_set_cpu_gemm", mode)
                rounds[mode].append(member_seconds(engine, batch, args.members, 100 * round_))
        engine.close()
    for mode, results in rounds.items():
        per_member = statistics.median(r[0] for r in results)
        print(json.dumps({"mode": mode, "s_per_member_median": round(per_member, 4),
                          "s_per_member_rounds": [round(r[0], 4) for r in results],
                          "tokens_per_s": round(results[0][2] / (per_member * args.members)),
                          "perturb_restore_s_median": round(statistics.median(r[1] for r in results), 4)}))


if __name__ == "__main__":
    main()
