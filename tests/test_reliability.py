"""Nothing lost, nothing mixed up: parallel sweeps, damaged checkpoints, resumed lineages, stray
sandbox replies, leaked processes, non-finite settings and careless input (real processes, real
files, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from esft.engines.base import NonFiniteWeights
from esft.engines.transformers_engine import TransformersEngine
import sandbox_rewards as R
from esft.rewards.runner import RewardRunner
from cli_runner import run_esft_here
from tiny_model import build_tiny_model, subprocess_env

TESTS = Path(__file__).parent
ENV = subprocess_env()
ROWS = [{"prompt": f"p{i}"} for i in range(4)]


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose greedy output changes under σ = 0.03 perturbations."""
    return build_tiny_model(tmp_path_factory.mktemp("lively-model"), initializer_range=0.3)


def toy(model: Path, out: Path, *extra: str) -> list[str]:
    """`esft train` on the toy task (tests/toy_task.py registers it), tiny sizes."""
    return [sys.executable, str(TESTS / "toy_task.py"), "train", "--preset", "none", "--model", str(model), "--task", "toy",
            "--population-size", "4", "--batch-size", "2", "--max-tokens", "6", "--eval-size", "4", "--train-size", "20",
            "--eval-batch-size", "4", "--sigma", "0.03", "--logging", "none", "--no-progress", "--output-dir", str(out),
            *extra]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command line `argv` (`python tests/toy_task.py ...` or `python -m esft.cli ...`) in this process
    (tests/cli_runner.py); what needs a process of its own (a lock held by another process, a kill) uses
    run_process or Popen."""
    if argv[1] == str(TESTS / "toy_task.py"):
        return run_esft_here(*argv[2:], cwd=cwd, env=ENV, script=TESTS / "toy_task.py")
    assert argv[1:3] == ["-m", "esft.cli"], argv
    return run_esft_here(*argv[3:], cwd=cwd, env=ENV)


def run_process(argv: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess, *expected: str, after: int = 0) -> str:
    """Exit 2 and one error line (after `after` lines that say what happened before it)."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()][after:]
    assert len(lines) == 1 and lines[0].startswith("esft: error: "), proc.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ 1. parallel sweeps
def test_parallel_runs_with_default_names_never_collide(lively_model_dir, tmp_path):
    procs = [subprocess.Popen(toy(lively_model_dir, tmp_path / "sweep", "--iterations", "1", "--sigma", sigma,
                                  "--save-every", "0"), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for sigma in ("0.01", "0.02", "0.03")]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err[-1500:] for _, err in outputs]
    runs = sorted((tmp_path / "sweep").iterdir())
    assert len(runs) == 3  # three directories, same second, same seed, same task
    import yaml

    sigmas = sorted(yaml.safe_load((run / "config.yaml").read_text())["sigma"] for run in runs)
    assert sigmas == [0.01, 0.02, 0.03]
    for run_dir in runs:
        assert [row["iteration"] for row in metrics(run_dir)] == [0, 1]  # nobody else's rows


def test_an_explicit_run_name_in_use_is_refused(lively_model_dir, tmp_path):
    from esft.settings.config import ESConfig
    from esft.runs.directory import open_run

    held = open_run(ESConfig(output_dir=str(tmp_path), run_name="busy"))  # this process holds it
    try:
        proc = run_process(toy(lively_model_dir, tmp_path, "--run-name", "busy", "--iterations", "1"), tmp_path)
        one_error_line(proc, "--run-name", f"{tmp_path / 'busy'} is in use by another esft process (pid {os.getpid()})")
    finally:
        held.discard_if_unused()  # claimed, never trained: its config.yaml (written at the claim) goes with it
    assert run(toy(lively_model_dir, tmp_path, "--run-name", "busy", "--iterations", "1"), tmp_path).returncode == 0


