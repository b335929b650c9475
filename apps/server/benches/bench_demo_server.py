"""Start-up time, time to first token and decode speed of the tiny-demo server, through the OpenAI API.

The ceiling, measured in the same run, is the same request against the same engine with ``max_tokens=1``
(prefill + one sampled token: the fixed per-request cost) and the server's own ``/health`` round trip.

    uv run python apps/server/benches/bench_demo_server.py [--root DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _stream(client: Any, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, total time, generated tokens) of one greedy streaming chat request."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in client.chat.completions.create(
        model="tiny-demo",
        messages=[{"role": "user", "content": "Tell me about the weather in Paris and Tokyo."}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return first or float("nan"), time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, help="working directory (default: a new temporary one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dsv41_server.testing import DemoServer
    from openai import OpenAI

    root = a.root or Path(tempfile.mkdtemp(prefix="dsv41-bench-"))
    server = DemoServer(root).start()
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)
        _stream(client, 4)  # warm-up
        health = []
        for _ in range(20):
            t0 = time.perf_counter()
            urllib.request.urlopen(server.base_url + "/health", timeout=10).close()
            health.append(time.perf_counter() - t0)
        one = [_stream(client, 1)[1] for _ in range(a.iters)]
        runs = [_stream(client, a.tokens) for _ in range(a.iters)]
        with ThreadPoolExecutor(a.concurrency) as pool:
            t0 = time.perf_counter()
            par = list(pool.map(lambda _: _stream(client, a.tokens), range(a.concurrency)))
            wall = time.perf_counter() - t0
        client.close()
    finally:
        server.stop()

    ttft = statistics.median(r[0] for r in runs)
    decode = statistics.median((r[2] - 1) / (r[1] - r[0]) for r in runs)
    rows = {
        "startup_s": server.startup_seconds,
        "health_ms": 1e3 * statistics.median(health),
        "one_token_request_ms": 1e3 * statistics.median(one),
        "ttft_ms": 1e3 * ttft,
        "decode_tok_s": decode,
        f"aggregate_tok_s_x{a.concurrency}": sum(r[2] for r in par) / wall,
    }
    print(f"# dsv41-server bench_demo_server | tokens={a.tokens} iters={a.iters} | root {root}")
    for k, v in rows.items():
        print(f"{k:<28}{v:>12.2f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
