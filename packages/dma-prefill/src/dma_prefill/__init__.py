"""dma-prefill: Host expert store and staged copy-engine streaming of MoE experts for prefill"""

from importlib.metadata import version as _version

__version__ = _version("dma-prefill")
__all__ = ["__version__"]
