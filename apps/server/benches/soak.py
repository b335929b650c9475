"""Soak a running dsv41-server (or any vLLM OpenAI server) on this machine: a bounded mix of requests at a
given concurrency, with the server's memory sampled along the way.

    uv run python apps/server/benches/soak.py --port 8000 [--api-key-file F] [--concurrency 4]
        [--requests 400] [--duration 600] [--json out.json]

The mix (``--mix``, weights): non-streaming chat, streaming chat, tool calls (named, required or auto;
streaming or not) and bad requests (malformed JSON, unknown model, bad parameters, a too-long prompt, a
wrong key, an oversize body, ...). It stops at ``--requests`` requests or ``--duration`` seconds, whichever
comes first (requests in flight then finish). Loopback only: it reads the server's memory from /proc.

Printed: per kind of request, the count, errors (a good request not answered 200 with a well-formed answer,
a bad one not answered 4xx, a broken connection), 5xx answers, answers cut at ``max_tokens`` (``cut``: a tool
call cut short is not judged) and latency percentiles (time to the last byte; streams also to the first
token); the server's resident memory (the API-server process and each
child, e.g. vLLM's engine core) every ``--rss-every`` seconds; the first distinct errors.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

WEATHER = {
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
PROMPTS = [
    "What is the weather in Paris today?",
    "Write a haiku about memory.",
    "Explain mixture-of-experts models in two sentences.",
    "List three prime numbers.",
    "Summarize the plot of a novel you like.",
]
KINDS = ("chat", "chat_stream", "tool", "bad")
DEFAULT_MIX = "chat=3,chat_stream=3,tool=2,bad=2"


@dataclass
class Result:
    kind: str
    case: str
    ok: bool
    status: int | None
    seconds: float
    ttft: float | None = None
    error: str = ""
    truncated: bool = False  # stopped at max_tokens: a tool call cut short is not judged


@dataclass
class Sample:
    t: float
    done: int
    rss: dict[str, int] = field(default_factory=dict)  # "api", "child:<name>:<pid>" -> bytes


# ------------------------------------------------------------------------------------------ requests


def _chat_body(model: str, rng: random.Random, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"[{rng.randrange(10**9)}] {rng.choice(PROMPTS)}"}],
        "max_tokens": rng.randint(8, 64),
        "temperature": rng.choice([0.0, 0.7]),
    }
    body.update(kw)
    return body


def _bad_cases(model: str, max_model_len: int, body_limit: int) -> list[tuple[str, dict[str, Any]]]:
    """(case, request) pairs that a correct server answers with 4xx."""
    user = [{"role": "user", "content": "hi"}]
    return [
        ("malformed_json", {"content": b'{"model": "' + model.encode() + b'", "messages": [', "json": None}),
        ("unknown_model", {"json": {"model": "no-such-model", "messages": user}}),
        ("negative_max_tokens", {"json": {"model": model, "messages": user, "max_tokens": -1}}),
        ("bad_temperature", {"json": {"model": model, "messages": user, "temperature": -3}}),
        ("empty_messages", {"json": {"model": model, "messages": []}}),
        ("unknown_role", {"json": {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}}),
        ("content_number", {"json": {"model": model, "messages": [{"role": "user", "content": 123}]}}),
        (
            "lone_surrogate",
            {
                "content": b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
                b'"content": "a\\ud800"}]}',
                "json": None,
            },
        ),  # fmt: skip
        (
            "invalid_utf8",
            {
                "content": b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "\xff"}]}',
                "json": None,
            },
        ),  # fmt: skip
        (
            "too_long_prompt",
            {"json": {"model": model, "messages": [{"role": "user", "content": "word " * max_model_len}]}},
        ),
        (
            "unknown_tool",
            {
                "json": {
                    "model": model,
                    "messages": user,
                    "tools": [WEATHER],
                    "tool_choice": {"type": "function", "function": {"name": "nope"}},
                }
            },
        ),  # fmt: skip
        ("wrong_key", {"json": {"model": model, "messages": user}, "headers": {"Authorization": "Bearer wrong"}}),
        ("oversize", {"content": b'{"x": "' + b"a" * (body_limit + 1) + b'"}', "json": None}),
    ]


class Soak:
    def __init__(self, a: argparse.Namespace, model: str, max_model_len: int, key: str | None) -> None:
        self.a = a
        self.model = model
        self.base = f"http://127.0.0.1:{a.port}" if a.url is None else a.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.key = key
        self.rng = random.Random(a.seed)
        weights = dict(part.split("=") for part in a.mix.split(","))
        unknown = set(weights) - set(KINDS)
        if unknown:
            raise SystemExit(f"--mix: unknown kinds {sorted(unknown)}; known: {KINDS}")
        self.kinds = [k for k in weights for _ in range(int(weights[k]))]
        self.bad = _bad_cases(model, max_model_len, a.body_limit)
        if not key:
            self.bad = [b for b in self.bad if b[0] != "wrong_key"]
        self.results: list[Result] = []
        self.issued = 0
        self.t0 = 0.0

    def _next(self) -> str | None:
        if self.issued >= self.a.requests or time.monotonic() - self.t0 >= self.a.duration:
            return None
        self.issued += 1
        return self.rng.choice(self.kinds)

    async def worker(self, http: httpx.AsyncClient) -> None:
        while (kind := self._next()) is not None:
            t = time.monotonic()
            try:
                r = await getattr(self, f"_{kind}")(http)
            except (httpx.HTTPError, OSError, ValueError) as e:
                r = Result(kind, kind, False, None, time.monotonic() - t, error=f"{type(e).__name__}: {e}"[:300])
            self.results.append(r)

    async def _chat(self, http: httpx.AsyncClient) -> Result:
        t = time.monotonic()
        resp = await http.post("/v1/chat/completions", json=_chat_body(self.model, self.rng), headers=self.headers)
        dt = time.monotonic() - t
        if resp.status_code != 200:
            return Result("chat", "chat", False, resp.status_code, dt, error=f"{resp.status_code}: {resp.text[:200]}")
        choice = resp.json()["choices"][0]
        ok = isinstance(choice["message"].get("content"), str) and choice["finish_reason"] in ("stop", "length")
        return Result("chat", "chat", ok, 200, dt, error="" if ok else f"malformed answer: {choice}"[:300])

    async def _stream(self, http: httpx.AsyncClient, body: dict[str, Any], kind: str, case: str) -> Result:
        t = time.monotonic()
        ttft = None
        finish, done, error = None, False, ""
        tool_args: dict[int, str] = defaultdict(str)
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                dt = time.monotonic() - t
                return Result(kind, case, False, resp.status_code, dt, error=f"{resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = f"error event: {event['error']}"[:300]
                    continue
                for ch in event.get("choices", []):
                    delta = ch.get("delta") or {}
                    if ttft is None and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning")):
                        ttft = time.monotonic() - t
                    for tc in delta.get("tool_calls") or []:
                        tool_args[tc.get("index", 0)] += (tc.get("function") or {}).get("arguments") or ""
                    finish = ch.get("finish_reason") or finish
        dt = time.monotonic() - t
        if not error and not done:
            error = "stream ended without data: [DONE]"
        if not error and finish not in ("stop", "length", "tool_calls"):
            error = f"stream ended with finish_reason {finish!r}"
        truncated = finish == "length" and kind == "tool"
        if not error and not truncated and body.get("tool_choice") not in (None, "auto", "none"):
            error = _tool_args_error(list(tool_args.values()))
        return Result(kind, case, not error, 200, dt, ttft, error, truncated)

    async def _chat_stream(self, http: httpx.AsyncClient) -> Result:
        body = _chat_body(self.model, self.rng, stream=True, stream_options={"include_usage": True})
        return await self._stream(http, body, "chat_stream", "chat_stream")

    async def _tool(self, http: httpx.AsyncClient) -> Result:
        choice = self.rng.choice(["named", "required", "auto"])
        tool_choice: Any = {"named": {"type": "function", "function": {"name": "get_weather"}}}.get(choice, choice)
        body = _chat_body(self.model, self.rng, tools=[WEATHER], tool_choice=tool_choice, max_tokens=64)
        if choice != "auto":
            body["parallel_tool_calls"] = False
        case = f"tool_{choice}"
        if self.rng.random() < 0.5:
            body["stream"] = True
            return await self._stream(http, body, "tool", case + "_stream")
        t = time.monotonic()
        resp = await http.post("/v1/chat/completions", json=body, headers=self.headers)
        dt = time.monotonic() - t
        if resp.status_code != 200:
            return Result("tool", case, False, resp.status_code, dt, error=f"{resp.status_code}: {resp.text[:200]}")
        answer = resp.json()["choices"][0]
        msg = answer["message"]
        error = ""
        truncated = answer["finish_reason"] == "length"
        if choice != "auto" and not truncated:
            error = _tool_args_error([c["function"]["arguments"] for c in msg.get("tool_calls") or []])
            if error:
                error += f" (finish_reason {answer['finish_reason']!r}, content {str(msg.get('content'))[:60]!r})"
        return Result("tool", case, not error, 200, dt, error=error, truncated=truncated)

    async def _bad(self, http: httpx.AsyncClient) -> Result:
        case, req = self.rng.choice(self.bad)
        headers = {**self.headers, "Content-Type": "application/json", **req.get("headers", {})}
        content = json.dumps(req["json"]).encode() if req.get("json") is not None else req["content"]
        t = time.monotonic()
        try:
            resp = await http.post("/v1/chat/completions", content=content, headers=headers)
        except httpx.HTTPError as e:
            return Result(
                "bad", case, False, None, time.monotonic() - t, error=f"{case}: {type(e).__name__}: {e}"[:300]
            )
        dt = time.monotonic() - t
        ok = 400 <= resp.status_code < 500
        error = "" if ok else f"{case}: answered {resp.status_code}, expected 4xx: {resp.text[:160]}"
        return Result("bad", case, ok, resp.status_code, dt, error=error)


def r_case(key: str) -> str:
    return key.split(": ", 1)[0]


def _tool_args_error(args: list[str]) -> str:
    if not args:
        return "no tool call in a named/required tool-call answer"
    for a in args:
        try:
            city = json.loads(a).get("city")
        except (ValueError, AttributeError):
            return f"tool-call arguments are not a JSON object: {a[:120]!r}"
        if city not in ("Paris", "Tokyo", "London"):
            return f"tool-call arguments break the schema: {a[:120]!r}"
    return ""


# ------------------------------------------------------------------------------------------ memory


def find_server(port: int) -> int:
    """The pid of the process listening on ``port`` (this user's processes only)."""
    import psutil

    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return int(c.pid)
    raise SystemExit(f"no process of this user listens on port {port}; pass --server-pid")


def rss_of(pid: int) -> dict[str, int]:
    import psutil

    out: dict[str, int] = {}
    try:
        p = psutil.Process(pid)
        out["api"] = p.memory_info().rss
        for c in p.children(recursive=True):
            try:
                cmdline = " ".join(c.cmdline())
                if "resource_tracker" in cmdline:
                    continue
                out[f"{(cmdline or c.name())[:22]}:{c.pid}"] = c.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


async def sample_memory(soak: Soak, pid: int, every: float, samples: list[Sample], stop: asyncio.Event) -> None:
    while True:
        samples.append(Sample(time.monotonic() - soak.t0, len(soak.results), rss_of(pid)))
        try:
            await asyncio.wait_for(stop.wait(), every)
            samples.append(Sample(time.monotonic() - soak.t0, len(soak.results), rss_of(pid)))
            return
        except asyncio.TimeoutError:
            pass


# ------------------------------------------------------------------------------------------ report


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return float("nan")
    xs, ys = [p[0] / 60 for p in points], [p[1] / 2**20 for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def report(soak: Soak, samples: list[Sample], wall: float) -> dict[str, Any]:
    rows = []
    print(f"{'case':<24}{'n':>6}{'errors':>8}{'5xx':>6}{'cut':>6}{'p50_ms':>9}{'p90_ms':>9}{'p99_ms':>9}{'max_ms':>9}"
          f"{'ttft_p50':>10}")  # fmt: skip
    by: dict[str, list[Result]] = defaultdict(list)
    for r in soak.results:
        by[r.kind].append(r)
        if r.case != r.kind:
            by[f"  {r.case}"].append(r)
    order = [k for k in KINDS if k in by]
    order = [x for k in order for x in [k, *sorted(c for c in by if c.startswith("  ") and by[c][0].kind == k)]]
    for name in [*order, "all"]:
        rs = soak.results if name == "all" else by[name]
        lat = [r.seconds * 1e3 for r in rs]
        ttft = [r.ttft * 1e3 for r in rs if r.ttft is not None]
        row = {"case": name.strip(), "n": len(rs), "errors": sum(not r.ok for r in rs),
               "5xx": sum(1 for r in rs if r.status is not None and r.status >= 500), "cut": sum(r.truncated for r in rs),
               "p50_ms": _pct(lat, 50), "p90_ms": _pct(lat, 90), "p99_ms": _pct(lat, 99),
               "max_ms": max(lat, default=float("nan")), "ttft_p50_ms": _pct(ttft, 50)}  # fmt: skip
        rows.append(row)
        print(f"{name:<24}{row['n']:>6}{row['errors']:>8}{row['5xx']:>6}{row['cut']:>6}{row['p50_ms']:>9.0f}{row['p90_ms']:>9.0f}"
              f"{row['p99_ms']:>9.0f}{row['max_ms']:>9.0f}{row['ttft_p50_ms']:>10.0f}")  # fmt: skip
    print(f"# {len(soak.results)} requests in {wall:.0f} s ({len(soak.results) / wall:.2f}/s)")

    names = sorted({k for s in samples for k in s.rss}, key=lambda k: (k != "api", k))
    print("\n# server resident memory (MiB)")
    print(f"{'t_s':>7}{'requests':>10}" + "".join(f"{n.split(':')[0][:22]:>24}" for n in names) + f"{'total':>10}")
    for s in samples:
        cells = "".join(f"{s.rss.get(n, 0) / 2**20:>24.1f}" for n in names)
        print(f"{s.t:>7.0f}{s.done:>10}{cells}{sum(s.rss.values()) / 2**20:>10.1f}")
    growth = {}
    if len(samples) >= 2:
        half = samples[len(samples) // 2 :]
        for n in [*names, "total"]:

            def val(s: Sample, n: str = n) -> float:
                return sum(s.rss.values()) if n == "total" else s.rss.get(n, 0)

            growth[n] = {"first_mib": val(samples[0]) / 2**20, "last_mib": val(samples[-1]) / 2**20,
                         "slope_second_half_mib_per_min": _slope_mib_per_min([(s.t, val(s)) for s in half])}  # fmt: skip
            g = growth[n]
            delta, slope = g["last_mib"] - g["first_mib"], g["slope_second_half_mib_per_min"]
            print(f"# {n.split(':')[0]}: {g['first_mib']:.1f} -> {g['last_mib']:.1f} MiB ({delta:+.1f}); "
                  f"second half {slope:+.2f} MiB/min")  # fmt: skip

    errors = Counter(r.error for r in soak.results if not r.ok)
    kinds: dict[str, list[str]] = defaultdict(list)  # the same error with other ids or text: one line, one example
    for r in soak.results:
        if not r.ok:
            kinds[f"{r.case}: {r.error[:50]}"].append(r.error)
    if kinds:
        print("\n# errors, by case and beginning (count, one example)")
        for key, examples in sorted(kinds.items(), key=lambda kv: -len(kv[1]))[:10]:
            print(f"{len(examples):>6}  {r_case(key)}: {examples[0][:200]}")
    return {"rows": rows, "rss": [{"t": s.t, "done": s.done, "rss": s.rss} for s in samples], "growth": growth,
            "errors": dict(errors)}  # fmt: skip


# ------------------------------------------------------------------------------------------ main


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "?"  # fmt: skip
    except OSError:
        return "?"


async def amain(a: argparse.Namespace) -> int:
    key = Path(a.api_key_file).read_text().strip() if a.api_key_file else None
    base = a.url.rstrip("/") if a.url else f"http://127.0.0.1:{a.port}"
    host = urlparse(base).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"{base}: the soak runs against a server on this machine only (a loopback address)")
    port = urlparse(base).port or 80
    pid = a.server_pid or find_server(port)
    timeout = httpx.Timeout(a.timeout, connect=10)
    limits = httpx.Limits(max_connections=a.concurrency + 2, max_keepalive_connections=a.concurrency + 2)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as http:
        models = (await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})).json()
        model = a.model or models["data"][0]["id"]
        max_len = int(models["data"][0].get("max_model_len") or 4096)
        soak = Soak(a, model, max_len, key)
        header = (f"# soak | git {_git()} | {base} model={model} pid={pid} | concurrency={a.concurrency} "
                  f"requests<={a.requests} duration<={a.duration:g}s mix={a.mix} seed={a.seed}")  # fmt: skip
        print(header, flush=True)
        samples: list[Sample] = []
        stop = asyncio.Event()
        soak.t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample_memory(soak, pid, a.rss_every, samples, stop))
        progress = asyncio.ensure_future(_progress(soak, a))
        await asyncio.gather(*(soak.worker(http) for _ in range(a.concurrency)))
        wall = time.monotonic() - soak.t0
        stop.set()
        progress.cancel()
        await sampler
    out = report(soak, samples, wall)
    if a.json:
        Path(a.json).write_text(json.dumps({"header": header, **out}, indent=1))
    return 1 if any(not r.ok for r in soak.results) else 0


