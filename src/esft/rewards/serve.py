"""`esft serve-reward`: one reward model shared over HTTP by many trainers and evaluators.

Endpoints (JSON; with --api-key-env every request needs `Authorization: Bearer <key>`, else 401):
- `POST /score` `{"prompts": [...], "completions": [...]}` → `{"rewards": [...]}`: prompts and
  completions are strings or chat messages, scored exactly as esft.rewards.models.RewardModel scores
  them in-process (what esft.rewards.remote_reward and `--reward-url` send).
- `POST /get_reward` `{"query": [...], "prompts": [...], "labels": [...]}` → `{"rewards": [...],
  "scores": [...]}`: OpenRLHF's remote reward model protocol (`--remote_rm_url`); each query is the
  full text (prompt + response) and is scored as it is.
- `GET /health`: model, dtype, device, requests served, batches run, largest batch, queue length.

Requests from concurrent clients wait in one bounded queue (full → 503) and a single scoring task
takes as many as fit in --batch-size completions for each forward pass, so concurrent clients share
batches. Bodies over --max-body-mb, requests of more than --max-request-items completions and texts
over --max-text-chars get 413, malformed JSON, an empty text or one that is not Unicode (a lone
surrogate) 400, wrong types or mismatched lengths 422, a body not sent as JSON 415, each with a
one-line `detail` naming the item; an unexpected error is a 500 with a message, never a traceback,
and only for the request that caused it (a failing batch is scored again request by request).
Connections that do not finish a request head within 10 s are closed (esft.rewards.serve_guard).
No /docs, /redoc or /openapi.json. SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator

from esft.settings.config import ConfigError
from esft.rewards.models import RewardModel, device_problem
from esft.rewards.serve_guard import CHARS_PER_TOKEN, Guard, HeaderTimeoutProtocol, text_problem

logger = logging.getLogger("esft.rewards.serve")


class Message(BaseModel):
    """One chat message (other keys a chat template may read are kept)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str


Sample = str | list[Message]


class ScoreRequest(BaseModel):
    """POST /score."""

    prompts: list[Sample]
    completions: list[Sample]

    @model_validator(mode="after")
    def _same_length(self) -> ScoreRequest:
        if len(self.prompts) != len(self.completions):
            raise ValueError(f"{len(self.prompts)} prompt(s) for {len(self.completions)} completion(s); send one prompt per completion")
        return self


class GetRewardRequest(BaseModel):
    """POST /get_reward (OpenRLHF): `query` holds the full texts; `prompts` and `labels` are accepted
    and not used by a reward model."""

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


@dataclass
class Job:
    texts: list[str]
    future: asyncio.Future


@dataclass
class Stats:
    """What /health reports about the traffic."""

    requests_served: int = 0
    completions_scored: int = 0
    batches: int = 0
    max_batch_requests: int = 0
    max_batch_completions: int = 0
    rejected_queue_full: int = 0