# ------------------------------------------------------------------ 2. damaged checkpoints, 3. lineage
@pytest.fixture(scope="module")
def finished_run(lively_model_dir, tmp_path_factory) -> Path:
    """A 4-iteration run with checkpoints 1..4 and final/ (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("finished")
    proc = run(toy(lively_model_dir, out, "--run-name", "run", "--iterations", "4", "--save-every", "1"), out)
    assert proc.returncode == 0, proc.stderr
    return out / "run"


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "run"
    shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns(".esft.lock"))
    return target


def flip_bytes(path: Path, offset: int = -4096, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[offset + i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted"])
def test_resume_passes_over_a_damaged_checkpoint(finished_run, tmp_path, damage):
    run_dir = copy_run(finished_run, tmp_path)
    import shutil

    shutil.rmtree(run_dir / "final")  # so the newest candidate is checkpoint-4, the damaged one
    weights = run_dir / "checkpoint-4" / "model.safetensors"
    if damage == "flipped":
        flip_bytes(weights)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    # naming the damaged checkpoint itself is refused with one line
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir / "checkpoint-4")], tmp_path)
    one_error_line(proc, "--resume", "checkpoint-4", "resume from the run directory")
    # the run directory: the newest intact checkpoint, saying which it passed over
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"passed over a damaged checkpoint: {weights}" in proc.stderr
    assert f"resumed from {run_dir / 'checkpoint-3'} at iteration 3" in proc.stderr
    # iteration 4 again from checkpoint-3: the same weights as the uninterrupted run
    assert (run_dir / "final" / "model.safetensors").read_bytes() == (finished_run / "final" / "model.safetensors").read_bytes()


def test_resume_with_no_intact_checkpoint_is_one_line(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path)
    for checkpoint in [*run_dir.glob("checkpoint-*"), run_dir / "final"]:
        flip_bytes(checkpoint / "model.safetensors")
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir)], tmp_path)
    one_error_line(proc, "--resume", "no checkpoint of", "is intact")


def test_a_low_precision_checkpoint_without_its_master_is_not_resumed(lively_model_dir, tmp_path):
    proc = run(toy(lively_model_dir, tmp_path, "--run-name", "bf", "--iterations", "2", "--save-every", "1",
                   "--dtype", "bfloat16"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "bf" / "checkpoint-2" / "master.safetensors").unlink()
    (tmp_path / "bf" / "final" / "master.safetensors").unlink()
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(tmp_path / "bf"), "--iterations", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "master.safetensors is missing" in proc.stderr
    assert f"resumed from {tmp_path / 'bf' / 'checkpoint-1'} at iteration 1" in proc.stderr


def test_resuming_an_older_checkpoint_sets_the_later_lineage_aside(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path)
    before = metrics(run_dir)
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir / "checkpoint-2"),
                "--iterations", "3", "--alpha", "0.05"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (aside,) = run_dir.glob("superseded-*")
    assert f"was moved to {aside}" in proc.stderr
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-3", "checkpoint-4", "eval", "final", "metrics.jsonl"]
    assert metrics(aside) == before  # the old lineage, whole
    rows = metrics(run_dir)
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3]  # one lineage, each iteration once
    assert rows[:3] == before[:3] and rows[3] != before[3]
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # a later plain --resume continues this lineage, not the old checkpoint-4
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir), "--iterations", "4"], tmp_path)
    assert proc.returncode == 0 and f"resumed from {run_dir / 'checkpoint-3'} at iteration 3" in proc.stderr, proc.stderr[-2000:]
    assert [row["iteration"] for row in metrics(run_dir)] == [0, 1, 2, 3, 4]


def test_a_run_written_between_reading_its_resume_point_and_taking_its_lock_is_refused_with_nothing_moved(
        finished_run, tmp_path):
    """Issue 66, case 1: `--resume` read the resume point while another process still wrote the run; that
    process let go (it was writing its report) before the resume took the lock. The resume now compares
    what it read with what is there once it holds the lock: a changed run is refused, nothing set aside."""
    from esft.runs.directory import find_resume_point, open_run
    from esft.settings.config import ConfigError, ESConfig

    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "final").rename(run_dir / "final-not-yet")
    point = find_resume_point(run_dir / "checkpoint-2")  # an explicit older checkpoint: its directory is compared too
    newest = find_resume_point(run_dir)
    assert newest.iteration == 4 and point.iteration == 2
    (run_dir / "final-not-yet").rename(run_dir / "final")  # the other process goes on writing: final/ appears
    listing = sorted(p.name for p in run_dir.iterdir() if p.name != ".esft.lock")
    for stale in (point, newest):
        with pytest.raises(ConfigError, match="changed while esft read it .*nothing was moved: run the command again"):
            open_run(ESConfig(), stale)
        assert sorted(p.name for p in run_dir.iterdir() if p.name != ".esft.lock") == listing
    point = find_resume_point(run_dir / "checkpoint-2")
    with (run_dir / "metrics.jsonl").open("a") as handle:  # a metrics row appended is a change too
        handle.write(json.dumps({"iteration": 5}) + "\n")
    with pytest.raises(ConfigError, match="changed while esft read it"):
        open_run(ESConfig(), point)
    fresh = open_run(ESConfig(), find_resume_point(run_dir / "checkpoint-2"))  # read under no race: resumes
    assert not list(run_dir.glob("superseded-*")) and fresh.resume.iteration == 2  # set aside once weights load
    fresh.set_aside_later()
    assert list(run_dir.glob("superseded-*"))
    fresh.close()


def test_a_resume_refused_once_the_model_has_loaded_moves_and_rewrites_nothing(finished_run, tmp_path):
    """A checkpoint whose state does not fit the resumed settings is found out only once the model has loaded
    (here: --optimizer adam, and the sgd run stored no moments). Refused in one line, and the run directory is
    as it was: its later checkpoints, final/ and metrics rows stay where they are, and config.yaml, status.json
    and report.html are not rewritten (they said what the run did, not what the refused resume tried)."""
    run_dir = copy_run(finished_run, tmp_path)
    kept = ("config.yaml", "status.json", "report.html", "metrics.jsonl")
    before = {name: (run_dir / name).read_bytes() for name in kept}
    listing = sorted(p.name for p in run_dir.iterdir())
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir / "checkpoint-2"),
                "--iterations", "3", "--optimizer", "adam"], tmp_path)
    one_error_line(proc, "holds no optimizer state", "resume it with --optimizer sgd")
    assert sorted(p.name for p in run_dir.iterdir() if p.name != ".esft.lock") == listing  # nothing set aside
    assert {name: (run_dir / name).read_bytes() for name in kept} == before


def test_a_checkpoint_of_another_run_copied_into_a_run_is_refused_with_nothing_moved(finished_run,
                                                                                    lively_model_dir, tmp_path):
    """Issue 66, case 2: run B's checkpoint copied into (a copy of) run A resumed silently, A's metrics
    then followed by B's and config.yaml rewritten with B's settings. Each run has an id now (config.yaml
    and every checkpoint): a checkpoint of another run is one line, exit 2, nothing moved or rewritten."""
    import shutil

    other = tmp_path / "other"
    proc = run(toy(lively_model_dir, other, "--run-name", "b", "--iterations", "2", "--save-every", "1", "--seed", "5"),
               tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = copy_run(finished_run, tmp_path)
    for later in ("checkpoint-2", "checkpoint-3", "checkpoint-4", "final"):  # A as it was after iteration 1
        shutil.rmtree(run_dir / later)
    shutil.copytree(other / "b" / "checkpoint-2", run_dir / "checkpoint-2")  # B's: the newest checkpoint now
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != ".esft.lock"}
    listing = sorted(p.name for p in run_dir.iterdir() if p.name != ".esft.lock")
    for target in (run_dir, run_dir / "checkpoint-2"):
        proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(target), "--iterations", "3"],
                   tmp_path)
        one_error_line(proc, f"--resume: {run_dir / 'checkpoint-2'} was written by another run", "nothing was moved")
        assert sorted(p.name for p in run_dir.iterdir() if p.name != ".esft.lock") == listing
        assert {name: (run_dir / name).read_bytes() for name in before} == before  # config.yaml, metrics.jsonl as they were
    shutil.rmtree(run_dir / "checkpoint-2")  # its own checkpoint resumes as before
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir), "--iterations", "2"], tmp_path)
    assert proc.returncode == 0 and f"resumed from {run_dir / 'checkpoint-1'} at iteration 1" in proc.stderr, proc.stderr[-2000:]


def test_the_report_is_written_while_the_run_is_still_held(lively_model_dir, tmp_path, monkeypatch):
    """Issue 66, case 1: the lock was released before report.html was written, so a resume could take the
    run while its first process still wrote into it."""
    import esft.trainer
    from esft import ESConfig, ESTrainer
    from esft.runs.directory import _lock
    from esft.settings.config import ConfigError
    from toy_task import byte_reward, toy_rows

    seen = []

    def report(run_dir):
        try:
            os.close(_lock(run_dir, "resume"))
            seen.append("free")
        except ConfigError as error:
            seen.append(str(error))
        return None

    monkeypatch.setattr(esft.trainer, "report_after_training", report)
    args = ESConfig(output_dir=str(tmp_path), run_name="held", iterations=1, population_size=2, batch_size=2,
                    max_tokens=3, eval_batch_size=4, progress=False, logging="none", reward_sandbox=False)
    trainer = ESTrainer(str(lively_model_dir), reward_funcs=[byte_reward], args=args, train_dataset=toy_rows(4),
                        eval_dataset=toy_rows(2, start=100))
    trainer.train()
    assert len(seen) == 1 and "is in use by another esft process" in seen[0]
    os.close(_lock(tmp_path / "held", "resume"))  # released once train() returned
    trainer.close()


def _interruptible() -> None:
    """In the child before exec: SIGINT delivered and at its default, as in a terminal. A child inherits
    an ignored or blocked SIGINT from pytest's process (in the whole suite it arrived ignored: the run
    carried on past Ctrl-C), and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(lively_model_dir, tmp_path):
    # far more iterations than it can run before the signal: a toy iteration takes milliseconds, and
    # with 50 the run sometimes ended (exit 0) before SIGINT reached it
    proc = subprocess.Popen(toy(lively_model_dir, tmp_path, "--run-name", "killed", "--iterations", "100000", "--save-every", "0"),
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_interruptible)
    metrics_file = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(metrics_file.read_text().splitlines() if metrics_file.exists() else []) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and f"resume with --resume {tmp_path / 'killed'}" in err, err[-1500:]
    (tmp_path / "killed" / ".checkpoint-7.abcd.tmp").mkdir()  # as a kill during a save leaves it
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(tmp_path / "killed"), "--iterations", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [row["iteration"] for row in metrics(tmp_path / "killed")] == [0, 1, 2]
    assert not list((tmp_path / "killed").glob(".*.tmp"))  # stale temporaries cleaned
    straight = run(toy(lively_model_dir, tmp_path, "--run-name", "straight", "--iterations", "2", "--save-every", "0"), tmp_path)
    assert straight.returncode == 0
    assert (tmp_path / "killed" / "final" / "model.safetensors").read_bytes() == \
        (tmp_path / "straight" / "final" / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------- 4. sandbox replies
def test_a_reward_that_forks_still_gets_exactly_its_own_replies(tmp_path):
    runner = RewardRunner([R.forks_then_scores], timeout=10, workers=1)
    try:
        for completions in (["a", "bb", "ccc", "dddd"], ["xyz"] * 4, ["", "q", "qq", "qqq"]):
            scores = runner.score(ROWS, completions)
            assert scores.total == [float(len(c)) for c in completions] and scores.failures == 0
        pidfile = str(tmp_path / "children")
        rows = [{"prompt": "p", "pidfile": pidfile}] * 2
        assert runner.score(rows, ["a", "bb"]).total == [1.0, 2.0]
        deadline = time.monotonic() + 10
        # the child opens the file before it writes its pid: wait for a whole line, not for the file
        while not (Path(pidfile).exists() and Path(pidfile).read_text().endswith("\n")) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(Path(pidfile).read_text().split()[0])
        assert _alive(child)
    finally:
        runner.close()
    assert _gone_within(child, 5)


def test_a_reward_that_kills_the_forkserver_does_not_stop_scoring():
    runner = RewardRunner([R.kills_its_forkserver], timeout=10, workers=1)
    try:
        for _ in range(3):  # each call takes its forkserver down; the next worker starts from a new one
            assert runner.score(ROWS, ["a", "bb", "ccc", "dddd"]).total == [1.0, 2.0, 3.0, 4.0]
        runner.close()
        ok = RewardRunner([R.length_reward], timeout=10, workers=1)
        try:
            assert ok.score(ROWS, ["a", "bb", "ccc", "dddd"]).total == [1.0, 2.0, 3.0, 4.0]  # a new forkserver
        finally:
            ok.close()
    finally:
        runner.close()


# --------------------------------------------------------------------------- 5. leaked processes
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


HANGING_REWARD = """
import os, subprocess, time

def starts_sleep_and_hangs(prompts, completions, **kwargs):
    child = subprocess.Popen(["sleep", "3600"])
    with open(os.environ["ESFT_TEST_PIDS"], "a") as handle:
        handle.write(f"{child.pid}\\n")
    time.sleep(3600)
"""


def test_a_timed_out_reward_leaves_no_child_behind(tmp_path):
    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    from esft.rewards.usercode import load_callable

    os.environ["ESFT_TEST_PIDS"] = str(tmp_path / "pids")
    func = load_callable(f"{tmp_path / 'hanging.py'}:starts_sleep_and_hangs", "--reward-funcs")
    runner = RewardRunner([func], timeout=1.5, workers=1)
    try:
        for _ in range(3):
            assert runner.score(ROWS, ["a"] * 4).timeouts == 4
    finally:
        runner.close()
        del os.environ["ESFT_TEST_PIDS"]
    sleepers = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert len(sleepers) == 3 and all(_gone_within(pid, 5) for pid in sleepers)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_process_outlives_a_killed_trainer(tiny_model_dir, tmp_path, sig):
    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}"}) + "\n" for i in range(4)))
    pids = tmp_path / "pids"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data", str(data),
         "--reward-funcs", f"{tmp_path / 'hanging.py'}:starts_sleep_and_hangs", "--population-size", "2",
         "--batch-size", "2", "--max-tokens", "2", "--iterations", "1", "--reward-timeout", "600", "--logging", "none",
         "--no-progress", "--output-dir", str(tmp_path / "runs")],
        cwd=tmp_path, env={**ENV, "ESFT_TEST_PIDS": str(pids)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not pids.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids.exists(), "the reward never started"
    left = _descendants(trainer.pid)  # forkserver, resource tracker, worker, its sleep
    assert len(left) >= 3
    trainer.send_signal(sig)
    trainer.wait(timeout=30)
    survivors = [pid for pid in left if not _gone_within(pid, 10)]
    assert not survivors, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in survivors]


