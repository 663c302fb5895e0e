"""Checkpoints: `checkpoint-<N>/` = a from_pretrained-loadable model + `trainer_state.json`.

Written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written `checkpoint-<N>` (resume only considers directories holding `trainer_state.json`,
which is written last). Low-precision runs and adapters (LoRA-ES: the directory is a PEFT adapter)
also store the float32 master (`master.safetensors`), which resume needs to continue bit-exactly;
runs with --optimizer adam store its moments and step counts (`optimizer/optimizer.safetensors`,
Hugging Face names: esft.es.optimizers), which resume loads so that it continues bit-exactly too; in
a folder of its own, because vLLM loads every top-level *.safetensors file of a model directory as
weights (and would refuse the moments' names).
`trainer_state.json` records a digest of every other file of the checkpoint and the checksum of the
weights: `verify` checks the files before any model loads, `load_master` checks the weights once
loaded, so a corrupted, truncated or incomplete checkpoint is never trained on. The state is signed
whole (`state_signed`): digests alone say a file is intact, the signature that this user's esft wrote
them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from esft.files import (SETTINGS_LIMIT, directory_digests, directory_written_atomically, file_digest, read_regular_text,
                        write_text_atomic)
from esft.runs.signature import sign, signed_whole

STATE_FILE = "trainer_state.json"
MASTER_FILE = "master.safetensors"
OPTIMIZER_FILE = "optimizer/optimizer.safetensors"
SIGNATURE = "settings_signature"
"""The trainer state's key holding this user's signature of the rest of it (esft.runs.signature)."""
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
MAX_ITERATION = 10**9
"""The largest iteration a trainer state may record (a hand-edited 10**30 is refused, not trained towards)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says which file and why."""


def save_checkpoint(engine, directory: Path, state: dict[str, Any], save_master: bool) -> Path:
    """Write `directory` (e.g. run/checkpoint-10) atomically and return it. `state` gets the digests
    of the files written (`files`)."""
    directory = Path(directory)
    try:
        with directory_written_atomically(directory) as tmp:
            engine.save_pretrained(tmp)
            if save_master or not list(tmp.glob("model*.safetensors")):  # an adapter: no model file is the master
                from safetensors.torch import save_file

                save_file(engine.master_state(), str(tmp / MASTER_FILE))
            if optimizer_state := engine.optimizer_state():  # adam's moments (sgd has none)
                from safetensors.torch import save_file

                (tmp / OPTIMIZER_FILE).parent.mkdir()
                save_file(optimizer_state, str(tmp / OPTIMIZER_FILE))
            state = json.loads(json.dumps({**state, "files": directory_digests(tmp, skip=(STATE_FILE,))}))
            # signed whole, as it reads back: the user's own checkpoint resumes without the opt-in, and a digest
            # edited to match an edited file (or an edited setting) no longer passes for what their esft wrote
            state[SIGNATURE] = sign(state)
            write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
    except BaseException as error:
        if not isinstance(error, OSError) and (os_error := _os_error_in(error, directory)) is not None:
            raise os_error from error  # e.g. safetensors' "I/O error: No space left on device (os error 28)"
        raise
    return directory


def _os_error_in(error: BaseException, path: Path) -> OSError | None:
    """The OSError a library reported in its own exception's message ("os error N"), if any."""
    match = re.search(r"os error (\d+)", str(error))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint directory."""
    return Path(path).is_dir() and (Path(path) / STATE_FILE).is_file()


def checkpoint_number(path: Path) -> int | None:
    """N of a `checkpoint-<N>` directory name, else None."""
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete `checkpoint-<N>` directories of a run, oldest first."""
    found = []
    for child in Path(run_dir).iterdir() if Path(run_dir).is_dir() else []:
        number = checkpoint_number(child)
        if number is not None and is_checkpoint(child):
            found.append((number, child))
    return [path for _, path in sorted(found)]


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state stored in a checkpoint (CheckpointError if unreadable)."""
    path = Path(checkpoint) / STATE_FILE
    try:
        state = json.loads(read_regular_text(path, SETTINGS_LIMIT))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is unreadable ({_short(error, 200)})") from None
    except RecursionError:
        raise CheckpointError(f"{path} is unreadable (nested too deeply: not what esft writes)") from None
    if not isinstance(state, dict) or "iteration" not in state or not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{path} is not an esft trainer state (no iteration/config)")
    problem = _state_problem(state, checkpoint_number(checkpoint))
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return state


def state_signed(state: dict[str, Any]) -> bool:
    """Whether this user's esft wrote the trainer `state` as it is: its settings, file digests, named files and
    run id (esft.runs.signature)."""
    return signed_whole(state, SIGNATURE)


def _state_problem(state: dict[str, Any], number: int | None) -> str | None:
    """What is wrong with a trainer state's fields (a hand edit, a renamed copy), checked before a resume
    moves or loads anything; None if nothing."""
    iteration = state["iteration"]
    if type(iteration) is not int or not 0 <= iteration <= MAX_ITERATION:
        return f"iteration must be a whole number from 0 to {MAX_ITERATION}, got {_short(iteration)}"
    if number is not None and number != iteration:
        return (f"the folder is named checkpoint-{number} but holds iteration {iteration} (renamed or copied?); "
                f"rename it checkpoint-{iteration}, or resume from another checkpoint")
    files = state.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        return f"files must map file names to digests, got {_short(files)}"
    for name in files or ():
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts or "\\" in name:
            return f"files names {name!r}, which is not a file inside the checkpoint"
    return None


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def verify(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a missing, truncated or altered file), or None.
    Checkpoints written before digests were recorded are checked for their files only."""
    checkpoint = Path(checkpoint)
    try:
        state = read_state(checkpoint)
    except CheckpointError as error:
        return str(error)
    special = next((p for p in sorted(checkpoint.rglob("*")) if not (p.is_symlink() or p.is_file() or p.is_dir())), None)
    if special is not None:  # a named pipe would hang whatever reads it (transformers, safetensors), a device flood it
        return f"{special} is a named pipe, socket or device; a checkpoint holds regular files only"
    files = state.get("files")
    if files is None:  # an older checkpoint: the files that must be there
        if not list(checkpoint.glob("model*.safetensors")):
            return f"{checkpoint}: model.safetensors is missing"
        if state["config"].get("dtype", "float32") != "float32" and not (checkpoint / MASTER_FILE).is_file():
            return f"{checkpoint / MASTER_FILE} (the float32 master of a {state['config']['dtype']} run) is missing"
        return None
    inside = checkpoint.resolve()
    for name, digest in sorted(files.items()):
        path = checkpoint / name
        if path.is_symlink() or not path.resolve().is_relative_to(inside):  # only the checkpoint's own files are read
            return f"{path} is a link to a file outside the checkpoint; a checkpoint holds its files itself"
        if not path.is_file():
            return f"{path} is missing"
        if file_digest(path) != digest:
            return f"{path} does not match the digest recorded when it was written (corrupted or altered)"
    return _unreadable_weights(checkpoint)


