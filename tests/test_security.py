"""A downloaded run or model directory is data, not code (issue 26): each test is an attack on real
files and real processes, and each failed on the code before it: a planted lock link, code named in
a checkpoint's settings, a renamed or hand-edited checkpoint, a poisonous request to a shared
reward service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
VICTIM_BYTES = b"precious data that is not esft's\n"


def esft(*argv: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter (tests/toy_task.py registers the toy task first)."""
    return subprocess.run([sys.executable, str(TESTS / "toy_task.py"), *argv], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("esft: evaluating with")]
    assert len(lines) == 1 and lines[0].startswith("esft: error: "), proc.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# ------------------------------------------------------------------------ 1. the run lock
@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM_BYTES)
    return path


def _plant(lock: Path, victim: Path, how: str) -> None:
    os.symlink(victim, lock) if how == "symlink" else os.link(victim, lock)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_lock_planted_in_a_new_runs_directory_never_writes_through(tmp_path, victim, how):
    shared = tmp_path / "shared-runs" / "nightly"  # a predictable --run-name, pre-created by someone else
    shared.mkdir(parents=True)
    _plant(shared / ".esft.lock", victim, how)
    proc = esft("train", "--output-dir", str(shared.parent), "--run-name", "nightly", "--iterations", "1", cwd=tmp_path)
    one_error_line(proc, "--run-name", str(shared / ".esft.lock"))
    assert victim.read_bytes() == VICTIM_BYTES


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_lock_planted_in_a_downloaded_run_never_writes_through(tmp_path, victim, how):
    run = tmp_path / "downloaded-run"  # a run killed before its first checkpoint: resumes from its config.yaml
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "countdown", "iterations": 1, "logging": "none"}))
    _plant(run / ".esft.lock", victim, how)
    proc = esft("train", "--resume", str(run), cwd=tmp_path)
    one_error_line(proc, "--resume", ".esft.lock")
    assert victim.read_bytes() == VICTIM_BYTES


def test_a_new_run_does_not_adopt_a_directory_holding_files_it_did_not_write(tmp_path, victim):
    shared = tmp_path / "runs" / "nightly"
    shared.mkdir(parents=True)
    os.symlink(victim, shared / "metrics.jsonl.tmp")  # anything: a link the run would later write through
    (shared / "notes.txt").write_text("someone else's")
    proc = esft("train", "--output-dir", str(shared.parent), "--run-name", "nightly", "--iterations", "1", cwd=tmp_path)
    one_error_line(proc, "--run-name", "already holds files that are not a run's", "notes.txt")
    os.symlink(tmp_path, tmp_path / "runs" / "linked")  # the run directory itself a link to elsewhere
    proc = esft("train", "--output-dir", str(shared.parent), "--run-name", "linked", "--iterations", "1", cwd=tmp_path)
    one_error_line(proc, "--run-name", "is a symbolic link")
    assert victim.read_bytes() == VICTIM_BYTES and sorted(p.name for p in shared.iterdir()) == ["metrics.jsonl.tmp", "notes.txt"]


def test_a_resumed_run_refuses_links_it_would_write_through(tmp_path, victim):
    run = tmp_path / "downloaded-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "countdown", "iterations": 1, "logging": "none"}))
    os.symlink(victim, run / "metrics.jsonl")
    proc = esft("train", "--resume", str(run), cwd=tmp_path)
    one_error_line(proc, "--resume", "symbolic links (metrics.jsonl)")
    assert victim.read_bytes() == VICTIM_BYTES
