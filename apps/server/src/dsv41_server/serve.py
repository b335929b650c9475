"""vLLM's OpenAI-compatible server, run in this process with the vllm-dsv41 plugin.

The arguments are built as a list and parsed by vLLM's own parser (so every vLLM option keeps its meaning and
validation); the API key is put on the parsed arguments afterwards, so it never appears on any command line.
vLLM's environment variables are set here, by the application, before vLLM is imported; the libraries read
none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_dsv41 import CONFIG_KEY

from .config import ServerConfig
from .packs import PackKind

__all__ = ["serve", "vllm_argv", "vllm_env"]


def vllm_argv(cfg: ServerConfig, pack: Path, kind: PackKind) -> list[str]:
    """vLLM server arguments for serving ``pack`` of ``kind`` as ``cfg`` says (no secrets in it)."""
    argv = [
        "--model", str(pack),
        "--served-model-name", cfg.served_model_name or kind.served_model_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--dtype", kind.dtype,
        "--max-model-len", str(cfg.max_model_len or kind.max_model_len),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--enable-auto-tool-choice",
        "--tool-call-parser", kind.tool_call_parser,
        "--reasoning-parser", kind.reasoning_parser,
        "--additional-config", json.dumps({CONFIG_KEY: _jsonable(cfg.plugin_overrides)}),
        "--uvicorn-log-level", cfg.log_level,
        *kind.extra_vllm_args,
    ]  # fmt: skip
    if kind.device == "cuda":
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    return argv


def _jsonable(overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}


def vllm_env(cfg: ServerConfig, kind: PackKind) -> dict[str, str]:
    """Environment variables vLLM (and libraries under it) read, for this server."""
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # packs are local directories: never reach the Hub
        "TOKENIZERS_PARALLELISM": "false",
    }
    if kind.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        # One process: the engine core runs inside the API server (faster start, a third of the memory).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.loopback:
        env["VLLM_HOST_IP"] = "127.0.0.1"
    return env


def serve(cfg: ServerConfig, pack: Path, kind: PackKind, api_key: str | None) -> None:
    """Serve until interrupted (SIGINT/SIGTERM)."""
    for k, v in vllm_env(cfg, kind).items():
        os.environ.setdefault(k, v)

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="dsv41-server"))
    args = parser.parse_args(vllm_argv(cfg, pack, kind))
    args.api_key = [api_key] if api_key else None
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))
