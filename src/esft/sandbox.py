"""Run untrusted code (user reward functions, math checks) in worker processes.

A `WorkerPool` keeps up to `workers` long-lived processes (forkserver context on Linux, spawn
elsewhere: never a fork of the torch-laden trainer). Each job is one call `target(*args, **kwargs)`
with a deadline. A job that raises comes back as an error; one that passes its deadline has its
worker killed (SIGKILL); one whose worker dies (os._exit, a segfault, the kernel's OOM killer) comes
back as a crash. Dead or killed workers are replaced on the next job, so the caller never stalls.
Workers cap their address space with RLIMIT_AS (`memory_mb`), ignore Ctrl-C (the trainer handles
it) and import nothing heavy: only this module, the target's module and `preload`.

Targets are `FuncRef`s (module, qualified name, and the file to load the module from when it is not
importable by name, e.g. a `path/to/file.py` or the `__main__` script), or pickled callables.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import types
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

STARTUP_TIMEOUT = 120.0
"""Seconds a new worker may take to start and import `preload` (not counted against job timeouts)."""


@dataclass(frozen=True)
class FuncRef:
    """A module-level function the worker imports by name (or loads from `file`)."""

    module: str
    qualname: str
    file: str | None = None


@dataclass
class Outcome:
    """What became of one job: kind is "ok", "error", "timeout" or "crash"."""

    kind: str
    value: Any = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def func_ref(func: Callable) -> FuncRef | bytes | None:
    """How to send `func` to a worker: a FuncRef for a module-level function, pickled bytes for
    other picklable callables (functools.partial of functions, instances of module-level classes),
    None when it cannot leave this process (lambdas, closures)."""
    module_name = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if module_name and qualname and "<" not in qualname and hasattr(func, "__code__"):
        file = getattr(sys.modules.get(module_name), "__file__", None)
        if module_name == "__main__" and not file:
            return None  # an interactive session: nothing to import in a worker
        return FuncRef(module_name, qualname, os.path.abspath(file) if file else None)
    try:
        return pickle.dumps(func)
    except Exception:  # noqa: BLE001 - anything unpicklable stays in-process
        return None


_RESOLVED: dict[Any, Callable] = {}


def resolve(ref: FuncRef | bytes | Callable) -> Callable:
    """The callable behind a FuncRef or pickled bytes (cached per process). A FuncRef's module is
    imported by name, else (the `__main__` script, a file loaded by path) loaded from its file."""
    if callable(ref) and not isinstance(ref, FuncRef):
        return ref
    if ref in _RESOLVED:
        return _RESOLVED[ref]
    if isinstance(ref, bytes):
        func = pickle.loads(ref)
    else:
        if ref.module == "__main__":
            module = load_module_from_file(ref.file, "__esft_main__")
        else:
            try:
                module = importlib.import_module(ref.module)
            except ImportError:
                if ref.file is None:
                    raise
                module = load_module_from_file(ref.file, ref.module)
        func = module
        for part in ref.qualname.split("."):
            func = getattr(func, part)
    _RESOLVED[ref] = func
    return func


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


def describe(error: BaseException) -> str:
    """`Type: message` plus the innermost frame, on one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(error).__name__}: {text}{where}" if text else f"{type(error).__name__}{where}"


# ---------------------------------------------------------------------------------- worker side
def _worker_main(conn, memory_mb: int, preload: Sequence[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:
        try:
            import resource

            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):  # not enforceable on this platform
            pass
    for name in preload:  # "module" or "module:function" (called once, e.g. to warm caches)
        module_name, _, function = name.partition(":")
        module = importlib.import_module(module_name)
        if function:
            getattr(module, function)()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        ref, args, kwargs = message
        try:
            reply = ("ok", resolve(ref)(*args, **kwargs), False)
        except MemoryError as error:
            reply = ("error", describe(error), True)  # the heap may be in a bad state: recycle
        except BaseException as error:  # noqa: BLE001 - SystemExit from user code is a failure too
            reply = ("error", describe(error), False)
        try:
            conn.send(reply)
        except Exception as error:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", f"result could not be sent back: {describe(error)}", False))


# ---------------------------------------------------------------------------------- parent side
class _Worker:
    def __init__(self, context, memory_mb: int, preload: Sequence[str]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, memory_mb, tuple(preload)), daemon=True)
        # Hide __main__ while starting: spawn/forkserver children would re-run the parent's main script
        # (a notebook, stdin, an unguarded script). Workers never need it: resolve() loads the file of
        # a __main__ function itself.
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self.process.start()
        finally:
            sys.modules["__main__"] = main
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.job: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _exit_message(process) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"worker process killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"worker process killed by signal {-code}"
    return f"worker process exited with code {code}"