# ------------------------------------------------------------------- 6. non-finite settings, weights
@pytest.mark.parametrize("flag, value, message", [
    ("--sigma", "inf", "--sigma: must be a finite number, got inf"),
    ("--alpha", "nan", "--alpha: must be a finite number, got nan"),
    ("--reward-timeout", "inf", "--reward-timeout: must be a finite number, got inf"),
    ("--sigma", "-1e-3", "--sigma: must be > 0, got -0.001"),
])
def test_non_finite_and_negative_settings_are_refused(tmp_path, flag, value, message):
    proc = run([sys.executable, "-m", "esft.cli", "train", flag, value, "--output-dir", str(tmp_path / "runs"),
                "--run-name", "r"], tmp_path)
    one_error_line(proc, message)
    assert not (tmp_path / "runs").exists()  # nothing left that would block the name


def test_an_update_that_would_make_weights_non_finite_is_refused(tiny_model_dir):
    engine = TransformersEngine.from_pretrained(str(tiny_model_dir), device="cpu", max_tokens=2)
    before = engine.checksum()
    weights = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    with pytest.raises(NonFiniteWeights, match="would make .* non-finite"):
        engine.update([1, 2], [3e38, 3e38])  # finite coefficients whose sum overflows
    assert engine.checksum() == before
    with pytest.raises(NonFiniteWeights, match="not a finite float32"):
        engine.update([1, 2], [1e39, -1e39])
    assert engine.checksum() == before
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())


