"""esft.allocator: `esft train` fixes glibc's malloc thresholds at start, unless the user chose their own
(the speed effect is measured in docs/benchmarks.md, not here)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = "from esft.allocator import steady_allocator; print(steady_allocator())"
# a 64 MiB tensor (above glibc's largest mmap threshold) made and freed 16 times: the page faults of the
# last 4 (torch's aligned blocks leave holes the next one does not fit at first; the heap settles within ~8)
REUSE_PROBE = """
import resource, torch
from esft.allocator import steady_allocator
steady_allocator()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(sum(faults[-4:]))
"""


def _probe(code: str = PROBE, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_a_fresh_process_gets_heap_only_malloc():
    assert _probe().strip() == "allocator: glibc, heap only (no mmap, no trimming; esft.allocator)"


def test_a_large_freed_block_is_reused_without_page_faults():
    """16,384 pages of 4 KiB per block: glibc's own malloc maps each afresh (a fault per page), esft's heap
    reuses the freed ones once it has settled."""
    assert int(_probe(REUSE_PROBE)) < 1_000
    assert int(_probe(REUSE_PROBE, MALLOC_ARENA_MAX="16")) > 4 * 15_000  # the user's choice: glibc's defaults


def test_settings_given_as_environment_variables_give_the_same_heap():
    """A user or a benchmark may set the heap through MALLOC_*_ variables: esft.allocator.SETTINGS
    written there must make the same malloc as steady_allocator's mallopt calls."""
    from esft.allocator import SETTINGS

    assert int(_probe(REUSE_PROBE, **{name: str(value) for name, value in SETTINGS.items()})) < 1_000


def test_a_users_malloc_variable_is_respected():
    assert _probe(MALLOC_TRIM_THRESHOLD_="0").strip() == "allocator: the user's glibc settings (MALLOC_TRIM_THRESHOLD_)"


def test_the_cli_applies_it_before_the_run(tmp_path, monkeypatch):
    """A real `esft eval` on the embedded model (2 problems, 4 tokens) calls it once, before the run."""
    import esft.allocator
    from esft.cli import main

    calls = []
    monkeypatch.setattr(esft.allocator, "steady_allocator", lambda: calls.append("called") or "recorded")
    argv = ["eval", "--eval-size", "2", "--max-tokens", "4", "--output-dir", str(tmp_path), "--logging", "none"]
    assert main(argv) == 0
    assert calls == ["called"]
    assert len(list(tmp_path.glob("*/report.html"))) == 1
