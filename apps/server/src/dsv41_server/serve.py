"""vLLM's OpenAI-compatible server with the vllm-dsv41 plugin, under this app's guard and lifecycle.

Processes: this one runs vLLM's API server (HTTP, tokenization, the OpenAI protocol); vLLM starts the engine
core in a child process (scheduler, model, and our expert runtimes). The vLLM arguments are built as a list and
parsed by vLLM's own parser, so every vLLM option keeps its meaning and validation. vLLM's app is composed from
its own parts (engine client, ``build_app``, ``init_app_state``) and served by uvicorn under this module's
control, which adds:

* ``Guard`` around the app (API key on every route but ``/health``, body-size limit, request checks, drain);
  the key never appears on a command line and vLLM's own key middleware is not used;
* the lifecycle: the exit status says what happened (``ExitCode``); the first SIGTERM/SIGINT stops accepting,
  lets requests in flight run for ``shutdown_grace_s``, ends the rest with an error and exits 0 (during
  start-up it stops the engine and exits 0); a second one kills the engine and exits at once; the engine
  dying ends every request with an error and exits 1;
* ``PROMETHEUS_MULTIPROC_DIR``: a fresh directory through which the engine process's ``dsv41_*`` metrics reach
  this process's ``/metrics`` (vllm_dsv41.metrics).

vLLM's environment variables are set here, by the application, before vLLM is imported; the libraries read
none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from vllm_dsv41 import CONFIG_KEY

from .config import ServerConfig, default_max_request_bytes
from .errors import ExitCode
from .packs import PackKind, kind_vllm_args, kind_vllm_env

__all__ = ["serve", "vllm_argv", "vllm_env"]

log = logging.getLogger("dsv41_server")

#: After the grace period, how long ended requests get to send their error before the HTTP server closes.
FLUSH_SECONDS = 2.0
#: How long the engine process gets to exit after SIGTERM before it is killed.
ENGINE_STOP_SECONDS = 3.0
#: The grace period for requests in flight when the engine died (they have had their error from vLLM already).
ENGINE_DEATH_GRACE_SECONDS = 5.0
#: The whole shutdown's deadline beyond the grace period: past it the process kills its children and exits.
BACKSTOP_SECONDS = 4.5
#: How often the engine's health is polled.
ENGINE_POLL_SECONDS = 0.25


def vllm_argv(cfg: ServerConfig, pack: Path, kind: PackKind) -> list[str]:
    """vLLM server arguments for serving ``pack`` of ``kind`` as ``cfg`` says (no secrets in it)."""
    return [
        "--model", str(pack),
        "--served-model-name", cfg.served_model_name or kind.served_model_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--enable-auto-tool-choice",
        "--additional-config", json.dumps({CONFIG_KEY: _jsonable(cfg.plugin_overrides)}),
        "--uvicorn-log-level", cfg.log_level,
        *kind_vllm_args(kind, cfg),
        *(["--pipeline-parallel-size", str(cfg.pipeline_parallel_size)] if cfg.pipeline_parallel_size > 1 else []),
    ]  # fmt: skip


def _jsonable(overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}


def vllm_env(cfg: ServerConfig, kind: PackKind) -> dict[str, str]:
    """Environment variables vLLM (and libraries under it) read, for this server."""
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # packs are local directories: never reach the Hub
        "TOKENIZERS_PARALLELISM": "false",
        **kind_vllm_env(kind, cfg),
    }
    if cfg.loopback:
        env["VLLM_HOST_IP"] = "127.0.0.1"
    return env


def serve(cfg: ServerConfig, pack: Path, kind: PackKind, api_key: str | None) -> int:
    """Serve until stopped; returns the exit status (``ExitCode``)."""
    for k, v in vllm_env(cfg, kind).items():
        os.environ.setdefault(k, v)
    metrics_dir = tempfile.mkdtemp(prefix="dsv41-metrics-")
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        log.warning("PROMETHEUS_MULTIPROC_DIR is set; using a fresh directory instead (%s)", metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return _Lifecycle(cfg, pack, kind, api_key, metrics_dir).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Lifecycle:
    """One run of the server: start-up, serving, and the way it ends."""

    def __init__(self, cfg: ServerConfig, pack: Path, kind: PackKind, api_key: str | None, metrics_dir: str) -> None:
        self.cfg, self.pack, self.kind, self.api_key, self.metrics_dir = cfg, pack, kind, api_key, metrics_dir
        self.signals = 0
        self.stop = asyncio.Event()
        self.serving = False

    # ------------------------------------------------------------------------------------------ signals

    def _exit_now(self, code: int, why: str, engine_grace: float = 0.0) -> None:
        """Stop every child process (the engine: SIGTERM, SIGKILL after ``engine_grace`` s) and exit now."""
        try:
            import psutil

            children = psutil.Process().children(recursive=True)
            for child in children:
                try:
                    if engine_grace > 0:
                        child.terminate()
                    else:
                        child.kill()
                except psutil.Error:
                    pass
            if engine_grace > 0:
                _, alive = psutil.wait_procs(children, timeout=engine_grace)
                for child in alive:
                    try:
                        child.kill()
                    except psutil.Error:
                        pass
        finally:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            print(f"dsv41-server: {why}; exiting now with status {code}", file=sys.stderr, flush=True)
            os._exit(code)

    def _on_startup_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Nothing is served yet, so there is nothing to drain: stop the engine's start and exit. (Raising
        # KeyboardInterrupt here, as vLLM does, is lost while vLLM waits for the engine in a ZMQ poll.)
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            self._exit_now(ExitCode.STOPPED, f"{name} during start-up", engine_grace=ENGINE_STOP_SECONDS)
        self._exit_now(128 + signum, f"second signal ({name}) during start-up")

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            self._exit_now(128 + signum, f"second signal ({name})")
        log.info("%s: stopping (grace for requests in flight: %g s; a second signal exits at once)",
                 name, self.cfg.shutdown_grace_s)  # fmt: skip
        self._arm_backstop(self.cfg.shutdown_grace_s, ExitCode.STOPPED)
        self.stop.set()

    def _arm_backstop(self, grace: float, code: int) -> None:
        deadline = grace + BACKSTOP_SECONDS
        timer = threading.Timer(
            deadline, self._exit_now, (code, f"shutdown still running {deadline:g} s after it began")
        )
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------------------------------ run

    def run(self) -> int:
        import prometheus_client.values

        if prometheus_client.values.ValueClass is prometheus_client.values.MutexValue:
            raise RuntimeError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set")
        import uvloop
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.logger import configure_logging_from_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        cli_env_setup()
        parser = make_arg_parser(FlexibleArgumentParser(prog="dsv41-server"))
        args = parser.parse_args(vllm_argv(self.cfg, self.pack, self.kind))
        args.api_key = None  # the Guard checks the key, on every route
        configure_logging_from_args(args)
        validate_parsed_serve_args(args)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_startup_signal)
        return int(uvloop.run(self._main(args)))

    async def _main(self, args: Any) -> int:
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.launcher import setup_server

        try:
            _, sock = setup_server(args, reuse_port=False)
        except Exception as e:
            log.error("cannot start the HTTP server: %s", e)
            return ExitCode.START_FAILED
        try:
            async with build_async_engine_client(args) as engine:
                try:
                    server, guard = await self._build(engine, args)
                except Exception:
                    log.exception("cannot build the API server")
                    return ExitCode.START_FAILED
                code = await self._serve(engine, server, guard, sock)
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: engine.shutdown(timeout=ENGINE_STOP_SECONDS)
                )
                return code
        except Exception as e:
            if self.serving:
                log.exception("the server failed")
                return ExitCode.ENGINE_DIED
            log.error("the engine failed to start: %s: %s", type(e).__name__, e)
            return ExitCode.START_FAILED
        finally:
            sock.close()

    async def _build(self, engine: Any, args: Any) -> tuple[Any, Any]:
        import uvicorn
        from vllm import envs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import NoSignalServer
        from vllm.entrypoints.launchers.utils.constants import (
            H11_MAX_HEADER_COUNT_DEFAULT,
            H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT,
        )
        from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

        from .guard import Guard

        supported_tasks = await engine.get_supported_tasks()
        app = build_app(args, supported_tasks, engine.model_config)
        await init_app_state(engine, app.state, args, supported_tasks)
        limit = self.cfg.max_request_bytes or default_max_request_bytes(engine.model_config.max_model_len)
        guard = Guard(app, api_key=self.api_key, max_body_bytes=limit)
        extra: dict[str, Any] = {}
        log_config = get_uvicorn_log_config(args)
        if log_config is not None:
            extra["log_config"] = log_config
        config = uvicorn.Config(
            guard,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            # uvicorn's own deadline, a backstop: the lifecycle ends late requests itself, at the grace.
            timeout_graceful_shutdown=int(self.cfg.shutdown_grace_s + FLUSH_SECONDS + 1),
            **extra,
        )
        config.h11_max_incomplete_event_size = (
            args.h11_max_incomplete_event_size or H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT
        )
        config.h11_max_header_count = args.h11_max_header_count or H11_MAX_HEADER_COUNT_DEFAULT
        config.load()
        server = NoSignalServer(config)
        app.state.server = server  # vLLM's engine-error handler stops it through this
        log.info("API key: %s; request bodies up to %d bytes; shutdown grace %g s",
                 "required on every route but /health" if self.api_key else "none (loopback)", limit,
                 self.cfg.shutdown_grace_s)  # fmt: skip
        return server, guard

    async def _serve(self, engine: Any, server: Any, guard: Any, sock: Any) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.serving = True
        server_task = asyncio.ensure_future(server.serve(sockets=[sock]))
        watch = asyncio.ensure_future(self._watch_engine(engine))
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({server_task, watch, stopped}, return_when=asyncio.FIRST_COMPLETED)

        if stopped.done():
            code, grace = ExitCode.STOPPED, self.cfg.shutdown_grace_s
            why = f"the server is shutting down and this request did not finish within the {grace:g} s grace period"
        elif watch.done():
            code, grace = ExitCode.ENGINE_DIED, min(self.cfg.shutdown_grace_s, ENGINE_DEATH_GRACE_SECONDS)
            why = "the engine process died"
            log.error("the engine process died; ending requests in flight and exiting with status %d", code)
            self._arm_backstop(grace, code)
        else:
            code = ExitCode.ENGINE_DIED if server.started else ExitCode.START_FAILED
            grace = min(self.cfg.shutdown_grace_s, ENGINE_DEATH_GRACE_SECONDS)
            why = "the HTTP server stopped"
            log.error("the HTTP server stopped on its own (engine errored: %s)", engine.errored)
            self._arm_backstop(grace, code)
        for task in (watch, stopped):
            task.cancel()

        guard.draining = True
        guard.drain_message = why if code != ExitCode.STOPPED else "the server is shutting down"
        server.should_exit = True  # uvicorn: stop accepting, close idle connections, wait for the busy ones
        if guard.in_flight:
            log.info("waiting up to %g s for %d request(s) in flight", grace, guard.in_flight)
        if not await guard.wait_idle(grace):
            n = guard.expire_all(why)
            log.warning("ended %d request(s) still in flight after %g s", n, grace)
            await guard.wait_idle(FLUSH_SECONDS)
        try:
            await asyncio.wait_for(asyncio.shield(server_task), FLUSH_SECONDS + 1)
        except asyncio.TimeoutError:
            server.force_exit = True
            await asyncio.wait({server_task}, timeout=1.0)
        return code

    @staticmethod
    async def _watch_engine(engine: Any) -> None:
        while not engine.errored:
            await asyncio.sleep(ENGINE_POLL_SECONDS)
