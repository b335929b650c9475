"""The OpenAI API of the running tiny-demo server, through the real ``openai`` client.

The demo's weights are random, so the text is gibberish: these tests check the shape and consistency of every
answer (and determinism under greedy decoding), not its content. Tool calls are made deterministic by
constraining them (a named or required tool with a ``strict`` schema).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-demo"
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "London"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _chat(client: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 0.0}
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_list(client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 2048


def test_chat_non_streaming(client: Any) -> None:
    r = _chat(client)
    assert r.object == "chat.completion" and r.model == MODEL and r.id
    (choice,) = r.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.tool_calls in (None, [])
    assert choice.message.model_extra.get("reasoning") is None  # thinking is off by default
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client: Any) -> None:
    full = _chat(client, max_tokens=10)
    chunks = list(_chat(client, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text == full.choices[0].message.content  # greedy decoding is deterministic
    assert finish == [full.choices[0].finish_reason]
    assert len(usage) == 1 and usage[0].completion_tokens == full.usage.completion_tokens


def test_completions(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="The weather in Paris", max_tokens=8, temperature=0.0, logprobs=3)
    assert r.object == "text_completion"
    (choice,) = r.choices
    assert isinstance(choice.text, str) and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens == 8
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
    streamed = client.completions.create(
        model=MODEL, prompt="The weather in Paris", max_tokens=8, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_named_tool_call(client: Any) -> None:
    r = _chat(client, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=64)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and args["city"] in ("Paris", "Tokyo", "London")


def test_required_tool_call_streaming(client: Any) -> None:
    kw = {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64}
    r = _chat(client, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo", "London")
    deltas = [tc for c in _chat(client, stream=True, **kw) if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.name or "" for d in deltas) == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)


def test_auto_tool_choice_is_well_formed(client: Any) -> None:
    r = _chat(client, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=16)
    msg = r.choices[0].message
    assert isinstance(msg.content, str) or msg.tool_calls
    for call in msg.tool_calls or []:
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)


def test_tool_result_turn(client: Any) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'},
    ]  # fmt: skip
    r = _chat(client, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > _chat(client).usage.prompt_tokens


def test_reasoning_enabled(client: Any) -> None:
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    r = _chat(client, max_tokens=12, extra_body=thinking)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning")
    # The prompt opens <think>; a random model rarely closes it, so the text is reasoning (and content empty).
    assert isinstance(reasoning, str) and reasoning
    assert msg.content is None or isinstance(msg.content, str)
    chunks = list(_chat(client, max_tokens=12, extra_body=thinking, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices)
    assert streamed == reasoning
    off = _chat(client, max_tokens=12).choices[0].message
    assert off.model_extra.get("reasoning") is None and off.content


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError),
        ({"max_tokens": -1}, openai.BadRequestError),
        ({"temperature": -2.0}, openai.BadRequestError),
        ({"messages": []}, openai.BadRequestError),
        ({"messages": [{"role": "user", "content": "weather " * 3000}]}, openai.BadRequestError),  # > 2048 tokens
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         openai.BadRequestError),
    ],
)  # fmt: skip
def test_bad_requests_get_4xx_and_the_server_keeps_serving(client: Any, kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error) as info:
        _chat(client, **kwargs)
    assert 400 <= info.value.status_code < 500
    assert _chat(client, max_tokens=2).choices[0].message.content is not None


def test_malformed_http_requests(demo_server: Any, client: Any) -> None:
    headers = {"Authorization": f"Bearer {demo_server.api_key}", "Content-Type": "application/json"}
    url = demo_server.base_url + "/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        assert 400 <= http.post(url, content=b"{not json", headers=headers).status_code < 500
        assert 400 <= http.post(url, json={"model": MODEL}, headers=headers).status_code < 500
        assert http.post(url, json={"model": MODEL, "messages": USER}).status_code == 401  # no API key
        assert (
            http.get(demo_server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
    assert demo_server.alive()
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_plugin_settings_reach_the_expert_runtime(demo_server: Any, client: Any) -> None:
    """--cpu-threads 1 (a flag) and precision 'exact' (the pack's config.json) arrive in the engine's runtime."""
    assert _chat(client, max_tokens=1).usage.completion_tokens == 1
    lines = [
        ln for ln in demo_server.log_path.read_text(errors="replace").splitlines() if "dsv41: routed experts" in ln
    ]
    assert len(lines) == 1, demo_server.log_tail()
    assert "1 threads" in lines[0] and "exact" in lines[0] and "'cpu' expert runtime" in lines[0]
