"""Settings a run directory holds, signed by the esft of the user who wrote them.

A run's settings may name code, data files and reward services (esft.runs.inherited), which a copied
or downloaded run directory must not get to use by itself. A run the user wrote themselves is not
such a directory, and asking them for --trust-run-code on every resume of their own run would only
teach them to pass it. So esft signs what it writes with a key only this user's esft can read: an
HMAC-SHA256 under a random 32-byte key kept in esft's cache ($ESFT_CACHE, else $XDG_CACHE_HOME/esft
or ~/.cache/esft: `run-key`, mode 0600, created on first use). Signed are config.yaml's settings
with the code and data files they name (absolute paths and digests: esft.runs.named_files), a
checkpoint's whole trainer_state.json (settings, the digests of the checkpoint's files, the named
files, the run id) and RandOpt's randopt.json. What verifies was written by this user's esft,
unedited, and is taken as the user's own; anything else (another user's run, a hand edit, no
signature, a key that cannot be read or is readable by others) needs the opt-in. Nothing here is
secret but the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any

from esft.models.gguf import cache_root

KEY_FILE = "run-key"
YAML_PREFIX = "# esft-settings-signature: "
"""config.yaml's first line: a YAML comment, so the file stays plain YAML."""


def _key(create: bool) -> bytes | None:
    """This user's key, created (mode 0600, never through a link) when `create` and missing; None when
    it is missing or not a private regular file of this user's."""
    path = cache_root() / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if not create:
            return None
        # Written whole under a private name, then linked into place: another esft process starting at the
        # same moment either makes the key first (link fails: theirs is used) or reads the whole of ours,
        # never an empty file created but not yet written.
        staging = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
            os.link(staging, path)
        except FileExistsError:  # another esft process made it first
            pass
        except OSError:  # a read-only home: runs are unsigned, resumes ask for the opt-in
            return None
        finally:
            staging.unlink(missing_ok=True)
        return _key(create=False)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        key = handle.read(64)
    return key if len(key) == 32 else None


def _digest(key: bytes, settings: dict[str, Any]) -> str:
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(key, canonical.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def sign(settings: dict[str, Any]) -> str | None:
    """The signature of `settings` (None when no key can be made here)."""
    key = _key(create=True)
    return None if key is None else _digest(key, settings)


def signed_by_user(settings: dict[str, Any], signature: Any) -> bool:
    """Whether `signature` is this user's signature of exactly these settings."""
    if not isinstance(signature, str) or not isinstance(settings, dict):
        return False
    key = _key(create=False)
    return key is not None and hmac.compare_digest(_digest(key, settings), signature)


def signed_whole(record: dict[str, Any], key: str) -> bool:
    """Whether `record[key]` is this user's signature of the rest of `record` (a trainer state, a RandOpt record)."""
    return isinstance(record, dict) and signed_by_user({k: v for k, v in record.items() if k != key}, record.get(key))


NAMED_PREFIX = "# esft-named-files: "
"""config.yaml's line recording the code and data files its settings name (esft.runs.named_files), as JSON."""


def signed_yaml(settings: dict[str, Any], body: str, named: list[dict[str, Any]]) -> str:
    """config.yaml's text: the signature line (when a key exists) over `settings` and the `named` files
    recorded for them, the YAML `body` of `settings`, and the named files' line."""
    signature = sign({"settings": settings, "named_files": named})
    head = "" if signature is None else f"{YAML_PREFIX}{signature}\n"
    return f"{head}{body}{NAMED_PREFIX}{json.dumps(named)}\n"


def yaml_vouched(text: str, settings: dict[str, Any]) -> tuple[bool, list[dict[str, Any]] | None]:
    """Whether a config.yaml's `text` carries this user's signature of its `settings` (the YAML read from it)
    and of the named files it records, and those records (None when it holds none)."""
    lines = text.split("\n")
    signature = lines[0][len(YAML_PREFIX):].strip() if lines[0].startswith(YAML_PREFIX) else None
    named = None
    for line in lines:
        if line.startswith(NAMED_PREFIX):
            try:
                named = json.loads(line[len(NAMED_PREFIX):])
            except (json.JSONDecodeError, RecursionError):
                named = None
    return signed_by_user({"settings": settings, "named_files": named}, signature), named
