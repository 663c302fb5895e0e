"""Status lines and one-line errors as a user sees them in a terminal (issue 25, item 6): with the
progress bar on, a budget stop, a reward notice and a fatal error each start a line of their own;
an unreachable --ray-address is one line naming it, not a traceback after minutes of retries."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tiny_model import subprocess_env

TESTS = Path(__file__).parent
ENV = {**subprocess_env(),
       "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")])}
REWARDS = """
calls = 0

def flaky(prompts, completions, **kwargs):
    global calls
    calls += 1
    if calls == 3:  # one member of iteration 1: a notice, not a stop
        return [float("nan")] * len(completions)
    if calls >= 6:  # every member of iteration 3: the run stops
        raise ConnectionError("the grader is down")
    return [float(len(c)) for c in completions]
"""


def _lines(stderr: str) -> list[str]:
    """What a terminal shows as lines: split on newlines only (a progress bar redraws with \\r)."""
    return [line.split("\r")[-1] if line.startswith("\r") else line for line in stderr.split("\n")]


def _train(tmp_path: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}:"}) + "\n" for i in range(4)))
    return subprocess.run([sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(model), "--train-data", "rows.jsonl",
                           "--reward-funcs", "rewards.py:flaky", "--no-reward-sandbox", "--population-size", "2",
                           "--batch-size", "2", "--max-tokens", "4", "--logging", "none", *extra],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)


def test_status_lines_never_glue_onto_the_progress_bar(tiny_model_dir, tmp_path):
    proc = _train(tmp_path, tiny_model_dir, "--iterations", "5", "--run-name", "r")
    assert proc.returncode == 2, proc.stderr[-2000:]
    raw = proc.stderr.split("\n")
    notice = [line for line in raw if "reward function flaky: returned nan" in line]
    error = [line for line in raw if "esft: error: reward function flaky" in line]
    assert notice and error, proc.stderr
    # each starts its own line: nothing of the bar ("ES:  20%|...") before it on the same line
    assert notice[0].startswith("reward function flaky") and error[0].startswith("esft: error:"), (notice, error)
    batching = [line for line in raw if "population batching:" in line]  # said during the first iteration
    assert batching == ["esft: population batching: 2 of 2 members per generate call"], batching

    budget = _train(tmp_path, tiny_model_dir, "--iterations", "5", "--budget-completions", "4", "--run-name", "b")
    assert budget.returncode == 0, budget.stderr[-2000:]
    stop = [line for line in budget.stderr.split("\n") if "the budget of 4 completions is spent" in line]
    assert stop and stop[0].startswith("esft: the budget"), stop


def test_an_unreachable_ray_address_is_one_line(tiny_model_dir, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "Q:"}) + "\n")
    (tmp_path / "rewards.py").write_text(REWARDS)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data",
                           "rows.jsonl", "--reward-funcs", "rewards.py:flaky", "--executor", "ray", "--ray-address",
                           f"127.0.0.1:{port}", "--logging", "none", "--no-progress"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    if importlib.util.find_spec("ray") is None:  # without the ray extra, that is the one line (a GPU image, say)
        assert line == "esft: error: --executor: ray is not installed (No module named 'ray'); pip install 'esft[ray]'"
        return
    assert line.startswith(f"esft: error: --ray-address: no Ray cluster answers at 127.0.0.1:{port}")
    assert "ray start --head" in line and time.monotonic() - started < 60
