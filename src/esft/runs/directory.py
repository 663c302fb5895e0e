"""Run directories: claimed by one process at a time, resumed from a verified checkpoint, never mixed.

- A new run claims `<output-dir>/<run-name>` while holding an exclusive lock on its `.esft.lock`
  file (flock: released by the kernel however the process ends). Default names carry the time and a
  random suffix, so parallel sweeps never collide; an explicit name that is in use, or that already
  holds a run or files the run did not write, is refused (ConfigError: exit 2 in the CLI). The lock
  file is opened without following links and must be a regular file of its own; a resumed directory
  holding symbolic links is refused: esft never writes through a link planted in a run directory.
- `find_resume_point(path)` is the one place a resume is resolved: a `checkpoint-<N>` directory, or
  the newest checkpoint of a run directory that verifies (esft.runs.checkpoint.verify: every file matches
  its recorded digest), saying which ones it passed over. A run killed before its first checkpoint
  resumes from the start with its own settings.
- `open_run(args, resume_point)` claims the directory; a directory that changed since its resume point was
  read (another process was still writing it), or whose checkpoint another run wrote, is refused, nothing moved.
  Once the resumed weights have loaded, `RunDir.set_aside_later` moves what the run did after its resume point N
  (later checkpoints, `final/`, metrics rows, evaluation files, TensorBoard events of a restart from scratch)
  into `superseded-<time>/`: nothing is lost, nothing is mixed in, and a resume refused before then moves nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esft.runs.checkpoint import (STATE_FILE, checkpoint_number, is_checkpoint, list_checkpoints, read_state,
                                  state_signed, verify)
from esft.settings.config import ConfigError, ESConfig
from esft.files import (METRICS_LIMIT, SETTINGS_LIMIT, YamlTooLarge, load_yaml, read_regular_text,
                        write_text_atomic)
from esft.runs.metrics import METRICS_FILE
from esft.runs.named_files import named_files
from esft.runs.randopt_record import record_vouched
from esft.runs.signature import signed_yaml, yaml_vouched

LOCK_FILE = ".esft.lock"
CONFIG_FILE = "config.yaml"
RUN_ID_PREFIX = "# esft-run: "
"""config.yaml's line naming the run: a random id given when the run is claimed, kept on resume and
written into every checkpoint (`run_id`), so a checkpoint copied from another run is told apart."""
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, "final", "final-merged")
"""Entries that mean a directory already holds a run (besides checkpoints)."""
_EVAL_DIR = re.compile(r"^iteration-(\d+)$")


class ResumeError(ValueError):
    """Nothing to resume from; the message says why and what to do."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues."""

    run_dir: Path
    checkpoint: Path | None
    """None: the run never wrote a checkpoint, and starts again from iteration 0."""
    iteration: int
    config: dict[str, Any]
    """The settings the run was started with (flags given on resume override them)."""
    skipped: list[str] = field(default_factory=list)
    """Newer checkpoints passed over, each with why."""
    signed: bool = False
    """The settings carry this user's signature (esft.runs.signature): written by them, unedited."""
    named_files: list | None = None
    """The code and data files the settings named when the run wrote them (esft.runs.named_files)."""
    seen: tuple | None = None
    """What the run directory held when the point was read (its_contents): open_run compares it again
    once it holds the lock, so a run another process was still writing is refused, never set aside."""
    run_id: str | None = None
    """The run the checkpoint was written by (None: before run ids, or no checkpoint)."""


def find_resume_point(path: str | Path) -> ResumePoint:
    """A checkpoint directory (verified), or the newest verified checkpoint (or `final/`) of a run
    directory; a run that never wrote one restarts from iteration 0 with its config.yaml."""
    path = Path(path).expanduser()
    if is_checkpoint(path):
        problem = verify(path)
        if problem:
            raise ResumeError(f"{problem}; resume from the run directory {path.parent} to use its newest intact checkpoint")
        seen = its_contents(path.parent)
        return _point(path.parent, path, read_state(path), [], seen)
    if not path.is_dir():
        raise ResumeError(f"{path} is neither a checkpoint nor a run directory")
    seen = its_contents(path)
    candidates = list_checkpoints(path) + ([path / "final"] if is_checkpoint(path / "final") else [])
    skipped = []
    # newest first; at equal iterations a checkpoint-<N> before final/ (the same weights)
    for checkpoint in sorted(candidates, key=lambda c: (_iteration_of_dir(c) or -1, c.name != "final"), reverse=True):
        problem = verify(checkpoint)
        if problem is None:
            return _point(path, checkpoint, read_state(checkpoint), skipped, seen)
        skipped.append(problem)
    if skipped:
        raise ResumeError(f"no checkpoint of {path} is intact ({'; '.join(skipped)})")
    if not os.path.lexists(path / CONFIG_FILE):
        raise ResumeError(f"{path} is neither a checkpoint nor a run directory (no checkpoint-<N>, no {CONFIG_FILE})")
    config = read_run_yaml(path / CONFIG_FILE)
    signed, named = yaml_vouched(read_regular_text(path / CONFIG_FILE, SETTINGS_LIMIT), config)
    return ResumePoint(path, None, 0, config, signed=signed and record_vouched(path), seen=seen, named_files=named)


