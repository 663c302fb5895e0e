"""`randopt.json`: what an --algorithm randopt run keeps (issue 53). Seeds and scores only: a member
is regenerated from its seed (esft.es.noise), so the record of N members is a few kilobytes whatever
the model. Written atomically after every scored chunk of members: a killed run resumes without
scoring them again; `esft eval --model RUN_DIR` reads it to let the kept members vote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from esft.files import SETTINGS_LIMIT, read_regular_text, write_text_atomic
from esft.runs.signature import sign, signed_whole

RECORD_FILE = "randopt.json"
FORMAT = 1
SIGNATURE = "signature"
"""The record's key holding this user's signature of the rest of it (esft.runs.signature)."""
IDENTITY = ("model", "task", "train_data", "train_rows", "train_size", "difficulty", "seed", "sigma", "noise",
            "rank", "trainable", "strategy", "dtype", "population_size", "validation_size", "max_tokens",
            "prompt_format", "reward_funcs", "reward_weights", "failed_samples")
"""The settings that decide which members exist and how they score: a record is resumed only under the same ones."""
MEMBERS = ("model", "seed", "sigma", "noise", "rank", "trainable", "strategy", "dtype")
"""The settings that decide which weights a seed stands for: a record's members are evaluated only under these."""


class RecordError(ValueError):
    """A randopt.json that cannot be used here; the message says why and what to do."""


def record_path(path: str | Path) -> Path | None:
    """The record of a run directory (or the record file itself), or None if `path` holds none."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / RECORD_FILE
    return path if path.name == RECORD_FILE and path.is_file() else None


def read_record(path: str | Path) -> dict[str, Any]:
    """The record at `path` (a run directory or its randopt.json): RecordError if unreadable or foreign."""
    found = record_path(path)
    if found is None:
        raise RecordError(f"{path} holds no {RECORD_FILE}")
    try:
        record = json.loads(read_regular_text(found, SETTINGS_LIMIT))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise RecordError(f"{found} cannot be read ({' '.join(str(error).split())[:200]})") from None
    members = record.get("members") if isinstance(record, dict) else None
    if not isinstance(members, list) or record.get("format") != FORMAT or not all(
            isinstance(m, dict) and isinstance(m.get("seed"), int) and isinstance(m.get("reward"), (int, float))
            for m in members):
        raise RecordError(f"{found} is not a randopt record of format {FORMAT} (seeds and scores) that esft wrote")
    return record


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Replace the run's record atomically (a kill leaves the old one or the new one, never half of one), signed
    as it reads back."""
    record = json.loads(json.dumps({key: value for key, value in record.items() if key != SIGNATURE}))
    write_text_atomic(Path(run_dir) / RECORD_FILE, json.dumps({**record, SIGNATURE: sign(record)}, indent=1) + "\n")


def record_vouched(run_dir: Path) -> bool:
    """True unless the run directory holds a randopt.json that is not this user's esft's, as written (no record:
    nothing to vouch for). A run's settings count as the user's own only with its record."""
    if record_path(run_dir) is None:
        return True
    try:
        record = read_record(run_dir)
    except RecordError:
        return False
    return signed_whole(record, SIGNATURE)


def identity_of(config: dict[str, Any]) -> dict[str, Any]:
    config = with_strategy(config)
    return {name: config.get(name) for name in IDENTITY}


def with_strategy(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with its strategy named: settings written before --strategy said `antithetic: true/false`."""
    if not isinstance(settings, dict) or settings.get("strategy") is not None:
        return settings
    return {**settings, "strategy": "antithetic" if settings.get("antithetic") else "paper"}


def check_identity(record: dict[str, Any], config: dict[str, Any], where: str, names: tuple[str, ...] = IDENTITY) -> None:
    """RecordError naming the first of `names` whose setting differs from the record's (its members would be others)."""
    config = with_strategy(config)
    for name, value in with_strategy(record.get("settings", {})).items():
        if name in names and config.get(name) != value:
            raise RecordError(f"{where} was scored with {name}={value!r}, this run has {config.get(name)!r}: its "
                              f"members would be other ones; use the record's settings or start a new run")
