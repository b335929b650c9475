"""Request-body checks the server makes before vLLM sees a request, each answering one clear 400.

vLLM accepts some malformed input silently (an unknown message role, ``best_of``, a tool whose ``parameters``
is not a JSON Schema) and answers other input with messages that do not say what is wrong (a lone UTF-16
surrogate, invalid UTF-8, ``content: 123``, ``top_logprobs: -1``). These checks name the field and the
problem instead. They look only at what they know; everything else is left to vLLM's own validation.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MESSAGE_ROLES", "BadRequest", "check_json_body"]

#: The message roles of the OpenAI chat API (and of Anthropic's messages API, a subset).
MESSAGE_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "function")


class BadRequest(Exception):
    """A request the server refuses: ``message`` says why, ``param`` names the field (or ``None``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    return "a string"


def _check_unicode(obj: Any) -> None:
    """Every string (and object key) in ``obj`` is valid Unicode: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no tokenizer (nor UTF-8) can encode."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = path or "the request body"
                raise BadRequest(
                    f"{where}: contains a lone UTF-16 surrogate (\\u{ord(v[e.start]):04x}) at character {e.start}; "
                    "strings must be valid Unicode (a surrogate escape needs its pair)",
                    path or None,
                ) from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((path, k))  # a key reports its parent object
                stack.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        return  # vLLM says "messages: expected a list"
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where}: expected an object with 'role' and 'content', got {_json_type(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise BadRequest(
                f"{where}.role: {json.dumps(role)} is not a message role; expected one of {', '.join(MESSAGE_ROLES)}",
                f"{where}.role",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"{where}.content: expected a string or an array of content parts, got {_json_type(content)}",
                f"{where}.content",
            )


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or "parameters" not in fn or fn["parameters"] is None:
            continue  # a missing schema means "no parameters"; vLLM checks the rest of the tool's shape
        where = f"tools[{i}].function.parameters"
        schema = fn["parameters"]
        if not isinstance(schema, dict):
            raise BadRequest(f"{where}: expected a JSON Schema object, got {_json_type(schema)}", where)
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
            raise BadRequest(f"{where}{at}: not a valid JSON Schema: {e.message}", where) from None


def _check_count(obj: dict[str, Any], name: str) -> None:
    v = obj.get(name)
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        raise BadRequest(f"{name}: expected the number of most likely tokens to return (0 or more), got {v}", name)


def check_json_body(body: bytes) -> Any:
    """Parse a JSON request body and check it; return the parsed value or raise ``BadRequest``.

    Checked: UTF-8, JSON syntax, lone surrogates in any string; ``messages[*].role`` (one of ``MESSAGE_ROLES``)
    and ``.content`` (string, array or null); ``top_logprobs`` (and a completion's integer ``logprobs``) not
    negative; ``best_of`` absent or 1 (vLLM's V1 engine ignores it); each ``tools[*].function.parameters`` a
    valid JSON Schema.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(
            f"request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}); JSON must be UTF-8"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    _check_unicode(obj)
    if not isinstance(obj, dict):
        return obj
    if "messages" in obj:
        _check_messages(obj["messages"])
    if "tools" in obj:
        _check_tools(obj["tools"])
    _check_count(obj, "top_logprobs")
    if "prompt" in obj:  # a completion request: its logprobs is a count (a chat request's is a boolean)
        _check_count(obj, "logprobs")
    best_of = obj.get("best_of")
    if best_of is not None and best_of != 1:
        raise BadRequest(
            f"best_of: not supported by this server (vLLM's engine ignores it), got {json.dumps(best_of)}; "
            "use n for several choices",
            "best_of",
        )
    return obj
