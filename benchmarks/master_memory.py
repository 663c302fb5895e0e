"""Memory of one ES iteration with and without a float32 master (issue 64), each in a fresh process.

For a model folder (default: the embedded model; SmolLM2 from `esft prepare-model smollm2-135m-instruct`) and each
dtype × mode, a child process loads the model and reports, in MiB of resident memory (Linux /proc/self/status):

  loaded     VmRSS once the model is loaded (weights, a master if kept, the noise scratch, torch itself)
  generate   the peak (VmHWM, reset after loading through /proc/self/clear_refs) of one greedy generate
  iteration  the peak of one ES iteration by hand: N members perturbed in place with low-rank noise (rank 4,
             σ 1e-2), each generating the P prompts, restored, then one update (survival: es/update_survival)

Modes: `inference` (the model alone through transformers' generate: what serving it costs), `float32` and `none`
(the transformers engine with --master-weights float32 / none). Run one thread per child.

    python benchmarks/master_memory.py --model "$(esft prepare-model smollm2-135m-instruct)" --dtypes bfloat16,float32
(the run recorded in docs/benchmarks.md, "Updates without a float32 master")
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PEAK_HELPERS = r"""
import gc


def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith(key + ":"))


def reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
"""
"""A child's own memory in MiB (status("VmRSS"), status("VmHWM")) and reset_peak(): the start of a child's script."""

CHILD = PEAK_HELPERS + r"""
import json, sys, torch
torch.set_num_threads(1)


model, dtype, mode, members, prompts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rows = [f"What is {i} times {i + 3}?" for i in range(prompts)]
survival = None
if mode == "inference":
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    batch = tokenizer(rows, return_tensors="pt", padding=True)
    generate = lambda: lm.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    iterate = generate
else:
    from esft.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(model, dtype=dtype, device="cpu", max_tokens=16, noise="lowrank",
                                                rank=4, master_weights=mode)
    generate = lambda: engine.generate(rows)

    def iterate():
        for seed in range(1, members + 1):
            engine.perturb(seed, 1e-2)
            engine.generate(rows)
            engine.restore()
        engine.update(list(range(1, members + 1)), [5e-3 / members * (1 if i % 2 else -1) for i in range(members)])
reset_peak()
loaded = status("VmRSS")
with torch.no_grad():
    generate()
    generated = status("VmHWM")
    reset_peak()
    iterate()
    iterated = status("VmHWM")
if mode != "inference":
    survival = engine.last_update_survival
print(json.dumps({"loaded_mib": loaded, "generate_mib": generated, "iteration_mib": iterated, "survival": survival}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--modes", default="inference,float32,none", help="inference and --master-weights values")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    if args.model is None:
        from esft.settings.config import embedded_model_path

        args.model = str(embedded_model_path())
    results = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            proc = subprocess.run([sys.executable, "-c", CHILD, args.model, dtype, mode, str(args.members),
                                   str(args.prompts)], capture_output=True, text=True, check=True)
            row = {"dtype": dtype, "master_weights": mode, **json.loads(proc.stdout.strip().splitlines()[-1])}
            results.append(row)
            survival = "-" if row["survival"] is None else f"{row['survival']:.4f}"
            print(f"{dtype:9s} {mode:9s}: loaded {row['loaded_mib']:6.0f} MiB, generate peak {row['generate_mib']:6.0f}"
                  f" MiB, iteration peak {row['iteration_mib']:6.0f} MiB, survival {survival}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
