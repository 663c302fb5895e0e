"""The code and data files a run's settings name, recorded as absolute paths and digests under the run's
signature (esft.runs.signature), so that the signature vouches for the files, not for the strings naming them.

A setting such as `--reward-funcs r.py:score` or `--train-data d.jsonl` is a string: resumed from another
directory, or after the file changed, the same string names other code or other data. Every config.yaml
and trainer_state.json therefore records, for each code and data file its settings name, the absolute
path that string resolved to when the run started and the file's digest. A resume (or `esft eval` of a
run's weights) takes those settings without --trust-run-code only when each names the same file, unchanged
(`changed_files` says which does not). What is recorded is the named file itself: modules it imports in
turn, and a reward service's behaviour, are trusted (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

from esft.files import directory_digests, file_digest, looks_like_path
from esft.rewards.usercode import source_file

CODE = ("task", "reward_funcs")
"""Settings naming code: `module:function` or `path/to/file.py:function` (reward functions comma-separated)."""
DATA = ("train_data", "eval_data")
"""Settings naming a data file or a save_to_disk directory (a dataset name of the local cache names no file)."""


def _code_specs(name: str, value: Any) -> list[str]:
    if not isinstance(value, str) or not value:
        return []
    if name == "task":
        return [value] if ":" in value else []  # a built-in task's name is esft's own code
    return [item.strip() for item in value.split(",") if item.strip()]


def _digest(path: Path) -> str | None:
    """The digest of a regular file or of a directory's regular files; None for anything else (a named pipe
    would hang the read, a device flood it: the data loader refuses those in one line)."""
    if path.is_dir():  # a save_to_disk dataset: every file of it
        listing = json.dumps(directory_digests(path), sort_keys=True).encode()
        return hashlib.blake2b(listing, digest_size=20).hexdigest()
    return file_digest(path) if stat.S_ISREG(path.stat().st_mode) else None


def _entry(name: str, value: str, path: Path | None) -> dict[str, Any]:
    found = path is not None and path.exists()
    return {"setting": name, "value": value, "path": str(path) if found else None,
            "digest": _digest(path) if found else None}


def named_files(settings: dict[str, Any], names: tuple[str, ...] = CODE + DATA) -> list[dict[str, Any]]:
    """Each code and data file that the settings `names` name, as resolved from here and now:
    {"setting", "value" (the spec or path as given), "path" (absolute; None: it names no file here),
    "digest"}."""
    entries = []
    for name in names:
        value = settings.get(name)
        if name in CODE:
            entries += [_entry(name, spec, source_file(spec)) for spec in _code_specs(name, value)]
        elif isinstance(value, str) and value and looks_like_path(value):
            entries.append(_entry(name, value, Path(value).expanduser().resolve()))
    return entries


def changed_files(recorded: Any, settings: dict[str, Any], names: set[str]) -> list[str]:
    """What differs between the files the run recorded (`recorded`: named_files when it started) and the
    files the settings `names` name now: one phrase per file, naming it (empty: the same files, unchanged)."""
    before = {(entry.get("setting"), entry.get("value")): entry for entry in recorded or []
              if isinstance(entry, dict)} if isinstance(recorded, list) else {}
    changes = []
    for now in named_files(settings, tuple(name for name in CODE + DATA if name in names)):
        flag = f"--{now['setting'].replace('_', '-')} {now['value']}"
        then = before.get((now["setting"], now["value"]))
        if then is None:
            changes.append(f"{flag} has no digest in the run's record (written by an older esft)")
        elif then.get("path") != now["path"]:
            changes.append(f"{flag} names {now['path'] or 'no file'} from here, the run used {then.get('path') or 'no file'}")
        elif then.get("digest") != now["digest"]:
            changes.append(f"{now['path']} changed since the run recorded it")
    return changes
