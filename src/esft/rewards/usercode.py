"""Loading the user's code, and sending it to other processes: one place for tasks, reward functions,
the reward sandbox and Ray actors.

- `load_callable("module:fn" | "path/to/file.py:fn")`: what `--task` and `--reward-funcs` name;
  `source_file(spec)`: the file it would load, found without importing it (esft.runs.named_files).
- `ship(func)`: how a callable reaches a worker process. A function that a fresh process can import
  by name goes by reference (module + qualified name); anything else goes by value with cloudpickle
  (the library Ray, Dask and joblib use for this): functions of the `__main__` script (guarded or
  not), of code on standard input or `python -c`, of a Jupyter/IPython cell, lambdas, closures,
  `functools.partial`s, callable objects, bound methods, and functions of files loaded by path.
  So a worker never imports or executes the user's main program.
- `resolve(shipped)`: the callable again, on the other side (cached per process).
- `describe(error)` / `user_traceback(error)`: an exception on one line, and the traceback lines that
  point into the user's code (not into esft's), for error messages.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USER_MODULE_PREFIX = "_esft_user_"
"""Modules loaded from a path given by the user (`file.py:fn`) are registered under this prefix."""
_ESFT_DIR = os.path.dirname(os.path.abspath(__file__))


class UserCodeError(ValueError):
    """A `module:function` spec that cannot be loaded; the message says what and how to fix it."""


@dataclass(frozen=True)
class ByReference:
    """A module-level function that a fresh process imports by name."""

    module: str
    qualname: str


@dataclass(frozen=True)
class ByValue:
    """A cloudpickled callable. `payload` may be None once the receiving worker has it (cached by `key`)."""

    key: str
    payload: bytes | None
    name: str = ""

    def without_payload(self) -> ByValue:
        return ByValue(self.key, None, self.name)


Shipped = ByReference | ByValue


# ------------------------------------------------------------------------------ loading
def load_module_from_file(path: str, name: str):
    """Import a Python file as module `name` (registered in sys.modules, so its functions pickle)."""
    if name in sys.modules and os.path.abspath(getattr(sys.modules[name], "__file__", "") or "") == os.path.abspath(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_callable(spec: str, option: str) -> Callable:
    """The function named by "module:function" or "path/to/file.py:function" (`option` names the flag
    in errors)."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise UserCodeError(f"{option} {spec}: expected module:function or path/to/file.py:function")
    if _names_a_file(target):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserCodeError(f"{option} {spec}: {path} is not a file")
        directory = str(path.resolve().parent)
        if directory not in sys.path:
            sys.path.insert(0, directory)  # the file may import its neighbours, as a script would
        digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=4).hexdigest()
        module_name = f"{USER_MODULE_PREFIX}{path.stem}_{digest}"
        loader = lambda: load_module_from_file(str(path.resolve()), module_name)  # noqa: E731
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # `esft` is a console script: make ./my_module.py importable
        loader = lambda: importlib.import_module(target)  # noqa: E731
    try:
        module = loader()
    except ModuleNotFoundError as error:
        raise UserCodeError(f"{option} {spec}: cannot import {target!r} ({error}); is it on PYTHONPATH or in the "
                            "current directory?") from None
    except BaseException as error:  # noqa: BLE001 - whatever the user's module raises while importing
        raise UserCodeError(f"{option} {spec}: importing {target!r} failed: {describe(error)}") from None
    func = getattr(module, name, None)
    if func is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserCodeError(f"{option} {spec}: {target!r} has no {name!r} (it defines: {', '.join(public[:12]) or 'nothing callable'})")
    if not callable(func):
        raise UserCodeError(f"{option} {spec}: {name!r} is a {type(func).__name__}, not a function")
    return func


def _names_a_file(target: str) -> bool:
    """`path/to/file.py` rather than an importable module name (the part of a spec before its ':')."""
    return target.endswith(".py") or os.sep in target or "/" in target


def source_file(spec: str) -> Path | None:
    """The Python file that `load_callable(spec)` would load, found from here without importing or
    executing anything: a path made absolute, or the module's file on the import path load_callable
    uses (the current directory first, as for a console script). None when nothing is found (the load
    would fail), or the module has no file of its own (built in, frozen, a namespace package)."""
    target = spec.rpartition(":")[0]
    if not target:
        return None
    if _names_a_file(target):
        path = Path(target).expanduser()
        return path.resolve() if path.is_file() else None
    module = sys.modules.get(target)  # what import_module would return: the module already loaded
    if module is not None:
        origin = getattr(module, "__file__", None)
        return Path(origin).resolve() if origin else None
    search = sys.path if os.getcwd() in sys.path or "" in sys.path else [os.getcwd(), *sys.path]
    search = [os.path.abspath(entry or os.getcwd()) for entry in search]
    found = None
    for part in target.split("."):  # a.b.c: `a` on the path, then `b` among a's submodules, ...
        found = importlib.machinery.PathFinder.find_spec(part, search)
        if found is None:
            return None
        search = list(found.submodule_search_locations or [])
    origin = found.origin if found is not None else None
    return Path(origin).resolve() if origin and os.path.isfile(origin) else None


