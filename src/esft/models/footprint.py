"""Whether a model folder can be fine-tuned here, read from its files before anything loads (issue 64, item 6;
issue 66, case 6).

Loading a model that does not fit ends in the kernel's OOM killer or minutes of silence, and a config.json that
does not describe its weights (a hand-edited `num_hidden_layers`, a wrong `intermediate_size`) makes transformers
build the model it describes before it notices. Both are known from a few kilobytes: config.json and the headers of
the safetensors files (8 bytes of length, then JSON naming every tensor's dtype, shape and byte range). So before an
engine loads a local folder, `check_model_folder` reads them and refuses, in one line:

- a config.json or a safetensors header that cannot be read (not JSON, nested too deep, truncated, a header or a
  tensor that claims more bytes than the file holds);
- a config.json that describes far more parameters than the weights hold (4× or more: an estimate from the
  config's sizes, `config_parameters`, is exact for Llama-shaped models and under-counts others, e.g. mixtures of
  experts, so only an excess is refused; quantized checkpoints are not compared);
- a model whose weights, float32 master and noise scratch (esft.engines.transformers_engine: the master holds
  every trainable tensor in float32 beside the weights) need more memory than is available here, with the flags
  that would make it fit (`--dtype bfloat16`, LoRA-ES with `--lora-r 16`: no master of the base weights).

What is counted is a lower bound (activations, the key/value cache and the tokenizer come on top), so a model that
passes may still not fit; a model that is refused would not. Pure file reading: nothing is loaded, no torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from esft.files import SETTINGS_LIMIT, read_regular_text

GIB = 1024**3
HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on a header's length
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                     "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
MISMATCH = 4.0
"""config.json's parameter estimate over the weights' count from which they are refused as not belonging together."""


class ModelFolderProblem(ValueError):
    """A model folder that cannot be fine-tuned here; the message says what and how to go on."""


@dataclass(frozen=True)
class Weights:
    """What a folder's safetensors headers say: tensor name -> shape."""

    shapes: dict[str, tuple[int, ...]]

    @property
    def sizes(self) -> dict[str, int]:
        return {name: math.prod(shape) for name, shape in self.shapes.items()}

    @property
    def parameters(self) -> int:
        return sum(self.sizes.values())

    def trainable(self, pattern: str | None) -> tuple[int, int]:
        """(elements of the tensors --trainable matches, the largest of them): the master and its scratch."""
        matcher = re.compile(pattern) if pattern else None
        kept = [n for name, n in self.sizes.items() if matcher is None or matcher.search(name)]
        return sum(kept), max(kept, default=0)


def read_json(path: Path) -> dict:
    """A folder's JSON file as a mapping: ModelFolderProblem if it cannot be read as one."""
    try:
        value = json.loads(read_regular_text(path, SETTINGS_LIMIT, follow_links=True))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelFolderProblem(f"{path} cannot be read as JSON ({' '.join(str(error).split())[:160]})") from None
    except RecursionError:
        raise ModelFolderProblem(f"{path} is nested too deeply to read: it is not a model's config") from None
    if not isinstance(value, dict):
        raise ModelFolderProblem(f"{path} holds a JSON {type(value).__name__}, not a mapping of settings")
    return value


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors file's header, checked against the file's length."""
    try:
        with open(path, "rb") as handle:
            length_bytes = handle.read(8)
            size = os.fstat(handle.fileno()).st_size
            length = struct.unpack("<Q", length_bytes)[0] if len(length_bytes) == 8 else None
            text = handle.read(length) if length is not None and length <= min(HEADER_LIMIT, size - 8) else None
    except OSError as error:
        raise ModelFolderProblem(f"{path} cannot be read ({error.strerror or error})") from None
    if length is None:
        raise ModelFolderProblem(f"{path} is {size} bytes long, shorter than a safetensors header: it is truncated; "
                                 "copy or download it again")
    if text is None:
        raise ModelFolderProblem(f"{path}: its header claims {length} bytes, the file holds {size}: it is truncated or "
                                 "not a safetensors file; copy or download it again")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ModelFolderProblem(f"{path}: its header is not the JSON a safetensors file holds; copy or download it "
                                 "again") from None
    if not isinstance(header, dict):
        raise ModelFolderProblem(f"{path}: its header is not a mapping of tensors")
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (begin, stop), dtype = tuple(int(n) for n in entry["shape"]), entry["data_offsets"], entry["dtype"]
            elements = math.prod(shape)
            fits = all(int(n) >= 0 for n in shape) and 0 <= int(begin) <= int(stop)
        except (TypeError, KeyError, ValueError):
            raise ModelFolderProblem(f"{path}: its header's entry for {name[:80]!r} is not a tensor's (dtype, shape, "
                                     "data_offsets)") from None
        if not fits or (dtype in SAFETENSORS_BYTES and elements * SAFETENSORS_BYTES[dtype] != stop - begin):
            raise ModelFolderProblem(f"{path}: tensor {name[:80]!r} has shape {shape} but {stop - begin} bytes: the file "
                                     "is damaged; copy or download it again")
        shapes[name], end = shape, max(end, int(stop))
    if 8 + length + end > size:
        raise ModelFolderProblem(f"{path}: its tensors need {8 + length + end} bytes, the file holds {size}: it is "
                                 "truncated; copy or download it again")
    return shapes


def folder_weights(folder: Path) -> Weights | None:
    """The weights a folder holds, from model.safetensors or the shards its index names (None: no safetensors,
    e.g. only pytorch_model.bin, which cannot be read without loading it)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return Weights(safetensors_shapes(single))
    if not index.is_file():
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelFolderProblem(f"{index} has no weight_map of tensor names to shard files")
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted({str(name) for name in weight_map.values()}):
        if Path(shard).name != shard:
            raise ModelFolderProblem(f"{index} names the shard {shard[:80]!r}, which is not a file of the folder")
        shapes |= safetensors_shapes(folder / shard)
    return Weights(shapes)


