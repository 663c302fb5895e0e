"""The largest model this machine can fine-tune (issue 64, item 5): one ES iteration against one TRL GRPO step on
Llama-shaped models with random bfloat16 weights, full-parameter and with a LoRA adapter, each in a child process
watched against a memory limit.

Shapes (built in the child from a LlamaConfig, nothing downloaded; a word-level tokenizer of the shape's vocabulary
is built in process too): 135m (SmolLM2-135M), 0.5b (Qwen2.5-0.5B's widths), 1.5b (Qwen2.5-1.5B's), 3b
(Llama-3.2-3B), 7b (Llama-2-7B), 8b (Llama-3.1-8B), and `tiny` for the tests. Every measurement runs P prompts of 32
tokens and 16 new tokens (EOS forbidden, so every method writes the same number of tokens):

  generate   plain batched greedy generation of N × P rows through transformers' generate: what serving costs
  es-full    one ES iteration of esft's transformers engine: low-rank noise (rank 4, σ 1e-3), population batching
             (all N members in one generate call over the P prompts; where its check refuses the model, the members
             one at a time, as --population-batching auto does, said in the row), --master-weights none, the update
  es-lora    the same with a LoRA adapter (r 16, all linear layers) as the trainable weights (--noise iid)
  grpo-full  one step of TRL's GRPOTrainer (N completions per prompt, P prompts, its defaults otherwise: AdamW, bf16)
  grpo-lora  the same with peft's LoraConfig(r=16, target_modules="all-linear")

The parent samples each child's resident memory every 20 ms and kills it when it passes --limit-gb: such a row
reads "does not fit", a measured failure, never the kernel's OOM killer. A row that fits reports the peak RSS
(the larger of the parent's samples and the child's VmHWM) from the moment the model is built (so it counts the ES
engine's and the GRPOTrainer's construction alike), the RSS once the model is built, and the seconds of the iteration
or step alone (not the builds). Children run one after another, --threads torch threads each.

    python benchmarks/memory_scale.py --shapes 135m,0.5b,1.5b,3b,7b,8b --limit-gb 20 --json runs/memory_scale.json
(the run recorded in docs/benchmarks.md, "The largest model this machine fine-tunes")
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from master_memory import PEAK_HELPERS  # noqa: E402  (a child's status() and reset_peak())

# Llama widths of each shape: hidden, MLP, layers, heads, key-value heads, vocabulary, tied embeddings
SHAPES = {
    "tiny": (64, 128, 2, 4, 2, 512, True),
    "135m": (576, 1536, 30, 9, 3, 49152, True),
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (3072, 8192, 28, 24, 8, 128256, True),
    "7b": (4096, 11008, 32, 32, 32, 32000, False),
    "8b": (4096, 14336, 32, 32, 8, 128256, False),
}
METHODS = ("generate", "es-full", "es-lora", "grpo-full", "grpo-lora")
PROMPT_TOKENS, NEW_TOKENS, LORA_R = 32, 16, 16
REPORT = "memory_scale: "  # the prefix of the child's report lines (TRL prints dicts of its own)

CHILD = PEAK_HELPERS + f"REPORT = {REPORT!r}\n" + r"""
import json, sys, tempfile, time, warnings
import torch

shape, method, members, prompts, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
hidden, mlp, layers, heads, kv_heads, vocab, tied = json.loads(sys.argv[6])
prompt_tokens, new_tokens, lora_r = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
torch.set_num_threads(threads)
warnings.filterwarnings("ignore")


def tell(**fields):
    print(REPORT + json.dumps(fields), flush=True)


from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0", pad_token="w1", unk_token="w1")
tokenizer.padding_side = "left"
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                     max_position_embeddings=4096, eos_token_id=0, pad_token_id=1, bos_token_id=None)
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model = model.to_empty(device="cpu")  # bfloat16 storage only: no float32 model first, no initialisation twice
model.tie_weights()  # to_empty gave the tied head a storage of its own
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, param in model.named_parameters():
        param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=generator)
model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its float32 buffers, which to_empty left empty
model.eval()
parameters = sum(p.numel() for p in model.parameters())
texts = [" ".join(f"w{2 + (7 * p + 13 * t) % (vocab - 2)}" for t in range(prompt_tokens)) for p in range(prompts)]
tell(built_mib=status("VmRSS"), parameters=parameters)
reset_peak()
start = time.perf_counter()
if method == "generate":
    from esft.engines.decoding import contiguous_head_input

    batch = tokenizer(texts * members, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad(), contiguous_head_input(model):  # as esft generates (transformers' own: a head copy per row)
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=1)
    trained = 0
