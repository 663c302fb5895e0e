"""The tiny test model as a GGUF file: a GGUF file written by the test itself, so GGUF loading is
tested without a download.

`write_tiny_gguf` converts what `tiny_model.build_tiny_model` saved into one llama GGUF of F32 tensors,
laid out as llama.cpp's `convert_hf_to_gguf.py` would, so that transformers' GGUF loader (and any
llama.cpp-based engine) reads back the same model and tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows (from HF's rotate-half to interleaved rotary pairs); the
    inverse of transformers' `LlamaTensorProcessor._reverse_permute_weights`."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def write_tiny_gguf(model_dir: Path, out_path: Path) -> Path:
    """Write the Llama model and byte-level tokenizer saved in `model_dir` to the GGUF file `out_path`.

    A GGUF cannot state a padding side, so load its tokenizer with `padding_side="left"` to match.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = LlamaConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = load_file(model_dir / "model.safetensors")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta

    writer = gguf.GGUFWriter(out_path, arch="llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_vocab_size(len(tokenizer))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Byte-level BPE ("gpt2"): the tokens are already spelled in the byte alphabet. The file must state
    # merges or scores; this vocabulary has no merges and gguf cannot write an empty array, so it gets
    # scores, from which transformers derives the (empty) merge list.
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)

    # With tied embeddings there is no `output.weight`: transformers (like llama.cpp) then ties lm_head.
    # The GGUF has no bos id, so transformers' config falls back to LlamaConfig's bos_token_id=1.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        weights = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            weights = _permute(weights, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weights = _permute(weights, config.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(weights, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
