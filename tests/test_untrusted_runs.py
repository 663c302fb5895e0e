"""A copied run directory edited by hand (issue 52): it may not send the user's files and reward API
key to a service it names, write outside itself through a hard link, hang esft on a named pipe, flood
it from a device, or print a gigabyte from a few hundred bytes of YAML. Each test attacks with real
files and processes the way the probe did: a listener on 127.0.0.1 that must receive nothing, a FIFO
with a time bound (a hang fails the test), a hard link, a link to /dev/zero."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from test_security import ENV, TESTS, copy_run, edit_state, one_error_line, small_run  # noqa: F401 - a fixture
from test_security import esft as security_esft, esft_process as security_esft_process
from cli_runner import without_model_preset

API_KEY = "sekrit-key-of-the-user"
HANG = 120
"""Seconds a command may take before the test calls it a hang (each of these stops before a model loads,
or right after)."""


USER_ENV = {**ENV, "ESFT_REWARD_API_KEY": API_KEY}


def esft(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python tests/toy_task.py ARGV` with the user's reward API key set, in this process (tests/cli_runner.py)."""
    return security_esft(*argv, cwd=cwd, env=USER_ENV)


def esft_process(*argv: str, cwd: Path, timeout: float = HANG) -> subprocess.CompletedProcess:
    """The same in a process of its own, for what could hang: a hang is a failed test, not a stuck suite."""
    return security_esft_process(*argv, cwd=cwd, env=USER_ENV, timeout=timeout)


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 recording every byte any client sends it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(65536):
                        received.append(chunk)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", received
    stop.set()
    thread.join(5)
    server.close()


@pytest.fixture
def secrets_file(tmp_path) -> Path:
    path = tmp_path / "home" / "secrets.csv"
    path.parent.mkdir()
    path.write_text("name,secret\nbank,PIN-4242\nmail,hunter2\n")
    return path


def test_a_copied_run_never_sends_your_files_or_key_where_it_names(small_run, tmp_path, listener, secrets_file):
    url, received = listener
    run = copy_run(small_run, tmp_path)
    taken = dict(task="custom", reward_url=url, train_data=str(secrets_file), eval_data=str(secrets_file),
                 prompt_column="secret")
    for checkpoint in [*run.glob("checkpoint-*"), run / "final"]:
        edit_state(checkpoint, lambda s: s["config"].update(taken))
    line = one_error_line(esft("train", "--resume", str(run), "--iterations", "3", cwd=tmp_path),
                          f"--resume {run}", f"--reward-url {url}", f"--train-data {secrets_file}", "--trust-run-code")
    assert API_KEY not in line
    # a run without checkpoints resumes from its config.yaml: the same
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text(yaml.safe_dump(taken))
    one_error_line(esft("train", "--resume", str(fresh), cwd=tmp_path), f"--reward-url {url}", "--trust-run-code")
    # esft eval --model RUN/final takes its data from the run: the same
    one_error_line(esft("eval", "--model", str(run / "final"), "--logging", "none", "--output-dir", str(tmp_path / "out"),
                        cwd=tmp_path), f"--model {run / 'final'}", f"--eval-data {secrets_file}", "--trust-run-code")
    assert received == [] and not list(run.glob("superseded-*"))


def test_a_hard_link_in_a_run_is_never_written_through(small_run, tmp_path):
    from esft.files import NotARegularFile
    from esft.runs.metrics import MetricsLogger

    run = copy_run(small_run, tmp_path)
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes((run / "metrics.jsonl").read_bytes())
    before = outside.read_bytes()
    (run / "metrics.jsonl").unlink()
    os.link(outside, run / "metrics.jsonl")
    one_error_line(esft("train", "--resume", str(run), "--iterations", "3", cwd=tmp_path), "hard links (metrics.jsonl)")
    assert outside.read_bytes() == before
    # and the logger itself never appends to one (a link made after the resume began)
    logger = MetricsLogger(run, backend="none")
    with pytest.raises(NotARegularFile, match="a hard link"):
        logger.log({"iteration": 99, "x": 1.0})
    assert outside.read_bytes() == before


