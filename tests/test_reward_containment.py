"""Careless or hostile reward code (issue 25, item 7), with real sandbox worker processes: children
that detach with setsid end with their worker, a flood of output never reaches the trainer's
stdout, rewards near the float limit stop the run in one line (or train), a memory cap that cannot
be applied is said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_model import subprocess_env
from esft.rewards.runner import RewardError, RewardRunner, Scores
from sandbox_rewards import detaches_two_sleepers

TESTS = Path(__file__).parent
ENV = {**subprocess_env(),
       "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")])}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["retired", "timed out"])
def test_children_that_detach_with_setsid_end_with_their_worker(tmp_path, how):
    os.environ["SLEEPER_DIR"] = str(tmp_path)
    if how == "timed out":
        os.environ["SLEEPER_HANG"] = "1"
    try:
        runner = RewardRunner([detaches_two_sleepers], timeout=5, workers=1)
        scores = runner.score([{"prompt": "p"}], ["c"])
        assert (scores.timeouts == 1) if how == "timed out" else (scores.failures == 0)
        runner.close()
    finally:
        os.environ.pop("SLEEPER_DIR")
        os.environ.pop("SLEEPER_HANG", None)
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    survivors = [pid for pid in pids if not _gone_within(pid, 5)]
    for pid in survivors:  # leave nothing behind even when the test fails
        os.kill(pid, 9)
    assert not survivors, f"{len(survivors)} detached children outlived their worker"


FLOOD = """
import sys
from esft.rewards.runner import RewardRunner

def floods(prompts, completions, **kwargs):
    chunk = "x" * 1_000_000 + "\\n"
    for _ in range(30):
        sys.stdout.write(chunk)
    print("the last words before the error", file=sys.stderr)
    if completions[0] == "raise":
        raise ValueError("grader broke")
    return [1.0] * len(completions)

if __name__ == "__main__":
    runner = RewardRunner([floods], workers=1)
    ok = runner.score([{"prompt": "p"}], ["fine"])
    bad = runner.score([{"prompt": "p"}], ["raise"])
    runner.close()
    detail = bad.first_failure["floods"].traceback
    print("RESULT", ok.failures, bad.failures, len(detail) < 4000, "what it printed last:" in detail, repr(detail[-300:]),
          flush=True)
"""


def test_a_reward_that_floods_its_output_costs_the_trainer_no_output(tmp_path):
    (tmp_path / "flood.py").write_text(FLOOD)
    proc = subprocess.run([sys.executable, "flood.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout) + len(proc.stderr) < 20_000, f"{len(proc.stdout)} + {len(proc.stderr)} bytes reached the trainer"
    (result,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    # a bounded tail, kept for the error's message
    assert result.startswith("RESULT 0 1 True True ") and "the last words before the error" in result


def test_rewards_near_the_float_limit_stop_the_run_in_one_line(tiny_model_dir, tmp_path):
    """1e308 per sample is finite, but the population's mean and spread overflow: the old code died in
    strategy.tell with a traceback and exit 1."""
    (tmp_path / "huge.py").write_text("def huge(prompts, completions, **kwargs):\n    return [1e308] * len(completions)\n")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + {i} ="}) + "\n" for i in range(4)))
    proc = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data",
                           "rows.jsonl", "--reward-funcs", "huge.py:huge", "--iterations", "2", "--population-size", "2",
                           "--batch-size", "2", "--max-tokens", "4", "--logging", "none", "--no-progress", "--run-name", "r"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("esft: error: ")]
    assert "reward function huge gave rewards too large to average or shape in float64" in error
    assert "iteration 1" in error and "nothing was updated" in error


def test_rewards_whose_spread_overflows_stop_with_the_one_line_rule():
    from esft.loop.reward_faults import stop_if_unshapeable

    scores = [Scores(total=[v], per_function={"huge": [v]}) for v in (1e308, -1e308)]
    assert scores[0].mean() == 1e308
    with pytest.raises(RewardError) as caught:
        stop_if_unshapeable([1e308, -1e308], "zscore", scores, "iteration 3", lambda: "the weights are in ckpt")
    assert caught.value.headline.startswith("reward function huge gave rewards too large to average or shape")
    assert "iteration 3" in caught.value.headline and "\n" not in caught.value.headline
    stop_if_unshapeable([1e308, -1e308], "rank", scores, "iteration 3", lambda: "")  # ranks need no arithmetic


CAPPED = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # a hard limit below the cap asked for
from esft.rewards.runner import RewardRunner

def one(prompts, completions, **kwargs):
    import resource
    return [resource.getrlimit(resource.RLIMIT_AS)[0] / 2**30] * len(completions)

runner = RewardRunner([one], memory_mb=65536, workers=1)
print("LIMIT", runner.score([{"prompt": "p"}], ["c"]).total[0], flush=True)
runner.close()
"""


def test_a_memory_cap_above_the_hard_limit_is_said_and_lowered(tmp_path):
    (tmp_path / "capped.py").write_text(CAPPED)
    proc = subprocess.run([sys.executable, "capped.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--reward-memory-mb 65536 is above this process's hard address-space limit (16384 MiB" in proc.stderr
    assert "LIMIT 16.0" in proc.stdout  # capped at the hard limit, not left uncapped
