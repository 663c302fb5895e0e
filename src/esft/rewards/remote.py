"""Reward functions answered by an HTTP reward service: `esft serve-reward` (esft.rewards.serve), or any
server that answers `POST /score {"prompts": [...], "completions": [...]}` with `{"rewards": [...]}`.

`remote_reward(url)` is a TRL-style reward function, trusted (it runs in the trainer process: an HTTP
client needs no sandbox). It splits a call into requests of `batch_size` completions sent in parallel
(`concurrency`), spreads them round-robin over several URLs (replicas of one service; a URL that
refused a connection is tried last until it answers again), and tries every URL in turn on
connection errors, timeouts and 408/429/5xx answers, then again after a pause, `retries` times (or,
with a `deadline`, until that many seconds have passed), the pause doubling from `backoff` seconds;
the progress bar says while it waits (esft.console). It raises RewardServiceError with the last error when
every retry failed, or at once for any other 4xx (a request the service will never accept): the
reward runner then counts those samples as failed and gives them the failure reward. After a call
failed every retry, calls fail at once for `cooldown` seconds, so a dead service costs one round of
retries, not one per member and sample.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from esft.settings.rules import url_problem
from esft.rewards.values import TRUSTED_ATTRIBUTE

API_KEY_ENV = "ESFT_REWARD_API_KEY"
"""Environment variable holding the API key sent as `Authorization: Bearer <key>` when none is given."""
RETRIED_STATUSES = {408, 429, 500, 502, 503, 504}


class RewardServiceError(RuntimeError):
    """The reward service could not score a request (after retries, or refused it)."""


def service_base(url: str) -> str:
    """The base URL endpoints are appended to (a trailing /score is accepted and dropped)."""
    base = url.strip().rstrip("/")
    return base[: -len("/score")] if base.endswith("/score") else base


class RemoteReward:
    """A reward function scored by one service behind one or more URLs; see the module docstring."""

    def __init__(self, urls: str | Sequence[str], api_key: str | None = None, *, batch_size: int = 64,
                 timeout: float = 60.0, retries: int = 3, backoff: float = 0.5, max_backoff: float = 10.0,
                 cooldown: float = 10.0, concurrency: int = 4, name: str | None = None,
                 deadline: float | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("remote_reward needs at least one URL")
        for url in urls:
            if problem := url_problem(url):
                raise ValueError(problem)
        if batch_size < 1 or retries < 0 or concurrency < 1 or not timeout > 0 or (deadline is not None and not deadline >= 0):
            raise ValueError("remote_reward: batch_size and concurrency must be >= 1, retries >= 0, timeout > 0, deadline >= 0")
        self.urls = [service_base(url) for url in urls]
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.batch_size, self.timeout, self.retries, self.concurrency = batch_size, timeout, retries, concurrency
        self.backoff, self.max_backoff, self.cooldown, self.deadline = backoff, max_backoff, cooldown, deadline
        self.__name__ = name or "remote:" + "+".join(urlsplit(url).netloc for url in self.urls)
        setattr(self, TRUSTED_ATTRIBUTE, True)
        self.stats = {"requests": 0, "retries": 0, "failed_calls": 0, "fast_failures": 0}
        """HTTP requests sent, of which retries; calls that failed every retry; calls failed at once
        during a cooldown."""
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._client = self._pool = None
        self._turn = 0
        self._refused: dict[str, float] = {}  # URL -> when it last refused a connection
        self._failing_until, self._last_failure = 0.0, ""

    def __getstate__(self) -> dict[str, Any]:  # a copy in another process opens its own connections
        return {k: v for k, v in self.__dict__.items() if k in ("urls", "api_key", "batch_size", "timeout", "retries",
                "concurrency", "backoff", "max_backoff", "cooldown", "deadline", "__name__", "stats", TRUSTED_ATTRIBUTE)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # ------------------------------------------------------------------------------ calling
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """TRL's reward signature: one reward per (prompt, completion); other columns are not sent."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        if time.monotonic() < self._failing_until:
            self._count("fast_failures")
            raise RewardServiceError(f"{self._last_failure} (not retried for {self.cooldown:g}s after a call failed "
                                     "every retry)")
        chunks = [(list(prompts[i : i + self.batch_size]), list(completions[i : i + self.batch_size]))
                  for i in range(0, len(prompts), self.batch_size)]
        if len(chunks) <= 1:
            results = [self._score_chunk(chunk) for chunk in chunks]
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="esft-remote-reward")
            results = list(self._pool.map(self._score_chunk, chunks))
        return [reward for rewards in results for reward in rewards]

    def _score_chunk(self, chunk: tuple[list, list]) -> list[float | None]:
        prompts, completions = chunk
        answer = self.request("POST", "/score", {"prompts": prompts, "completions": completions})
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(completions) or not all(
                r is None or (isinstance(r, (int, float)) and not isinstance(r, bool)) for r in rewards):
            raise RewardServiceError(f"reward service {self.__name__} answered {str(answer)[:200]!r}; expected "
                                     f'{{"rewards": [{len(completions)} numbers]}}')
        return [None if r is None else float(r) for r in rewards]

    def health(self) -> dict[str, Any]:
        """GET /health of the first URL that answers (with the same retries as scoring)."""
        return self.request("GET", "/health")

    def request(self, method: str, path: str, payload: Any = None) -> Any:
        """One request with retries over the URLs; the answer's JSON. RewardServiceError on failure.
        Retries `retries` rounds, or with a `deadline` until that many seconds have passed; while it
        waits, the progress bar says so (esft.console)."""
        import httpx

        started, sent, round_, last, unreachable = time.monotonic(), 0, 0, "", True
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            while True:
                if round_:
                    pause = min(self.backoff * 2 ** (round_ - 1), self.max_backoff)
                    if self.deadline is not None:
                        pause = min(pause, max(0.0, started + self.deadline - time.monotonic()))
                    self._wait_notice(last, started, unreachable)
                    time.sleep(pause)
                for url in self._rotation():
                    self._count("requests", retry=sent > 0)
                    sent += 1
                    try:
                        response = self._http().request(method, url + path, json=payload, headers=headers)
                    except httpx.TransportError as error:
                        with self._lock:
                            self._refused[url] = time.monotonic()
                        what = "cannot connect" if isinstance(error, httpx.ConnectError) else "no answer"
                        last = f"{url}{path}: {what} ({type(error).__name__}: {str(error) or 'no answer'})"
                        continue
                    with self._lock:
                        self._refused.pop(url, None)
                    if response.status_code == 200:
                        try:
                            answer = response.json()
                        except ValueError:
                            raise RewardServiceError(f"reward service {url}{path} answered with something that is "
                                                     f"not JSON: {response.text[:200]!r}") from None
                        self._failing_until = 0.0
                        return answer
                    last, unreachable = f"{url}{path}: HTTP {response.status_code}: {_detail(response)}", False
                    if response.status_code not in RETRIED_STATUSES:
                        raise RewardServiceError(f"reward service refused the request: {last}")
                round_ += 1
                if (round_ > self.retries if self.deadline is None
                        else time.monotonic() - started >= self.deadline):
                    break
        finally:
            self._wait_notice(None, started, unreachable)
        problem = ("the reward service did not score" if not unreachable else "could not reach the reward service"
                   if ": cannot connect (" in last else "the reward service did not answer")
        message = f"{problem} in {sent} attempts over {time.monotonic() - started:.1f}s; last: {last}"
        self._count("failed_calls")
        self._failing_until, self._last_failure = time.monotonic() + self.cooldown, message
        raise RewardServiceError(message)

    def _wait_notice(self, last: str | None, started: float, unreachable: bool) -> None:
        """Say in the progress bar that this service is being waited for (None: no longer)."""
        from esft import console

        if last is None:
            console.waiting(self.__name__, None)
            return
        limit = f" of {self.deadline:g}s" if self.deadline is not None else ""
        state = "unreachable" if unreachable else "failing"
        console.waiting(self.__name__, f"{self.__name__} {state}, retrying ({time.monotonic() - started:.0f}s{limit})")

    def _rotation(self) -> list[str]:
        """Every URL once, round-robin from call to call; URLs that refused a connection go last
        (the one that refused longest ago first), until they answer again."""
        with self._lock:
            order = [self.urls[(self._turn + i) % len(self.urls)] for i in range(len(self.urls))]
            self._turn += 1
            return sorted(order, key=lambda url: self._refused.get(url, 0.0))

    def _http(self):
        import httpx

        with self._lock:
            if self._client is None:
                limits = httpx.Limits(max_connections=self.concurrency * len(self.urls), max_keepalive_connections=self.concurrency * len(self.urls))
                self._client = httpx.Client(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0)), limits=limits)
            return self._client

    def _count(self, name: str, retry: bool = False) -> None:
        with self._lock:
            self.stats[name] += 1
            if retry:
                self.stats["retries"] += 1

    def close(self) -> None:
        """Close the connections and the request threads (they reopen if called again)."""
        with self._lock:
            client, pool, self._client, self._pool = self._client, self._pool, None, None
        if client is not None:
            client.close()
        if pool is not None:
            pool.shutdown(wait=True)


def _detail(response) -> str:
    """The service's one-line reason: its JSON `detail`, else the start of the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return " ".join(str(detail if detail is not None else response.text or response.reason_phrase).split())[:300]


def remote_reward(urls: str | Sequence[str], api_key: str | None = None, **options: Any) -> RemoteReward:
    """A TRL-style reward function scored over HTTP by the reward service at `urls` (one URL, or
    several replicas of one service, load-balanced). `api_key` defaults to $ESFT_REWARD_API_KEY.
    Options: batch_size (completions per request, 64), timeout (seconds per request, 60), retries (3),
    deadline (seconds to keep retrying instead of a number of retries: `esft train --reward-url` uses
    --reward-url-deadline, 60), backoff (first retry delay in seconds, doubled each retry, 0.5; at most
    max_backoff, 10),
    cooldown (seconds calls fail at once after a call failed every retry, 10), concurrency (requests
    in flight per call, 4), name (metrics name, default remote:<host:port>)."""
    return RemoteReward(urls, api_key, **options)
