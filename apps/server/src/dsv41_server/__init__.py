"""dsv41-server: the OpenAI-compatible server for DeepSeek-V4.1 EXL3 packs and the tiny demo pack.

Run it with ``uv run apps/server`` (the tiny demo on CPU) or ``uv run apps/server --pack DIR``.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from .cli import main
from .config import ServerConfig
from .errors import ServerError

__version__ = _version("dsv41-server")
__all__ = ["ServerConfig", "ServerError", "__version__", "main"]
