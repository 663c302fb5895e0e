"""How `esft serve-reward` (esft.rewards.serve) shares its one model between requests: every request
is cut into work units, and a single scoring task builds each forward pass of up to --batch-size
completions from all the requests being scored: each gets an equal share (at least one completion,
in turn when there are more requests than room), and what a request leaves unused goes to the
others, so passes stay full and small requests share them. A request of 4,000 completions holds the
model one forward pass at a time, and a 1-item request made meanwhile rides in the next pass instead
of waiting for all of it. A request whose client has gone (the connection closed) or whose time is up
(--max-request-seconds) is dropped from the rotation: the rest of its completions are never scored."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import HTTPException

from esft.rewards.models import RewardModel

logger = logging.getLogger("esft.rewards.serve")


@dataclass(eq=False)
class Job:
    """One request's completions: scored shortest first (less padding), `done` of them so far."""

    texts: list[str]
    future: asyncio.Future
    order: list[int] = field(init=False)
    rewards: list[float] = field(init=False)
    done: int = 0
    taken: int = 0  # completions of this job in the forward pass now running
    gone: str | None = None  # why its remaining work was dropped

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.texts)), key=lambda i: len(self.texts[i]))
        self.rewards = [0.0] * len(self.texts)

    @property
    def remaining(self) -> int:
        return len(self.texts) - self.done - self.taken


@dataclass
class Stats:
    """What /health reports about the traffic."""

    requests_served: int = 0
    completions_scored: int = 0
    batches: int = 0
    max_batch_requests: int = 0
    max_batch_completions: int = 0
    rejected_queue_full: int = 0
    requests_abandoned: int = 0  # the client closed its connection before the answer
    requests_timed_out: int = 0  # answered 503 after --max-request-seconds
    completions_dropped: int = 0  # never scored: their request was abandoned or timed out first


