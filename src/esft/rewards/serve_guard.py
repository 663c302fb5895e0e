"""What `esft serve-reward` (esft.rewards.serve) checks before a request reaches the model, so one
client cannot hurt the others: the API key, the content type and the body size (Guard, before the
body is read), every text the model would score (text_problem: empty, not Unicode, too long), and
connections that never finish their headers (HeaderTimeoutProtocol)."""

from __future__ import annotations

import asyncio
import secrets

import h11
from fastapi import HTTPException
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

CHARS_PER_TOKEN = 16
"""--max-text-chars by default: this many characters per token of the model's context (a text is cut
to its last context-length tokens anyway; longer ones only cost tokenizing time)."""
HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a request's headers; then it is closed."""


def text_problem(texts: list[str], max_chars: int) -> HTTPException | None:
    """The first text the model cannot score, as the 4xx naming its item (None if all can be scored)."""
    for index, text in enumerate(texts):
        if not text:
            return HTTPException(400, f"item {index}: prompt + completion is empty; a reward model needs some text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            return HTTPException(400, f"item {index}: character {error.start} is a lone surrogate "
                                      f"({text[error.start]!r}), not Unicode text; send valid UTF-8")
        if len(text) > max_chars:
            return HTTPException(413, f"item {index}: {len(text)} characters, over the limit of {max_chars} "
                                      "(--max-text-chars); the model reads only the end of a long text: send that")
    return None


class Guard:
    """ASGI middleware checked before a body is read: the bearer token (401), a JSON content type
    (415, also when the header is missing) and the body size (413, from Content-Length, and while
    reading a body sent without one)."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and not secrets.compare_digest(headers.get(b"authorization", b""),
                                                                   f"Bearer {self.api_key}".encode()):
            response = JSONResponse({"detail": "missing or wrong API key: send the header 'Authorization: Bearer <key>'"},
                                    401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and kind != b"application/json":
            message = f"send JSON with the header 'Content-Type: application/json' (got {kind.decode(errors='replace') or 'none'!r})"
            return await JSONResponse({"detail": message}, 415)(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        too_large = f"request body over the limit of {self.max_body} bytes (--max-body-mb); send fewer completions per request"
        if not length.isdigit() or int(length) > self.max_body:
            return await JSONResponse({"detail": too_large}, 413)(scope, receive, send)
        received = 0
        chunks = scope.setdefault("state", {})["esft_body"] = []  # the body as read: to name a bad item in an error

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            chunks.append(message.get("body", b""))
            if received > self.max_body:
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    HEADER_TIMEOUT seconds of starting it (uvicorn's keep-alive timeout covers only the idle time
    between requests: headers that never finish would hold a connection open forever)."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = self.loop.call_later(HEADER_TIMEOUT, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:  # the next request on a kept-alive connection
            self._deadline = self.loop.call_later(HEADER_TIMEOUT, self._too_slow)
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state is not h11.IDLE:  # its head is in
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
