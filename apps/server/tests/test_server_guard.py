"""The Guard middleware and the request checks, on small ASGI apps (no vLLM: these run in a second)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from dsv41_server.checks import BadRequest, check_json_body
from dsv41_server.guard import DRAIN_BYTES, Guard

KEY = "k" * 24
AUTH = [(b"authorization", f"Bearer {KEY}".encode())]


class Response:
    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.complete = False
        self.unread_chunks = 0  # request-body chunks the app (or the guard) never received

    def json(self) -> Any:
        return json.loads(self.body)


async def _request(
    app: Any,
    method: str = "GET",
    path: str = "/v1/models",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[bytes] | None = None,
    on_body: Callable[[Response], Awaitable[None]] | None = None,
) -> Response:
    """Drive one HTTP request through ``app`` the way uvicorn does; the client never disconnects early."""
    chunks = list(chunks or [b""])
    resp = Response()
    disconnected = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if chunks:
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        assert not resp.complete, f"sent after the response was complete: {msg}"
        if msg["type"] == "http.response.start":
            assert resp.status is None
            resp.status = msg["status"]
            resp.headers = dict(msg.get("headers", ()))
        else:
            resp.body += msg.get("body", b"")
            resp.complete = not msg.get("more_body", False)
            if on_body is not None:
                await on_body(resp)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers or []}
    try:
        await app(scope, receive, send)
    finally:
        disconnected.set()
    resp.unread_chunks = len(chunks)
    return resp


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    body, more = b"", True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    out = json.dumps({"path": scope["path"], "len": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _guard(app: Any = echo_app, key: str | None = KEY, limit: int = 4096) -> Guard:
    return Guard(app, api_key=key, max_body_bytes=limit)


def _error(resp: Response, status: int) -> dict[str, Any]:
    assert resp.status == status and resp.complete, (resp.status, resp.body)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


# ------------------------------------------------------------------------------------------------ key


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/invocations"), ("POST", "/tokenize"),
     ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"), ("GET", "/openapi.json"),
     ("GET", "/ping"), ("POST", "/scale_elastic_ep"), ("GET", "/no-such-route"), ("POST", "/health"),
     ("OPTIONS", "/v1/models")],
)  # fmt: skip
def test_every_route_but_health_needs_the_key(method: str, path: str) -> None:
    guard = _guard()
    err = _error(_run(_request(guard, method, path)), 401)
    assert err["type"] == "AuthenticationError" and "missing API key" in err["message"]
    wrong = _run(_request(guard, method, path, [(b"authorization", b"Bearer nope")]))
    assert _error(wrong, 401)["message"] == "invalid API key"
    assert wrong.headers[b"www-authenticate"] == b"Bearer"
    for other in (f"Basic {KEY}", KEY):  # the key in another scheme, or bare
        assert _run(_request(guard, method, path, [(b"authorization", other.encode())])).status == 401
    ok = _run(_request(guard, method, path, AUTH))
    assert ok.status == 200 and ok.json()["path"] == path


def test_health_and_cors_preflight_are_open_and_x_api_key_works() -> None:
    guard = _guard()
    assert _run(_request(guard, "GET", "/health")).status == 200
    assert _run(_request(guard, "HEAD", "/health")).status == 200
    preflight = [(b"origin", b"http://x"), (b"access-control-request-method", b"POST")]
    assert _run(_request(guard, "OPTIONS", "/v1/chat/completions", preflight)).status == 200
    assert _run(_request(guard, "GET", "/v1/models", [(b"x-api-key", KEY.encode())])).status == 200
    assert _run(_request(guard, "GET", "/v1/models", [(b"X-Api-Key", b"nope")])).status == 401


def test_no_key_configured_lets_everything_in() -> None:
    assert _run(_request(_guard(key=None), "GET", "/metrics")).status == 200


def test_websocket_without_key_is_closed() -> None:
    sent: list[dict[str, Any]] = []
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def go(headers: list[tuple[bytes, bytes]]) -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "websocket.connect"}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        await _guard(app)({"type": "websocket", "path": "/v1/realtime", "headers": headers}, receive, send)

    _run(go([]))
    assert sent == [{"type": "websocket.close", "code": 1008}] and reached == []
    _run(go(AUTH))
    assert reached == ["/v1/realtime"]


# ----------------------------------------------------------------------------------------------- body


def test_body_limit_by_content_length_and_by_counting() -> None:
    guard = _guard(limit=1000)
    declared = _run(_request(guard, "POST", "/v1/completions", [*AUTH, (b"content-length", b"1001")], [b"x" * 1001]))
    err = _error(declared, 413)
    assert err["type"] == "RequestTooLargeError" and "1000 bytes" in err["message"]
    assert declared.headers[b"connection"] == b"close"
    chunked = _run(_request(guard, "POST", "/v1/completions", AUTH, [b"{" + b" " * 600, b" " * 600 + b"}", b" "]))
    _error(chunked, 413)
    # The rest of a refused body is read (up to DRAIN_BYTES), so the client reads the answer, not a reset.
    assert chunked.unread_chunks == 0 and declared.unread_chunks == 0
    huge = [*AUTH, (b"content-length", str(1000 + DRAIN_BYTES + 1).encode())]
    assert _run(_request(guard, "POST", "/v1/completions", huge, [b"x"] * 3)).unread_chunks == 3  # not read at all
    nokey = _run(_request(guard, "POST", "/v1/completions", [], [b"{", b"}"]))
    assert nokey.status == 401 and nokey.unread_chunks == 0
    ok = _run(_request(guard, "POST", "/v1/completions", AUTH, [b"{" + b" " * 400, b" " * 400 + b"}"]))
    assert ok.status == 200 and ok.json()["len"] == 802  # the app gets the whole body, replayed


def test_bad_json_bodies_get_400_and_other_content_types_pass() -> None:
    guard = _guard()
    err = _error(_run(_request(guard, "POST", "/v1/chat/completions", AUTH, [b"{not json"])), 400)
    assert err["type"] == "BadRequestError" and "not valid JSON" in err["message"]
    form = [*AUTH, (b"content-type", b"multipart/form-data; boundary=x")]
    assert _run(_request(guard, "POST", "/v1/audio/transcriptions", form, [b"\xff\xfe"])).status == 200


# ---------------------------------------------------------------------------------------------- drain


async def _sse_app(scope: Any, receive: Any, send: Any, state: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    try:
        i = 0
        while True:
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            i += 1
            await asyncio.sleep(0.005)
    finally:
        state["handler_ended"] = True


def test_expire_ends_a_stream_with_an_error_event_and_done() -> None:
    state: dict[str, Any] = {}

    async def main() -> Response:
        guard = _guard(lambda s, r, se: _sse_app(s, r, se, state))
        req = asyncio.ensure_future(_request(guard, "POST", "/v1/chat/completions", AUTH, [b"{}"]))
        while not guard.in_flight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # a few events out
        assert not await guard.wait_idle(0.05)
        assert guard.expire_all("the grace is over") == 1
        resp = await asyncio.wait_for(req, 5)
        assert await guard.wait_idle(0.1) and guard.in_flight == 0
        return resp

    resp = _run(main())
    assert resp.status == 200 and resp.complete and state["handler_ended"]
    events = resp.body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    err = json.loads(events[-3].removeprefix("data: "))["error"]
    assert err == {"message": "the grace is over", "type": "ServiceUnavailableError", "param": None, "code": 503}
    assert all(e.startswith("data: ") for e in events[:-1])  # whole events only


def test_expire_before_the_response_starts_answers_503() -> None:
    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(3600)

    async def main() -> Response:
        guard = _guard(slow_app)
        req = asyncio.ensure_future(_request(guard, "POST", "/v1/completions", AUTH, [b"{}"]))
        while not guard.in_flight:
            await asyncio.sleep(0.01)
        guard.expire_all("stopping")
        return await asyncio.wait_for(req, 5)

    assert _error(_run(main()), 503)["message"] == "stopping"


def test_draining_answers_503_and_finished_requests_leave_no_trace() -> None:
    async def main() -> tuple[Response, Response, int]:
        guard = _guard()
        ok = await _request(guard, "GET", "/v1/models", AUTH)
        guard.draining = True
        return ok, await _request(guard, "GET", "/health"), guard.in_flight

    ok, drained, in_flight = _run(main())
    assert ok.status == 200 and in_flight == 0
    assert _error(drained, 503)["type"] == "ServiceUnavailableError"
    assert drained.headers[b"connection"] == b"close"


def test_cancelling_the_connection_cancels_the_handler_and_errors_propagate() -> None:
    state: dict[str, Any] = {}

    async def main() -> None:
        guard = _guard(lambda s, r, se: _sse_app(s, r, se, state))
        req = asyncio.ensure_future(_request(guard, "POST", "/v1/chat/completions", AUTH, [b"{}"]))
        await asyncio.sleep(0.05)
        req.cancel()
        with pytest.raises(asyncio.CancelledError):
            await req
        await asyncio.sleep(0)
        assert guard.in_flight == 0

    _run(main())
    assert state["handler_ended"]

    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("handler bug")

    with pytest.raises(RuntimeError, match="handler bug"):
        _run(_request(_guard(failing), "GET", "/v1/models", AUTH))


# --------------------------------------------------------------------------------------------- checks


def _bad(body: Any) -> BadRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as info:
        check_json_body(raw)
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_checks_name_the_field() -> None:
    e = _bad(b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert e.param == "messages[0].content" and "lone UTF-16 surrogate (\\ud800) at character 1" in e.message
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    e = _bad(raw)
    assert e.param is None and f"not valid UTF-8 (byte 0xff at offset {raw.index(0xFF)})" in e.message
    e = _bad({**CHAT, "messages": [{"role": "user", "content": 123}]})
    assert e.param == "messages[0].content" and e.message.endswith("got a number")
    e = _bad({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]})
    assert e.param == "messages[0].role" and '"wizard" is not a message role' in e.message
    e = _bad({**CHAT, "messages": ["hi"]})
    assert e.param == "messages[0]"
    e = _bad({**CHAT, "logprobs": True, "top_logprobs": -1})
    assert e.param == "top_logprobs" and "got -1" in e.message
    e = _bad({"model": "m", "prompt": "hi", "logprobs": -1})
    assert e.param == "logprobs"
    for body in ({**CHAT, "best_of": 3}, {"model": "m", "prompt": "hi", "best_of": 2}):
        assert _bad(body).param == "best_of"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    e = _bad({**CHAT, "tools": [tool], "tool_choice": "required"})
    assert e.param == "tools[0].function.parameters" and "not a valid JSON Schema" in e.message
    e = _bad({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]})
    assert "expected a JSON Schema object" in e.message
    assert "not valid JSON" in _bad(b'{"a": 1,}').message
    assert "surrogate" in _bad(b'{"a\\udc00": 1}').message  # keys too


def test_checks_pass_what_the_api_allows() -> None:
    ok = [
        CHAT,
        {**CHAT, "messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
                              {"role": "user", "content": [{"type": "text", "text": "\U0001f600 emoji"}]},
                              {"role": "assistant", "content": None, "tool_calls": []},
                              {"role": "tool", "tool_call_id": "1", "content": "r"}]},
        {**CHAT, "best_of": 1, "top_logprobs": 0, "logprobs": True},
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}},
                           {"type": "function", "function": {"name": "g", "parameters": {
                               "type": "object", "properties": {"a": {"type": "string"}}}}}]},
        {"model": "m", "prompt": "hi", "logprobs": 3},
        [1, 2, 3],
    ]  # fmt: skip
    for body in ok:
        assert check_json_body(json.dumps(body).encode()) == body
    assert check_json_body(b'{"s": "\\ud83d\\ude00"}') == {"s": "\U0001f600"}  # an escaped pair is fine
