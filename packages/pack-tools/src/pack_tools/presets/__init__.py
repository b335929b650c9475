"""Synthetic pack presets.

Each preset lives in its own module and is imported lazily by the CLI, so that importing
``pack_tools.presets`` stays cheap and never pulls in a preset that is not installed yet:

* ``pack_tools.presets.tiny_v41``: the real DeepSeek-V4.1-Flash tensor names and layout at tiny sizes.
* ``pack_tools.presets.flash_layer``: one Flash-shaped MoE layer (384 experts, H=5120, I=2304).
* ``pack_tools.presets.tiny_demo``: a small vLLM-CPU-runnable demo pack (``synth_tiny_demo``),
  maintained by the vLLM-plugin/server side.
"""

from __future__ import annotations

#: Preset name -> (module, function). The function signature is ``fn(out: Path, seed: int = 0) -> Path``.
PRESETS: dict[str, tuple[str, str]] = {
    "tiny-v41": ("pack_tools.presets.tiny_v41", "synth_tiny_v41"),
    "flash-layer": ("pack_tools.presets.flash_layer", "synth_flash_layer"),
    "tiny-demo": ("pack_tools.presets.tiny_demo", "synth_tiny_demo"),
}

__all__ = ["PRESETS"]
