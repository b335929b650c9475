"""Start-up time, time to first token and decode speed of the tiny-demo server, through the OpenAI API.

``--ceiling`` measures plain vLLM instead (its own API server and CPU fused MoE, no plugin) on the demo's
weights dequantized to float32: what the same engine does without EXL3 and without the CPU expert tier.

    uv run python apps/server/benches/bench_demo_server.py [--ceiling] [--root DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
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


def dequantized_copy(pack: Path, out: Path) -> Path:
    """``pack`` as a plain Qwen3-MoE checkpoint: every EXL3 linear reconstructed to a float32 ``.weight``."""
    import numpy as np
    from cpu_tier.exl3 import Exl3Tensor
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    raw = load_file(str(pack / "model.safetensors"))
    mods = {k[: -len(".trellis")] for k in raw if k.endswith(".trellis")}
    tensors = {k: v.astype(np.float32) for k, v in raw.items() if k.rsplit(".", 1)[0] not in mods}
    for m in mods:
        tensors[m + ".weight"] = np.ascontiguousarray(Exl3Tensor.from_safetensors(raw, m).reconstruct().T)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((pack / "config.json").read_text())
    cfg.update(architectures=["Qwen3MoeForCausalLM"], torch_dtype="float32")
    cfg.pop("quantization_config")
    cfg.pop("dsv41", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(pack / f, out / f)
    return out


class PlainVllm:
    """vLLM's own OpenAI server on a plain checkpoint, with the demo's serving flags (the ceiling)."""

    def __init__(self, root: Path, model: Path) -> None:
        from dsv41_server.testing import free_port

        self.root, self.model, self.port = root, model, free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_seconds = float("nan")

    def start(self) -> PlainVllm:
        from dsv41_server.testing import isolated_env

        env = isolated_env(self.root)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny-demo", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4", "--enforce-eager"]  # fmt: skip
        t0 = time.monotonic()
        with (self.root / "plain-vllm.log").open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plain vLLM exited with {self.proc.returncode}; see {self.root / 'plain-vllm.log'}")
            try:
                urllib.request.urlopen(self.base_url + "/health", timeout=5).close()
                break
            except OSError:
                time.sleep(1.0)
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        self.proc.send_signal(2)
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, help="working directory (default: a new temporary one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    ap.add_argument("--ceiling", action="store_true", help="plain vLLM on the dequantized demo instead")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dsv41_server.packs import ensure_demo_pack
    from dsv41_server.testing import DemoServer
    from openai import OpenAI

    root = a.root or Path(tempfile.mkdtemp(prefix="dsv41-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    server: DemoServer | PlainVllm
    if a.ceiling:
        plain = dequantized_copy(ensure_demo_pack(root / "tiny-demo"), root / "tiny-demo-dequantized")
        server = PlainVllm(root, plain).start()
    else:
        server = DemoServer(root, extra_args=tuple(a.server_arg)).start()
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
    what = "plain vLLM, dequantized (ceiling)" if a.ceiling else f"dsv41-server {a.server_arg}"
    print(f"# dsv41-server bench_demo_server | {what} | tokens={a.tokens} iters={a.iters} | root {root}")
    for k, v in rows.items():
        print(f"{k:<28}{v:>12.2f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
