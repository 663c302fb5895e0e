"""`--mini-batch-size auto`: prompts per generate call, from the model, the device and the rows each
prompt brings (population batching: one per member).

Rows per call aim at what runs fastest and stay within memory:
- CPU: about CPU_TARGET_ROWS rows (measured on this project's 2-core CPU with esft's decoder, natural
  completion lengths: plain generation ran fastest at 480–960 rows per call, 240 3% and 120 16% slower;
  the low-rank population's hooks cost less per row in larger calls: 960 rows as fast as 510 or 10% faster;
  docs/benchmarks.md), and no more than a quarter of the available RAM for the call's key/value
  cache and activations;
- CUDA: as many rows as fit in GPU_MEMORY_SHARE of the free GPU memory (larger batches keep a GPU
  busier; the cache and activations are what grows), at most GPU_MAX_ROWS.

Full-rank population batching holds every member's own copy of the trainable tensors and reads each
member's at every decoding step: members per call are as many as bring about the rows above with all
of the iteration's prompts each (32 prompts: all 30; 200 prompts: 5), and no more than their
copies fit in WEIGHTS_MEMORY_SHARE of the free memory (RAM or GPU); the rows are then sized from what
is left.

Scoring completions (per-token KL in evaluation) runs forward passes over whole sequences, whose full-vocabulary
logits dominate: rows per pass are as many as fit in the same share of free memory (logprob_rows), at most
CPU_LOGPROB_ROWS on CPU (SmolLM2-135M, 64 rows of 61 tokens, one thread: 16 rows per pass 11% faster than 4,
64 in one pass no faster than 4 and 0.7 GB more) and GPU_MAX_ROWS on a GPU.
"""

from __future__ import annotations

from esft.models.footprint import available_cpu_memory

CPU_TARGET_ROWS = 1024
GPU_MEMORY_SHARE = 0.5
GPU_MAX_ROWS = 8192
CPU_MEMORY_SHARE = 0.25
WEIGHTS_MEMORY_SHARE = 0.25
CPU_LOGPROB_ROWS = 16


def bytes_per_row(model, sequence_length: int) -> int:
    """Key/value cache of one row of `sequence_length` positions, plus its largest activations
    (the MLP's during the prompt's forward pass), in the model's dtype."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    element = next(model.parameters()).element_size()
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", 0)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    cache = 2 * layers * kv_heads * head_dim * sequence_length * element
    activations = 4 * sequence_length * max(intermediate, hidden) * element
    return cache + activations + 4 * getattr(config, "vocab_size", 0)  # + one row of float32 logits


def free_memory(model) -> int:
    """Bytes free where the model lives: on a GPU the driver's free memory plus what torch's caching
    allocator holds unused (the driver counts that as taken, so without it the rows per call would
    shrink after any earlier large call in the same process); elsewhere available RAM."""
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda":
        cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(0, cached_unused)
    return available_cpu_memory()


def full_rank_members_per_call(model, bytes_per_member: int, prompts: int, sequence_length: int) -> int:
    """Members per call of full-rank population batching: about auto_rows rows with all `prompts` per
    member, and no more members than their own weights fit in WEIGHTS_MEMORY_SHARE of free memory."""
    fit = int(WEIGHTS_MEMORY_SHARE * free_memory(model)) // max(1, bytes_per_member)
    return max(1, min(fit, auto_rows(model, sequence_length) // max(1, prompts)))


def auto_rows(model, sequence_length: int) -> int:
    """Rows per generate call for this model on its device (module docstring)."""
    per_row = max(1, bytes_per_row(model, sequence_length))
    if next(model.parameters()).device.type == "cuda":
        return max(1, min(GPU_MAX_ROWS, int(GPU_MEMORY_SHARE * free_memory(model)) // per_row))
    return max(1, min(CPU_TARGET_ROWS, int(CPU_MEMORY_SHARE * free_memory(model)) // per_row))


def auto_prompts_per_call(model, prompts: int, copies: int, sequence_length: int) -> int:
    """Prompts per call so that prompts × copies rows are about auto_rows (at least one prompt)."""
    return max(1, min(prompts, auto_rows(model, sequence_length) // max(1, copies)))


def logprob_rows(model, sequence_length: int) -> int:
    """Rows per forward pass when scoring completions of up to `sequence_length` tokens: each row holds
    its full-vocabulary logits at every position (model dtype), a float32 copy and its log-softmax, plus
    the pass's activations (bytes_per_row); as many as fit in the share of free memory auto_rows uses."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    element = next(model.parameters()).element_size()
    logits = sequence_length * getattr(config, "vocab_size", 0) * (element + 2 * 4)
    per_row = max(1, logits + bytes_per_row(model, sequence_length))
    if next(model.parameters()).device.type == "cuda":
        return max(1, min(GPU_MAX_ROWS, int(GPU_MEMORY_SHARE * free_memory(model)) // per_row))
    return max(1, min(CPU_LOGPROB_ROWS, int(CPU_MEMORY_SHARE * free_memory(model)) // per_row))