def test_a_run_whose_update_turns_non_finite_stops_with_its_last_finite_checkpoint(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path)
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "train", "--resume", str(run_dir / "checkpoint-2"),
                "--iterations", "4", "--alpha", "1e39"], tmp_path)
    line = one_error_line(proc, "iteration 3", "not a finite float32", f"the weights from before it are in {run_dir / 'checkpoint-2'}",
                          after=3)  # the lines saying where it resumed and how members are batched
    assert "smaller --alpha" in line
    assert not (run_dir / "final").exists() and not (run_dir / "checkpoint-3").exists()


# ------------------------------------------------------------------------ 7. prompts it cannot take
@pytest.mark.parametrize("prompts, expected", [
    (["", "", ""], "the prompt of rows 0, 1, 2 is empty"),
    (["short", "x" * 2000, "fine"], "the prompt of row 1 has 2000 tokens, which with --max-tokens 4 exceeds the model's 1024 positions"),
])
def test_prompts_the_model_cannot_take_are_named_before_generation(tiny_model_dir, tmp_path, prompts, expected):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    proc = run([sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--train-data", str(data),
                "--reward-funcs", f"{TESTS / 'sandbox_rewards.py'}:length_reward", "--max-tokens", "4",
                "--output-dir", str(tmp_path / "runs"), "--run-name", "r"], tmp_path)
    one_error_line(proc, str(data), expected)
    assert not (tmp_path / "runs").exists()


