"""Run reward code in worker processes, so that its failures cost only the samples concerned.

What is contained: exceptions, wrong return values, hangs (a per-job deadline), memory exhaustion
(RLIMIT_AS per worker, `memory_mb`), crashes (os._exit, segfaults, the OOM killer), a forkserver
killed by user code, replies forged by forked copies, output (captured, only a bounded tail kept
for error messages: esft.rewards.containment), and child processes, also ones that detach with
`setsid` or a double fork (each worker is a child subreaper and its whole tree is stopped and
killed when it is retired, times out, or the trainer ends). What is NOT contained: the worker runs
as the trainer's user with its environment variables, files, network and GPU, so reward code can
read, write or delete anything that user can, open connections, or signal other processes of that
user. It is a guard against careless code, not a security boundary for hostile code: run code you
do not trust in a container or VM.

A `WorkerPool` keeps up to `workers` long-lived processes (forkserver context on Linux, spawn
elsewhere: never a fork of the torch-laden trainer, and never a re-run of the user's main program).
Each job is one call `target(*args, **kwargs)` with a deadline; targets and callables among the
arguments are `esft.rewards.usercode` Shipped values (by reference, or cloudpickled by value: sent once per
worker, then named by key). A job that raises comes back as an error (with the traceback lines in
the user's code and the tail of its output); one that passes its deadline has its worker's whole
tree killed; one whose worker dies comes back as a crash. Dead or killed workers are replaced on the
next job, and a dead forkserver is restarted, so the caller never stalls.

Every job carries an id and every reply names it: a reply that belongs to no job in flight (a
forked copy of a worker answering twice) is dropped. Workers lead their own process group, cap
their address space with RLIMIT_AS (`memory_mb`; a cap above the process's hard limit is lowered
to it, said in one warning), ignore Ctrl-C (the trainer handles it), and a watchdog thread kills
their tree when the trainer process ends, however it ends (even SIGKILL).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from esft.child_processes import main_module_hidden
from esft.rewards.containment import OutputTail, applicable_memory_mb, become_subreaper, kill_tree
from esft.rewards.usercode import ByValue, describe, resolve, user_traceback, worker_sys_path

STARTUP_TIMEOUT = 120.0
"""Seconds a new worker may take to start and import `preload` (not counted against job timeouts)."""
START_ATTEMPTS = 3
"""Tries to start a worker (a forkserver killed by user code is restarted in between)."""


@dataclass
class Outcome:
    """What became of one job: kind is "ok", "error", "timeout" or "crash"."""

    kind: str
    value: Any = None
    message: str = ""
    traceback: str = ""
    """For errors: the traceback lines in the user's code (esft's own frames left out)."""
    output: str = ""
    """The last lines the job printed (stdout and stderr, at most containment.OUTPUT_TAIL bytes)."""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


# ---------------------------------------------------------------------------------- worker side
def _watch_parent(liveness) -> None:
    """Block until the trainer's end of `liveness` closes (the trainer exited or closed the pool),
    then kill this worker's tree and process group: the worker and whatever it started."""
    try:
        liveness.recv()
    except (EOFError, OSError):
        pass
    try:
        kill_tree(os.getpid())
    finally:
        os.killpg(0, signal.SIGKILL)