def _point(run_dir: Path, checkpoint: Path, state: dict[str, Any], skipped: list[str], seen: tuple) -> ResumePoint:
    """The resume point of a verified checkpoint, vouched for when its whole state carries this user's
    signature (and a RandOpt run's record does: esft.runs.randopt_record)."""
    return ResumePoint(run_dir, checkpoint, state["iteration"], state["config"], skipped,
                       signed=state_signed(state) and record_vouched(run_dir), named_files=state.get("named_files"),
                       seen=seen, run_id=state.get("run_id"))


def run_id_of(path: Path) -> str | None:
    """The run id in a run directory's config.yaml (RUN_ID_PREFIX), or None (no config.yaml, or a run from
    before run ids)."""
    try:
        text = read_regular_text(path / CONFIG_FILE, SETTINGS_LIMIT)
    except (OSError, ValueError):
        return None
    return next((line[len(RUN_ID_PREFIX):].strip() for line in text.splitlines() if line.startswith(RUN_ID_PREFIX)), None)


def its_contents(path: Path) -> tuple:
    """What a run directory holds, cheaply (no digests): its checkpoint directories, whether final/ is
    complete, and the size of metrics.jsonl. Another process writing the run changes it."""
    metrics = path / METRICS_FILE
    return (tuple(sorted(c.name for c in path.glob("checkpoint-*"))), is_checkpoint(path / "final"),
            metrics.stat().st_size if metrics.is_file() else None)


