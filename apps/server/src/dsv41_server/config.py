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

__all__ = ["ServerConfig", "default_demo_dir", "is_loopback"]


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
    kv_cache_gib : KV-cache size on CPU, in GiB.
    gpu_memory_utilization : fraction of VRAM vLLM may use (GPU packs).
    plugin_overrides : vllm-dsv41 plugin settings (``Dsv41PluginConfig`` fields) that override the pack's.
    log_level : uvicorn's log level.
    """

    pack: Path | None = None
    demo_dir: Path = dataclasses.field(default_factory=default_demo_dir)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 4
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.90
    plugin_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"max_model_len: expected at least 16, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected at least 1, got {self.max_num_seqs}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib: expected at least 1 (GiB), got {self.kv_cache_gib}")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: expected 0.05..1.0, got {self.gpu_memory_utilization}")
        Dsv41PluginConfig.from_mapping(self.plugin_overrides, "plugin settings")  # validates names and values
        object.__setattr__(self, "plugin_overrides", MappingProxyType(dict(self.plugin_overrides)))
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level: unknown level {self.log_level!r}")

    @property
    def demo(self) -> bool:
        return self.pack is None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)
