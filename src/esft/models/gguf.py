"""A GGUF file (llama.cpp's format) as `--model`: transformers' GGUF loader dequantizes it to float32 once,
into a safetensors folder in esft's cache keyed by the file's digest; every engine, `esft eval` and
`final/` then see a normal Hugging Face model folder."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

from esft.files import directory_written_atomically

MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""
READY = "esft-gguf.txt"
"""Written last into a converted folder: the folder is complete (and names its source)."""


def cache_root() -> Path:
    """esft's cache: $ESFT_CACHE, else $XDG_CACHE_HOME/esft, else ~/.cache/esft."""
    if os.environ.get("ESFT_CACHE"):
        return Path(os.environ["ESFT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "esft"


def is_gguf(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


def gguf_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be loaded as a GGUF model (what and how to fix), None if it can."""
    path = Path(path).expanduser()
    if not path.is_file():
        return f"GGUF file {str(path)!r} does not exist (or is not a regular file)"
    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            return f"{str(path)!r} is not a GGUF file (it does not start with 'GGUF'); give a .gguf model file"
    missing = gguf_package_missing()
    return f"{str(path)!r} is a GGUF file, and loading one {missing}" if missing else None


def gguf_package_missing() -> str | None:
    """What to install when a package transformers reads GGUF files with is missing, else None: gguf, and
    accelerate (transformers' from_pretrained refuses a gguf_file without it)."""
    missing = []
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if not missing:
        return None
    return f"needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: pip install 'esft[gguf]'"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@functools.lru_cache(maxsize=8)
def _digest_of(path: Path, size: int, mtime_ns: int) -> str:
    """sha256_of, once per version of a file in this process (model_path asks for the folder several times
    a run; a large GGUF file takes seconds to hash)."""
    return sha256_of(path)


class GGUFError(ValueError):
    """A GGUF file that transformers cannot read; the message names it and says what to do."""


def converted_folder(path: str | os.PathLike) -> Path:
    """The safetensors folder of GGUF file `path`, converted on first use (said in one line) and reused after."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    digest = _digest_of(path, stat.st_size, stat.st_mtime_ns)
    target = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if not (target / READY).is_file():
        print(f"esft: {path.name} is a GGUF file: transformers dequantizes it to float32 into {target} (once)",
              file=sys.stderr, flush=True)
        convert(path, target, f"{path} (sha256 {digest})")
    return target


def convert(path: Path, target: Path, source: str) -> None:
    """Load GGUF file `path` with transformers (dequantized to float32) and write it with its tokenizer and
    chat template to `target` as safetensors, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notices are not esft's output (its progress bar stays: a minute on a CPU)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - gguf's reader: ValueError, struct.error, UnicodeDecodeError, a
        # Rust panic from the tokenizers library (a BaseException), MemoryError for counts of 2^62
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise GGUFError(f"{path} cannot be read as a GGUF model ({type(error).__name__}"
                        f"{': ' + first[:200] if first else ''}): the file is damaged, truncated or not a model "
                        "transformers reads; download it again") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # the weights are plain float32 now; transformers still marks the model as GGUF-quantized and refuses to
    # save it ("quantized with gguf and is not serializable") until the marks are gone
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.config.__dict__.pop("_is_quantized", None)
    with directory_written_atomically(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / READY).write_text(f"converted from {source} by esft (transformers' GGUF loader, float32)\n")