def _unreadable_weights(checkpoint: Path) -> str | None:
    """A weights file that is not safetensors (its header is read, nothing else): refused before a
    resume moves anything."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(checkpoint.glob("*.safetensors")) + sorted(checkpoint.glob(OPTIMIZER_FILE)):
        if path.is_symlink():  # also in checkpoints written before digests were recorded
            return f"{path} is a link; a checkpoint holds its weights itself"
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{path} is not a readable safetensors file ({str(error).splitlines()[0]})"
    return None


def load_master(checkpoint: Path, engine, optimizer: str = "sgd") -> None:
    """Give `engine` the checkpoint's weights: the float32 master if stored, else the model file
    (float32 runs: there the saved weights are the master, bit for bit); then check that they are the
    weights the checkpoint recorded (CheckpointError otherwise). With `optimizer` adam, also adam's
    state (OPTIMIZER_FILE): a checkpoint without it (an sgd run's) is a CheckpointError, since
    fresh moments would not continue the run it wrote; sgd ignores a stored state (it has none)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    master_file = checkpoint / MASTER_FILE
    try:
        if master_file.is_file():
            engine.load_master_state(load_file(str(master_file)))
        else:
            weights: dict = {}
            for shard in sorted(checkpoint.glob("model*.safetensors")):
                weights.update(load_file(str(shard)))
            wanted = set(engine.trainable_names())
            engine.load_master_state({name: tensor.float() for name, tensor in weights.items() if name in wanted})
    except SafetensorError as error:
        raise CheckpointError(f"{checkpoint}: its weights are not a readable safetensors file ({str(error).splitlines()[0]})") from None
    except (ValueError, RuntimeError) as error:  # missing tensors, other shapes (another --lora-r, --trainable)
        raise CheckpointError(f"{checkpoint}: its weights do not fit this model ({str(error).splitlines()[0]}); resume "
                              "with the run's own --model, --trainable and LoRA settings") from None
    expected = read_state(checkpoint).get("checksum")
    if expected is not None and engine.checksum() != expected:
        raise CheckpointError(f"{checkpoint}: the loaded weights do not match the checksum recorded in {STATE_FILE} "
                              "(a different model, dtype, --trainable or --master-weights than the run used?)")
    if optimizer == "adam":
        _load_optimizer(checkpoint, engine)


def _load_optimizer(checkpoint: Path, engine) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checkpoint / OPTIMIZER_FILE
    if not path.is_file():
        used = read_state(checkpoint)["config"].get("optimizer", "sgd")
        raise CheckpointError(f"{checkpoint} holds no optimizer state ({OPTIMIZER_FILE}; it was written with --optimizer "
                              f"{used}): resume it with --optimizer {used}, or start a new run with --optimizer adam")
    try:
        engine.load_optimizer_state(load_file(str(path)))
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path} does not fit this run ({str(error).splitlines()[0]}); resume with the run's own "
                              "--model, --trainable, --noise and LoRA settings") from None


def prune_checkpoints(run_dir: Path, keep: int | None) -> None:
    """Delete the oldest checkpoints beyond `keep`."""
    if keep is None:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