def mismatched_model(path: Path, kind: str) -> Path:
    """A saved model whose tokenizer has tokens its embedding has no row for: 100 rows for the
    258-token byte tokenizer ("short embedding"), or a pad token added to the tokenizer and not to
    the model, as users do for GPT-2 ("added pad")."""
    from transformers import AutoTokenizer

    if kind == "short embedding":
        return build_tiny_model(path, vocab_size=100)
    build_tiny_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"pad_token": "<newpad>"})
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind, expected", [
    ("short embedding", "the prompt of row 1 holds token id 222, past the model's 100 embedding rows"),
    ("added pad", "the tokenizer's pad token '<newpad>' is id 258, past the model's 258 embedding rows"),
])
def test_a_tokenizer_that_does_not_match_the_weights_is_named_before_generation(tmp_path, kind, expected):
    """Without the check a prompt's out-of-range token fails mid-run on CPU (a traceback), and on CUDA is a
    device-side assert that leaves the process unable to use the GPU."""
    model = mismatched_model(tmp_path / "model", kind)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["abc", "a b", "fine"]))  # the space is id 222
    proc = run([sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(model), "--train-data", str(data),
                "--reward-funcs", f"{TESTS / 'sandbox_rewards.py'}:length_reward", "--max-tokens", "4",
                "--output-dir", str(tmp_path / "runs"), "--run-name", "r"], tmp_path)
    line = one_error_line(proc, expected, "the tokenizer does not match the model's weights")
    assert "resize_token_embeddings(len(tokenizer))" in line
    assert not (tmp_path / "runs").exists()


