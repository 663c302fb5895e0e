"""Starting child processes without re-running the user's main program."""

from __future__ import annotations

import sys
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
