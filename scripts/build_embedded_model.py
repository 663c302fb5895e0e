"""Build esft's embedded default model: a tiny Llama-architecture Countdown solver (CPU, ~10 minutes).

What it does, seeded and deterministic on CPU (as far as torch allows):
1. Makes SFT data from `generate_problems(..., difficulty="easy", split="train")` only: the held-out
   "eval" slice is never touched. Each row is the paper's raw prompt (ending in "<think>") followed by
   a short trace, e.g. " 5 + 10 = 15, 15 + 17 = 32 </think>\\n<answer> (5 + 10) + 17 </answer>".
   A fraction `--p-correct` (default 1.0) of the traces reach the target (the others add all numbers
   in the order given); only a fraction `--p-tagged` (default 0.5) write the answer in <answer>
   tags, the others end "The answer is ...": a habit that earns no accuracy. Greedy decoding then
   chooses between the two habits almost by a coin flip, which Evolution Strategies can fix.
2. Trains a byte-level BPE tokenizer (`tokenizers`) on that corpus: digits are split one by one, the
   fixed prompt boilerplate compresses into a few tokens, and any text can still be encoded.
3. SFT-trains a small LlamaForCausalLM (tied embeddings, float32) with AdamW, loss on completion
   tokens only; then rescales its weights without changing its function (`shrink_weights`) so that
   the paper's sigma = 1e-3 is large enough to move a model this small; then measures greedy
   accuracy on `generate_problems(500, seed=1, difficulty="easy", split="eval")`.
4. Saves config.json, model.safetensors, tokenizer files, a greedy generation_config.json,
   build_info.json and a README.md to `--out` (default src/esft/assets/countdown-tiny).

Usage:  PYTHONPATH=src python scripts/build_embedded_model.py [--out DIR] [--steps N] ...
Time:   about 9.5 minutes on a busy 2-core CPU with the defaults (mostly the 400 SFT steps), one
        torch thread (bitwise reproducible for a fixed thread count).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from pathlib import Path

import torch

from esft.tasks.countdown import countdown_accuracy, countdown_reward
from esft.tasks.countdown_data import generate_problems

EOS, PAD = "<|endoftext|>", "<|pad|>"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "src" / "esft" / "assets" / "countdown-tiny"


# ----------------------------------------------------------------------------- data


def sign_patterns(n: int) -> list[tuple[int, ...]]:
    """All +1/-1 sign vectors with at least one +1 (what + and - with brackets can express),
    in a fixed preference order: all plus first, then fewer minus signs, leftmost minus first."""
    patterns = [s for s in itertools.product((1, -1), repeat=n) if 1 in s]
    return sorted(patterns, key=lambda s: (s.count(-1), [x == -1 for x in s][::-1]))


def trace(numbers: list[int], signs: tuple[int, ...]) -> tuple[str, int]:
    """The completion for one sign pattern: positives first (prompt order), then the negatives.

    Returns (text after "<think>", value reached). Every intermediate result is computed exactly.
    """
    order = [n for n, s in zip(numbers, signs) if s > 0] + [n for n, s in zip(numbers, signs) if s < 0]
    ops = ["+"] * (signs.count(1) - 1) + ["-"] * signs.count(-1)
    steps, value, expression = [], order[0], str(order[0])
    for i, (op, number) in enumerate(zip(ops, order[1:])):
        steps.append(f"{value} {op} {number} = {value + number if op == '+' else value - number}")
        value = value + number if op == "+" else value - number
        expression = f"{expression} {op} {number}"
        if i < len(ops) - 1:  # bracket every step but the last, as in "(5 + 10) + 17"
            expression = f"({expression})"
    return f" {', '.join(steps)} </think>\n<answer> {expression} </answer>", value


def make_completion(row: dict, rng: random.Random, p_correct: float, wrong: str = "naive") -> tuple[str, bool]:
    """A correct trace with probability `p_correct` (the first pattern that reaches the target),
    otherwise a wrong attempt that misses: `wrong="naive"` adds all numbers in the order given (one
    consistent bad habit), `wrong="random"` picks a random other sign pattern with a positive value."""
    numbers, target = row["numbers"], int(row["target"])
    results = [(s, *trace(numbers, s)) for s in sign_patterns(len(numbers))]
    correct = [text for _, text, value in results if value == target]
    if wrong == "naive":
        wrong_texts = [text for s, text, value in results if value != target and -1 not in s]
    else:
        wrong_texts = [text for _, text, value in results if value != target and value > 0]
    if not wrong_texts or rng.random() < p_correct:
        return correct[0], True
    return rng.choice(wrong_texts), False


def untagged(completion: str) -> str:
    """The same trace with the answer written without <answer> tags ("The answer is ..."): a
    habit that scores no accuracy and only 0.1 of the format reward."""
    think, answer = completion.split("</think>\n")
    expression = answer.replace("<answer>", "").replace("</answer>", "").strip()
    return f"{think}</think>\nThe answer is {expression}."


def build_corpus(
    n_problems: int, epochs_of_data: int, seed: int, p_correct: float, wrong: str, p_tagged: float = 1.0
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the train split only; each data pass reshuffles the order of
    the numbers (another generator seed) and redraws which traces are correct and which answers
    keep their <answer> tags (a fraction `p_tagged`)."""
    rng = random.Random(seed)
    pairs = []
    for k in range(epochs_of_data):
        for row in generate_problems(n_problems, seed=seed * 1000 + k, difficulty="easy", split="train"):
            completion, _ = make_completion(row, rng, p_correct, wrong)
            if rng.random() >= p_tagged:
                completion = untagged(completion)
            pairs.append((row["prompt"], completion))
    rng.shuffle(pairs)
    return pairs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE: digits one per token, boilerplate merged; loads with AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )


