"""A run never trains on half its objective without saying so (issue 25): a real `esft serve-reward`
killed (by the run's own other reward, at a chosen call) and restarted by the test, real `esft train`
processes, real evaluations interrupted and resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_model import subprocess_env
from test_serve_reward import free_port, start_server, stop

TESTS = Path(__file__).parent
ENV = {**subprocess_env(),
       "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")])}

# A reward the run calls in-process (--no-reward-sandbox) before the service's: at its Nth call it
# SIGKILLs the reward server (the pid in $KILL_PID), so the service dies at a known point of the run.
KILLER = '''
import os, signal
from pathlib import Path

def length(prompts, completions, **kwargs):
    calls = Path(os.environ["CALLS_FILE"])
    count = int(calls.read_text() or 0) + 1 if calls.exists() else 1
    calls.write_text(str(count))
    if count == int(os.environ["KILL_AT_CALL"]):
        os.kill(int(os.environ["KILL_PID"]), signal.SIGKILL)
        Path(os.environ["CALLS_FILE"] + ".killed").write_text("")
    return [float(len(c)) for c in completions]
'''


def train(tmp_path: Path, model: Path, url: str, *extra: str, kill_pid: int = 0, kill_at: int = 0,
          name: str = "run", background: bool = False, progress: bool = False):
    (tmp_path / "killer.py").write_text(KILLER)
    rows = [{"prompt": p} for p in ("2 + 2 =", "3 + 5 =", "7 - 4 =", "9 - 1 =")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**ENV, "CALLS_FILE": str(tmp_path / f"{name}.calls"), "KILL_AT_CALL": str(kill_at), "KILL_PID": str(kill_pid),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV['PYTHONPATH']}"}
    argv = [sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(model), "--reward-funcs", "killer:length",
            "--reward-url", url, "--train-data", "train.jsonl", "--eval-data", "train.jsonl", "--population-size", "2",
            "--batch-size", "2", "--max-tokens", "4", "--sigma", "0.03", "--no-reward-sandbox", "--logging", "none",
            "--save-every", "1", "--run-name", name, *(() if progress else ("--no-progress",)), *extra]
    if background:
        return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without what depends on the clock."""
    return [{k: v for k, v in row.items() if not k.startswith("perf/") and k != "budget/seconds"} for row in rows]


