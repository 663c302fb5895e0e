"""`esft serve-reward`: one reward model shared over HTTP by many trainers and evaluators.

Endpoints (JSON; with --api-key-env every request needs `Authorization: Bearer <key>`, else 401):
- `POST /score` `{"prompts": [...], "completions": [...]}` → `{"rewards": [...]}`: prompts and
  completions are strings or chat messages, scored exactly as esft.rewards.models.RewardModel scores
  them in-process (what esft.rewards.remote_reward and `--reward-url` send).
- `POST /get_reward` `{"query": [...], "prompts": [...], "labels": [...]}` → `{"rewards": [...],
  "scores": [...]}`: OpenRLHF's remote reward model protocol (`--remote_rm_url`); each query is the
  full text (prompt + response) and is scored as it is.
- `GET /health`: model, dtype, device, requests served, batches run, largest batch, queue length,
  requests abandoned or timed out and the completions they left unscored.

At most --max-queue requests are scored at a time (more → 503); a single scoring task builds each
forward pass of up to --batch-size completions from them in turn (esft.rewards.serve_schedule), so
concurrent clients share batches and a large request does not make a small one wait for all of it.
A request whose client has gone is dropped, one not answered within --max-request-seconds gets 503.
Bodies over --max-body-mb, requests of more than --max-request-items completions and texts
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
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, model_validator

from esft.settings.config import ConfigError
from esft.rewards.models import RewardModel, device_problem
from esft.rewards.serve_guard import CHARS_PER_TOKEN, Guard, HeaderTimeoutProtocol, text_problem
from esft.rewards.serve_schedule import Scheduler

logger = logging.getLogger("esft.rewards.serve")
DEFAULT_MAX_REQUEST_SECONDS = 120.0
"""--max-request-seconds by default: a request not answered in this time gets 503 and its remaining
completions are not scored (remote_reward's default timeout is 60 s: such a client has gone anyway)."""


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


def _utf8_problem(body: bytes) -> str | None:
    """For a body that fails to parse: which item holds bytes that are not UTF-8 (FastAPI says only
    "There was an error parsing the body"), or None if the body is valid UTF-8."""
    try:
        body.decode("utf-8")
        return None
    except UnicodeDecodeError as error:
        offset = error.start
    try:
        data = json.loads(body.decode("utf-8", "surrogateescape"))  # the bad bytes become U+DC80..U+DCFF
    except ValueError:
        data = None
    escaped = lambda value: any("\udc80" <= c <= "\udcff" for c in json.dumps(value, ensure_ascii=False))  # noqa: E731
    for field in ("completions", "prompts", "query"):
        items = data.get(field) if isinstance(data, dict) else None
        for index, value in enumerate(items if isinstance(items, list) else []):
            if escaped(value):
                return f"item {index}: its {field.rstrip('s')} is not valid UTF-8 (byte {offset} of the body); send UTF-8 text"
    return f"the body is not valid UTF-8 (byte {offset}); send UTF-8 text"


def create_app(scorer: RewardModel, *, batch_size: int = 32, max_queue: int = 256, max_request_items: int = 4096,
               max_body_bytes: int = 16 << 20, api_key: str | None = None, max_text_chars: int | None = None,
               max_request_seconds: float = DEFAULT_MAX_REQUEST_SECONDS) -> FastAPI:
    """The FastAPI app serving `scorer` (loaded here if it is not yet); no /docs, /redoc or /openapi.json."""
    info = scorer.info()
    max_text_chars = max_text_chars or CHARS_PER_TOKEN * (scorer.max_length or 65536)
    state: dict[str, Scheduler] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler = state["scheduler"] = Scheduler(scorer, batch_size, max_queue, max_request_seconds)
        task = asyncio.create_task(scheduler.run(), name="esft-scheduler")
        yield
        task.cancel()
        scheduler.fail_waiting()

    app = FastAPI(title="esft reward model", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        status, message = _one_line_validation(error)
        return JSONResponse({"detail": message}, status)

    @app.exception_handler(StarletteHTTPException)  # what FastAPI raises for a body it cannot parse
    async def http_error(request: Request, error: HTTPException):
        detail = error.detail
        if error.status_code == 400 and detail == "There was an error parsing the body":
            detail = _utf8_problem(b"".join(request.scope.get("state", {}).get("esft_body", []))) or detail
        return JSONResponse({"detail": detail}, error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception):
        message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        logger.error("%s %s failed: %s", request.method, request.url.path, message)
        return JSONResponse({"detail": f"internal error: {message}"}, 500)

    def checked(count: int) -> Scheduler:
        if count > max_request_items:
            raise HTTPException(413, f"{count} completions in one request, over the limit of {max_request_items} "
                                "(--max-request-items); split the request")
        return state["scheduler"]

    async def rewards_of(texts: list[str], request: Request) -> list[float]:
        scheduler = checked(len(texts))
        if problem := text_problem(texts, max_text_chars):
            raise problem
        if not texts:
            return []
        watcher = asyncio.create_task(_client_gone(request))
        try:
            return await scheduler.score(texts, watcher)
        except HTTPException:
            raise
        except Exception as error:  # noqa: BLE001 - this request's own failure: one line, no traceback
            message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            logger.error("scoring %d text(s) failed: %s", len(texts), message)
            raise HTTPException(500, f"internal error: {message}") from None
        finally:
            watcher.cancel()

    @app.post("/score")
    async def score(request: ScoreRequest, raw: Request) -> dict[str, list[float]]:
        checked(len(request.prompts))
        prompts = [p if isinstance(p, str) else [m.model_dump() for m in p] for p in request.prompts]
        completions = [c if isinstance(c, str) else [m.model_dump() for m in c] for c in request.completions]
        try:
            texts = scorer.texts(prompts, completions)
        except Exception as error:  # noqa: BLE001 - the chat template refused these messages
            raise HTTPException(422, f"cannot render the messages with the model's chat template: {type(error).__name__}: {error}") from None
        return {"rewards": await rewards_of(texts, raw)}

    @app.post("/get_reward")
    async def get_reward(request: GetRewardRequest, raw: Request) -> dict[str, list[float]]:
        rewards = await rewards_of(request.query, raw)
        return {"rewards": rewards, "scores": rewards}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        scheduler = state["scheduler"]
        return {"status": "ok", **info, "batch_size": batch_size, "max_request_seconds": max_request_seconds,
                "queue": scheduler.waiting,
                "requests_active": scheduler.active, **vars(scheduler.stats)}

    return app


async def _client_gone(request: Request) -> None:
    """Returns when the client has closed its connection. The body has been read: the next ASGI
    message of this request is its disconnect (uvicorn sends it when the socket closes; a test
    client once the answer is out)."""
    with contextlib.suppress(Exception):  # a receive that fails: the connection is gone too
        while (await request.receive())["type"] != "http.disconnect":
            pass


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
          max_body_mb: float = 16.0, max_text_chars: int | None = None,
          max_request_seconds: float = DEFAULT_MAX_REQUEST_SECONDS) -> None:
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
    for name, value in {"max_body_mb": max_body_mb, "max_request_seconds": max_request_seconds}.items():
        if not value > 0:  # also NaN
            raise ConfigError(name, f"must be > 0, got {value}")
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
                     max_body_bytes=int(max_body_mb * (1 << 20)), api_key=api_key, max_text_chars=max_text_chars,
                     max_request_seconds=max_request_seconds)
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

