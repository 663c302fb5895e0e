"""What a sandbox worker (esft.rewards.sandbox) does to keep careless reward code from outliving or
flooding the run. Used on both sides: the worker captures its own output and adopts orphans; the
trainer ends a retired worker's whole tree.

- Every descendant ends with its worker: the worker is a Linux child subreaper (prctl
  PR_SET_CHILD_SUBREAPER), so a child that detaches (`setsid`, a double fork) is re-parented to the
  worker instead of to init, and `kill_tree` stops (SIGSTOP) the worker and every process below it
  before killing them all (SIGKILL), so nothing can fork its way out meanwhile.
- Output is captured: the worker's stdout and stderr (file descriptors 1 and 2, inherited by its
  children) go to a pipe that a thread drains, keeping only the last `OUTPUT_TAIL` bytes of the job
  in flight; an error's message carries that tail. Printing 100 MB costs the run nothing but the time.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import select
import signal
import sys
import threading

logger = logging.getLogger("esft")
PR_SET_CHILD_SUBREAPER = 36
OUTPUT_TAIL = 2000
"""Bytes of a job's output kept for its error message."""


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux 3.4+); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill_tree(pid: int) -> None:
    """SIGSTOP `pid` and every descendant (until no new one appears), then SIGKILL them all. The
    calling process itself is never signalled (a worker's watchdog ends its own tree this way)."""
    import psutil

    me = os.getpid()
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    frozen: dict[int, psutil.Process] = {}
    for _ in range(20):  # each round stops what the previous round could still have started
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.Error:
            found = [root]
        new = [p for p in found if p.pid not in frozen and p.pid != me]
        if not new:
            break
        for process in new:
            frozen[process.pid] = process
            try:
                process.send_signal(signal.SIGSTOP)
            except psutil.Error:
                pass
    for process in frozen.values():
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


class OutputTail:
    """This process's fds 1 and 2 redirected to a pipe, drained by a thread; `take()` is the last
    OUTPUT_TAIL bytes written since the previous `take()`, as text."""

    def __init__(self) -> None:
        self._read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._tail: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._drain_forever, daemon=True, name="esft-output").start()

    def _drain(self, wait: float) -> bool:
        """Read what the pipe holds (waiting up to `wait` s for something); False once it is closed."""
        if not select.select([self._read], [], [], wait)[0]:
            return True
        with self._lock:
            for _ in range(64):  # a bounded hold: take() gets its turn even under a flood
                if not select.select([self._read], [], [], 0)[0]:
                    break
                data = os.read(self._read, 1 << 16)
                if not data:
                    return False
                self._tail.append(data)
                self._size += len(data)
                while self._size - len(self._tail[0]) >= OUTPUT_TAIL:
                    self._size -= len(self._tail.popleft())
        return True

    def _drain_forever(self) -> None:
        try:
            while self._drain(0.5):
                pass
        except OSError:
            pass

    def take(self) -> str:
        """The job's captured output (its last OUTPUT_TAIL bytes), then forget it."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        self._drain(0)
        with self._lock:
            data = b"".join(self._tail)[-OUTPUT_TAIL:]
            self._tail.clear()
            self._size = 0
        return data.decode("utf-8", errors="replace")


def applicable_memory_mb(memory_mb: int) -> int:
    """The address-space cap workers can take: `memory_mb`, or the process's hard limit when that is
    lower (an unprivileged process cannot raise it), said in one warning rather than dropped."""
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    except (ImportError, OSError, ValueError):
        if memory_mb:
            logger.warning("--reward-memory-mb %d cannot be applied on this platform: reward workers run without a "
                           "memory cap", memory_mb)
        return memory_mb
    if memory_mb and hard != resource.RLIM_INFINITY and memory_mb * 1024 * 1024 > hard:
        logger.warning("--reward-memory-mb %d is above this process's hard address-space limit (%d MiB, ulimit -Hv): "
                       "reward workers are capped at %d MiB instead", memory_mb, hard // (1024 * 1024),
                       hard // (1024 * 1024))
        return max(1, hard // (1024 * 1024))
    return memory_mb