def default_context():
    """forkserver where available (cheap replacement of killed workers), else spawn."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


class WorkerPool:
    """Up to `workers` processes running jobs with per-job timeouts; repaired as it goes."""

    def __init__(self, workers: int = 2, memory_mb: int = 0, preload: Sequence[str] = (), context=None):
        self.size = max(1, workers)
        self.memory_mb = memory_mb
        self.preload = tuple(preload)
        self.context = context or default_context()
        self.workers: list[_Worker] = []
        self.replaced = 0
        """Workers killed or lost and replaced so far."""
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)

    def run(self, jobs: Sequence[tuple[Any, tuple, dict]], timeout: float) -> list[Outcome]:
        """Run every (target, args, kwargs) job; each gets `timeout` seconds once a worker has it."""
        outcomes: list[Outcome | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        resent: dict[int, int] = {}
        while pending or any(w.job is not None for w in self.workers):
            while len(self.workers) < min(self.size, len(pending) + sum(w.job is not None for w in self.workers)):
                self.workers.append(_Worker(self.context, self.memory_mb, self.preload))
            for worker in self.workers:
                if worker.process is not None and worker.ready and worker.job is None and pending:
                    index = pending.popleft()
                    try:
                        worker.conn.send(jobs[index])
                    except (BrokenPipeError, EOFError, OSError):  # it died while idle: next worker
                        self._drop(worker)
                        resent[index] = resent.get(index, 0) + 1
                        if resent[index] > 2:
                            outcomes[index] = Outcome("crash", message="worker processes keep dying")
                        else:
                            pending.appendleft(index)
                        continue
                    except Exception as error:  # noqa: BLE001 - arguments that do not pickle
                        outcomes[index] = Outcome("error", message=f"arguments could not be sent: {describe(error)}")
                        continue
                    worker.job, worker.deadline = index, time.monotonic() + timeout
            self.workers[:] = [w for w in self.workers if w.process is not None]
            self._wait(outcomes, pending, timeout)
        return outcomes  # type: ignore[return-value]

    def _wait(self, outcomes, pending, timeout: float) -> None:
        now = time.monotonic()
        deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT for w in self.workers]
        waitables = {}
        for worker in self.workers:
            waitables[worker.conn] = worker
            waitables[worker.process.sentinel] = worker
        if not waitables:
            return
        ready = wait(list(waitables), timeout=max(0.0, min(deadlines) - now) if deadlines else None)
        done: set[int] = set()
        for item in ready:
            worker = waitables[item]
            if id(worker) in done:
                continue
            done.add(id(worker))
            try:
                message = worker.conn.recv() if worker.conn.poll() else None
            except (EOFError, OSError):
                message = None
            if message is not None and message[0] == "ready":
                worker.ready = True
                continue
            if message is not None and worker.job is not None:
                kind, value, recycle = message
                outcomes[worker.job] = Outcome("ok", value) if kind == "ok" else Outcome("error", message=value)
                worker.job = None
                if recycle:
                    self._drop(worker)
                continue
            if not worker.process.is_alive() or message is None:
                worker.process.join(1)
                if worker.job is not None:
                    outcomes[worker.job] = Outcome("crash", message=_exit_message(worker.process))
                    worker.job = None
                elif not worker.ready:  # died while starting: fail what waits rather than loop
                    text = f"worker failed to start ({_exit_message(worker.process)})"
                    while pending:
                        outcomes[pending.popleft()] = Outcome("crash", message=text)
                self._drop(worker)
        now = time.monotonic()
        for worker in [w for w in self.workers if w.process is not None]:
            if worker.job is not None and now >= worker.deadline:
                outcomes[worker.job] = Outcome("timeout", message=f"no result within {timeout:g} s; worker killed")
                worker.job = None
                self._drop(worker)
            elif not worker.ready and now >= worker.started + STARTUP_TIMEOUT:
                self._drop(worker)
                while pending:
                    outcomes[pending.popleft()] = Outcome("crash", message=f"worker did not start within {STARTUP_TIMEOUT:g} s")
        self.workers[:] = [w for w in self.workers if w.process is not None]

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        worker.process = None  # marks it for removal
        self.replaced += 1

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None]

    def close(self) -> None:
        """Stop every worker (also done automatically when the pool is garbage-collected)."""
        for worker in self.workers:
            if worker.process is not None:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
                worker.kill()
        self.workers.clear()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process is not None and worker.process.is_alive():
            worker.process.kill()


# ------------------------------------------------------------------------- reward calls
def clean_values(raw: Any, n: int) -> tuple[list[float | None], dict[int, str]]:
    """A reward function's return value as n floats/None plus {index: error} for non-numbers and
    NaN/inf (failures). Raises ValueError when it is not a sequence of n values."""
    if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__len__") or not hasattr(raw, "__iter__"):
        raise ValueError(f"returned {_short(raw)} ({type(raw).__name__}); expected a list of {n} floats or None")
    if len(raw) != n:
        raise ValueError(f"returned {len(raw)} values for {n} completions")
    values: list[float | None] = []
    errors: dict[int, str] = {}
    for index, value in enumerate(raw):
        if value is None:
            values.append(None)
            continue
        number = None
        if not isinstance(value, (str, bytes)):
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                number = None
        if number is None:
            errors[index] = f"returned {_short(value)} ({type(value).__name__}), not a number"
        elif number != number or number in (float("inf"), float("-inf")):
            errors[index] = f"returned {number}"
            number = None
        values.append(number)
    return values, errors


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def call_reward(ref: Any, kwargs: dict[str, list], n: int) -> tuple[list[float | None], dict[int, str], str | None]:
    """Run a reward function on a batch: `func(**kwargs)`, every kwarg a list of n items.

    Returns n values (None = no score or failed), {index: error message} for failed samples, and the
    batch call's error if it failed: then every sample was retried alone, so one bad completion costs
    only its own score. Runs in a worker (sandboxed) or in-process (trusted, --no-reward-sandbox).
    """
    func = resolve(ref)
    try:
        return (*clean_values(func(**kwargs), n), None)
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - user code may raise anything
        batch_error = describe(error)
    if n == 1:
        return [None], {0: batch_error}, batch_error
    values: list[float | None] = []
    errors: dict[int, str] = {}
    for index in range(n):
        try:
            (value,), one_error = clean_values(func(**{k: v[index : index + 1] for k, v in kwargs.items()}), 1)
            if one_error:
                errors[index] = one_error[0]
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001
            value, errors[index] = None, describe(error)
        values.append(value)
    return values, errors, batch_error