elif method.startswith("es-"):
    from esft.engines.population import generate_population, population_batching_problem
    from esft.engines.transformers_engine import TransformersEngine

    if method == "es-full":
        engine = TransformersEngine(model, tokenizer, noise="lowrank", rank=4, max_tokens=new_tokens, master_weights="none")
    else:
        from esft.engines.lora import lora_engine
        from esft.engines.settings import EngineSettings
        from esft.settings.config import ESConfig

        engine = lora_engine(EngineSettings.of(ESConfig(lora_r=lora_r, device="cpu")), model, tokenizer,
                             {"trainable": None, "noise": "iid", "mini_batch_size": None, "max_tokens": new_tokens})
    engine.min_new_tokens = new_tokens
    start = time.perf_counter()  # the iteration's seconds; its peak counts the engine's construction (as GRPO's)
    seeds = list(range(1, members + 1))
    if (problem := population_batching_problem(engine)) is None:
        results = generate_population(engine, texts, seeds, 1e-3)
    else:  # as `esft train` does under --population-batching auto: the members one at a time, said in the row
        tell(note="members one at a time: " + problem.split(":")[0])
        results = []
        for seed in seeds:
            engine.perturb(seed, 1e-3)
            results.append(engine.generate(texts))
            engine.restore()
    assert all(len(ids) == new_tokens for r in results for ids in r.token_ids), "every row writes its 16 tokens"
    rewards = torch.tensor([float(sum(r.num_tokens) + seed % 3) for seed, r in zip(seeds, results)])
    z = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    engine.update(seeds, (5e-4 / members * z).tolist())
    trained = engine.num_trainable()
else:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    peft_config = None
    if method == "grpo-lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
    model.requires_grad_(True)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=1, num_generations=members,
                      per_device_train_batch_size=members * prompts, max_completion_length=new_tokens,
                      bf16=True, use_cpu=True, dataloader_pin_memory=False, save_strategy="no", report_to="none",
                      disable_tqdm=True, logging_strategy="no", seed=0)
    dataset = Dataset.from_dict({"prompt": texts})
    reward = lambda prompts, completions, **_: [float(len(c) % 5) for c in completions]
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=peft_config)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    start = time.perf_counter()  # the step's seconds; its peak counts the trainer's construction (as ES's)
    trainer.train()
tell(seconds=time.perf_counter() - start, peak_mib=status("VmHWM"), trained=trained)
"""


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) / 1024 for line in handle if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


def measure(shape: str, method: str, members: int, prompts: int, threads: int, limit_mib: float,
            timeout: float) -> dict:
    """One child: its reports, its peak as the parent saw it, and whether it fit."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-c", CHILD, shape, method, str(members), str(prompts), str(threads),
            json.dumps(SHAPES[shape]), str(PROMPT_TOKENS), str(NEW_TOKENS), str(LORA_R)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env)
        seen, verdict, began = 0.0, None, time.monotonic()
        while child.poll() is None:
            seen = max(seen, rss_mib(child.pid))
            if seen > limit_mib:
                verdict = f"does not fit: passed {limit_mib / 1024:.3g} GiB"
            elif time.monotonic() - began > timeout:
                verdict = f"timed out after {timeout:.0f} s"
            if verdict:
                child.kill()
                child.wait()
                break
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        reports = {}
        for line in out.read().splitlines():
            if line.startswith(REPORT):
                reports.update(json.loads(line[len(REPORT):]))
        if verdict is None and child.returncode != 0:
            tail = err.read().strip().splitlines()[-1:] or ["no output"]
            verdict = f"failed (exit {child.returncode}): {tail[0][:200]}"
    row = {"shape": shape, "method": method, "members": members, "prompts": prompts, "fits": verdict is None,
           "verdict": verdict or "fits", "peak_mib": max(seen, reports.get("peak_mib", 0.0)), **reports}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="135m,0.5b,1.5b,3b,7b,8b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--members", type=int, default=8, help="ES members = GRPO completions per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit-gb", type=float, default=20.0, help="resident memory a child may use (GiB)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a child may take")
    parser.add_argument("--json", default=None, help="write the rows here (rewritten after each row)")
    args = parser.parse_args()
    shapes, methods = args.shapes.split(","), args.methods.split(",")
    for name, known in (("shape", SHAPES), ("method", METHODS)):
        unknown = [value for value in (shapes if name == "shape" else methods) if value not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown[0]!r}: choose from {', '.join(known)}")
    rows = []
    print(f"{args.members} members/completions x {args.prompts} prompts x {NEW_TOKENS} new tokens, bfloat16, "
          f"limit {args.limit_gb:g} GiB, {args.threads} threads, load {os.getloadavg()[0]:.1f}", flush=True)
    print("| shape | parameters | method | fits | peak RSS GiB | / generate | RSS built GiB | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for shape in shapes:
        generate_peak = None
        for method in methods:
            row = measure(shape, method, args.members, args.prompts, args.threads, args.limit_gb * 1024, args.timeout)
            rows.append(row)
            if method == "generate" and row["fits"]:
                generate_peak = row["peak_mib"]
            ratio = f"{row['peak_mib'] / generate_peak:.2f}" if generate_peak and row["fits"] else "-"
            params = f"{row['parameters'] / 1e6:,.0f}M" if "parameters" in row else "-"
            built = f"{row['built_mib'] / 1024:.2f}" if "built_mib" in row else "-"
            seconds = f"{row['seconds']:.0f}" if row["fits"] else "-"
            verdict = row["verdict"] + (f" ({row['note']})" if "note" in row else "")
            print(f"| {shape} | {params} | {method} | {verdict} | {row['peak_mib'] / 1024:.2f} | {ratio} | {built}"
                  f" | {seconds} |", flush=True)
            if args.json:
                path = Path(args.json)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".tmp").write_text(json.dumps(rows, indent=1))
                path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    main()