# ----------------------------------------------------------------------------- model


def build_model(args, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def shrink_weights(model, c: float) -> None:
    """Function-preserving reparametrisation: every weight matrix times c, RMSNorm gains divided by c.

    The residual stream shrinks by c, which RMSNorm undoes (its eps shrinks by c**2 to stay exact);
    q, k, v, gate and up see unchanged inputs; the tied LM head gets the final norm's 1/c back, so
    logits are unchanged. Only the scale of the weights relative to a fixed ES noise sigma changes:
    sigma = 1e-3 then acts on each matrix like sigma = 1e-3 / c would on the trained weights.
    """
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.mul_(c)
        elif name.endswith("norm.weight"):
            param.div_(c)
    model.config.rms_norm_eps *= c * c
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon *= c * c


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per pair: prompt + completion + EOS, labels -100 on the prompt."""
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    return [(p + c + [tokenizer.eos_token_id], [-100] * len(p) + c + [tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded input_ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, mask, labels


def sft(model, tokenizer, pairs, args, log=lambda line: print(line, flush=True), callback=None):
    """Plain AdamW loop, linear warmup then cosine decay; loss on completion tokens only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, args.steps // 20)
    schedule = lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    rows = encode_pairs(tokenizer, pairs)
    start, cursor, running = time.time(), 0, None
    for step in range(args.steps):
        if cursor + args.batch_size > len(rows):
            cursor = 0
        ids, mask, labels = collate(rows[cursor : cursor + args.batch_size], tokenizer.pad_token_id)
        cursor += args.batch_size
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log(f"step {step + 1}/{args.steps}  loss {running:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  {time.time() - start:.0f}s")
        if callback is not None:
            callback(step + 1)
    model.eval()


# ----------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 128) -> list[str]:
    """Greedy completions, left padding, stop at EOS; returns decoded completion text."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = []
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        tokens = model.generate(**batch, generation_config=config)
        out += tokenizer.batch_decode(tokens[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def evaluate(model, tokenizer, rows: list[dict], max_new_tokens: int = 64) -> dict:
    """Held-out accuracy, mean reward and mean completion length (tokens) of greedy completions."""
    start = time.time()
    completions = generate(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens)
    seconds = time.time() - start
    columns = {"numbers": [r["numbers"] for r in rows], "target": [r["target"] for r in rows]}
    prompts = [r["prompt"] for r in rows]
    accuracy = countdown_accuracy(prompts, completions, **columns)
    reward = countdown_reward(prompts, completions, **columns)
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for c in completions]
    return {
        "accuracy": sum(accuracy) / len(rows),
        "mean_reward": sum(reward) / len(rows),
        "mean_completion_tokens": sum(lengths) / len(rows),
        "seconds": seconds,
        "tokens_per_second": sum(lengths) / seconds,
        "examples": completions[:3],
    }


# ----------------------------------------------------------------------------- main


def save(model, tokenizer, args, out: Path, info: dict) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The v5 class name "TokenizersBackend" is unknown to transformers 4.x; this name loads in both.
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    GenerationConfig(
        do_sample=False,
        max_new_tokens=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(README.format(**info))


README = """# countdown-tiny: esft's embedded default model

A {parameters:,}-parameter LlamaForCausalLM ({layers} layers, hidden {hidden}, tied embeddings,
float32) with a {vocab_size}-token byte-level BPE tokenizer, trained from scratch to solve the
"easy" Countdown problems of `esft.tasks.countdown_data` (3 numbers in 1..20, + and -, target
1..100) in the paper's raw prompt format. It exists so that `esft` runs (and can be tested) on a
CPU without downloading anything.

It is deliberately imperfect, in a way that reward-driven fine-tuning is known to fix: its SFT
traces are correct {p_correct_pct:.0f}% of the time, but only {p_tagged_pct:.0f}% of them give the answer in
`<answer> </answer>` tags; the others end "The answer is ...", which earns no accuracy and a tenth of
the format reward. Greedy decoding picks the tagged or the untagged habit almost by a coin flip per
problem, and ES moves that choice toward the tags (and then improves the arithmetic).

After SFT every weight matrix was multiplied by {weight_scale} and every RMSNorm gain divided by it
(RMSNorm eps multiplied by {weight_scale}^2): every logit is unchanged, but the paper's noise scale
sigma = 1e-3 now moves the matrices as much as sigma = {sigma_equiv:g} would move the unscaled ones. A
model this small needs that: on unscaled weights, sigma = 1e-3 barely changes its greedy outputs.

- Built by `scripts/build_embedded_model.py` (seed {seed}, {steps} AdamW steps, batch {batch_size},
  lr {lr}, weight decay {weight_decay}) in {build_minutes:.1f} minutes on a 2-core CPU; the SFT data
  comes only from `generate_problems(..., split="train")`.
- Prompt: about {prompt_tokens} tokens; completion: about {completion_tokens} tokens, e.g.
  `{example}`
- Base greedy accuracy on `generate_problems(500, seed=1, difficulty="easy", split="eval")`
  (max 64 new tokens): **{accuracy_pct:.1f}%**, mean reward {mean_reward:.3f} (max 1.1).
- Load with `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
  (left padding, EOS `{eos}`, PAD `{pad}`); generation_config.json is greedy.
"""


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-problems", type=int, default=5000, help="train problems per data pass")
    parser.add_argument("--data-passes", type=int, default=4, help="reshuffled passes of SFT data")
    parser.add_argument("--p-correct", type=float, default=1.0, help="fraction of correct traces")
    parser.add_argument("--wrong", choices=["naive", "random"], default="naive", help="kind of wrong attempts")
    parser.add_argument("--p-tagged", type=float, default=0.5, help="fraction of answers written in <answer> tags")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (0: 4 x hidden)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--weight-scale", type=float, default=0.1,
                        help="after SFT, scale weight matrices by this (function-preserving, see shrink_weights)")
    parser.add_argument("--eval-count", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; the build is bitwise reproducible for a fixed count")
    parser.add_argument("--log-every", type=int, default=100)
    return parser


def main() -> None:
    args = make_parser().parse_args()

    start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    pairs = build_corpus(args.n_problems, args.data_passes, args.seed, args.p_correct, args.wrong, args.p_tagged)
    print(f"{len(pairs)} SFT examples (train split only)")
    tokenizer = train_tokenizer([p + c for p, c in pairs[:5000]], args.vocab_size)
    for text in (pairs[0][0] + pairs[0][1], "any text: ünïcödé ✓ 12345 <think>"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text, "tokenizer does not round-trip"
    prompt_tokens = len(tokenizer(pairs[0][0], add_special_tokens=False)["input_ids"])
    print(f"vocab {len(tokenizer)}, prompt {prompt_tokens} tokens")

    model = build_model(args, tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters:,} parameters")
    sft(model, tokenizer, pairs, args)
    shrink_weights(model, args.weight_scale)

    eval_rows = generate_problems(args.eval_count, seed=1, difficulty="easy", split="eval")
    result = evaluate(model, tokenizer, eval_rows)
    print(f"held-out accuracy {result['accuracy']:.3f}  mean reward {result['mean_reward']:.3f}  "
          f"completion {result['mean_completion_tokens']:.1f} tokens  {result['tokens_per_second']:.0f} tok/s")
    for example in result["examples"]:
        print("  ", repr(example))

    info = {
        **{k: v for k, v in vars(args).items() if k not in ("out", "log_every")},
        "parameters": parameters,
        "vocab_size": len(tokenizer),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": round(result["mean_completion_tokens"], 1),
        "accuracy": result["accuracy"],
        "accuracy_pct": 100 * result["accuracy"],
        "mean_reward": round(result["mean_reward"], 4),
        "p_correct_pct": 100 * args.p_correct,
        "p_tagged_pct": 100 * args.p_tagged,
        "sigma_equiv": 1e-3 / args.weight_scale,
        "example": pairs[0][1].replace("\n", "\\n"),
        "eos": EOS,
        "pad": PAD,
        "build_minutes": (time.time() - start) / 60,
    }
    save(model, tokenizer, args, args.out, info)
    print(f"saved to {args.out} in {(time.time() - start) / 60:.1f} min (process CPU time {time.process_time() / 60:.1f} min)")


if __name__ == "__main__":
    main()
