"""The Ray cluster a run's actors live on: a local one that esft starts and stops, the one this process
already runs, or one joined with --ray-address; and whether it has room for the actors before they are
asked for (Ray would wait for room silently, forever: a notebook cell run again, whose earlier trainer
still holds the CPUs/GPUs, would hang without a word)."""

from __future__ import annotations

import logging
import os
import sys
import time

import ray

from esft.executors.settings import PoolSettings
from esft.settings.config import ConfigError

_NICENESS = "RAY_worker_niceness"
"""Ray's setting for its workers' niceness (15 unless set), read when its processes start."""
_local = {"started": False, "executors": 0}
"""The local cluster esft started in this process, and how many executors use it: it stops with the last."""


def open_cluster(pool: PoolSettings) -> None:
    """Join --ray-address, use the Ray this process already runs, or start a local one sized for the run."""
    if not ray.is_initialized():
        _local.update(started=False, executors=0)  # stopped by someone else (ray.shutdown()) since
        if pool.ray_address:
            join_cluster(pool.ray_address)
        else:
            start_local_cluster(max(os.cpu_count() or 1, int(pool.workers * max(pool.ray_cpus_per_worker, 1))))
            _local["started"] = True
    if _local["started"]:
        _local["executors"] += 1


def start_local_cluster(num_cpus: int) -> None:
    """ray.init() of a new local cluster (address "local": never one that `ray start` runs here, which a plain
    ray.init() would join, refusing num_cpus) whose workers run at normal priority. Ray starts workers at niceness
    15 so they never starve its own processes; here the actors *are* the run, and at 15 they crawl beside
    anything else the machine runs (an unprivileged process cannot undo it). The variable is set for
    ray.init only; a value of the user's own is kept."""
    before = os.environ.get(_NICENESS)
    os.environ.setdefault(_NICENESS, "0")
    try:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=num_cpus,
                 logging_level=logging.ERROR)  # not Ray's own lines
    finally:
        if before is None:
            os.environ.pop(_NICENESS, None)


def close_cluster() -> None:
    """An executor is done with the cluster; the local one esft started stops when no executor uses it."""
    if _local["started"]:
        _local["executors"] -= 1
        if _local["executors"] <= 0:
            ray.shutdown()
            _local.update(started=False, executors=0)


def check_room(pool: PoolSettings, settle_seconds: float = 10.0) -> None:
    """Before the actors are asked for: ConfigError (exit 2) if the local cluster esft started cannot
    place them (only this process uses it: nothing else will free room), one warning line if any other
    cluster cannot yet (other jobs may free room, an autoscaler may add nodes). Waits up to
    `settle_seconds` for room that actors just killed (a trainer closed) are giving back; not at all
    when the local cluster could never hold them."""
    per_actor = {"CPU": pool.ray_cpus_per_worker, "GPU": pool.ray_gpus_per_worker}
    need = {kind: amount * pool.workers for kind, amount in per_actor.items() if amount > 0}
    total = ray.cluster_resources()
    local = _local["started"]
    never = local and any(total.get(kind, 0) < amount for kind, amount in need.items())
    deadline = time.monotonic() + (0 if never else settle_seconds)
    while any((free := ray.available_resources()).get(kind, 0) < amount for kind, amount in need.items()):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    else:
        return
    asked = (f"{pool.workers} actors need {_amounts(need)} (--workers {pool.workers} × --ray-cpus-per-worker "
             f"{pool.ray_cpus_per_worker:g}, --ray-gpus-per-worker {pool.ray_gpus_per_worker:g})")
    short = [kind for kind, amount in need.items() if free.get(kind, 0) < amount]
    has = f"{_amounts({kind: free.get(kind, 0) for kind in short})} free of {_amounts({kind: total.get(kind, 0) for kind in short})}"
    if never:
        in_all = _amounts({kind: total.get(kind, 0) for kind, amount in need.items() if total.get(kind, 0) < amount})
        raise ConfigError("workers", f"{asked}, but the local Ray cluster has {in_all} in all: lower --workers or the "
                          "per-worker resources, or join a larger cluster with --ray-address")
    if not local:
        print(f"esft: Ray cannot place the actors yet: {asked}; the cluster at "
              f"{pool.ray_address or ray.get_runtime_context().gcs_address} has {has}; they start when other jobs "
              "free room or an autoscaler adds nodes", file=sys.stderr)
        return
    raise ConfigError("workers", f"{asked}, but the local Ray cluster has {has}: the rest is held by other actors of "
                      "this process, e.g. another ESTrainer's (a notebook cell run again): call close() on that "
                      "trainer first, or restart the kernel")


def room_for_one(pool: PoolSettings, wait_seconds: float = 0.0) -> str | None:
    """None when the cluster has room for one more actor now (or within `wait_seconds`: the room of an
    actor that just died comes back a moment after its death is reported), else what is short, e.g.
    "1 CPU needed, 0 free": a node was lost and nothing can hold a replacement until one is added."""
    need = {kind: amount for kind, amount in (("CPU", pool.ray_cpus_per_worker), ("GPU", pool.ray_gpus_per_worker))
            if amount > 0}
    deadline = time.monotonic() + wait_seconds
    while True:
        free = ray.available_resources()
        short = {kind: amount for kind, amount in need.items() if free.get(kind, 0) < amount}
        if not short:
            return None
        if time.monotonic() >= deadline:
            return f"{_amounts(short)} needed, {_amounts({kind: free.get(kind, 0) for kind in short})} free"
        time.sleep(0.25)


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {kind}" for kind, amount in resources.items())


def join_cluster(address: str, connect_timeout: float = 5.0) -> None:
    """ray.init(address=...) or one line (ConfigError, exit 2) naming the address and how to start a
    cluster: a host:port that refuses connections is found out in seconds (Ray itself retries for
    minutes, then raises with a traceback)."""
    import socket
    from urllib.parse import urlsplit

    hint = ("start one with `ray start --head` (then --ray-address auto, or the address it prints), or leave "
            "--ray-address out to start a local Ray instance")
    if address not in ("auto", "local"):
        parts = urlsplit(address if "://" in address else f"ray://{address}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ConfigError("ray_address", f"{address!r} is not host:port, ray://host:port or auto; {hint}")
        try:
            socket.create_connection((parts.hostname, port), timeout=connect_timeout).close()
        except OSError as error:
            raise ConfigError("ray_address", f"no Ray cluster answers at {address} ({error.strerror or error}); "
                              f"{hint}") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as error:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
        message = " ".join(str(error).split())[:300]
        raise ConfigError("ray_address", f"cannot join the Ray cluster at {address} ({type(error).__name__}: "
                          f"{message}); {hint}") from None
