"""Serve a V4.1 pack with apps/server on the GPU and drive it with the real ``openai`` client (device machine).

    python3 packages/vllm-dsv41/scripts/gpu_serve_check.py PACK OUT

Checks: models, chat, streaming chat (equal to non-streaming under greedy decoding), a named tool call
(``tool_choice`` forces the tool: the random-weight model could not choose one), reasoning on and off, a 4xx for
a bad request after which the server keeps serving. Prints one line per check; exit 1 if any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def main() -> int:
    pack, out = Path(sys.argv[1]), Path(sys.argv[2])
    port = 8011
    key = "dsv41-device-check-key"
    keyfile = out / "key.txt"
    keyfile.write_text(key)
    os.chmod(keyfile, 0o600)
    log = open(out / "server.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "dsv41_server",
        "--pack",
        str(pack),
        "--port",
        str(port),
        "--api-key-file",
        str(keyfile),
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.17",
        "--cpu-threads",
        "8",
    ]
    t0 = time.time()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    fails = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal fails
        fails += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    try:
        while True:
            if server.poll() is not None:
                print(open(out / "server.log").read()[-4000:])
                check("server start", False, f"exited {server.returncode}")
                return 1
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 420:
                check("server start", False, "no /health in 420 s")
                return 1
            time.sleep(2)
        check("server start", True, f"{time.time() - t0:.0f} s")
        from openai import BadRequestError, OpenAI

        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        check("models", model == "deepseek-v4.1-flash", model)
        msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
        r = c.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=24,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        text = r.choices[0].message.content or ""
        check("chat", r.usage.completion_tokens > 0, repr(text[:60]))
        chunks = c.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        streamed = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        check("streaming equals non-streaming", streamed == text, repr(streamed[:60]))
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}}]  # fmt: skip
        named = {"type": "function", "function": {"name": "get_weather"}}
        # thinking off, as the checks above: V4.1's parser takes thinking as on when the request does not say, and
        # vLLM applies the forced call's grammar (an xgrammar structural tag for the DSML call) only once the
        # reasoning has ended, which a random-weight model never does (run 2: "none" without this)
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=tools, tool_choice=named, max_tokens=64, temperature=0,
                                      extra_body={"chat_template_kwargs": {"thinking": False}})  # fmt: skip
        calls = r.choices[0].message.tool_calls or []
        check(
            "named tool call",
            len(calls) == 1 and calls[0].function.name == "get_weather",
            calls[0].function.arguments[:60]
            if calls
            else f"none (finish {r.choices[0].finish_reason}, content {str(r.choices[0].message.content)[:80]!r}, "
            f"reasoning {str(getattr(r.choices[0].message, 'reasoning_content', None))[:60]!r})",
        )
        for thinking in (True, False):
            r = c.chat.completions.create(
                model=model,
                messages=msgs,
                max_tokens=32,
                temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": thinking}},
            )
            m = r.choices[0].message
            reasoning = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
            check(
                f"reasoning {'on' if thinking else 'off'}",
                r.usage.completion_tokens > 0,
                f"reasoning={str(reasoning)[:40]!r} content={str(m.content)[:40]!r}",
            )
        try:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=-5)
            check("4xx for a bad request", False, "accepted max_tokens=-5")
        except BadRequestError as e:
            check("4xx for a bad request", e.status_code == 400, str(e)[:80])
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4)
        check("serves after the 4xx", r.usage.completion_tokens > 0)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    print(f"{fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
