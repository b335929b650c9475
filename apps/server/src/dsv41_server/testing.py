"""A tiny-demo server in a subprocess, for the test suites of this workspace.

Starting vLLM costs a minute or more on a small machine, so a test session starts one server and every suite
that needs it shares it (``shared_demo_server``). Everything the server and vLLM write (the pack, vLLM's
caches, temporary files) goes under one directory the caller owns.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = [
    "TEST_API_KEY",
    "TEST_SERVER_ARGS",
    "DemoServer",
    "free_port",
    "release_shared_demo_server",
    "shared_demo_server",
]

#: The API key the shared test server requires (it binds loopback, where a key is optional: this exercises it).
TEST_API_KEY = "dsv41-test-key-3f1c9a"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def isolated_env(root: Path) -> dict[str, str]:
    """This process's environment with every cache and temporary directory moved under ``root``."""
    env = dict(os.environ)
    for var, sub in (
        ("VLLM_CACHE_ROOT", "cache/vllm"),
        ("HF_HOME", "cache/hf"),
        ("XDG_CACHE_HOME", "cache/xdg"),
        ("TORCHINDUCTOR_CACHE_DIR", "cache/inductor"),
        ("TRITON_CACHE_DIR", "cache/triton"),
        ("TMPDIR", "tmp"),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(root / sub)
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    return env


class DemoServer:
    """``python -m dsv41_server`` serving the tiny-demo pack on a free loopback port.

    Parameters
    ----------
    root : directory for the pack (``root/tiny-demo``), the API key file, caches, temp files and the log.
    api_key : when given, the server is started with ``--api-key-file`` holding it.
    extra_args : further server flags.
    """

    def __init__(self, root: Path, api_key: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.api_key = api_key
        self.extra_args = extra_args
        self.port = free_port()
        self.pack_dir = self.root / "tiny-demo"
        self.log_path = self.root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = float("nan")
        self._t0 = float("nan")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "dsv41_server", "--demo-dir", str(self.pack_dir), "--port", str(self.port)]
        if self.api_key is not None:
            key_file = self.root / "api-key"
            key_file.write_text(self.api_key + "\n")
            key_file.chmod(0o600)
            cmd += ["--api-key-file", str(key_file)]
        return cmd + list(self.extra_args)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start_async(self) -> DemoServer:
        """Start the server process and return at once."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = isolated_env(self.root)
        self._t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def start(self, timeout: float = 900.0) -> DemoServer:
        """Start the server and wait until ``/health`` answers; raise with the log tail if it does not."""
        self.start_async()
        assert self.proc is not None
        t0 = self._t0
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the demo server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_seconds = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the demo server was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def engine_pids(self) -> list[int]:
        """The engine-core processes vLLM started under the server (``VLLM::EngineCore``)."""
        import psutil

        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for c in children:
            try:
                if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()):
                    out.append(c.pid)
            except psutil.Error:
                pass
        return out

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status, once the server has exited within ``timeout`` seconds; ``None`` if it has not."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT (vLLM's clean shutdown), then SIGKILL of the process group if it lingers."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


_shared: DemoServer | None = None
_users = 0


#: Plugin flags of the shared test server (checked end to end: they must reach the engine's expert runtime).
TEST_SERVER_ARGS = ("--cpu-threads", "1")


def shared_demo_server(root: Path, api_key: str | None = TEST_API_KEY) -> DemoServer:
    """The one demo server of this process, started on first use under ``root`` (later ``root``s are ignored).

    Pair every call with ``release_shared_demo_server``; the server stops when the last user releases it.
    """
    global _shared, _users
    if _shared is None:
        _shared = DemoServer(root, api_key=api_key, extra_args=TEST_SERVER_ARGS).start()
    _users += 1
    return _shared


def release_shared_demo_server() -> None:
    global _shared, _users
    _users -= 1
    if _users <= 0 and _shared is not None:
        _shared.stop()
        _shared = None
        _users = 0
