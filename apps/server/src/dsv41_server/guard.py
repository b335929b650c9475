"""``Guard``: the ASGI middleware in front of every route of the server (the outermost layer of vLLM's app).

It does five things, in this order, for each HTTP request:

1. While the server is stopping, answers 503 (``Connection: close``) instead of starting new work.
2. Requires the API key (``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic clients send it)
   on every route except ``GET /health`` and CORS preflights, when a key is configured: 401 otherwise.
3. Refuses a request body larger than ``max_body_bytes`` with 413, before reading it when the request says
   its length, as soon as it passes the limit otherwise.
4. Checks JSON request bodies (``checks.check_json_body``): 400 naming the field.
5. Tracks the request while vLLM serves it, so that a stopping server can wait for it and, after the grace
   period, end it: a response not yet started gets 503; a stream (server-sent events) gets a last
   ``data: {"error": ...}`` event and ``data: [DONE]``; then the handler is cancelled (vLLM aborts the
   request in the engine).

Every answer of its own is in the OpenAI error shape that vLLM uses:
``{"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .checks import BadRequest, check_json_body

__all__ = ["OPEN_PATHS", "Guard", "error_body"]

log = logging.getLogger("dsv41_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Routes answered without the API key (GET/HEAD only): the health check load balancers and supervisors poll.
OPEN_PATHS: frozenset[str] = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: How much of a refused request's body is read and dropped before the answer, so that a client still sending
#: it reads the 401/413 instead of a reset connection (past this the answer is sent and the connection closed).
DRAIN_BYTES = 16 << 20


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    """An error in the OpenAI shape, as vLLM writes its own."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}}).encode()


async def _respond(send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Call:
    """One request the guard has handed to vLLM."""

    __slots__ = ("ended", "expired", "message", "sse", "started", "task")

    def __init__(self) -> None:
        self.task: asyncio.Future[None] | None = None
        self.started = False  # the response's status line is sent
        self.ended = False  # the response's last body part is sent
        self.sse = False  # the response is a stream of server-sent events
        self.expired = False  # the guard has ended it (the grace period is over)
        self.message = ""


class Guard:
    """ASGI middleware: see the module docstring.

    Parameters
    ----------
    app : the ASGI app behind it (vLLM's).
    api_key : the key clients must send; ``None`` lets every request in.
    max_body_bytes : the largest request body accepted.
    """

    def __init__(self, app: App, *, api_key: str | None, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected at least 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._key_hash = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self._calls: set[_Call] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        #: Set when the server stops: new requests get 503.
        self.draining = False
        self.drain_message = "the server is shutting down"

    # ------------------------------------------------------------------------------------------ state

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        return len(self._calls)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request in flight to finish; whether they all did."""
        if not self._calls:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def expire_all(self, message: str) -> int:
        """End every request still in flight with an error saying ``message``; returns how many."""
        n = 0
        for call in list(self._calls):
            if call.task is not None and not call.task.done() and not call.expired:
                call.expired = True
                call.message = message
                call.task.cancel()
                n += 1
        return n

    # ------------------------------------------------------------------------------------------ checks

    def _authorized(self, headers: dict[bytes, bytes]) -> bool | None:
        """``True``: the right key; ``False``: a wrong key; ``None``: no key sent."""
        assert self._key_hash is not None
        sent: bytes | None = None
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, token = auth.partition(b" ")
            sent = token.strip() if scheme.lower() == b"bearer" else b""  # only the Bearer scheme
        elif b"x-api-key" in headers:
            sent = headers[b"x-api-key"].strip()
        if sent is None:
            return None
        return secrets.compare_digest(hashlib.sha256(sent).digest(), self._key_hash)

    # ------------------------------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "") or "/"
        method = scope.get("method", "GET")
        if kind == "websocket":
            if self.draining or (self._key_hash is not None and not self._authorized(headers)):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return

        if self.draining:
            body = error_body(503, self.drain_message, "ServiceUnavailableError")
            await _respond(send, 503, body, ((b"connection", b"close"),))
            return
        is_open = (method in ("GET", "HEAD") and path in OPEN_PATHS) or (
            method == "OPTIONS" and b"access-control-request-method" in headers  # CORS preflight
        )
        if self._key_hash is not None and not is_open:
            ok = self._authorized(headers)
            if not ok:
                message = (
                    "invalid API key" if ok is False else "missing API key: send the header 'Authorization: Bearer KEY'"
                )
                if method in _BODY_METHODS:
                    await _drain(receive, self.max_body_bytes)
                await _respond(
                    send, 401, error_body(401, message, "AuthenticationError"), ((b"www-authenticate", b"Bearer"),)
                )
                return

        if method in _BODY_METHODS:
            body_or_none = await self._read_body(headers, receive, send)
            if body_or_none is None:
                return  # answered (413 / 400) or the client left
            receive = _replay(body_or_none, receive)
        await self._serve(scope, receive, send)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive, send: Send) -> bytes | None:
        limit = self.max_body_bytes
        too_large = f"request body is larger than this server's limit of {limit} bytes (--max-request-bytes)"
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        parts: list[bytes] = []
        size = 0
        more = True
        while more and (declared is None or declared <= limit):
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > limit:
                break
            parts.append(chunk)
        if size > limit or (declared is not None and declared > limit):
            if more and (declared is None or declared <= limit + DRAIN_BYTES):
                await _drain(receive, DRAIN_BYTES)
            await _respond(send, 413, error_body(413, too_large, "RequestTooLargeError"), ((b"connection", b"close"),))
            return None
        body = b"".join(parts)
        ctype = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if body and (ctype == b"application/json" or ctype.endswith(b"+json")):
            try:
                check_json_body(body)
            except BadRequest as e:
                await _respond(send, 400, error_body(400, e.message, "BadRequestError", e.param))
                return None
        return body

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = _Call()

        async def tracked_send(msg: Message) -> None:
            if call.expired:
                return  # the guard ended this response; drop what the handler still sends
            if msg["type"] == "http.response.start":
                call.started = True
                for k, v in msg.get("headers", ()):
                    if k.lower() == b"content-type" and v.lower().startswith(b"text/event-stream"):
                        call.sse = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                call.ended = True
            await send(msg)

        self._calls.add(call)
        self._idle.clear()
        try:
            inner = asyncio.ensure_future(self.app(scope, receive, tracked_send))
            call.task = inner
            try:
                await asyncio.wait({inner})
            except asyncio.CancelledError:
                inner.cancel()
                raise
            if inner.cancelled() and call.expired:
                await self._end_expired(call, send)
                return
            inner.result()  # re-raise what the handler raised (uvicorn logs it and answers 500)
        finally:
            self._calls.discard(call)
            if not self._calls:
                self._idle.set()

    async def _end_expired(self, call: _Call, send: Send) -> None:
        if not call.started:
            body = error_body(503, call.message, "ServiceUnavailableError")
            await _respond(send, 503, body, ((b"connection", b"close"),))
        elif not call.ended:
            tail = b""
            if call.sse:
                tail = b"data: " + error_body(503, call.message, "ServiceUnavailableError") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and drop the rest of a request body, at most ``max_bytes`` of it."""
    seen = 0
    while seen <= max_bytes:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return
        seen += len(msg.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the already-read ``body`` once, then defers to the client's (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
