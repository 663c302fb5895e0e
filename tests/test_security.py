"""A downloaded run or model directory is data, not code (issue 26): each test is an attack on real
files and real processes, and each failed on the code before it: a planted lock link, code named in
a checkpoint's settings, a renamed or hand-edited checkpoint, a poisonous request to a shared
reward service."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from cli_runner import run_esft, run_esft_here
from tiny_model import subprocess_env

TESTS = Path(__file__).parent
ENV = subprocess_env()
VICTIM_BYTES = b"precious data that is not esft's\n"


def esft(*argv: str, cwd: Path, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    """`python tests/toy_task.py ARGV` (the toy task registered first) in this process (tests/cli_runner.py)."""
    return run_esft_here(*argv, cwd=cwd, env=env, script=TESTS / "toy_task.py")


def esft_process(*argv: str, cwd: Path, env: dict[str, str] = ENV, timeout: float = 180) -> subprocess.CompletedProcess:
    """The same in a fresh interpreter, as a user runs it."""
    return run_esft(*argv, cwd=cwd, env=env, script=TESTS / "toy_task.py", timeout=timeout)


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


# ------------------------------------------------- 2. code named in a run's settings, 3. checkpoints
@pytest.fixture(scope="module")
def small_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 2-iteration toy run with checkpoint-1, checkpoint-2 and final/ (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("small-run")
    proc = esft_process("train", "--model", str(tiny_model_dir), "--task", "toy", "--population-size", "2", "--batch-size", "2",
                "--max-tokens", "4", "--eval-size", "2", "--train-size", "8", "--eval-batch-size", "2", "--logging", "none",
                "--no-progress", "--output-dir", str(out), "--run-name", "run", "--iterations", "2", "--save-every", "1",
                cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "run"


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "run"
    shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns(".esft.lock"))
    return target


def edit_state(checkpoint: Path, change) -> None:
    path = checkpoint / "trainer_state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


def evil_script(tmp_path: Path) -> tuple[Path, Path]:
    """A script that leaves a marker file when it is imported: what a downloaded run's settings might name."""
    marker = tmp_path / "marker"
    script = tmp_path / "evil.py"
    script.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                      "def reward(completions, **kwargs):\n    return [0.0] * len(completions)\n"
                      "def make_task(**kwargs):\n    raise SystemExit(0)\n")
    return script, marker


