"""A tiny Llama-architecture model and a byte-level tokenizer, built in-process (no downloads), and the
environment tests start esft processes with."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>"]


VLLM_MAX_TOKENS = 8
"""Completion length of the session's vLLM engine (tests/conftest.py's session_vllm)."""


def subprocess_env() -> dict[str, str]:
    """The environment of every esft process a test starts (the CLI, a user's script): this process's
    (read now), one torch thread (2 cores, tests in parallel), no hub access, transformers' warnings off."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: every byte is a token (258 tokens)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", padding_side="left")


def build_tiny_model(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **config) -> Path:
    """Save a randomly initialised 2-layer Llama (~60k parameters) and its tokenizer to `path`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=True,
    )
    settings.update(config)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_tiny_reward_model(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """Save a randomly initialised 2-layer LlamaForSequenceClassification with one output (a reward
    model) and the byte-level tokenizer to `path`. Its score head is scaled up so that rewards differ
    visibly between texts (about ±1 instead of ±0.02)."""
    from transformers import LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, architectures=["LlamaForSequenceClassification"],
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(50.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_sparse_model(path: Path, **config) -> Path:
    """A Llama folder of any size that costs no disk or memory: the tiny model's config and tokenizer with `config`
    changed, and a model.safetensors whose header names every tensor of that model (bfloat16) while its data is a
    hole (a sparse file). What esft reads of a folder before loading it (esft.models.footprint) sees a real model."""
    import json

    build_tiny_model(path)
    settings = json.loads((path / "config.json").read_text()) | config | {"dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(settings))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**settings))
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and settings.get("tie_word_embeddings"):
            continue
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + 2 * tensor.numel()]}
        offset += 2 * tensor.numel()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path / "model.safetensors", "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + offset)
    return Path(path)
