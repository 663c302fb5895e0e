"""`esft ...` run by a test: as a subprocess (`run_esft`), the way a user runs it, or in this process
(`run_esft_here`), for the many variations of a path whose end-to-end run is already a subprocess test.

A fresh process costs ~5 s of imports (torch, transformers, esft) before esft reads its first flag, most of a
tiny run's time; `run_esft_here` pays none of it. It calls `esft.cli.main` as `python -m esft.cli` would
(in `cwd`, with `env` set, stdout and stderr captured, an uncaught exception printed as the traceback a
process would print with exit code 1) and returns the same `subprocess.CompletedProcess`, so a test reads
either the same way. What a separate process is needed for stays a subprocess: a lock held by another
process, signals, a user's own script, the start-up itself (imports, the allocator).

Both pin ESConfig's own ES defaults (`without_model_preset`): `esft train` on a model other than the embedded
one adds the model preset (64 members, σ chosen by --sigma auto), and the tests of other behaviour were written
for the paper's defaults on tiny random models, where no σ of the ladder carries a signal. The model preset's
own tests pass `model_preset=True`."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from tiny_model import subprocess_env


def without_model_preset(argv) -> list[str]:
    """`argv` with `--preset none` after `train` when it trains a model other than the embedded one (so
    would get the model preset) and names no preset itself."""
    argv = [str(arg) for arg in argv]
    if "train" in argv and "--model" in argv and "--preset" not in argv:
        model = argv[argv.index("--model") + 1]
        if model != "embedded":
            at = argv.index("train") + 1
            argv[at:at] = ["--preset", "none"]
    return argv


def run_esft(*argv: str, cwd: Path, env: dict[str, str] | None = None, script: Path | None = None,
             timeout: float = 300, model_preset: bool = False) -> subprocess.CompletedProcess:
    """`python -m esft.cli ARGV` (or `python SCRIPT ARGV`, e.g. tests/toy_task.py) in a process of its own."""
    entry = [str(script)] if script is not None else ["-m", "esft.cli"]
    argv = list(argv) if model_preset else without_model_preset(argv)
    return subprocess.run([sys.executable, *entry, *argv], cwd=cwd, env=env or subprocess_env(), capture_output=True,
                          text=True, encoding="utf-8", timeout=timeout)


def run_esft_here(*argv: str, cwd: Path, env: dict[str, str] | None = None,
                  script: Path | None = None, model_preset: bool = False) -> subprocess.CompletedProcess:
    """`esft ARGV` in this process: `esft.cli.main(ARGV)` in `cwd` with `env`'s variables set, its output
    captured. `script` may be tests/toy_task.py (its task registered first, as its __main__ does). Two
    process-wide effects of the CLI are left out: esft.allocator's malloc settings (permanent for the process,
    and pytest's worker is not a training run; tests/test_allocator.py checks that the CLI applies them) and
    the environment, which is restored afterwards."""
    import esft.allocator
    from esft.cli import main

    argv = list(argv) if model_preset else without_model_preset(argv)

    if script is not None:
        assert Path(script).name == "toy_task.py", f"{script}: a user's own script runs as a subprocess (run_esft)"
        import toy_task

        toy_task.register()
    out, err = io.StringIO(), io.StringIO()
    kept_allocator = esft.allocator.steady_allocator
    esft.allocator.steady_allocator = lambda: "allocator: left as the test process's (tests/cli_runner.py)"
    try:
        with _environment(env), contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as stop:  # argparse's errors and --help
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except Exception:  # noqa: BLE001 - what the process would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        esft.allocator.steady_allocator = kept_allocator
    return subprocess.CompletedProcess([*argv], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    """os.environ as `env` (subprocess_env() when None) for the duration; the process's own afterwards."""
    kept = dict(os.environ)
    os.environ.clear()
    os.environ.update(env or subprocess_env())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(kept)
