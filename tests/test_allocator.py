"""esft.allocator: `esft train` fixes glibc's malloc thresholds at start, unless the user chose their own
(the speed effect is measured in benchmarks/RESULTS.md, not here)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = "from esft.allocator import steady_allocator; print(steady_allocator())"


def _probe(**extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout


def test_thresholds_are_fixed_in_a_fresh_process():
    assert _probe().strip() == "allocator: glibc, fixed thresholds (mmap 32 MiB, no trimming; esft.allocator)"


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
