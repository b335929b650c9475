"""expert-cache: The elastic VRAM expert cache for MoE serving: slot pool, pointer tables, policies and a trace simulator"""

from importlib.metadata import version as _version

__version__ = _version("expert-cache")
__all__ = ["__version__"]