def test_named_pipes_and_devices_in_a_run_never_hang_or_flood_esft(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    one_error_line(esft_process("train", "--resume", str(run), "--iterations", "3", cwd=tmp_path), "named pipes", "metrics.jsonl")
    (run / "checkpoint-1" / "model.safetensors").unlink()  # in a checkpoint: whatever loads it would hang
    os.mkfifo(run / "checkpoint-1" / "model.safetensors")
    one_error_line(esft_process("train", "--resume", str(run / "checkpoint-1"), cwd=tmp_path), "model.safetensors is a named pipe")
    fresh = tmp_path / "fresh"  # a run without checkpoints: its config.yaml is read first
    fresh.mkdir()
    os.mkfifo(fresh / "config.yaml")
    one_error_line(esft_process("train", "--resume", str(fresh), cwd=tmp_path), "config.yaml cannot be read (a named pipe")
    # esft report: status.json a pipe, then a link to /dev/zero: the report is written all the same
    report_run = copy_run(small_run, tmp_path / "r")
    for plant in (os.mkfifo, lambda path: os.symlink("/dev/zero", path)):
        (report_run / "status.json").unlink(missing_ok=True)
        plant(report_run / "status.json")
        proc = esft_process("report", str(report_run), cwd=tmp_path)
        assert proc.returncode == 0 and (report_run / "report.html").is_file(), proc.stderr[-2000:]
    (report_run / "metrics.jsonl").unlink()
    os.symlink("/dev/zero", report_run / "metrics.jsonl")
    one_error_line(esft_process("report", str(report_run), cwd=tmp_path), "metrics.jsonl", "symbolic link")


def test_a_pipe_named_as_eval_data_is_one_line_even_when_trusted(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    pipe = tmp_path / "rows.jsonl"
    os.mkfifo(pipe)
    edit_state(run / "final", lambda s: s["config"].update(task="custom", eval_data=str(pipe), reward_funcs=None))
    proc = esft_process("eval", "--model", str(run / "final"), "--trust-run-code", "--logging", "none", "--output-dir",
                        str(tmp_path / "out"), "--reward-funcs", str(TESTS / "sandbox_rewards.py") + ":length_reward", cwd=tmp_path)
    assert f"--trust-run-code: taking the code, data and services that --model {run / 'final'} names: --eval-data {pipe}" \
        in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("esft: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "a named pipe, not a regular file" in lines[0], proc.stderr[-3000:]


def _alias_bomb(levels: int) -> str:
    lines = ["trainable:", "- &a [1,1,1,1,1,1,1,1,1]"]
    lines += [f"- &{chr(97 + n)} [{','.join([f'*{chr(96 + n)}'] * 9)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_few_hundred_bytes_of_yaml_never_print_megabytes(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(8))
    assert len(bomb.read_bytes()) < 400
    line = one_error_line(esft("train", "--config", str(bomb), cwd=tmp_path), f"--config {bomb}", "aliases expand")
    assert len(line) < 400
    small = tmp_path / "small.yaml"  # within the budget: the type error echoes at most 200 characters of it
    small.write_text(_alias_bomb(3))
    line = one_error_line(esft("train", "--config", str(small), cwd=tmp_path), "--trainable: must be a str")
    assert len(line) < 400
    fresh = tmp_path / "fresh"  # a run's own config.yaml
    fresh.mkdir()
    (fresh / "config.yaml").write_text(_alias_bomb(8))
    line = one_error_line(esft("train", "--resume", str(fresh), cwd=tmp_path), "aliases expand")
    assert len(line) < 400


def test_extreme_settings_are_one_line_before_anything_loads(small_run, tmp_path):
    run = copy_run(small_run, tmp_path)
    state = run / "checkpoint-1" / "trainer_state.json"
    original = state.read_text()
    state.write_text(original[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_error_line(esft("train", "--resume", str(run / "checkpoint-1"), cwd=tmp_path), "nested too deeply")
    state.write_text(original)
    edit_state(run / "checkpoint-1", lambda s: s.update(config={}))
    one_error_line(esft("train", "--resume", str(run / "checkpoint-1"), cwd=tmp_path), "records no settings")
    one_error_line(esft("train", "--population-size", "1000000000000", cwd=tmp_path), "--population-size: must be <= ")
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in small_run.iterdir() if p.name != ".esft.lock")


def test_rewards_of_1e308_are_reported_not_a_lost_report(tmp_path):
    run = tmp_path / "run"  # what a reward function returning ±1e308 leaves in metrics.jsonl
    run.mkdir()
    rows = [{"iteration": i, "reward/mean": (-1) ** i * 1e308, "reward/min": -1e308, "reward/max": 1e308,
             "eval/heldout/accuracy": 0.5} for i in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "config.yaml").write_text("iterations: 3\n")
    proc = esft("report", str(run), cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    page = (run / "report.html").read_text()
    assert "final reward mean</th><td class=\"num\">-1e+308</td>" in page


def test_your_own_run_resumes_without_the_opt_in_and_nobody_elses_does(tiny_model_dir, tmp_path):
    """Settings esft wrote are signed with a key only this user's esft reads (esft.runs.signature): the
    user's own run with their data and reward file resumes and evaluates without --trust-run-code; the
    same directory under another user's key (another user's esft), or with a key others can read, does not."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"say {n}"}) + "\n" for n in range(6)))
    (tmp_path / "rewards.py").write_text("def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n")
    mine, theirs = tmp_path / "cache-mine", tmp_path / "cache-theirs"

    def run(cache: Path, *argv: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "esft", *without_model_preset(argv)], cwd=cwd, capture_output=True,
                              text=True,
                              env={**ENV, "ESFT_CACHE": str(cache)}, timeout=300)

    small = ("--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--eval-batch-size", "2",
             "--logging", "none", "--no-progress")
    first = run(mine, "train", "--model", str(tiny_model_dir), "--train-data", "train.jsonl", "--eval-data",
                "train.jsonl", "--reward-funcs", "rewards.py:length", *small, "--output-dir", "runs", "--run-name", "own",
                "--iterations", "1", "--save-every", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    key = mine / "run-key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == 32
    assert (tmp_path / "runs" / "own" / "config.yaml").read_text().startswith("# esft-settings-signature: ")

    resumed = run(mine, "train", "--resume", "runs/own", "--iterations", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "settings written by your esft, unedited" in resumed.stderr and "--reward-funcs rewards.py:length" in resumed.stderr
    evaluated = run(mine, "eval", "--model", "runs/own/final")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]

    # issue 66, case 3: the signature vouches for the files the settings named (absolute paths, digests), not for
    # the strings: the run copied and resumed from a directory holding another rewards.py and train.jsonl
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "runs", other / "runs", ignore=shutil.ignore_patterns(".esft.lock"))
    marker = other / "imported"
    (other / "rewards.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                      "def length(prompts, completions, **kw):\n    return [0.0 for c in completions]\n")
    (other / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    moved = run(mine, "train", "--resume", "runs/own", "--iterations", "3", cwd=other)
    line = one_error_line(moved, "your esft wrote these settings, but", "pass --trust-run-code")
    assert f"--reward-funcs rewards.py:length names {(other / 'rewards.py').resolve()} from here, the run used " \
           f"{(tmp_path / 'rewards.py').resolve()}" in line and "--train-data train.jsonl names" in line
    assert not marker.exists() and not list((other / "runs" / "own").glob("superseded-*"))
    data = (tmp_path / "train.jsonl").read_text()
    (tmp_path / "train.jsonl").write_text(data + json.dumps({"prompt": "say 99"}) + "\n")  # the same path, other rows
    changed = run(mine, "train", "--resume", "runs/own", "--iterations", "3")
    one_error_line(changed, f"{(tmp_path / 'train.jsonl').resolve()} changed since the run recorded it")
    (tmp_path / "train.jsonl").write_text(data)

    # case 4: the checkpoint's file digests are under the signature: an edited chat template whose digest was
    # edited to match no longer passes for what the user's esft wrote
    from esft.files import file_digest

    tokenizer_config = tmp_path / "runs" / "own" / "final" / "tokenizer_config.json"
    original = tokenizer_config.read_bytes()
    tokenizer_config.write_text(json.dumps({**json.loads(original), "chat_template": "{{ 'edited' }}"}))
    edit_state(tokenizer_config.parent, lambda state: state["files"].update(
        {"tokenizer_config.json": file_digest(tokenizer_config)}))
    edited = run(mine, "eval", "--model", "runs/own/final")
    assert "unedited" not in edited.stderr
    one_error_line(edited, "--reward-funcs rewards.py:length", "pass --trust-run-code")

    elsewhere = run(theirs, "train", "--resume", "runs/own", "--iterations", "3")
    assert elsewhere.returncode == 2 and "pass --trust-run-code" in one_error_line(elsewhere)
    key.chmod(0o644)  # a key others can read proves nothing
    exposed = run(mine, "eval", "--model", "runs/own/final")
    assert exposed.returncode == 2 and "pass --trust-run-code" in one_error_line(exposed)


def test_eval_checks_the_digests_of_what_it_loads(small_run, tmp_path):
    """Issue 52 item 6: a flipped byte in the weights, a truncated tokenizer.json: one line, exit 2, as
    --resume says it; a checkpoint whose digests were removed is evaluated, said to be unverified."""
    flipped = copy_run(small_run, tmp_path / "flipped")
    weights = flipped / "final" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    proc = esft("eval", "--model", str(flipped / "final"), "--logging", "none", cwd=tmp_path)
    one_error_line(proc, "model.safetensors does not match the digest", "evaluate an intact checkpoint")

    truncated = copy_run(small_run, tmp_path / "truncated")
    tokenizer = truncated / "final" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:100])
    one_error_line(esft("eval", "--model", str(truncated / "final"), "--logging", "none", cwd=tmp_path),
                   "tokenizer.json does not match the digest")

    unverified = copy_run(small_run, tmp_path / "unverified")
    edit_state(unverified / "final", lambda state: state.pop("files"))
    proc = esft("eval", "--model", str(unverified / "final"), "--logging", "none", "--output-dir", str(tmp_path / "out"),
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "records no digests of its files" in proc.stderr and "unverified" in proc.stderr


def test_a_run_killed_while_its_model_loads_can_be_resumed(tiny_model_dir, tmp_path):
    """Issue 52 item 8: config.yaml is written when the run directory is claimed, before the model
    loads, so a run killed then resumes with its own settings instead of "not a run directory"."""
    import signal
    import time

    argv = [sys.executable, str(TESTS / "toy_task.py"), "train", "--preset", "none", "--model", str(tiny_model_dir),
            "--task", "toy", "--population-size", "2", "--batch-size", "2", "--max-tokens", "4", "--eval-size", "2",
            "--train-size", "8",
            "--eval-batch-size", "2", "--logging", "none", "--no-progress", "--output-dir", str(tmp_path),
            "--run-name", "killed", "--iterations", "1"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tmp_path / "killed" / "config.yaml"
    deadline = time.monotonic() + HANG
    while not config.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert config.exists() and not (tmp_path / "killed" / "metrics.jsonl").exists()  # killed before it trained
    resumed = esft("train", "--resume", str(tmp_path / "killed"), "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / "killed" / "final" / "model.safetensors").is_file()


def _make_key(cache: str, start: float, out) -> None:
    import time

    os.environ["ESFT_CACHE"] = cache
    from esft.runs import signature

    draw = signature.secrets.token_bytes
    signature.secrets.token_bytes = lambda n: (time.sleep(0.3), draw(n))[1]  # a slow first write, as on a busy disk
    time.sleep(max(0.0, start - time.time()))  # every process at once
    out.put(signature._key(create=True))


def test_esft_processes_starting_at_once_share_one_whole_key(tmp_path):
    """Eight esft processes making the run key at the same moment: each gets the same 32 bytes (the key is
    linked into place whole), none an empty file created and not yet written (it would sign nothing)."""
    import multiprocessing
    import time

    context = multiprocessing.get_context("fork")
    out, start = context.Queue(), time.time() + 0.5
    processes = [context.Process(target=_make_key, args=(str(tmp_path), start, out)) for _ in range(8)]
    for process in processes:
        process.start()
    keys = [out.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert len(set(keys)) == 1 and len(keys[0]) == 32, keys
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run-key"]


@pytest.mark.parametrize("settings, expected", [  # issue 66, case 10: each was a traceback, a hang or a wrong verdict
    ({"seed": -1}, "--seed: must be >= 0, got -1"),
    ({"rank": 10**9}, "--rank: must be <= 4096"),
    ({"eval_samples": 10**9, "temperature": 1.0}, "--eval-samples: must be <= 4096"),
    ({"reward_workers": 10**6}, "--reward-workers: must be <= 256"),
    ({"sigma": 1e300}, "--sigma: must be <= 1.0 (σ = 1 already adds noise as large as a typical weight"),
    ({"train_size": 10**8}, "--train-size: must be <= 1000000 (generated problems"),
    ({"eval_size": 10**9}, "--eval-size: must be <= 1000000 (evaluation rows per split"),
])
def test_size_flags_have_upper_bounds_checked_before_anything_loads(settings, expected):
    from esft.settings.config import ConfigError, ESConfig

    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        ESConfig(**settings)


def test_more_generated_problems_than_the_split_holds_is_one_line_in_seconds(tmp_path):
    """Issue 66, case 10: --train-size within its bound but beyond the distinct problems of easy Countdown's
    training split (about 5,100) ran for hours (1,000 draws per problem asked); it stops once 50,000 draws in a
    row find no new problem, before any model loads."""
    started = time.monotonic()
    proc = esft("train", "--train-size", "20000", "--iterations", "1", "--logging", "none", "--no-progress", cwd=tmp_path)
    one_error_line(proc, "could not generate 20000 distinct train-split problems at this difficulty: ")
    assert "use a harder --difficulty" in proc.stderr and time.monotonic() - started < 60
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_sigma_scan_refuses_a_huge_population_and_an_out_it_cannot_write_before_scanning(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = esft("sigma-scan", "--members", "1000000000", cwd=tmp_path)
    assert proc.returncode == 2 and "--members: '1000000000' is not a whole number from 2 to 4096" in proc.stderr
    line = one_error_line(esft("sigma-scan", "--out", str(a_file / "scan"), cwd=tmp_path),
                          f"--out {a_file / 'scan'}: {a_file} is a file, not a folder")
    assert "sigma-scan:" not in line and a_file.read_text() == ""  # refused before the first member was scored


def test_a_module_named_by_name_is_recorded_as_the_file_it_would_import_without_importing_it(tmp_path, monkeypatch):
    """Issue 66, case 3, for `--reward-funcs module:function` and `--task package.module:function`: the file the
    run would import is found on the import path (the current directory first, as the console script does)
    without executing it or its package, and another directory's module of the same name is told apart."""
    from esft.runs.named_files import changed_files, named_files

    first, second = tmp_path / "first", tmp_path / "second"
    for place in (first, second):
        (place / "esft_case3_pkg").mkdir(parents=True)
        (place / "esft_case3_pkg" / "__init__.py").write_text(f"open({str(place / 'executed')!r}, 'w').close()\n")
        (place / "esft_case3_pkg" / "task.py").write_text("def make():\n    pass\n")
        (place / "esft_case3_rewards.py").write_text(f"# {place.name}\ndef score(completions, **kw):\n    return [0.0]\n")
    settings = {"reward_funcs": "esft_case3_rewards:score", "task": "esft_case3_pkg.task:make"}
    monkeypatch.chdir(first)
    recorded = named_files(settings)
    assert [(entry["setting"], entry["path"]) for entry in recorded] == [
        ("task", str((first / "esft_case3_pkg" / "task.py").resolve())),
        ("reward_funcs", str((first / "esft_case3_rewards.py").resolve()))]
    assert all(entry["digest"] for entry in recorded) and changed_files(recorded, settings, set(settings)) == []
    monkeypatch.chdir(second)
    changes = changed_files(recorded, settings, set(settings))
    assert len(changes) == 2 and f"names {(second / 'esft_case3_rewards.py').resolve()} from here" in changes[1]
    monkeypatch.chdir(first)
    (first / "esft_case3_rewards.py").write_text("def score(completions, **kw):\n    return [1.0]\n")
    assert changed_files(recorded, settings, {"reward_funcs"}) == [
        f"{(first / 'esft_case3_rewards.py').resolve()} changed since the run recorded it"]
    assert not (first / "executed").exists() and not (second / "executed").exists()  # nothing was imported
