"""A --model that is no path on this machine is a hub id. Before transformers tries it (on a machine without
network that is a minute of retries, then "couldn't connect to huggingface.co"), one look says whether it
can be had: from the local Hugging Face cache, or from a hub that answers. A mistyped local folder name
(`--model mymodel` for `./mymodel`) is then one line at once."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
"""Behind a proxy the hub's address need not resolve here: no look, transformers goes through the proxy."""


def hub_problem(name: str) -> str | None:
    """None when `name` can load: a path that exists, a hub id in the local cache, or a hub that answers
    (its own errors, e.g. an id it does not have, are then transformers'). Otherwise why not, in one line:
    no such directory here, and why the hub id cannot be had (HF_HUB_OFFLINE, or the hub unreachable)."""
    if Path(name).expanduser().exists():
        return None
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return None
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except ValueError:  # not a valid hub id (HFValidationError): only a path was meant
        return f"no directory {name!r} in {Path.cwd()} (and it is not a hub id); give the model directory's path"
    here = f"no directory {name!r} in {Path.cwd()}, and as a hub id it is not in the local Hugging Face cache"
    fix = f"give the model directory's path (e.g. ./{name} or an absolute path)"
    if constants.HF_HUB_OFFLINE:
        return f"{here} and HF_HUB_OFFLINE is set; {fix}, or download it once while online"
    if any(os.environ.get(variable) for variable in PROXY_VARIABLES):
        return None
    if (reason := unreachable(constants.ENDPOINT)) is not None:
        return f"{here} and {constants.ENDPOINT} could not be reached ({reason}); {fix}, or run where the hub is reachable"
    return None


def unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to `endpoint` (a URL) fails, or None when it opens: one try, no retries."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return None
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__