@dataclass
class Batcher:
    """A bounded queue of scoring jobs and the single task that scores them in coalesced batches."""

    scorer: RewardModel
    batch_size: int
    max_queue: int
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Job] = asyncio.Queue(self.max_queue)
        self.carry: Job | None = None  # taken from the queue but did not fit in the last batch
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="esft-reward-model")  # one model, one thread

    async def score(self, texts: list[str]) -> list[float]:
        """Queue `texts` and wait for their rewards; 503 when the queue is full."""
        job = Job(texts, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.stats.rejected_queue_full += 1
            raise HTTPException(503, f"queue full ({self.max_queue} requests waiting); retry later",
                                headers={"Retry-After": "1"}) from None
        rewards = await job.future
        self.stats.requests_served += 1
        self.stats.completions_scored += len(texts)
        return rewards

    async def run(self) -> None:
        """Forever: take the waiting jobs that fit in one batch (at least one), score them together."""
        loop = asyncio.get_running_loop()
        while True:
            jobs = [self.carry or await self.queue.get()]
            self.carry = None
            size = len(jobs[0].texts)
            while not self.queue.empty():
                job = self.queue.get_nowait()
                if size + len(job.texts) > self.batch_size:
                    self.carry = job
                    break
                jobs.append(job)
                size += len(job.texts)
            texts = [text for job in jobs for text in job.texts]
            try:
                rewards = await loop.run_in_executor(self.executor, self.scorer.score_texts, texts)
            except Exception as error:  # noqa: BLE001 - delivered to the waiting requests as a 500
                await self._score_alone(jobs, error)
                continue
            self.stats.batches += 1
            self.stats.max_batch_requests = max(self.stats.max_batch_requests, len(jobs))
            self.stats.max_batch_completions = max(self.stats.max_batch_completions, len(texts))
            start = 0
            for job in jobs:
                if not job.future.done():  # a client that went away cancelled its future
                    job.future.set_result(rewards[start : start + len(job.texts)])
                start += len(job.texts)

    async def _score_alone(self, jobs: list[Job], error: Exception) -> None:
        """A batch failed: score each of its requests alone, so a failing one fails only itself."""
        loop = asyncio.get_running_loop()
        for job in jobs:
            outcome: list[float] | Exception = error
            if len(jobs) > 1:
                try:
                    outcome = await loop.run_in_executor(self.executor, self.scorer.score_texts, job.texts)
                except Exception as alone:  # noqa: BLE001
                    outcome = alone
            if not job.future.done():
                job.future.set_exception(outcome) if isinstance(outcome, Exception) else job.future.set_result(outcome)

    def fail_waiting(self) -> None:
        """At shutdown: answer every queued job with 503."""
        waiting = [self.carry] if self.carry else []
        while not self.queue.empty():
            waiting.append(self.queue.get_nowait())
        for job in waiting:
            if not job.future.done():
                job.future.set_exception(HTTPException(503, "the server is shutting down"))
        self.executor.shutdown(wait=False)


def _one_line_validation(error: RequestValidationError) -> tuple[int, str]:
    """400 for a body that is not JSON, else 422; the problems on one line."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        if item.get("type") == "json_invalid":
            return 400, f"the body is not valid JSON ({item.get('ctx', {}).get('error', item.get('msg'))})"
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{where or 'body'}: {message}")
    return 422, "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


def create_app(scorer: RewardModel, *, batch_size: int = 32, max_queue: int = 256, max_request_items: int = 4096,
               max_body_bytes: int = 16 << 20, api_key: str | None = None, max_text_chars: int | None = None) -> FastAPI:
    """The FastAPI app serving `scorer` (loaded here if it is not yet); no /docs, /redoc or /openapi.json."""
    info = scorer.info()
    max_text_chars = max_text_chars or CHARS_PER_TOKEN * (scorer.max_length or 65536)
    state: dict[str, Batcher] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher = state["batcher"] = Batcher(scorer, batch_size, max_queue)
        task = asyncio.create_task(batcher.run(), name="esft-batcher")
        yield
        task.cancel()
        batcher.fail_waiting()

    app = FastAPI(title="esft reward model", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        status, message = _one_line_validation(error)
        return JSONResponse({"detail": message}, status)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception):
        message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        logger.error("%s %s failed: %s", request.method, request.url.path, message)
        return JSONResponse({"detail": f"internal error: {message}"}, 500)

    def checked(count: int) -> Batcher:
        if count > max_request_items:
            raise HTTPException(413, f"{count} completions in one request, over the limit of {max_request_items} "
                                "(--max-request-items); split the request")
        return state["batcher"]

    async def rewards_of(texts: list[str]) -> list[float]:
        batcher = checked(len(texts))
        if problem := text_problem(texts, max_text_chars):
            raise problem
        try:
            return await batcher.score(texts) if texts else []
        except HTTPException:
            raise
        except Exception as error:  # noqa: BLE001 - this request's own failure: one line, no traceback
            message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            logger.error("scoring %d text(s) failed: %s", len(texts), message)
            raise HTTPException(500, f"internal error: {message}") from None

    @app.post("/score")
    async def score(request: ScoreRequest) -> dict[str, list[float]]:
        checked(len(request.prompts))
        prompts = [p if isinstance(p, str) else [m.model_dump() for m in p] for p in request.prompts]
        completions = [c if isinstance(c, str) else [m.model_dump() for m in c] for c in request.completions]
        try:
            texts = scorer.texts(prompts, completions)
        except Exception as error:  # noqa: BLE001 - the chat template refused these messages
            raise HTTPException(422, f"cannot render the messages with the model's chat template: {type(error).__name__}: {error}") from None
        return {"rewards": await rewards_of(texts)}

    @app.post("/get_reward")
    async def get_reward(request: GetRewardRequest) -> dict[str, list[float]]:
        rewards = await rewards_of(request.query)
        return {"rewards": rewards, "scores": rewards}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        batcher = state["batcher"]
        return {"status": "ok", **info, "batch_size": batch_size, "queue": batcher.queue.qsize(),
                **vars(batcher.stats)}

    return app


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ConfigError("port", f"cannot listen on {host}:{port} ({reason}); pick another --port or "
                          "stop what uses it") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, batch_size: int = 32, api_key_env: str | None = None,
          device: str = "auto", dtype: str = "auto", max_queue: int = 256, max_request_items: int = 4096,
          max_body_mb: float = 16.0, max_text_chars: int | None = None) -> None:
    """Load the reward model, listen, serve until SIGTERM/SIGINT (then return). ConfigError or
    RewardModelError for bad settings, before anything is served."""
    import uvicorn

    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the previous
    # handler: this one makes that (and a signal during loading) a clean exit, status 0.
    for handled in (signal.SIGTERM, signal.SIGINT):
        signal.signal(handled, _exit_cleanly)
    for name, value in {"batch_size": batch_size, "max_queue": max_queue, "max_request_items": max_request_items}.items():
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}")
    if device_problem(device):
        raise ConfigError("device", device_problem(device))
    if not 0 <= port <= 65535:
        raise ConfigError("port", f"must be 0-65535 (0 = any free port), got {port}")
    if max_text_chars is not None and max_text_chars < 1:
        raise ConfigError("max_text_chars", f"must be >= 1, got {max_text_chars}")
    if not max_body_mb > 0:
        raise ConfigError("max_body_mb", f"must be > 0, got {max_body_mb}")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ConfigError("api_key_env", f"the environment variable {api_key_env} is not set or empty; export "
                              f"{api_key_env}=<a secret> before starting the server")
    elif not _is_loopback(host):
        print(f"esft serve-reward: warning: listening on {host} without --api-key-env: anyone who reaches this port "
              "can use the model", file=sys.stderr)
    sock = _listen(host, port)  # before the model loads: a port in use fails at once
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a server's log: no loading bars
    scorer = RewardModel(model, device=device, dtype=dtype, batch_size=batch_size, where=f"--model {model}")
    app = create_app(scorer, batch_size=batch_size, max_queue=max_queue, max_request_items=max_request_items,
                     max_body_bytes=int(max_body_mb * (1 << 20)), api_key=api_key, max_text_chars=max_text_chars)
    bound = sock.getsockname()[1]
    described = ", ".join(f"{k} {v}" for k, v in scorer.info().items() if k != "model")
    print(f"esft serve-reward: {model} ({described}) on http://{host if ':' not in host else f'[{host}]'}:{bound}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                           http=HeaderTimeoutProtocol, timeout_keep_alive=5,
                                           h11_max_incomplete_event_size=64 << 10))  # a request head: 64 KiB at most
    try:
        server.run(sockets=[sock])
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    print("esft serve-reward: stopped", file=sys.stderr, flush=True)


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)