def test_a_loaded_model_with_an_added_pad_token_is_refused_by_the_trainer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esft.settings.config import ESConfig
    from esft.tasks.base import TaskError
    from esft.trainer import ESTrainer

    path = mismatched_model(tmp_path / "model", "added pad")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    args = ESConfig(output_dir=str(tmp_path / "runs"), iterations=1, logging="none", progress=False, device="cpu")
    with pytest.raises(TaskError, match="pad token '<newpad>' is id 258, past the model's 258 embedding rows"):
        ESTrainer(model, R.length_reward, args, train_dataset=[{"prompt": "abc"}], processing_class=tokenizer)
    model.resize_token_embeddings(len(tokenizer))  # what the message tells the user to do
    trainer = ESTrainer(model, R.length_reward, args, train_dataset=[{"prompt": "abc"}], processing_class=tokenizer)
    assert trainer.engine.embedding_rows() == 259


# --------------------------------------------------------------------- 8. esft eval of a run's weights
def test_eval_of_a_runs_weights_uses_the_runs_settings(finished_run, tmp_path):
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "eval", "--model", str(finished_run / "final"),
                "--output-dir", str(tmp_path), "--run-name", "e", "--logging", "none"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"evaluating with the settings of the run that wrote {finished_run / 'final'}" in proc.stderr
    assert "task=toy" in proc.stderr and "max_tokens=6" in proc.stderr
    (row,) = metrics(tmp_path / "e")
    trained = metrics(finished_run)[-1]
    assert {k: v for k, v in row.items() if k.startswith("eval/")} == {k: v for k, v in trained.items() if k.startswith("eval/")}
    # a flag still overrides the run's setting
    proc = run([sys.executable, str(TESTS / "toy_task.py"), "eval", "--model", str(finished_run / "final"), "--max-tokens",
                "2", "--output-dir", str(tmp_path), "--run-name", "e2", "--logging", "none"], tmp_path)
    assert proc.returncode == 0 and metrics(tmp_path / "e2")[0]["eval/heldout/mean_length"] <= 2


