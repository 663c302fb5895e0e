"""Checkpoints: `checkpoint-<N>/` = a from_pretrained-loadable model + `trainer_state.json`.

Written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written `checkpoint-<N>` (resume only considers directories holding `trainer_state.json`,
which is written last). Low-precision runs also store the float32 master (`master.safetensors`),
which resume needs to continue bit-exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
MASTER_FILE = "master.safetensors"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: temp file in the same directory, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(engine, directory: Path, state: dict[str, Any], save_master: bool) -> Path:
    """Write `directory` (e.g. run/checkpoint-10) atomically and return it."""
    directory = Path(directory)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        engine.save_pretrained(tmp)
        if save_master:
            from safetensors.torch import save_file

            save_file(engine.master_state(), str(tmp / MASTER_FILE))
        write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint directory."""
    return Path(path).is_dir() and (Path(path) / STATE_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete `checkpoint-<N>` directories of a run, oldest first."""
    found = []
    for child in Path(run_dir).iterdir() if Path(run_dir).is_dir() else []:
        match = _CHECKPOINT.match(child.name)
        if match and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest complete checkpoint of a run directory."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with a complete checkpoint-<N>")
    return checkpoints[-1]


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state stored in a checkpoint."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def load_master(checkpoint: Path, engine) -> None:
    """Give `engine` the checkpoint's weights: the float32 master if stored, else the model file
    (float32 runs: there the saved weights are the master, bit for bit)."""
    from safetensors.torch import load_file

    master_file = Path(checkpoint) / MASTER_FILE
    if master_file.is_file():
        engine.load_master_state(load_file(str(master_file)))
        return
    weights: dict = {}
    for shard in sorted(Path(checkpoint).glob("model*.safetensors")):
        weights.update(load_file(str(shard)))
    engine.load_master_state({name: tensor.float() for name, tensor in weights.items() if name in engine.master})


def prune_checkpoints(run_dir: Path, keep: int | None) -> None:
    """Delete the oldest checkpoints beyond `keep`."""
    if keep is None:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