# ----------------------------------------------------------------------------- 1. a reward dies mid-run
@pytest.mark.slow
def test_a_reward_service_that_dies_mid_run_stops_the_run_at_that_iteration(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    """`--reward-funcs A --reward-url URL`, the service killed in iteration 2 (the evaluation before
    training makes call 1, iteration 1 calls 2-3): the run must not go on training on A alone."""
    proc, url = start_server(tiny_reward_model_dir)
    try:
        run = train(tmp_path, tiny_model_dir, url, "--iterations", "5", "--reward-url-deadline", "1", kill_pid=proc.pid, kill_at=4)
    finally:
        proc.kill()
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    error = [line for line in run.stderr.splitlines() if line.startswith("esft: error: ")]
    assert len(error) == 1, run.stderr
    name = "remote:" + url.removeprefix("http://")
    assert f"reward function {name} got no scores from its reward service on every sample of iteration 2" in error[0]
    assert "could not reach the reward service" in error[0] and "ConnectError" in error[0]
    assert "checkpoint-1; fix it and --resume" in error[0]
    rows = rows_of(tmp_path / "runs/run")
    assert [row["iteration"] for row in rows] == [0, 1]  # no iteration trained on the other reward alone
    assert (tmp_path / "runs/run/checkpoint-1").is_dir() and not (tmp_path / "runs/run/final").exists()


@pytest.mark.slow
def test_skipping_a_named_failing_reward_is_explicit_and_said_every_iteration(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    """--reward-skip-failing names a reward; the service behind it killed in iteration 2, the run goes on without it
    and says so every iteration (slow: a real reward server process and a run that waits out its deadline)."""
    proc, url = start_server(tiny_reward_model_dir)
    name = "remote:" + url.removeprefix("http://")
    try:
        typo = train(tmp_path, tiny_model_dir, url, "--reward-skip-failing", "nobody", name="typo")
        assert typo.returncode == 2 and "--reward-skip-failing: no reward function named nobody" in typo.stderr
        run = train(tmp_path, tiny_model_dir, url, "--iterations", "3", "--reward-url-deadline", "0.5",
                    "--reward-skip-failing", name, "--eval-every", "0", kill_pid=proc.pid, kill_at=2)
    finally:
        proc.kill()
    # the final evaluation cannot be scored by the dead service: that still stops the run
    assert run.returncode == 2, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if f"--reward-skip-failing {name}" in line]
    assert [line.split(":")[1].strip() for line in said] == ["iteration 1", "iteration 2", "iteration 3"], run.stderr
    rows = rows_of(tmp_path / "runs/run")
    assert [row[f"rewards/{name}/failures"] for row in rows[1:]] == [4, 4, 4]


# ------------------------------------------------------------------ 2. a restart rides on the deadline
@pytest.mark.slow
def test_a_service_restart_mid_run_is_waited_for_and_costs_nothing(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    """The reward server killed mid-run and restarted seconds later: the run waits for it and loses no sample
    (slow: a real server is started twice and the run waits for the restart)."""
    port = free_port()
    proc, url = start_server(tiny_reward_model_dir, port=port)
    run = train(tmp_path, tiny_model_dir, url, "--iterations", "3", kill_pid=proc.pid, kill_at=4, background=True, progress=True)
    restarted = None
    try:
        proc.wait(timeout=240)  # killed by the run in iteration 2
        time.sleep(6)  # a restart takes a while: longer than the old client's 4 attempts in 3.5 s
        restarted, _ = start_server(tiny_reward_model_dir, port=port)
        stdout, stderr = run.communicate(timeout=240)
    finally:
        run.kill()
        if restarted is not None:
            stop(restarted)
    assert run.returncode == 0, stderr[-3000:]
    rows = rows_of(tmp_path / "runs/run")
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3]
    assert all(row["reward/errors"] == 0 for row in rows[1:]), rows
    assert (tmp_path / "runs/run/final").is_dir()
    name = "remote:" + url.removeprefix("http://")
    assert f"{name} unreachable, retrying" in stderr  # the progress bar said what the run waited for


def test_the_retry_deadline_is_a_flag_and_a_refused_connection_is_named(tmp_path):
    from esft.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--reward-url-deadline" in help_text and "[default: 60.0]" in help_text
    from esft.rewards.remote import RewardServiceError, remote_reward

    client = remote_reward(f"http://127.0.0.1:{free_port()}", deadline=1.0, backoff=0.1)
    started = time.monotonic()
    with pytest.raises(RewardServiceError, match="could not reach the reward service .* cannot connect"):
        client(["a"], ["b"])
    assert 1.0 <= time.monotonic() - started < 5 and client.stats["requests"] >= 4


# ------------------------------------------------- 3. a failed final evaluation keeps the training row
@pytest.mark.slow
def test_a_killed_final_evaluation_resumes_to_the_rows_of_an_uninterrupted_run(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    """The service killed during the final evaluation; the resumed run's rows are the uninterrupted run's (slow:
    a real server and three runs)."""
    port = free_port()
    proc, url = start_server(tiny_reward_model_dir, port=port)
    try:
        whole = train(tmp_path, tiny_model_dir, url, "--iterations", "2", name="whole")
        assert whole.returncode == 0, whole.stderr[-3000:]
        # calls: 1 = evaluation before training, 2-5 = two iterations of two members, 6 = the final evaluation
        cut = train(tmp_path, tiny_model_dir, url, "--iterations", "2", "--reward-url-deadline", "0.5",
                    kill_pid=proc.pid, kill_at=6, name="cut")
    finally:
        proc.kill()
    assert cut.returncode == 2 and "every sample of" in cut.stderr, cut.stderr[-3000:]
    cut_dir = tmp_path / "runs/cut"
    assert [row["iteration"] for row in rows_of(cut_dir)] == [0, 1, 2]  # the last training row was written
    assert "reward/mean" in rows_of(cut_dir)[-1] and (cut_dir / "checkpoint-2").is_dir()
    restarted, url = start_server(tiny_reward_model_dir, port=port)
    try:
        env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV['PYTHONPATH']}", "CALLS_FILE": str(tmp_path / "x"),
               "KILL_AT_CALL": "0", "KILL_PID": "0"}
        resumed = subprocess.run([sys.executable, "-m", "esft.cli", "train", "--resume", str(cut_dir),  # its reward
                                  "--trust-run-code"], cwd=tmp_path,  # file is code the run's settings name (issue 26)
                                 env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop(restarted)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert comparable(rows_of(cut_dir)) == comparable(rows_of(tmp_path / "runs/whole"))
