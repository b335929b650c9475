"""vllm-dsv41: vLLM plugin: EXL3 routed experts in host memory computed by cpu-tier (and, later, the GPU tiers)"""

from importlib.metadata import version as _version

__version__ = _version("vllm-dsv41")
__all__ = ["__version__"]
