"""pack-tools: Download, build, verify, inspect and synthesize DeepSeek-V4.1 EXL3 model packs"""

from importlib.metadata import version as _version

__version__ = _version("pack-tools")
__all__ = ["__version__"]
