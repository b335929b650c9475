"""The same soak on dsv41-server and on plain vLLM serving the same model shape: whose memory grows?

    uv run python apps/server/benches/soak_compare.py [--minutes 20] [--concurrency 4] [--which both|ours|plain]

Ours: the tiny-demo pack (EXL3 experts in host memory, computed by cpu-tier through the plugin). Plain vLLM:
the same weights dequantized to float32 as a Qwen3-MoE checkpoint, served by vLLM's own API server and CPU
fused MoE with the same vLLM flags (parsers, context, sequences, KV cache, eager). Each server gets the same
bounded soak (soak.py, same seed, no API key) and its memory is sampled by soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import soak  # noqa: E402
from bench_demo_server import dequantized_copy  # noqa: E402


def _plain_vllm(root: Path, model: Path, port: int) -> subprocess.Popen[bytes]:
    """Plain vLLM with the demo's flags from the server's own per-kind argument builder, minus the plugin."""
    from dsv41_server import ServerConfig
    from dsv41_server.packs import DEMO
    from dsv41_server.serve import vllm_argv, vllm_env
    from dsv41_server.testing import isolated_env

    cfg = ServerConfig(port=port)
    argv = vllm_argv(cfg, model, DEMO)
    i = argv.index("--additional-config")
    del argv[i : i + 2]
    env = {**isolated_env(root), **vllm_env(cfg, DEMO)}
    log = (root / "plain-vllm.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip


def _wait_healthy(base: str, proc: subprocess.Popen[bytes]) -> float:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(base + "/health", timeout=5).close()
            return time.monotonic() - t0
        except OSError:
            time.sleep(1.0)


def _soak(port: int, pid: int, a: argparse.Namespace, json_path: Path) -> None:
    args = argparse.Namespace(
        port=port, url=None, api_key_file=None, model=None, concurrency=a.concurrency, requests=10**9,
        duration=a.minutes * 60, mix=soak.DEFAULT_MIX, timeout=300, body_limit=1 << 20, server_pid=pid,
        rss_every=a.rss_every, seed=0, json=str(json_path),
    )  # fmt: skip
    asyncio.run(soak.amain(args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rss-every", type=float, default=30)
    p.add_argument("--which", choices=("both", "ours", "plain"), default="both")
    p.add_argument("--root", type=Path, default=None)
    a = p.parse_args()

    from dsv41_server.packs import ensure_demo_pack
    from dsv41_server.testing import DemoServer, free_port

    root = a.root or Path(tempfile.mkdtemp(prefix="dsv41-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    pack = ensure_demo_pack(root / "ours" / "tiny-demo")
    if a.which in ("both", "ours"):
        server = DemoServer(root / "ours").start()
        assert server.proc is not None
        print(f"# ours: dsv41-server, started in {server.startup_seconds:.0f} s", flush=True)
        try:
            _soak(server.port, server.proc.pid, a, root / "ours.json")
        finally:
            server.stop()
    if a.which in ("both", "plain"):
        plain_root = root / "plain"
        plain_root.mkdir(exist_ok=True)
        model = dequantized_copy(pack, plain_root / "tiny-demo-dequantized")
        port = free_port()
        proc = _plain_vllm(plain_root, model, port)
        try:
            started = _wait_healthy(f"http://127.0.0.1:{port}", proc)
            print(f"# plain vLLM (dequantized, same flags), started in {started:.0f} s", flush=True)
            _soak(port, proc.pid, a, root / "plain.json")
        finally:
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"# results: {root}")


if __name__ == "__main__":
    main()
