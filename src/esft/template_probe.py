"""A tokenizer's chat template is code that came with a model folder (the trained model's, a reward model's):
before esft renders with it, one sample is rendered once in a forked child process under a time limit and an
address-space cap, so that a template that loops without end or builds a string of gigabytes is one line
(TemplateProbeError, which the caller words: esft.tasks.loading, esft.rewards.models) instead of a hang or a
MemoryError. An exception the template raises is left to the caller's own rendering in its process."""

from __future__ import annotations

import os
import resource
import select
import signal
from collections.abc import Callable
from typing import Any

PROBE_SECONDS = 30.0
"""Time the first chat prompt may take to render (a sound template takes milliseconds, also on a loaded machine)."""
PROBE_BYTES = 2 << 30
"""Memory the first rendering may add to this process's address space (a chat prompt is kilobytes)."""


class TemplateProbeError(ValueError):
    """A chat template that did not render one sample within the limits; the message says which limit."""


def _address_space() -> int:
    """This process's address-space size in bytes (VmSize), 0 where /proc cannot be read."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def probe_chat_template(render: Callable[[], Any], seconds: float | None = None, extra_bytes: int | None = None,
                        what: str = "the first chat prompt") -> None:
    """Run `render()` (`what`: one sample through the template) in a forked child: TemplateProbeError when it takes
    more than `seconds` (PROBE_SECONDS) or more than `extra_bytes` (PROBE_BYTES) of memory. An exception it raises is
    left for the rendering in this process to report. Where fork is missing, nothing is probed."""
    if not hasattr(os, "fork"):
        return
    seconds = PROBE_SECONDS if seconds is None else seconds
    extra_bytes = PROBE_BYTES if extra_bytes is None else extra_bytes
    size = _address_space()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render once, say how it went, never return into the parent's code
        code = b"error"
        try:
            os.close(read_end)
            if size:
                _, hard = resource.getrlimit(resource.RLIMIT_AS)
                limit = size + extra_bytes
                resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
            render()
            code = b"ok"
        except BaseException as error:  # noqa: BLE001 - any other failure is reported by the rendering in the parent
            while error is not None and not isinstance(error, MemoryError):
                error = error.__cause__  # render_prompt's TaskError holds the template's own error
            code = b"error" if error is None else b"memory"
        finally:
            try:
                os.write(write_end, code)
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], seconds)
        answer = os.read(read_end, 16) if ready else None
    finally:
        os.close(read_end)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if answer is None:
        raise TemplateProbeError(f"did not render {what} within {seconds:g} s (a template that loops "
                                 "without end?)")
    if answer in (b"memory", b""):  # b"": the child died before answering (killed for its memory)
        raise TemplateProbeError(f"needed more than {extra_bytes >> 30} GiB to render {what} (a "
                                 "template that builds a huge string?)")