def read_run_yaml(path: Path) -> dict[str, Any]:
    """A run's config.yaml as a non-empty mapping of settings (read as a regular file of bounded size,
    aliases within a budget: esft.files), or ResumeError saying why not."""
    import yaml

    try:
        config = load_yaml(read_regular_text(path, SETTINGS_LIMIT))
    except OSError as error:
        raise ResumeError(f"{path} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ResumeError(f"{path} is not UTF-8 text (byte {error.start})") from None
    except (yaml.YAMLError, YamlTooLarge) as error:
        problem = " ".join(str(error).split())
        raise ResumeError(f"{path} is not valid YAML ({problem[:200]})") from None
    if not isinstance(config, dict) or not config:
        raise ResumeError(f"{path} records no settings (a mapping of setting: value); resume a run that esft wrote, "
                          "or start a new run")
    return config


def default_run_name(args: ESConfig) -> str:
    """<task>-s<seed>-<time>-<random>: unique even for runs started in the same second."""
    task = args.task.rpartition(":")[2] or "task"
    return f"{task}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class RunDir:
    """A run directory this process holds (the lock is released by close() or when the process ends)."""

    def __init__(self, path: Path, lock_fd: int, resume: ResumePoint | None = None, created: Path | None = None,
                 run_id: str | None = None):
        self.path = path
        self.resume = resume
        self.run_id = run_id or secrets.token_hex(8)
        """This run's id (RUN_ID_PREFIX): config.yaml and every checkpoint carry it."""
        self.named_files: list[dict[str, Any]] = []
        """The code and data files the settings name (esft.runs.named_files), recorded by write_config: every
        checkpoint carries them under its signature."""
        self._lock_fd: int | None = lock_fd
        self._set_aside = False
        self._created = created
        """The outermost directory open_run created for this run (removed again if setup fails)."""

    @property
    def name(self) -> str:
        return self.path.name

    def write_config(self, args: ESConfig) -> None:
        """config.yaml: the resolved settings, with where the run actually lives."""
        import yaml

        settings = {**args.to_dict(), "output_dir": str(self.path.parent), "run_name": self.path.name, "resume": None}
        self.named_files = named_files(settings)
        body = yaml.safe_dump(settings, sort_keys=False, allow_unicode=True)
        text = signed_yaml(settings, body, self.named_files) + f"{RUN_ID_PREFIX}{self.run_id}\n"  # esft.runs.signature
        write_text_atomic(self.path / CONFIG_FILE, text)

    def set_aside_later(self) -> None:
        """Resumed: move what the run did after its resume point into superseded-<time>/ (module docstring), once.
        Called by the trainer once the resumed weights have loaded: a resume refused before then moves nothing."""
        if self.resume is not None and not self._set_aside:
            _set_aside_later(self.path, self.resume)
        self._set_aside = True

    def discard_if_unused(self) -> None:
        """Remove a new run directory nothing was written to (setup failed), and release it."""
        if self.resume is None and {p.name for p in self.path.iterdir()} <= {LOCK_FILE, CONFIG_FILE}:
            shutil.rmtree(self._created or self.path, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _lock(path: Path, flag: str) -> int:
    """Take the run directory's lock, or ConfigError naming who holds it. The lock file is opened
    without following a link and must be a regular file of its own: it is truncated to take our pid,
    and a link planted there (a copied or downloaded run, a pre-created directory) would have that
    write land on the file it points to."""
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise ConfigError(flag, f"{lock_path} cannot be opened as esft's lock file ({error.strerror}: a symbolic link or "
                          "something else esft did not write); remove it, or use a directory you made") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise ConfigError(flag, f"{lock_path} is not a lock file esft wrote (a hard link, a pipe or a device); remove it, "
                          "or use a directory you made")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(flag, f"{path} is in use by another esft process (pid {holder}); wait for it to finish "
                          "or pick another directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError("output_dir", f"cannot create {path} ({error.strerror or error}); pick a writable --output-dir") from None
    if not os.access(path, os.W_OK):
        raise ConfigError("output_dir", f"{path} is not writable; pick a writable --output-dir")


def holds_run(path: Path) -> bool:
    return bool(list_checkpoints(path)) or any((path / entry).exists() for entry in RUN_MARKERS)


def open_run(args: ESConfig, resume: ResumePoint | None = None) -> RunDir:
    """Claim the run's directory (module docstring): a new one, or the resumed one with what came
    after the resume point set aside."""
    if resume is not None:
        path = resume.run_dir
        _refuse_links(path)
        fd = _lock(path, "resume")
        try:
            if resume.seen is not None and its_contents(path) != resume.seen:  # read, then written by another process
                raise ConfigError("resume", f"{path} changed while esft read it (another esft process was still "
                                  "writing it and has just let go of it); nothing was moved: run the command again")
            own = run_id_of(path)
            if resume.run_id is not None and own is not None and resume.run_id != own:
                raise ConfigError("resume", f"{resume.checkpoint} was written by another run (run {resume.run_id}; "
                                  f"{path / CONFIG_FILE} is run {own}): resume the directory that run wrote, or copy a "
                                  "whole run directory, never a checkpoint into another run; nothing was moved")
            _remove_stale_temporaries(path)
        except BaseException:
            os.close(fd)
            raise
        return RunDir(path, fd, resume, run_id=own)
    output_dir = Path(args.output_dir).expanduser()
    for _ in range(5):
        path = output_dir / (args.run_name or default_run_name(args))
        created = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
        flag = "run_name" if args.run_name else "output_dir"
        if path.is_symlink():
            raise ConfigError(flag, f"{path} is a symbolic link; a new run gets a directory of its own: pick another "
                              "--run-name or remove the link")
        _make_dir(path)
        foreign = sorted(entry.name for entry in path.iterdir() if entry.name != LOCK_FILE)
        if foreign and args.run_name and not holds_run(path):  # never adopted: they could be links to others' files
            raise ConfigError("run_name", f"{path} already holds files that are not a run's ({', '.join(foreign[:3])}"
                              f"{', ...' if len(foreign) > 3 else ''}); pick another --run-name or empty it")
        fd = _lock(path, flag)
        if not foreign and not any(entry.name != LOCK_FILE for entry in path.iterdir()):
            run = RunDir(path, fd, created=created)
            run.write_config(args)  # at once: a run killed while its model loads can still be resumed
            return run
        os.close(fd)
        if args.run_name:
            raise ConfigError("run_name", f"{path} already holds a run; pass --resume {path} to continue it, "
                              "or another --run-name")
    raise ConfigError("output_dir", f"could not find a free run name in {output_dir}")


def _refuse_links(path: Path) -> None:
    """A resumed run writes into its directory (metrics rows appended, evaluation files, events) and
    reads it: a symbolic or hard link there (a copied or downloaded run) would have those writes land
    elsewhere, a named pipe or a device would hang or flood the reads."""
    entries = [*path.iterdir(), *((path / "eval").rglob("*") if (path / "eval").is_dir() else ())]
    links, hard, special = [], [], []
    for entry in entries:
        info = entry.lstat()
        name = str(entry.relative_to(path))
        if stat.S_ISLNK(info.st_mode):
            links.append(name)
        elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            hard.append(name)
        elif not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            special.append(name)
    for found, what in ((links, "symbolic links"), (hard, "hard links"),
                        (special, "named pipes, sockets or devices")):
        if found:
            raise ConfigError("resume", f"{path} holds {what} ({', '.join(sorted(found)[:3])}), which esft never "
                              "writes: a resumed run would write through them (a hard link names a file elsewhere "
                              "too) or hang on them; remove them (or copy the files into place), then resume")


def _remove_stale_temporaries(path: Path) -> None:
    """Half-written checkpoints (`.checkpoint-N.*.tmp`) of a process that died while saving."""
    for entry in path.glob(".*.tmp"):
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def _set_aside_later(path: Path, resume: ResumePoint) -> None:
    """Move what the run did after resume.iteration into superseded-<time>/ (and say so)."""
    n = resume.iteration
    later: list[Path] = [c for c in list_checkpoints(path) if checkpoint_number(c) > n]
    later += [c for c in path.glob("checkpoint-*") if c.is_dir() and not is_checkpoint(c)]  # incomplete ones
    final = path / "final"
    if final.exists() and (not (final / STATE_FILE).is_file() or _iteration_of_dir(final) != n or resume.checkpoint is None):
        later.append(final)
    merged = path / "final-merged"  # LoRA-ES: the merged export goes with its final/ (or without one)
    if merged.exists() and (final in later or not final.exists()):
        later.append(merged)
    evals = path / "eval"
    if evals.is_dir():
        later += [d for d in evals.iterdir() if (m := _EVAL_DIR.match(d.name)) and (int(m.group(1)) > n or resume.checkpoint is None)]
    if resume.checkpoint is None:  # a restart from scratch: its old TensorBoard events go too
        later += list(path.glob("events.out.tfevents.*"))
    later = [entry for entry in later if entry != resume.checkpoint]  # never the very checkpoint resumed from
    metrics = path / METRICS_FILE
    kept, dropped = _split_metrics(metrics, n if resume.checkpoint is not None else -1)
    if not later and not dropped:
        return
    aside = path / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    aside.mkdir()
    for entry in later:
        target = aside / entry.relative_to(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(entry), str(target))
    if dropped:
        shutil.copy2(metrics, aside / METRICS_FILE)  # the whole file as it was
        write_text_atomic(metrics, "".join(line + "\n" for line in kept))
    names = sorted({entry.relative_to(path).parts[0] if entry.parent == path else str(entry.relative_to(path)) for entry in later})
    what = ", ".join(names[:6] + ([f"… ({len(names) - 6} more)"] if len(names) > 6 else []))
    rows = f"{len(dropped)} metrics rows" if dropped else ""
    print(f"esft: resuming {path} at iteration {n}: what it did after that ({', '.join(x for x in (what, rows) if x)}) "
          f"was moved to {aside}", file=sys.stderr)


def _iteration_of_dir(directory: Path) -> int | None:
    try:
        return read_state(directory)["iteration"]
    except Exception:  # noqa: BLE001 - unreadable counts as "not this lineage"
        return None


def _split_metrics(metrics: Path, iteration: int) -> tuple[list[str], list[str]]:
    """metrics.jsonl lines of rows up to `iteration`, and the others (later rows, torn or foreign lines)."""
    if not metrics.is_file():
        return [], []
    kept, dropped = [], []
    for line in read_regular_text(metrics, METRICS_LIMIT, errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            row = None
        number = row.get("iteration") if isinstance(row, dict) else None
        (kept if isinstance(number, int) and number <= iteration else dropped).append(line)
    return kept, [line for line in dropped if line.strip()]
