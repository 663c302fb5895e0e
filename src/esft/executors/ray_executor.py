"""The Ray executor (`--executor ray --workers K`): K actors, each hosting one engine.

Traffic is seeds and scalars only. Each actor loads the model itself and holds the task (datasets
and reward functions); per piece of work it receives (member seeds, the iteration of its prompt batch) and returns the
members' rewards. Members are handed out one at a time to whichever actor is free, so a fast actor
takes more; with --population-batching each actor instead gets an equal share of the population
and evaluates it in one batched generate call per mini-batch (esft.engines.population). Every
actor applies the same update from (seeds, coefficients) and reports the checksum of its weights;
they must agree every iteration, or the run stops naming the actors.

Fault tolerance: if an actor dies, the member (or share) it was evaluating goes back in the queue
for the others, and a replacement actor is started and synchronised (base weights + the log of
updates when the log is short; otherwise the weights of a live actor), then checked against the
agreed checksum before it takes work. Rewards depend only on (weights, seed, batch), so the
iteration finishes with exactly the rewards of a failure-free run. A lost node takes several actors
at once and their room with them: a slot no node has room for stays vacant (one line), the run goes
on with fewer actors, and the slot is filled again at the start of an iteration once a node has room.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any

import ray

from esft.es.batches import PromptBatch, prompt_batch
from esft.settings.config import ConfigError
from esft.engines.base import NonFiniteWeights, Sampling
from esft.executors.local import MemberResult, resolve_population_batching
from esft.executors.ray_actor import ESActor
from esft.executors.ray_cluster import check_room, close_cluster, open_cluster, room_for_one
from esft.executors.ray_engine import RayEngine
from esft.executors.settings import ExecutorSettings

log = logging.getLogger(__name__)


class ReplicaMismatch(RuntimeError):
    """Actors disagree on the weights after an update."""


class _Slot:
    """A place in the pool: the current actor there and its counters."""

    def __init__(self, index: int):
        self.index = index
        self.actor = None
        self.identity: tuple[int, str] | None = None
        self.members = 0  # members evaluated in the last evaluate_population
        self.generation = 0  # replacements so far

    @property
    def name(self) -> str:
        where = f" (pid {self.identity[0]} on {self.identity[1]})" if self.identity else ""
        return f"actor {self.index}{where}"


class RayExecutor:
    """Evaluates members on --workers Ray actors; same calls as LocalExecutor."""

    replay_limit = 8
    """Replacements replay at most this many logged updates; beyond, they copy a live actor."""
    max_replacements = 5
    """Replacements per slot before the run stops (an actor that keeps dying is not bad luck)."""
    room_wait = 10.0
    """Seconds a replacement waits for room (a dead actor's comes back a moment later) before its slot is left vacant."""

    def __init__(self, settings: ExecutorSettings, task, model: str | None = None):
        self.settings, self.task, self.model = settings, task, model
        pool = settings.pool
        open_cluster(pool)
        self._on_cluster = True  # until close()
        atexit.register(self.close)  # before Ray's own exit handler kills the actors (registered earlier, runs later)
        try:
            check_room(pool)
        except ConfigError:
            self.close()
            raise
        self._actor_class = ray.remote(ESActor).options(
            num_cpus=pool.ray_cpus_per_worker, num_gpus=pool.ray_gpus_per_worker, max_restarts=0, max_task_retries=0
        )
        self._task_ref = None  # shipped on first use: the trainer renders chat prompts after building us
        self._base_ref = None  # master state loaded by load_master_state (resume), else the model on disk
        self._base_optimizer_ref = None  # optimizer state loaded on resume (adam), else a fresh optimizer
        self.updates: list[tuple[list[int], list[float], float]] = []
        self.events: list[str] = []
        self.slots = [_Slot(i) for i in range(pool.workers)]
        for slot in self.slots:
            slot.actor = self._new_actor()
        identities = ray.get([slot.actor.identity.remote() for slot in self.slots])
        for slot, identity in zip(self.slots, identities):
            slot.identity = tuple(identity)
        for line in ray.get(self.slots[0].actor.startup_notes.remote()):  # every actor built the same engine
            print(line, file=sys.stderr)
        self._checksum = self._agreed(ray.get([slot.actor.checksum.remote() for slot in self.slots]))
        try:  # the batched path's self-check on one actor, before training (every actor holds the same model)
            self.population_batching = resolve_population_batching(
                settings, lambda: ray.get(self.slots[0].actor.population_batching_problem.remote()))
        except ConfigError:
            self.close()
            raise
        self.engine = RayEngine(self)

    def _new_actor(self):
        actor = self._actor_class.remote(self.settings, self.model, [p for p in sys.path if p])
        if self._task_ref is not None:
            actor.set_task.remote(self._task_ref, self.population_batching)
        return actor

    def _live(self) -> list[_Slot]:
        """The slots that hold an actor (a slot is vacant while no node has room for its replacement)."""
        return [slot for slot in self.slots if slot.actor is not None]

    def _ship_task(self) -> None:
        """Send the task to every actor once (before the first members); an actor found dead is replaced."""
        if self._task_ref is not None:
            return
        self._task_ref = ray.put(self.task)
        futures = {slot.actor.set_task.remote(self._task_ref, self.population_batching): slot for slot in self._live()}
        for future, slot in futures.items():
            try:
                ray.get(future)
            except ray.exceptions.RayActorError as error:
                self._report(f"{slot.name} died before its first work ({type(error).__name__}); starting a replacement")
                if (replacement := self._replace(slot)) is not None:  # it gets the task as it starts
                    self._joined(slot, replacement, {}, wait=True)

    def _report(self, message: str) -> None:
        self.events.append(message)
        log.info(message)
        print(f"esft: {message}", file=sys.stderr)

    # ------------------------------------------------------------ members
    def evaluate_population(self, member_seeds: Sequence[int], batch: PromptBatch, sigma: float,
                            sampling: Sampling | None = None) -> list[MemberResult]:
        """Every member once, on whichever actor is free; a dead actor's members are re-run elsewhere.
        The unit of work is one member, or with --population-batching an equal share per actor. Only
        the iteration goes out when the actors can rebuild the batch (esft.es.batches.prompt_batch).
        `sigma` (this iteration's σ) and `sampling` (greedy when None) go out with the seeds."""
        sigma = float(sigma)
        self._ship_task()
        expected = prompt_batch(self.task.train_dataset, self.settings.pool.seed, self.settings.pool.batch_size, batch.iteration)
        payload = None if expected.rows == batch.rows else list(batch.rows)
        starting: dict[Any, _Slot] = self._refill()  # vacant slots a node has room for again
        share = -(-len(member_seeds) // max(1, len(self._live()))) if self.population_batching else 1
        pending = deque(list(range(start, min(start + share, len(member_seeds))))
                        for start in range(0, len(member_seeds), share))
        results: list[MemberResult | None] = [None] * len(member_seeds)
        idle = deque(slot for slot in self._live() if slot not in starting.values())
        running: dict[Any, tuple[_Slot, list[int]]] = {}
        for slot in self.slots:
            slot.members = 0
        while pending or running:
            while pending and idle:
                slot, indices = idle.popleft(), pending.popleft()
                running[slot.actor.evaluate.remote([member_seeds[i] for i in indices], batch.iteration, payload,
                                                    sigma, sampling)] = (slot, indices)
            if not running and not starting:
                raise RuntimeError("no Ray actor is left to evaluate members")
            ready, _ = ray.wait(list(running) + list(starting), num_returns=1)
            future = ready[0]
            if future in starting:
                slot = starting.pop(future)
                if self._joined(slot, future, starting):
                    idle.append(slot)
                continue
            slot, indices = running.pop(future)
            try:
                members = ray.get(future)
            except ray.exceptions.RayActorError as error:
                which = f"member{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"
                self._report(f"{slot.name} died while evaluating {which} ({type(error).__name__}); "
                             "re-running them on the other actors and starting a replacement")
                pending.appendleft(indices)
                if (replacement := self._replace(slot)) is not None:
                    starting[replacement] = slot
                continue
            slot.members += len(indices)
            idle.append(slot)
            for index, member in zip(indices, members):
                results[index] = member
                self._member_done(slot, index)
        # Replacements still starting join before the update, so every actor applies it.
        for future, slot in list(starting.items()):
            self._joined(slot, future, starting, wait=True)
        return results  # type: ignore[return-value]

    def _member_done(self, slot: _Slot, index: int) -> None:
        """Hook called after each member's result arrives (the kill test uses it)."""

    def _refill(self) -> dict:
        """Start replacements in the vacant slots the cluster has room for now; {sync future: slot}."""
        starting = {}
        for slot in self.slots:
            if slot.actor is None and room_for_one(self.settings.pool) is None:
                self._report(f"the cluster has room again: starting a replacement for actor {slot.index}")
                if (replacement := self._replace(slot)) is not None:
                    starting[replacement] = slot
        return starting

    def _replace(self, slot: _Slot):
        """Start a new actor in `slot`; returns the future of its synchronisation (its checksum), or None
        when no node has room for it within `room_wait` s (a lost node): the slot is left vacant."""
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # already gone
                pass
        slot.identity = slot.actor = None
        short = room_for_one(self.settings.pool, self.room_wait)
        if short is not None:
            survivors = len(self._live())
            self._report(f"no node has room for a replacement of actor {slot.index} ({short}; a node was lost?): "
                         f"going on with {survivors} actor{'s' if survivors != 1 else ''}, and the replacement starts "
                         "at the first iteration a node has room again")
            return None
        slot.generation += 1
        if slot.generation > self.max_replacements:
            raise RuntimeError(f"actor {slot.index} died {slot.generation} times; stopping (see the Ray logs)")
        slot.identity = None
        slot.actor = self._new_actor()
        live = [s for s in self.slots if s is not slot and s.identity is not None]
        state = optimizer = None
        if len(self.updates) > self.replay_limit and live:
            state, optimizer = live[0].actor.master_state.remote(), live[0].actor.optimizer_state.remote()
        return slot.actor.synchronise.remote(self._base_ref, [] if state is not None else self.updates, state,
                                             self._base_optimizer_ref, optimizer)

    def _joined(self, slot: _Slot, future, starting: dict, wait: bool = False) -> bool:
        """A replacement finished synchronising: check it, or start yet another one."""
        while True:
            try:
                checksum = ray.get(future)
                slot.identity = tuple(ray.get(slot.actor.identity.remote()))
            except ray.exceptions.RayActorError as error:
                self._report(f"replacement for actor {slot.index} died while starting ({error}); starting another")
                future = self._replace(slot)
                if future is None:
                    return False
                if wait:
                    continue
                starting[future] = slot
                return False
            if checksum != self._checksum:
                raise ReplicaMismatch(f"replacement {slot.name} synchronised to checksum {checksum}, the others hold {self._checksum}")
            self._report(f"{slot.name} replaced the dead actor and is in sync (checksum {checksum})")
            return True

    # ------------------------------------------------------------ weights
    def update(self, member_seeds: Sequence[int], coefficients: Sequence[float], learning_rate: float = 1.0) -> None:
        """Every actor applies the optimizer's step on G = Σ cᵢ·εᵢ itself (each holds the same optimizer
        state); then their checksums must agree."""
        seeds, coefficients = [int(s) for s in member_seeds], [float(c) for c in coefficients]
        self.updates.append((seeds, coefficients, float(learning_rate)))
        futures = {slot.actor.update.remote(seeds, coefficients, float(learning_rate)): slot for slot in self._live()}
        checksums: dict[int, str] = {}
        for future, slot in futures.items():
            try:
                checksums[slot.index] = ray.get(future)
            except ray.exceptions.RayTaskError as error:
                cause = getattr(error, "cause", None)
                if isinstance(cause, NonFiniteWeights):
                    # every actor computes the same update: all refused it and kept their weights
                    self.updates.pop()
                    ray.wait(list(futures), num_returns=len(futures))
                    raise cause from None
                raise
            except ray.exceptions.RayActorError:
                self._report(f"{slot.name} died during the update; starting a replacement")
                replacement = self._replace(slot)  # replays the log, which holds this update
                if replacement is None:
                    continue
                self._checksum = None  # checked against the survivors below
                checksums[slot.index] = ray.get(replacement)
                slot.identity = tuple(ray.get(slot.actor.identity.remote()))
        self._checksum = self._agreed(checksums)

    def _agreed(self, checksums) -> str:
        """The common checksum, or ReplicaMismatch naming the actors in each group."""
        if not isinstance(checksums, dict):
            checksums = {slot.index: c for slot, c in zip(self._live(), checksums)}
        if not checksums:
            raise RuntimeError("no Ray actor is left: every node holding one was lost, and none has room for a replacement")
        groups: dict[str, list[str]] = {}
        for slot in self.slots:
            if slot.index in checksums:
                groups.setdefault(checksums[slot.index], []).append(slot.name)
        if len(groups) > 1:
            detail = "; ".join(f"{', '.join(names)}: {checksum}" for checksum, names in groups.items())
            raise ReplicaMismatch(f"Ray actors hold different weights after iteration {len(self.updates)}: {detail}")
        return next(iter(groups))

    def checksum(self) -> str:
        """The checksum every actor agrees on (checked now)."""
        return self._agreed(ray.get([slot.actor.checksum.remote() for slot in self._live()]))

    def update_ratio(self) -> float | None:
        """‖Δθ‖/‖θ‖ of the last update, from one actor (all apply the same update)."""
        return self._call_one("update_ratio")

    def update_survival(self) -> float | None:
        """How much of the last update survived rounding without a master, from one actor (all round alike)."""
        return self._call_one("update_survival")

    def _call_one(self, method: str, *args, **kwargs):
        """Run a call on the first actor that answers (evaluation, saving)."""
        for slot in self._live():
            try:
                return ray.get(getattr(slot.actor, method).remote(*args, **kwargs))
            except ray.exceptions.RayActorError:
                self._report(f"{slot.name} died during {method}; starting a replacement")
                if (replacement := self._replace(slot)) is not None:
                    ray.get(replacement)
                    slot.identity = tuple(ray.get(slot.actor.identity.remote()))
        self._agreed({})  # no actor left: says so
        return ray.get(getattr(self._live()[0].actor, method).remote(*args, **kwargs))

    def generate(self, prompts: Sequence[str], mini_batch_size: int | None = None, sampling=None):
        """Completions of the unperturbed model (evaluation), from one actor."""
        return self._call_one("generate", list(prompts), mini_batch_size, sampling)

    def close(self) -> None:
        """Stop the actors, giving their CPUs/GPUs back (and the local Ray esft started, once no executor uses it).
        Each actor first stops its engine, for ~10 s at most (a busy one is killed): killed outright, a vLLM
        engine leaves its socket files and a zombie worker behind."""
        atexit.unregister(self.close)
        slots = [slot for slot in getattr(self, "slots", []) if slot.actor is not None] if self._on_cluster else []
        try:
            ray.wait(closing := [slot.actor.close.remote() for slot in slots], num_returns=len(closing), timeout=10)
        except Exception:  # noqa: BLE001 - Ray already shut down by the user: the actors are gone with it
            pass
        for slot in slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        if self._on_cluster:
            self._on_cluster = False
            close_cluster()
