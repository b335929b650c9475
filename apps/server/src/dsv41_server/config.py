"""``ServerConfig``: everything the server was asked to do, validated once (built from the command line)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vllm_dsv41 import Dsv41PluginConfig

__all__ = ["MIN_API_KEY_CHARS", "ServerConfig", "default_demo_dir", "default_max_request_bytes", "is_loopback"]

#: The shortest API key accepted for a server reachable from other machines (loopback binds accept any key).
MIN_API_KEY_CHARS = 16


def default_demo_dir() -> Path:
    """``$XDG_CACHE_HOME/dsv41/tiny-demo`` (``~/.cache/dsv41/tiny-demo`` without XDG)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsv41" / "tiny-demo"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves beyond loopback


def default_max_request_bytes(max_model_len: int) -> int:
    """The default request-body limit: 32 bytes per context token (a full-context prompt fits even as escaped
    JSON, about 4 characters a token written as 6-byte escapes), at least 1 MiB."""
    return max(1 << 20, 32 * max_model_len)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """The server's settings.

    Attributes
    ----------
    pack : the pack directory to serve; ``None`` serves the tiny-demo pack from ``demo_dir``.
    demo_dir : where the tiny-demo pack is built or reused.
    host, port : where to listen.
    api_key_file : a file holding the API key clients must send; required when ``host`` is not loopback.
    served_model_name : the model id clients use (default: the pack kind's name).
    max_model_len : context length (default: the pack kind's).
    max_num_seqs : concurrent sequences.
    prefill_chunk_tokens : vLLM's ``max_num_batched_tokens`` (the prefill chunk); None: vLLM's default on CPU packs,
        ``vllm_dsv41.config.DEFAULT_PREFILL_CHUNK_TOKENS`` on GPU packs.
    kv_cache_gib : KV-cache size on CPU, in GiB.
    gpu_memory_utilization : fraction of VRAM vLLM may use (GPU packs).
    plugin_overrides : vllm-dsv41 plugin settings (``Dsv41PluginConfig`` fields) that override the pack's.
    log_level : uvicorn's log level.
    max_request_bytes : the largest request body accepted (413 beyond); ``None``: ``default_max_request_bytes``
        of the context length.
    shutdown_grace_s : on SIGTERM/SIGINT, how long requests in flight may still run before they are ended
        with an error.
    pipeline_parallel_size : vLLM pipeline stages, one GPU each (GPU packs; the plugin's ``pp_cpus`` splits the
        CPU tier's cores between them).
    """

    pack: Path | None = None
    demo_dir: Path = dataclasses.field(default_factory=default_demo_dir)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 4
    prefill_chunk_tokens: int | None = None
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.90
    plugin_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    log_level: str = "info"
    max_request_bytes: int | None = None
    shutdown_grace_s: float = 30.0
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"max_model_len: expected at least 16, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected at least 1, got {self.max_num_seqs}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 16:
            raise ValueError(f"prefill_chunk_tokens: expected at least 16, got {self.prefill_chunk_tokens}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib: expected at least 1 (GiB), got {self.kv_cache_gib}")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: expected 0.05..1.0, got {self.gpu_memory_utilization}")
        Dsv41PluginConfig.from_mapping(self.plugin_overrides, "plugin settings")  # validates names and values
        object.__setattr__(self, "plugin_overrides", MappingProxyType(dict(self.plugin_overrides)))
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level: unknown level {self.log_level!r}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: expected at least 1024, got {self.max_request_bytes}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ValueError(f"shutdown_grace_s: expected 0..3600 seconds, got {self.shutdown_grace_s}")
        if not 1 <= self.pipeline_parallel_size <= 64:
            raise ValueError(f"pipeline_parallel_size: expected 1..64 stages, got {self.pipeline_parallel_size}")

    @property
    def demo(self) -> bool:
        return self.pack is None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)