@dataclass
class Scheduler:
    """The requests being scored (at most `max_queue`) and the single task that scores them, a forward
    pass of up to `batch_size` completions at a time, taken from the requests in turn."""

    scorer: RewardModel
    batch_size: int
    max_queue: int
    max_seconds: float
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.rotation: deque[Job] = deque()  # arrival order; a request that gets a share goes to the back
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="esft-reward-model")  # one model, one thread

    @property
    def active(self) -> int:
        return len(self.rotation)

    @property
    def waiting(self) -> int:
        """Requests with no part in the forward pass running now (/health's `queue`)."""
        return sum(1 for job in self.rotation if not job.taken)

    async def score(self, texts: list[str], disconnected: asyncio.Future) -> list[float]:
        """Schedule `texts` and wait for their rewards: 503 when `max_queue` requests are already
        being scored or when this one takes over `max_seconds`; when `disconnected` completes first
        (the client has gone) its remaining work is dropped (the answer reaches nobody)."""
        if self.active >= self.max_queue:
            self.stats.rejected_queue_full += 1
            raise HTTPException(503, f"queue full ({self.max_queue} requests being scored, --max-queue); retry later",
                                headers={"Retry-After": "1"})
        job = Job(texts, asyncio.get_running_loop().create_future())
        self.rotation.append(job)
        self.wake.set()
        try:
            await asyncio.wait({job.future, disconnected}, timeout=self.max_seconds, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled: nobody waits for the answer
            if not job.future.done():
                self._drop(job, "abandoned")
            raise
        if not job.future.done():
            self._drop(job, "abandoned" if disconnected.done() else "timed out")
        if job.gone == "abandoned":
            raise HTTPException(499, "the client closed the connection")  # read by nobody
        if job.gone == "timed out":
            raise HTTPException(503, f"scoring took over {self.max_seconds:g} s (--max-request-seconds; {job.done} of "
                                f"{len(texts)} completions scored); send fewer completions per request, or retry later",
                                headers={"Retry-After": "1"})
        rewards = job.future.result()
        self.stats.requests_served += 1
        self.stats.completions_scored += len(texts)
        return rewards

    def _drop(self, job: Job, why: str) -> None:
        job.gone = why
        dropped = job.remaining  # a forward pass running now scores its part, for nobody
        self.stats.completions_dropped += dropped
        if why == "abandoned":
            self.stats.requests_abandoned += 1
        else:
            self.stats.requests_timed_out += 1
        if job in self.rotation:
            self.rotation.remove(job)
        job.future.cancel()
        logger.warning("request %s: %d of %d completions not scored", why, dropped, len(job.texts))

    def _next_batch(self) -> list[tuple[Job, list[int]]]:
        """Up to batch_size completions: an equal share of each request in rotation order (at least
        one each, until the pass is full), then the room left to the same requests in the same order.
        The requests that got a share go to the back of the rotation, those that did not stay in front."""
        jobs = list(self.rotation)
        share = max(1, self.batch_size // len(jobs))
        counts = dict.fromkeys(jobs, 0)
        room = self.batch_size
        for limit in (share, self.batch_size):
            for job in jobs:
                take = min(job.remaining - counts[job], limit - counts[job], room)
                counts[job] += take
                room -= take
        batch = []
        for job, count in counts.items():
            if count:
                start = job.done + job.taken
                batch.append((job, job.order[start : start + count]))
                job.taken += count
        self.rotation = deque([job for job in jobs if not counts[job]] + [job for job in jobs if counts[job] and job.remaining])
        return batch

    async def run(self) -> None:
        """Forever: build a forward pass from the requests in turn, score it, hand out the rewards."""
        loop = asyncio.get_running_loop()
        while True:
            while not self.active:
                self.wake.clear()
                await self.wake.wait()
            batch = self._next_batch()
            texts = [job.texts[i] for job, indices in batch for i in indices]
            try:
                rewards = await loop.run_in_executor(self.executor, self.scorer.score_texts, texts)
            except Exception as error:  # noqa: BLE001 - delivered to the waiting requests as a 500
                await self._score_alone(batch, error)
                continue
            self.stats.batches += 1
            self.stats.max_batch_requests = max(self.stats.max_batch_requests, len(batch))
            self.stats.max_batch_completions = max(self.stats.max_batch_completions, len(texts))
            start = 0
            for job, indices in batch:
                self._deliver(job, indices, rewards[start : start + len(indices)])
                start += len(indices)

    def _deliver(self, job: Job, indices: list[int], rewards: list[float]) -> None:
        job.taken -= len(indices)
        if job.gone:  # dropped while this pass ran
            return
        for i, reward in zip(indices, rewards):
            job.rewards[i] = reward
        job.done += len(indices)
        if job.done == len(job.texts):
            job.future.set_result(job.rewards)

    def _fail(self, job: Job, error: Exception) -> None:
        job.taken = 0
        if job in self.rotation:
            self.rotation.remove(job)
        if not job.future.done():
            job.future.set_exception(error)

    async def _score_alone(self, batch: list[tuple[Job, list[int]]], error: Exception) -> None:
        """A forward pass failed: score each request's part alone, so a failing one fails only itself."""
        loop = asyncio.get_running_loop()
        for job, indices in batch:
            if job.gone:
                job.taken -= len(indices)
                continue
            if len(batch) == 1:
                self._fail(job, error)
                continue
            try:
                rewards = await loop.run_in_executor(self.executor, self.scorer.score_texts, [job.texts[i] for i in indices])
            except Exception as alone:  # noqa: BLE001
                self._fail(job, alone)
                continue
            self._deliver(job, indices, rewards)

    def fail_waiting(self) -> None:
        """At shutdown: answer every request still being scored with 503."""
        for job in self.rotation:
            if not job.future.done():
                job.future.set_exception(HTTPException(503, "the server is shutting down"))
        self.rotation.clear()
        self.executor.shutdown(wait=False)
