"""How close the vLLM and transformers engines are, same seeds, float32, CPU.

Greedy completions of 64 prompts × 32 tokens on the ~4M-parameter model of vllm_cpu_gemm.py, for
the unperturbed weights and 8 members (σ = 1e-3); counts identical completions and tokens before the
first divergence.

    OMP_NUM_THREADS=1 python benchmarks/vllm_agreement.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from vllm_cpu_gemm import build_model

    from esft.engines.transformers_engine import TransformersEngine
    from esft.engines.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model")
        prompts = [f"Q{i}: what is {i} + {2 * i}? Answer:" for i in range(64)]
        ours = VLLMEngine(str(path), max_tokens=32, max_model_len=512)
        reference = TransformersEngine.from_pretrained(str(path), device="cpu", max_tokens=32)
        same = total = tokens_same = tokens = 0
        for seed in range(9):  # seed 0: the unperturbed model
            if seed:
                ours.perturb(seed, 1e-3)
                reference.perturb(seed, 1e-3)
            a, b = ours.generate(prompts), reference.generate(prompts)
            for x, y in zip(a.token_ids, b.token_ids):
                total += 1
                same += x == y
                tokens_same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                tokens += max(len(x), len(y))
            if seed:
                ours.restore()
                reference.restore()
        ours.close()
    print(json.dumps({"completions_identical": same, "completions": total,
                      "tokens_before_first_divergence": tokens_same, "tokens": tokens}))


if __name__ == "__main__":
    main()
