"""Chat messages: recognising a conversation, and its plain-text ChatML rendering (used for tokenizers
without a chat template, by the policy's prompts and by reward models alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_messages(value: Any) -> bool:
    """A chat conversation: a non-empty list of {"role": str, "content": ...} mappings."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def chatml(messages: list[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Messages in the ChatML format of Qwen models, as plain text: the rendering used when the
    tokenizer has no chat template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
