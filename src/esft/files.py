"""Writing files so that a crash never leaves half of one, fingerprints to check them later, reading
files that a run directory or a run's settings name without hanging on or flooding from them, and
telling a data path from a dataset name."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
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


KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SETTINGS_LIMIT = 16 * MIB
"""The largest settings file (trainer_state.json, config.yaml, status.json, --config) esft reads."""
METRICS_LIMIT = 1 * GIB
"""The largest metrics.jsonl esft reads (10^6 iterations of 1 KiB rows)."""
DATA_LIMIT = 4 * GIB
"""The largest data file (--train-data, --eval-data) esft reads into memory."""


class NotARegularFile(OSError):
    """A file esft would read that is a pipe, a device, a socket, a link (where links are refused) or
    larger than its bound; str() and strerror say which."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike, limit: int, follow_links: bool = False) -> bytes:
    """The bytes of `path`, opened only as a regular file: never blocking on a named pipe, never
    reading a device (/dev/zero never ends), and by default not through a symbolic link (a run
    directory's own files are never links); at most `limit` bytes. Anything else raises
    NotARegularFile (an OSError, so callers' OSError handling covers it), other failures OSError."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_links:
            raise NotARegularFile(errno.ELOOP, "a symbolic link (esft reads a run's own files only)", str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(errno.EINVAL, f"{_kind(info.st_mode)}, not a regular file", str(path))
        if info.st_size > limit:
            raise NotARegularFile(errno.EFBIG, f"larger than esft reads ({info.st_size} bytes > {_size(limit)})", str(path))
        chunks, total = [], 0
        while chunk := os.read(fd, min(MIB, limit + 1 - total)):  # a file that grows while read is still bounded
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise NotARegularFile(errno.EFBIG, f"larger than esft reads (> {_size(limit)})", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest ancestor that does: where making `path` would start (a file
    there, or a folder this user cannot write to, says before any work that it cannot be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_regular_text(path: str | os.PathLike, limit: int, follow_links: bool = False, errors: str = "strict") -> str:
    """read_regular decoded as UTF-8 (UnicodeDecodeError unless `errors` says otherwise)."""
    return read_regular(path, limit, follow_links).decode("utf-8", errors=errors)


def _size(limit: int) -> str:
    return next(f"{limit // unit} {name}" for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"), (1, "bytes"))
                if limit >= unit)


def open_for_append(path: str | os.PathLike):
    """A text handle appending to `path` (created if missing), which must be a regular file of its own:
    not a link, not a pipe, not a hard link shared with a file elsewhere (the row would land there too)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else f"a hard link ({info.st_nlink} names for one file)"
        raise NotARegularFile(errno.EINVAL, f"{what}: esft appends only to a file of its own", str(path))
    return os.fdopen(fd, "a", encoding="utf-8")


YAML_NODE_BUDGET = 100_000
"""The most nodes a YAML document may expand to through its aliases (a settings file has a few hundred)."""


class YamlTooLarge(ValueError):
    """A YAML document whose aliases expand beyond YAML_NODE_BUDGET nodes (or refer to themselves)."""


def _yaml_loader():
    import yaml

    class BudgetLoader(yaml.SafeLoader):
        """yaml.SafeLoader that counts what its aliases expand to: 340 bytes of nested aliases make
        10^9 nodes, which nothing in esft needs and which any message that echoed them would print."""

        def compose_document(self):
            node = super().compose_document()
            _expanded_size(node, {}, set())
            return node

    return BudgetLoader


def _expanded_size(node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise YamlTooLarge("an alias refers to the node that holds it (a recursive document)")
    open_nodes.add(id(node))
    children = node.value if isinstance(node.value, list) else []
    size = 1
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):  # a mapping's (key, value) pairs
            size += _expanded_size(part, sizes, open_nodes)
            if size > YAML_NODE_BUDGET:
                raise YamlTooLarge(f"its aliases expand to more than {YAML_NODE_BUDGET} values (an alias bomb?)")
    open_nodes.discard(id(node))
    sizes[id(node)] = size
    return size


def load_yaml(text: str):
    """yaml.safe_load with an alias budget: YamlTooLarge beyond it, yaml.YAMLError for bad YAML,
    RecursionError never (nesting too deep is a YamlTooLarge too)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise YamlTooLarge("nested too deeply") from None