def _size(config: dict, *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def config_parameters(config: dict) -> int | None:
    """The parameters a transformer's config.json describes, counted as a Llama-shaped model has them (embeddings,
    attention with grouped key/value heads, a gated MLP, the output head unless tied); None when the config lacks
    the sizes. Exact for Llama, Qwen2, Mistral and SmolLM2 up to biases and norms; an under-count for others."""
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = _size(config, "hidden_size", "n_embd", "d_model")
    layers = _size(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _size(config, "num_attention_heads", "n_head")
    vocab = _size(config, "vocab_size")
    if not all(isinstance(n, int) and n > 0 for n in (hidden, layers, heads, vocab)):
        return None
    kv_heads = _size(config, "num_key_value_heads", default=heads)
    head_dim = _size(config, "head_dim", default=hidden // heads)
    intermediate = _size(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    head = 0 if config.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + head + layers * (attention + mlp + 2 * hidden) + hidden


def first_different_shape(folder: Path, weights: Weights) -> tuple[str, tuple, tuple] | None:
    """The first tensor the weights hold in another shape than the model config.json describes: (name, held,
    described). The model is built on torch's meta device (shapes only, no memory; only for a config already known
    to describe no more than MISMATCH times the weights). None where names do not meet (a checkpoint whose names
    transformers converts) or the config does not build (transformers' loading then says why)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        finally:
            transformers_logging.set_verbosity(verbosity)
    except Exception:  # noqa: BLE001 (any config transformers cannot build: its own loading reports it)
        return None
    described = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return next(((name, shape, described[name]) for name, shape in weights.shapes.items()
                 if name in described and described[name] != shape), None)


def needed_bytes(weights: Weights, dtype: str, trainable: str | None, lora: bool, master: bool = True,
                 noise: str = "iid") -> int:
    """The least memory the transformers engine holds for these weights: the weights in `dtype`, and (full-parameter
    ES) a float32 master of each trainable tensor (unless --master-weights none: `master` False) and float32 scratch
    the size of the largest (without a master: its noise, its update and its rounding's, esft.es.rounding; none of
    that under low-rank noise on bfloat16/float16 weights, perturbed and updated a block of rows at a time)."""
    total = weights.parameters * DTYPE_BYTES.get(dtype, 4)
    if lora:  # LoRA-ES: the master and the noise are the adapter's, a few MB
        return total
    trained, largest = weights.trainable(trainable)
    if master:
        return total + 4 * trained + 4 * largest
    return total + (0 if noise == "lowrank" and DTYPE_BYTES.get(dtype, 4) == 2 else 3 * 4 * largest)


def master_fits(folder: Path, dtype: str, trainable: str | None, device: str) -> tuple[bool, str] | None:
    """Whether a float32 master of a local model folder's trainable weights fits in the memory available here
    (True or False, and the sizes in words), None where that is not known (not a folder of safetensors, a GPU)."""
    weights = folder_weights(Path(folder)) if (Path(folder) / "config.json").is_file() else None
    have = available_bytes(device)
    if weights is None or have is None:
        return None
    need = needed_bytes(weights, dtype, trainable, False)
    return need <= have, f"{dtype} weights and a float32 master need about {gb(need)}, {gb(have)} available"


def available_bytes(device: str) -> int | None:
    """Memory a model could take here: on CPU the smaller of MemAvailable and the room an address-space limit
    (RLIMIT_AS) leaves; None where not known (a GPU: the engine's own check)."""
    if device != "cpu":
        return None
    room = available_cpu_memory()
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as handle:
                used = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            room = min(room, max(0, limit - used))
    except (ImportError, OSError, ValueError):
        pass
    return room


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gb(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n < 100 * GIB else f"{n / GIB:,.0f} GiB"


def count(n: int) -> str:
    if n >= 1e15:
        return f"{n:.3g}"
    return next(f"{n / unit:.3g} {name}" for unit, name in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million"),
                                                             (1e3, "thousand"), (1, "")) if n >= unit or unit == 1).strip()


def check_model_folder(folder: Path, dtype: str, trainable: str | None, lora: bool, device: str,
                       available: int | None = None, master: bool = True, noise: str = "iid") -> None:
    """ModelFolderProblem (module docstring) for a local model folder that cannot be fine-tuned here; nothing for
    one that may be (or that is not a folder: a hub id, a GGUF file, checked elsewhere). `available`: the bytes
    free for it (default: available_bytes(device))."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return  # not a model folder of files: transformers says what is missing
    config = read_json(folder / "config.json")
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (folder / name).is_file():
            read_json(folder / name)
    weights = folder_weights(folder)
    if weights is None:
        return
    described = None if config.get("quantization_config") else config_parameters(config)
    if described is not None and described >= MISMATCH * max(1, weights.parameters):
        sizes = ", ".join(f"{k} {config[k]}" for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                      "vocab_size") if k in config)
        raise ModelFolderProblem(f"{folder}/config.json describes about {count(described)} parameters ({sizes}), its "
                                 f"weights hold {count(weights.parameters)}: config and weights do not belong together; "
                                 "put back the model's own config.json")
    if (different := first_different_shape(folder, weights)) is not None:
        name, held, wanted = different
        raise ModelFolderProblem(f"{folder}: its weights hold {name} of shape {list(held)}, its config.json describes "
                                 f"{list(wanted)}: config and weights do not belong together; put back the model's own "
                                 "config.json")
    master = master and not lora
    need = needed_bytes(weights, dtype, trainable, lora, master, noise)
    have = available_bytes(device) if available is None else available
    if have is None or need <= have:
        return
    wide = DTYPE_BYTES.get(dtype, 4) > 2
    smaller = [("--dtype bfloat16", "bfloat16", lora, master)] if wide else []  # (flags, dtype, lora, master)
    if master:
        smaller += [("--master-weights none", dtype, False, False)]
        smaller += [("--dtype bfloat16 --master-weights none", "bfloat16", False, False)] if wide else []
    if not lora:
        smaller += [("--lora-r 16", dtype, True, False)]
        smaller += [("--lora-r 16 --dtype bfloat16", "bfloat16", True, False)] if wide else []
    fitting = next(((flags, n) for flags, d, lo, m in smaller
                    if (n := needed_bytes(weights, d, trainable, lo, m, noise)) <= have), None)
    if fitting is not None:
        advice = f"{fitting[0]} would need about {gb(fitting[1])}"
    else:
        advice = "no setting of esft makes it fit here (LoRA-ES in bfloat16 still needs the weights); use a machine " \
                 "with more memory"
    what = "weights" if lora else f"{dtype} weights and a float32 master" if master else f"{dtype} weights, no master"
    raise ModelFolderProblem(f"{folder} needs about {gb(need)} ({count(weights.parameters)} parameters: {what}), "
                             f"{gb(have)} available here; {advice}")