# ----------------------------------------------------------------------------- shipping
class NotShippable(Exception):
    """cloudpickle could not serialise the callable (it holds a lock, an open file, a C handle...)."""


def ship(func: Callable) -> Shipped:
    """How `func` reaches a worker: by reference when a fresh process imports it by name, else by
    value (cloudpickle). NotShippable (saying why) when neither works."""
    reference = _by_reference(func)
    if reference is not None:
        return reference
    import cloudpickle

    for module in _user_modules():  # functions of files loaded by path cannot be imported by name
        cloudpickle.register_pickle_by_value(module)
    try:
        payload = _dumps_keeping_filenames(func)
    except Exception as error:  # noqa: BLE001 - any pickling failure means the same
        raise NotShippable(describe(error)) from None
    finally:
        for module in _user_modules():
            cloudpickle.unregister_pickle_by_value(module)
    return ByValue(hashlib.blake2b(payload, digest_size=16).hexdigest(), payload, getattr(func, "__name__", ""))


def _dumps_keeping_filenames(func: Callable) -> bytes:
    """cloudpickle.dumps, except that code objects keep their file name: cloudpickle >= 3.1.3 writes
    "<dynamic-code>" instead (for deterministic payloads), and a failing reward's traceback must name
    the user's file. A code object travels whole through marshal (same interpreter on both sides)."""
    import io
    import marshal
    import types
    from collections import ChainMap

    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: lambda code: (marshal.loads, (marshal.dumps(code),))},
                                  cloudpickle.Pickler.dispatch_table)

    with io.BytesIO() as file:
        Pickler(file).dump(func)
        return file.getvalue()


def _user_modules() -> list:
    return [module for name, module in list(sys.modules.items()) if name.startswith(USER_MODULE_PREFIX)]


def _by_reference(func: Callable) -> ByReference | None:
    """A ByReference for a plain function of a module that a fresh process finds on sys.path."""
    if not hasattr(func, "__code__") or "<" in getattr(func, "__qualname__", "<"):
        return None  # lambdas, closures, partials, objects: by value
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    if module is None or not _importable_by_name(module):
        return None
    target: Any = module
    for part in func.__qualname__.split("."):
        target = getattr(target, part, None)
    return ByReference(module.__name__, func.__qualname__) if target is func else None


def _importable_by_name(module) -> bool:
    """True when `import <module.__name__>` in a fresh process loads this very file."""
    name = module.__name__
    spec = getattr(module, "__spec__", None)
    if name == "__main__" or name.startswith(USER_MODULE_PREFIX) or spec is None or spec.name != name:
        return False
    origin = getattr(module, "__file__", None)
    if origin is None:
        return spec.origin in ("built-in", "frozen")
    found = importlib.machinery.PathFinder.find_spec(name.partition(".")[0], worker_sys_path())
    if found is None or found.origin is None:
        return False
    root = os.path.dirname(found.origin) if found.submodule_search_locations else found.origin
    return os.path.abspath(origin).startswith(os.path.abspath(root))


def worker_sys_path() -> list[str]:
    """This process's import path for a worker (the current directory made absolute): a worker
    started earlier or elsewhere imports the same modules."""
    return [os.path.abspath(entry or os.getcwd()) for entry in sys.path]


_RESOLVED: dict[Any, Callable] = {}


def resolve(shipped: Shipped | Callable) -> Callable:
    """The callable behind a Shipped (cached per process); a callable is returned as it is."""
    if not isinstance(shipped, (ByReference, ByValue)):
        return shipped
    key = shipped.key if isinstance(shipped, ByValue) else shipped
    if key in _RESOLVED:
        return _RESOLVED[key]
    if isinstance(shipped, ByValue):
        if shipped.payload is None:
            raise RuntimeError(f"function {shipped.name or shipped.key} was never sent to this process")
        import cloudpickle

        func = cloudpickle.loads(shipped.payload)
    else:
        func = importlib.import_module(shipped.module)
        for part in shipped.qualname.split("."):
            func = getattr(func, part)
    _RESOLVED[key] = func
    return func


# ----------------------------------------------------------------------------- errors
def describe(error: BaseException) -> str:
    """`Type: message` plus the innermost frame, on one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(error).__name__}: {text}{where}" if text else f"{type(error).__name__}{where}"


def user_traceback(error: BaseException, limit: int = 6) -> str:
    """The traceback lines of frames outside esft (the user's file, cell or stdin), innermost last."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(frame.filename).startswith(_ESFT_DIR + os.sep)
              and "cloudpickle" not in frame.filename]
    return "".join(traceback.format_list(frames[-limit:])).rstrip()