def test_a_resume_never_imports_reward_code_named_by_the_checkpoint(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    script, marker = evil_script(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    for checkpoint in [*run.glob("checkpoint-*"), run / "final"]:
        edit_state(checkpoint, lambda s: s["config"].update(reward_funcs=f"{script}:reward", train_data=str(tmp_path / "rows.jsonl"),
                                                            task="custom"))
    proc = esft("train", "--resume", str(run), "--iterations", "3", cwd=tmp_path)
    one_error_line(proc, f"--resume {run}", f"--reward-funcs {script}:reward", "--trust-run-code")
    assert not marker.exists() and not list(run.glob("superseded-*"))
    # the explicit opt-in loads it, and says so
    proc = esft("train", "--resume", str(run), "--iterations", "3", "--trust-run-code", cwd=tmp_path)
    assert marker.exists() and f"--trust-run-code: taking the code, data and services that --resume {run} names" in proc.stderr
    # a run's own config.yaml (a run killed before its first checkpoint) is no different
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text(yaml.safe_dump({"reward_funcs": f"{script}:reward", "train_data": "rows.jsonl"}))
    marker.unlink()
    one_error_line(esft("train", "--resume", str(fresh), cwd=tmp_path), "--reward-funcs", "--trust-run-code")
    assert not marker.exists()


def test_eval_never_imports_a_task_named_by_the_checkpoint(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    script, marker = evil_script(tmp_path)
    edit_state(run / "final", lambda s: s["config"].update(task=f"{script}:make_task"))
    proc = esft("eval", "--model", str(run / "final"), "--output-dir", str(tmp_path / "out"), "--logging", "none", cwd=tmp_path)
    one_error_line(proc, f"--model {run / 'final'}", f"--task {script}:make_task", "--trust-run-code")
    assert not marker.exists()
    # named again on the command line, it is the user's choice
    esft("eval", "--model", str(run / "final"), "--task", f"{script}:make_task", "--output-dir", str(tmp_path / "out"),
         "--logging", "none", cwd=tmp_path)
    assert marker.exists()


def test_the_checkpoint_checker_reads_only_files_inside_the_checkpoint(small_run, tmp_path):
    from esft.files import file_digest
    from esft.runs.directory import ResumeError, find_resume_point

    run = copy_run(small_run, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's")
    checkpoint = run / "checkpoint-2"
    for name in (str(secret), f"../../{secret.name}"):  # an absolute name, a name leading out of it
        edit_state(checkpoint, lambda s: s["files"].update({name: file_digest(secret)}))
        with pytest.raises(ResumeError, match="not a file inside the checkpoint"):
            find_resume_point(checkpoint)
        edit_state(checkpoint, lambda s: s["files"].pop(name))
    os.symlink(secret, checkpoint / "extra.txt")  # a link inside it to a file outside
    edit_state(checkpoint, lambda s: s["files"].update({"extra.txt": file_digest(secret)}))
    with pytest.raises(ResumeError, match="a link to a file outside the checkpoint"):
        find_resume_point(checkpoint)


def test_a_renamed_checkpoint_is_refused_and_never_set_aside(small_run, tmp_path):
    import shutil

    run = copy_run(small_run, tmp_path)
    shutil.copytree(run / "checkpoint-1", run / "checkpoint-5")  # a copy, a rename: it holds iteration 1
    proc = esft("train", "--resume", str(run / "checkpoint-5"), "--iterations", "6", cwd=tmp_path)
    one_error_line(proc, "checkpoint-5 but holds iteration 1", "rename it checkpoint-1")
    assert (run / "checkpoint-5" / "model.safetensors").is_file() and not list(run.glob("superseded-*"))
    # the run directory: the renamed copy is passed over, the newest intact checkpoint resumed
    proc = esft("train", "--resume", str(run), "--iterations", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint-2'} at iteration 2" in proc.stderr
    (aside,) = run.glob("superseded-*")  # the stray copy is kept, out of the lineage
    assert (aside / "checkpoint-5" / "model.safetensors").is_file()


@pytest.mark.parametrize("edit, expected", [
    (lambda s: s.update(iteration=True), "iteration must be a whole number"),
    (lambda s: s.update(iteration=-7), "iteration must be a whole number from 0"),
    (lambda s: s.update(iteration=10**30), "iteration must be a whole number from 0"),
    (lambda s: s.update(files=[1, 2]), "files must map file names to digests"),
    (lambda s: s["config"].update(old_setting_name=3), "the setting 'old_setting_name', which this esft version does not know"),
])
def test_a_hand_edited_trainer_state_is_one_line_and_moves_nothing(small_run, tmp_path, edit, expected):
    run = copy_run(small_run, tmp_path)
    edit_state(run / "checkpoint-1", edit)
    proc = esft("train", "--resume", str(run / "checkpoint-1"), "--iterations", "3", cwd=tmp_path)
    one_error_line(proc, expected)
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in small_run.iterdir() if p.name != ".esft.lock")


def test_weights_that_are_not_safetensors_are_one_line(small_run, tmp_path):
    from esft.files import file_digest

    run = copy_run(small_run, tmp_path)
    weights = run / "checkpoint-1" / "model.safetensors"
    weights.write_bytes(b"\x80\x04 a pickle, perhaps; not safetensors")
    edit_state(run / "checkpoint-1", lambda s: s["files"].update({"model.safetensors": file_digest(weights)}))
    proc = esft("train", "--resume", str(run / "checkpoint-1"), "--iterations", "3", cwd=tmp_path)
    one_error_line(proc, "not a readable safetensors file")


# ------------------------------------------------------ 4-6. a shared reward service and its worst client
@pytest.fixture(scope="module")
def reward_server(tiny_reward_model_dir):
    """`esft serve-reward` with its default limits (batches of 32), as a real process on loopback."""
    from test_serve_reward import start_server, stop

    proc, url = start_server(tiny_reward_model_dir)
    yield url, proc
    code, stderr = stop(proc)
    assert code == 0 and "Traceback" not in stderr, stderr


def post_score(url: str, body: bytes, timeout: float = 60):
    import httpx

    return httpx.post(f"{url}/score", content=body, headers={"Content-Type": "application/json"}, timeout=timeout)


def good_bodies(count: int) -> list[tuple[str, bytes]]:
    texts = [f"prompt {i} " + "x" * (i % 5) for i in range(count)]
    return [(text, json.dumps({"prompts": [text], "completions": [" ok"]}).encode()) for text in texts]


@pytest.mark.parametrize("poison, detail", [
    (b'{"prompts": [""], "completions": [""]}', "item 0: prompt + completion is empty"),
    (b'{"prompts": ["a"], "completions": ["\\ud800"]}', "item 0: character 1 is a lone surrogate"),
    (b'{"prompts": ["a", [{"role": "user", "content": "\\udfff"}]], "completions": ["b", "c"]}', "item 1:"),
    (b'{"prompts": ["a", "b"], "completions": ["ok", "caf\xe9"]}', "item 1: its completion is not valid UTF-8"),
])
def test_one_poisonous_request_fails_alone_among_32_good_ones(reward_server, tiny_reward_model_dir, poison, detail):
    from concurrent.futures import ThreadPoolExecutor

    from esft.rewards.models import RewardModel

    url, _ = reward_server
    goods = good_bodies(32)
    expected = RewardModel(str(tiny_reward_model_dir))([t for t, _ in goods], [" ok"] * len(goods))  # the server's device
    with ThreadPoolExecutor(33) as pool:
        bad = pool.submit(post_score, url, poison)
        answers = list(pool.map(lambda item: post_score(url, item[1]), goods))
    assert bad.result().status_code == 400 and detail in bad.result().json()["detail"], bad.result().text
    assert [a.status_code for a in answers] == [200] * 32, [a.text for a in answers if a.status_code != 200][:2]
    assert [a.json()["rewards"][0] for a in answers] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_a_request_that_fails_in_the_model_fails_only_itself(tmp_path):
    """A poison validation cannot see (a real broken model: tokens past its 100 embedding rows), among
    32 good requests scored in shared batches through the real app."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from esft.rewards.models import RewardModel
    from esft.rewards.serve import create_app
    from tiny_model import build_tiny_reward_model

    import threading
    import time

    broken = RewardModel(str(build_tiny_reward_model(tmp_path)))
    broken.load()
    broken.model.resize_token_embeddings(100)
    gate, score_texts = threading.Event(), broken.score_texts
    broken.score_texts = lambda texts: (gate.wait(60), score_texts(texts))[1]  # holds the first batch until all wait
    with TestClient(create_app(broken, batch_size=64), raise_server_exceptions=False) as client:
        def score(body):
            return client.post("/score", json=body)

        goods = [{"prompts": [f"ab{i}"], "completions": ["c!"]} for i in range(32)]  # printable ASCII: tokens below 100
        with ThreadPoolExecutor(33) as pool:
            first = pool.submit(score, goods[0])
            time.sleep(0.5)  # in the model (held), so the others queue and are batched together with the poison
            bad = pool.submit(score, {"prompts": ["a b"], "completions": ["c"]})
            answers = [first, *(pool.submit(score, body) for body in goods[1:])]
            deadline = time.monotonic() + 30
            while (waiting := client.get("/health").json()["queue"]) < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            gate.set()
            answers = [a.result() for a in answers]
        assert bad.result().status_code == 500 and bad.result().json()["detail"].startswith(
            "internal error: IndexError: token id 222 is past the model's 100 embedding rows")
        assert [a.status_code for a in answers] == [200] * 32
        assert waiting == 32  # the poison and 31 batch-mates, scored in one batch


def test_one_huge_request_is_refused_and_small_ones_keep_moving(reward_server):
    import time
    from concurrent.futures import ThreadPoolExecutor

    url, _ = reward_server
    huge = json.dumps({"prompts": ["Summarize:"], "completions": ["word " * 1_600_000]}).encode()  # 8 MB
    small = json.dumps({"prompts": ["hi"], "completions": [" there"]}).encode()
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(post_score, url, huge)
        time.sleep(0.3)
        started = time.perf_counter()
        answer = post_score(url, small)
        waited = time.perf_counter() - started
    assert answer.status_code == 200 and waited < 5, waited
    assert big.result().status_code == 413 and "--max-text-chars" in big.result().json()["detail"]


def test_no_content_type_no_docs_and_slow_headers_are_cut_off(reward_server):
    import socket
    import time

    import httpx

    url, _ = reward_server
    bare = httpx.post(f"{url}/score", content=b'{"prompts": ["a"], "completions": ["b"]}', timeout=10)  # no Content-Type
    assert bare.status_code == 415 and "Content-Type: application/json" in bare.json()["detail"]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 404, path
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # headers that never finish
        started = time.perf_counter()
        try:
            closed = sock.recv(1024) == b""
        except (TimeoutError, ConnectionResetError) as error:
            closed = isinstance(error, ConnectionResetError)
        assert closed and time.perf_counter() - started < 20


def returns_true(completions, **kwargs):
    return [True] * len(completions)


def returns_numpy_bools(completions, **kwargs):
    import numpy

    return list(numpy.array([1.0] * len(completions)) > 0)


@pytest.mark.parametrize("func", [returns_true, returns_numpy_bools])
def test_a_bool_is_not_a_reward_of_one(func):
    from esft.rewards.runner import RewardRunner

    runner = RewardRunner([func], timeout=10, workers=1, sandbox=False)
    try:
        scores = runner.score([{"prompt": "p"}, {"prompt": "q"}], ["a", "b"])
    finally:
        runner.close()
    assert scores.errors == 2 and scores.mean() != 1.0