async def _progress(soak: Soak, a: argparse.Namespace) -> None:
    while True:
        await asyncio.sleep(30)
        errs = sum(not r.ok for r in soak.results)
        print(
            f"# t={time.monotonic() - soak.t0:.0f}s done={len(soak.results)} errors={errs}", file=sys.stderr, flush=True
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8000, help="the server's port on 127.0.0.1 (default 8000)")
    p.add_argument("--url", default=None, help="base URL instead of --port (a loopback address)")
    p.add_argument("--api-key-file", default=None, help="file holding the server's API key")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=400, help="at most this many requests (default 400)")
    p.add_argument("--duration", type=float, default=600, help="at most this many seconds (default 600)")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... of {', '.join(KINDS)} (default {DEFAULT_MIX})")
    p.add_argument("--timeout", type=float, default=300, help="per-request timeout, seconds")
    p.add_argument(
        "--body-limit", type=int, default=1 << 20, help="the server's body limit (oversize requests exceed it)"
    )
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid (default: who listens on the port)")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows, memory samples and errors here")
    a = p.parse_args()
    if a.concurrency < 1 or a.requests < 1 or a.duration <= 0:
        p.error("--concurrency, --requests and --duration must be positive")
    return asyncio.run(amain(a))


if __name__ == "__main__":
    raise SystemExit(main())
