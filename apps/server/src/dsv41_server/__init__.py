"""dsv41-server: The OpenAI-compatible server for DeepSeek-V4.1 packs (and the tiny demo pack)"""

from importlib.metadata import version as _version

__version__ = _version("dsv41-server")
__all__ = ["__version__"]
