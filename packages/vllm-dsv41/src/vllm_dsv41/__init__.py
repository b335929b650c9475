"""vllm-dsv41: a vLLM plugin that serves EXL3 MoE packs with the routed experts in host memory.

The plugin is loaded by vLLM through the ``vllm.general_plugins`` entry point (``vllm_dsv41.plugin:register``).
What the library exposes directly is its configuration and the numpy references it is tested against.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from .config import CONFIG_KEY, Dsv41PluginConfig, vllm_env_for_pack
from .plugin import ARCHITECTURES, register

__version__ = _version("vllm-dsv41")
__all__ = ["ARCHITECTURES", "CONFIG_KEY", "Dsv41PluginConfig", "__version__", "register", "vllm_env_for_pack"]
