"""How the server ends: its exit status, SIGTERM with streams in flight, a second signal, the engine dying,
a failed start. Each test runs a demo server of its own (they end it), with the real ``openai`` client."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from dsv41_server.errors import ExitCode
from dsv41_server.testing import TEST_API_KEY, TEST_SERVER_ARGS, DemoServer

pytestmark = pytest.mark.slow

#: Long enough to outlast a few seconds of grace on any machine that runs this suite (the context is 2048).
LONG = 2000


class Streams:
    """``n`` greedy streaming chats in threads; each records how it ended and when."""

    def __init__(self, server: DemoServer, n: int) -> None:
        self.outcomes: list[tuple[str, float, str]] = []
        self._lock = threading.Lock()
        self._first_token = threading.Barrier(n + 1, timeout=600)
        self._threads = [threading.Thread(target=self._run, args=(server,), daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()
        self._first_token.wait()  # every stream is producing tokens

    def _run(self, server: DemoServer) -> None:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=600)
        outcome, detail, waited = "end", "", False
        try:
            for chunk in client.chat.completions.create(
                model="tiny-demo", messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=LONG, temperature=0.0, stream=True, extra_body={"ignore_eos": True},
            ):  # fmt: skip
                if not waited and chunk.choices and chunk.choices[0].delta.content:
                    waited = True
                    self._first_token.wait()
        except openai.APIError as e:  # the error event the server sends into the stream
            outcome, detail = "error", str(e)
        except Exception as e:  # a broken connection
            outcome, detail = "broken", repr(e)
        finally:
            client.close()
            if not waited:
                self._first_token.abort()  # it failed before its first token: the test fails now, not at the timeout
        with self._lock:
            self.outcomes.append((outcome, time.monotonic(), detail))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _server(tmp_path: Path, *args: str) -> DemoServer:
    return DemoServer(tmp_path, api_key=TEST_API_KEY, extra_args=(*TEST_SERVER_ARGS, *args)).start()


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_sigterm_with_streams_in_flight_ends_each_within_the_grace(tmp_path: Path) -> None:
    grace = 3.0
    server = _server(tmp_path, "--shutdown-grace", str(grace))
    try:
        engines = server.engine_pids()
        assert len(engines) == 1
        streams = Streams(server, 3)
        t0 = time.monotonic()
        server.signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no longer accepting
            httpx.get(server.base_url + "/health", timeout=5).raise_for_status()
        streams.join(grace + 5)
        assert len(streams.outcomes) == 3, server.log_tail()
        for outcome, at, detail in streams.outcomes:
            assert outcome in ("end", "error"), (outcome, detail)
            assert at - t0 <= grace + 1.0, (at - t0, outcome, detail)
            if outcome == "error":
                assert f"did not finish within the {grace:g} s grace period" in detail
        status = server.wait_exit(max(0.0, t0 + grace + 5 - time.monotonic()))
        assert status == ExitCode.STOPPED, (status, server.log_tail())
        assert _gone(engines)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "exiting with status 0 (STOPPED)" in log


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    server = _server(tmp_path)  # the default grace: 30 s
    try:
        engines = server.engine_pids()
        streams = Streams(server, 2)
        server.signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.alive()  # draining: the streams may run 30 s more
        t0 = time.monotonic()
        server.signal(signal.SIGINT)
        status = server.wait_exit(5)
        assert status == 128 + signal.SIGINT, (status, server.log_tail())
        assert time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5
        while not _gone(engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(engines)  # the engine was killed with the server, not orphaned
        streams.join(30)
        assert len(streams.outcomes) == 2 and all(o in ("error", "broken") for o, _, _ in streams.outcomes)
    finally:
        server.stop()


def test_engine_killed_means_errors_for_the_clients_and_a_nonzero_exit(tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        (engine,) = server.engine_pids()
        streams = Streams(server, 2)
        t0 = time.monotonic()
        psutil.Process(engine).kill()
        streams.join(30)
        assert len(streams.outcomes) == 2
        assert all(o in ("error", "broken") for o, _, _ in streams.outcomes), streams.outcomes
        status = server.wait_exit(30)
        assert status == ExitCode.ENGINE_DIED, (status, server.log_tail())
        assert time.monotonic() - t0 < 30
    finally:
        server.stop()
    assert "the engine process died" in server.log_path.read_text(errors="replace")


def test_failed_start_exits_nonzero(tmp_path: Path) -> None:
    server = DemoServer(tmp_path, extra_args=("--max-model-len", "4096"))  # the demo's positions end at 2048
    with pytest.raises(RuntimeError, match=f"exited with {int(ExitCode.START_FAILED)}"):
        server.start()
    assert "the engine failed to start" in server.log_path.read_text(errors="replace")


def test_sigterm_during_start_up_stops_cleanly(tmp_path: Path) -> None:
    server = DemoServer(tmp_path, extra_args=TEST_SERVER_ARGS)
    server.start_async()
    try:
        deadline = time.monotonic() + 600
        while not server.engine_pids():  # the engine process is starting
            assert server.alive() and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        engines = server.engine_pids()
        server.signal(signal.SIGTERM)
        status = server.wait_exit(30)
        assert status == ExitCode.STOPPED, (status, server.log_tail())
        deadline = time.monotonic() + 10
        while not _gone(engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(engines), server.log_tail()
    finally:
        server.stop()