def _worker_main(conn, liveness, memory_mb: int, preload: Sequence[str], sys_path: Sequence[str],
                 environ: dict[str, str]) -> None:
    os.setpgid(0, 0)  # lead a process group: a timeout kills the worker and every child it started
    become_subreaper()  # children that detach (setsid, double fork) stay below the worker, to be killed with it
    output = OutputTail()  # a reward's prints never reach the trainer's stdout; an error keeps their tail
    threading.Thread(target=_watch_parent, args=(liveness,), daemon=True, name="esft-watchdog").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:
        try:
            import resource

            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):  # not enforceable on this platform
            pass
    sys.path[:0] = [entry for entry in sys_path if entry not in sys.path]
    os.environ.clear()  # the trainer's environment now, not the forkserver's from when it started
    os.environ.update(environ)
    for name in preload:  # "module" or "module:function" (called once, e.g. to warm caches)
        module_name, _, function = name.partition(":")
        module = importlib.import_module(module_name)
        if function:
            getattr(module, function)()
    pid = os.getpid()
    conn.send(("ready", pid))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if message is None:  # retired: end what the jobs started while it is still ours (once this worker
            kill_tree(pid)  # exits, detached children go to init and the trainer's kill_tree finds nothing)
            return
        job_id, target, args, kwargs = message
        output.take()  # what earlier jobs printed is not this job's
        try:
            reply = (job_id, "ok", resolve(target)(*args, **kwargs), False, "")
        except MemoryError as error:
            reply = (job_id, "error", describe(error), True, user_traceback(error))  # the heap may be broken: recycle
        except BaseException as error:  # noqa: BLE001 - SystemExit from user code is a failure too
            reply = (job_id, "error", describe(error), False, user_traceback(error))
        reply = (*reply, output.take())  # the tail of what the job printed, for error messages
        if os.getpid() != pid:
            os._exit(0)  # a copy made by os.fork() in user code: only the worker itself answers
        try:
            conn.send(reply)
        except Exception as error:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send((job_id, "error", f"result could not be sent back: {describe(error)}", False, "", reply[5]))