# ---------------------------------------------------------------------------------------- warts
@pytest.mark.parametrize("argv, expected", [
    (["--run-name", ".."], "--run-name: must be a plain directory name"),
    (["--device", "cuda"], "--device: cuda asked for, but torch sees no CUDA device"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size: is a setting of --engine vllm"),
    (["--max-model-len", "512"], "--max-model-len: is a setting of --engine vllm"),
    (["--vllm-cpu-gemm", "repack"], "--vllm-cpu-gemm: is a setting of --engine vllm"),
    (["--ray-address", "auto"], "--ray-address: is a setting of --executor ray"),
    (["--iterations", "0", "--config", "NONUTF8"], "not UTF-8 text"),
])
def test_careless_input_is_one_line(tmp_path, argv, expected):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this machine has CUDA")
    (tmp_path / "bad.yaml").write_bytes(b"sigma: 0.01 # \xff\xfe latin-1\n")
    argv = [str(tmp_path / "bad.yaml") if a == "NONUTF8" else a for a in argv]
    proc = run([sys.executable, "-m", "esft.cli", "train", "--output-dir", str(tmp_path / "runs"), *argv], tmp_path)
    one_error_line(proc, expected)


def test_output_dir_that_is_a_file_and_tilde_paths(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run([sys.executable, "-m", "esft.cli", "train", "--output-dir", str(tmp_path / "afile")], tmp_path)
    one_error_line(proc, "--output-dir", "is a file, not a directory")
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "run.yaml").write_text("output_dir: ~/esft-runs\nrun_name: r\niterations: 0\neval_size: 2\n")
    proc = subprocess.run([sys.executable, "-m", "esft.cli", "eval", "--config", str(tmp_path / "run.yaml"),
                           "--logging", "none", "--no-progress"], cwd=tmp_path, env={**ENV, "HOME": str(home)},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert (home / "esft-runs" / "r" / "metrics.jsonl").exists() and not (tmp_path / "~").exists()


def test_a_full_disk_ends_with_one_line(lively_model_dir, tmp_path):
    """Files may not grow past 64 KiB (RLIMIT_FSIZE, as a full disk refuses writes): the first
    checkpoint fails; the run says so in one line and how to resume."""
    import resource

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = subprocess.run(toy(lively_model_dir, tmp_path, "--run-name", "full", "--iterations", "1", "--save-every", "1"),
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180, preexec_fn=small_files)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("esft: error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0]
    assert "File too large" in errors[0] and f"--resume {tmp_path / 'full'}" in errors[0]
    assert not list((tmp_path / "full").glob("checkpoint-*")) and not list((tmp_path / "full").glob(".*.tmp"))


def test_eval_refuses_iterations(tmp_path):
    proc = run([sys.executable, "-m", "esft.cli", "eval", "--iterations", "3"], tmp_path)
    assert proc.returncode == 2 and "unrecognized arguments: --iterations 3" in proc.stderr


def test_data_problems_are_named_before_the_model_loads(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = [sys.executable, "-m", "esft.cli", "train", "--preset", "none", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "runs"),
            "--reward-funcs", f"{TESTS / 'sandbox_rewards.py'}:trl_uses_prompts_and_column"]
    one_error_line(run([*base, "--train-data", str(empty)], tmp_path), f"--train-data {empty}: has no rows")
    partial = tmp_path / "partial.jsonl"
    partial.write_text(json.dumps({"prompt": "a", "solution": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    one_error_line(run([*base, "--train-data", str(partial)], tmp_path), "needs column 'solution'", f"{partial} row 1 does not have")
    assert not (tmp_path / "runs").exists()


def test_a_wrong_length_reward_reports_the_real_lengths(caplog):
    runner = RewardRunner([R.returns_nothing], timeout=10, workers=1)
    try:
        scores = runner.score(ROWS, ["a", "b", "c", "d"])
    finally:
        runner.close()
    assert scores.errors == 4
    logged = [r.getMessage() for r in caplog.records if "returns_nothing" in r.getMessage()]
    assert logged and "returned 0 values for 4 completions" in logged[0]
