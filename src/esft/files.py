"""Writing files so that a crash never leaves half of one, fingerprints to check them later, and
telling a data path from a dataset name."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_temporary_dir(directory: Path, name: str) -> Path:
    """A hidden temporary sibling `.<name>.*.tmp` of the directory-to-be, with normal permissions
    (mkdtemp's 0700 would survive the rename)."""
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{name}.", suffix=".tmp"))
    tmp.chmod(0o777 & ~_umask())
    return tmp


@contextmanager
def directory_written_atomically(path: Path) -> Iterator[Path]:
    """Yields a temporary sibling directory to write into; when the block ends, it replaces `path` (a
    directory already there is removed), and if the block raises it is removed and `path` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temporary_dir(path.parent, path.name)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: temp file in the same directory, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would survive the rename
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_digest(path: Path) -> str:
    """blake2b of a file's bytes (hex), read in chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=20)).hexdigest()


def directory_digests(directory: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: file_digest} of every file under `directory` except the relative paths in `skip`
    (a file of that name in a subdirectory, such as a GRPO checkpoint's trl/trainer_state.json, counts)."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): file_digest(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and str(p.relative_to(directory)) not in skip}


DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_path(source: str) -> bool:
    """True unless `source` could be a dataset name ("name" or "org/name" without a data suffix)."""
    return (
        source.lower().endswith(DATA_SUFFIXES)
        or source.startswith((".", "/", "~"))
        or not _DATASET_NAME.match(source)
        or Path(source).exists()
    )