# ---------------------------------------------------------------------------------- parent side
class _Worker:
    def __init__(self, context, liveness, memory_mb: int, preload: Sequence[str]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, daemon=True, name="esft-sandbox",
                                       args=(child, liveness, memory_mb, tuple(preload), worker_sys_path(),
                                             dict(os.environ)))
        # Workers never need the parent's main program: user code arrives by value.
        try:
            with main_module_hidden():
                self.process.start()
        finally:
            child.close()
        self.ready = False
        self.started = time.monotonic()
        self.job: int | None = None
        """Index (in the current run) of the job in flight."""
        self.job_id: int | None = None
        self.deadline = 0.0
        self.known: set[str] = set()
        """Keys of the ByValue callables this worker has already received."""
        self.pending_keys: list[str] = []
        """Keys the job in flight carries (known once it succeeds)."""
        self.orphaned = False
        """Its forkserver died (user code can kill it): its exit can then only be seen as the pipe's EOF."""

    def kill(self) -> None:
        """SIGKILL the worker's tree (it and every descendant, detached ones included), its process
        group, then the worker itself."""
        pid = self.process.pid
        kill_tree(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass  # no such group: the worker is gone, or died before it made its group
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: existence is all we can tell


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


def _strip_known(job: tuple, known: set[str]) -> tuple[tuple, list[str]]:
    """The job with ByValue payloads this worker already holds left out; and the keys it carries."""
    target, args, kwargs = job
    keys = []

    def light(value):
        if isinstance(value, ByValue):
            keys.append(value.key)
            return value.without_payload() if value.key in known else value
        return value

    return (light(target), tuple(light(a) for a in args), kwargs), keys


class WorkerPool:
    """Up to `workers` processes running jobs with per-job timeouts; repaired as it goes."""

    def __init__(self, workers: int = 2, memory_mb: int = 0, preload: Sequence[str] = (), context=None):
        self.size = max(1, workers)
        self.memory_mb = applicable_memory_mb(memory_mb)
        self.preload = tuple(preload)
        self.context = context or default_context()
        self.workers: list[_Worker] = []
        self.replaced = 0
        """Workers killed or lost and replaced so far."""
        self.strays = 0
        """Replies dropped because they belonged to no job in flight."""
        self._ids = itertools.count()
        # The trainer holds the writing end and never writes: it closes when the trainer exits.
        self._liveness_reader, self._liveness_writer = self.context.Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, _kill_all, self.workers, self._liveness_writer)

    def _start_worker(self) -> _Worker:
        for attempt in range(START_ATTEMPTS):
            try:
                return _Worker(self.context, self._liveness_reader, self.memory_mb, self.preload)
            except (OSError, EOFError) as error:  # e.g. user code killed the forkserver: it restarts
                if attempt == START_ATTEMPTS - 1:
                    raise RuntimeError(f"cannot start a sandbox worker process: {describe(error)}") from error
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def run(self, jobs: Sequence[tuple[Any, tuple, dict]], timeout: float) -> list[Outcome]:
        """Run every (target, args, kwargs) job; each gets `timeout` seconds once a worker has it."""
        outcomes: list[Outcome | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        resent: dict[int, int] = {}
        while pending or any(w.job is not None for w in self.workers):
            while len(self.workers) < min(self.size, len(pending) + sum(w.job is not None for w in self.workers)):
                try:
                    self.workers.append(self._start_worker())
                except RuntimeError as error:
                    while pending:
                        outcomes[pending.popleft()] = Outcome("crash", message=str(error))
                    break
            for worker in self.workers:
                if worker.process is not None and worker.ready and worker.job is None and pending:
                    index = pending.popleft()
                    job, keys = _strip_known(jobs[index], worker.known)
                    job_id = next(self._ids)
                    try:
                        worker.conn.send((job_id, *job))
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
                    worker.job, worker.job_id, worker.deadline = index, job_id, time.monotonic() + timeout
                    worker.pending_keys = keys
            self.workers[:] = [w for w in self.workers if w.process is not None]
            self._wait(outcomes, pending, timeout)
        return outcomes  # type: ignore[return-value]

    def _wait(self, outcomes, pending, timeout: float) -> None:
        now = time.monotonic()
        deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT for w in self.workers]
        waitables = {}
        for worker in self.workers:
            waitables[worker.conn] = worker
            if not worker.orphaned:
                waitables[worker.process.sentinel] = worker
        if not waitables:
            return
        ready = wait(list(waitables), timeout=max(0.0, min(deadlines) - now) if deadlines else None)
        for worker in {id(waitables[item]): waitables[item] for item in ready}.values():
            self._receive(worker, outcomes, pending)
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

    def _receive(self, worker: _Worker, outcomes, pending) -> None:
        """Take every reply waiting on `worker`'s pipe; then, if it died, fail its job."""
        closed = False
        while worker.process is not None:
            try:
                message = worker.conn.recv() if worker.conn.poll() else None
            except (EOFError, OSError):
                message, closed = None, True
            if message is None:
                break
            if message[0] == "ready":
                worker.ready = True
                continue
            job_id, kind, value, recycle, detail, printed = message
            if worker.job is None or job_id != worker.job_id:
                self.strays += 1  # not the job in flight: a duplicate from a forked copy, or late
                continue
            outcomes[worker.job] = (Outcome("ok", value, output=printed) if kind == "ok" else
                                    Outcome("error", message=value, traceback=detail, output=printed))
            if kind == "ok":
                worker.known.update(worker.pending_keys)
            worker.job = None
            if recycle:
                self._drop(worker)
        if worker.process is None:
            return
        if not closed and not worker.orphaned and not worker.process.is_alive() and _pid_alive(worker.process.pid):
            worker.orphaned = True  # the forkserver died, not the worker: watch its pipe from now on
        if closed or (not worker.orphaned and not worker.process.is_alive()):
            worker.process.join(1)
            if worker.job is not None:
                outcomes[worker.job] = Outcome("crash", message=_exit_message(worker.process))
                worker.job = None
            elif not worker.ready:  # died while starting: fail what waits rather than loop
                text = f"worker failed to start ({_exit_message(worker.process)})"
                while pending:
                    outcomes[pending.popleft()] = Outcome("crash", message=text)
            self._drop(worker)

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


def _kill_all(workers: list[_Worker], liveness_writer) -> None:
    for worker in workers:
        if worker.process is not None:
            kill_tree(worker.process.pid)
            try:
                os.killpg(worker.process.pid, signal.SIGKILL)
            except OSError:
                pass
    liveness_writer.close()

