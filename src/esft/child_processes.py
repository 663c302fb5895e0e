"""Starting child processes without re-running the user's main program or leaving their socket files behind."""

from __future__ import annotations

import os
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def main_module_hidden() -> Iterator[None]:
    """While open, `__main__` is an empty module. A process started with spawn or forkserver imports
    its parent's main script again (as `__mp_main__`); for a user's script without an
    `if __name__ == "__main__":` guard that re-runs the whole script in the child (a second trainer,
    its side effects) and ends in multiprocessing's "bootstrapping phase" RuntimeError. The children
    esft starts (reward workers, vLLM's engine core) need only importable code, so they lose nothing.
    Notebooks, `python -c` and standard input have no main file and were never affected."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """While open, os.environ also holds `values`, so that child processes started meanwhile inherit
    them; afterwards each variable is as it was (set to its old value, or unset)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


SOCKET_PATH_MAX = 103
"""The longest path a Unix socket can be bound to everywhere (sun_path: 108 bytes on Linux, 104 on macOS)."""


def new_socket_directory(name_length: int = 36) -> str | None:
    """A new, empty directory for socket files named with `name_length` characters (vLLM: a uuid4), under
    the temporary directory, or under /tmp where that path would be too long to bind (a long TMPDIR, as
    on macOS); None if neither fits."""
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        if len(os.path.join(base, "esft-12345678", "x" * name_length)) <= SOCKET_PATH_MAX and os.path.isdir(base):
            return tempfile.mkdtemp(prefix="esft-", dir=base)
    return None
