"""The running demo server under hostile or malformed input: the API key on every route, the body limit, and
the request checks (raw HTTP and the real ``openai`` client)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-demo"
USER = [{"role": "user", "content": "hi"}]
#: Routes vLLM mounts outside its OpenAPI schema.
EXTRA_ROUTES = [("GET", "/metrics"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json")]


def _routes(server: Any) -> list[tuple[str, str]]:
    schema = httpx.get(server.base_url + "/openapi.json", headers=_auth(server), timeout=30).json()
    routes = [(m.upper(), p.replace("{", "").replace("}", "")) for p, ops in schema["paths"].items() for m in ops]
    return routes + EXTRA_ROUTES


def _auth(server: Any, key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key or server.api_key}"}


def _openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_every_route_but_health_answers_401_without_or_with_a_wrong_key(demo_server: Any) -> None:
    routes = _routes(demo_server)
    paths = {p for _, p in routes}
    for needed in ("/invocations", "/tokenize", "/detokenize", "/metrics", "/version", "/v1/chat/completions",
                   "/v1/completions", "/v1/models", "/ping", "/load"):  # fmt: skip
        assert needed in paths, sorted(paths)
    with httpx.Client(base_url=demo_server.base_url, timeout=60) as http:
        for method, path in routes:
            if path == "/health":
                continue
            for headers in ({}, _auth(demo_server, "wrong-key-0123456789"), {"x-api-key": "wrong"}):
                r = http.request(method, path, headers=headers, json={} if method in ("POST", "PUT") else None)
                assert _openai_error(r, 401)["type"] == "AuthenticationError"
        assert http.get("/health").status_code == 200
        assert http.get("/version", headers=_auth(demo_server)).status_code == 200
        assert (
            http.post("/tokenize", headers=_auth(demo_server), json={"model": MODEL, "prompt": "hi"}).status_code == 200
        )
        assert http.get("/metrics", headers={"x-api-key": demo_server.api_key}).status_code == 200


def test_openai_client_with_a_wrong_key(demo_server: Any) -> None:
    with openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="not-the-key", max_retries=0) as bad:
        for call in (lambda: bad.models.list(), lambda: bad.chat.completions.create(model=MODEL, messages=USER),
                     lambda: bad.completions.create(model=MODEL, prompt="hi")):  # fmt: skip
            with pytest.raises(openai.AuthenticationError) as info:
                call()
            assert info.value.status_code == 401 and info.value.body["message"] == "invalid API key"


def test_oversize_body_gets_413(demo_server: Any, client: Any) -> None:
    big = [{"role": "user", "content": "x" * (2 << 20)}]  # the demo's limit: 1 MiB (2048-token context)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=big, max_tokens=1)
    assert info.value.status_code == 413 and "1048576 bytes" in info.value.body["message"]
    body = json.dumps({"model": MODEL, "messages": big}).encode()

    def chunks() -> Any:  # no Content-Length: the server counts
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    r = httpx.post(demo_server.base_url + "/tokenize", content=chunks(), headers=_auth(demo_server), timeout=60)
    assert _openai_error(r, 413)["type"] == "RequestTooLargeError"
    r = httpx.post(demo_server.base_url + "/tokenize", content=body, timeout=60)  # and without a key: 401 first
    assert r.status_code == 401
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).usage.completion_tokens == 1


RAW_BAD = [
    (b'{"model": "tiny-demo", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content",
     "lone UTF-16 surrogate"),
    (b'{"model": "tiny-demo", "messages": [{"role": "user", "content": "caf\xe9"}]}', None, "not valid UTF-8"),
    (b'{"model": "tiny-demo", "messages": [{"role": "user", "content": 123}]}', "messages[0].content",
     "expected a string or an array of content parts, got a number"),
    (b"{not json", None, "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "needle"), RAW_BAD)
def test_unclear_400s_now_name_the_problem(demo_server: Any, body: bytes, param: str | None, needle: str) -> None:
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", content=body,
                   headers={**_auth(demo_server), "Content-Type": "application/json"}, timeout=60)  # fmt: skip
    err = _openai_error(r, 400)
    assert err["param"] == param and needle in err["message"], err


BROKEN_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
     ({"extra_body": {"best_of": 3}}, "best_of"),
     ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
     ({"tools": [BROKEN_TOOL], "tool_choice": "required"}, "tools[0].function.parameters")],
)  # fmt: skip
def test_silently_accepted_input_is_refused(demo_server: Any, client: Any, kwargs: dict[str, Any], param: str) -> None:
    log_before = demo_server.log_path.read_text(errors="replace").count("Traceback")
    args: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 16}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**args, **kwargs})
    assert info.value.body["param"] == param, info.value.body
    assert demo_server.log_path.read_text(errors="replace").count("Traceback") == log_before
    assert client.chat.completions.create(**args).choices[0].finish_reason in ("length", "stop")


def test_completions_logprobs_and_best_of(client: Any) -> None:
    for kwargs, param in (({"logprobs": -1}, "logprobs"), ({"best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
        assert info.value.body["param"] == param
