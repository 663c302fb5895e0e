"""Settings a run directory holds, signed by the esft of the user who wrote them.

A run's settings may name code, data files and reward services (esft.runs.inherited), which a copied
or downloaded run directory must not get to use by itself. A run the user wrote themselves is not
such a directory, and asking them for --trust-run-code on every resume of their own run would only
teach them to pass it. So esft signs the settings it writes (config.yaml, every trainer_state.json)
with a key only this user's esft can read: an HMAC-SHA256 of the settings under a random 32-byte key
kept in esft's cache ($ESFT_CACHE, else $XDG_CACHE_HOME/esft or ~/.cache/esft: `run-key`, mode 0600, created on first use).
Settings whose signature verifies were written by this user's esft, unedited, and are taken as
the user's own; anything else (another user's run, a hand edit, no signature, a key that cannot be
read or is readable by others) needs the opt-in as before. Nothing here is secret but the key.
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


def yaml_signature(text: str) -> str | None:
    """The signature on a config.yaml's first line, if any."""
    first = text.split("\n", 1)[0]
    return first[len(YAML_PREFIX):].strip() if first.startswith(YAML_PREFIX) else None


def signed_yaml(settings: dict[str, Any], body: str) -> str:
    """config.yaml's text: the signature line (when a key exists) and the YAML `body` of `settings`."""
    signature = sign(settings)
    return body if signature is None else f"{YAML_PREFIX}{signature}\n{body}"
