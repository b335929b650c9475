"""Synthetic pack presets.

Each preset lives in its own module and is imported lazily by :func:`synth` (and the CLI), so that importing
``pack_tools.presets`` stays cheap and never pulls in a preset that is not installed yet:

* ``pack_tools.presets.tiny_v41``: the real DeepSeek-V4.1-Flash tensor names and layout at tiny sizes
  (the two build inputs);
* ``pack_tools.presets.flash_layer``: one Flash-shaped MoE layer (384 experts, H=5120, I=2304, mul1 K=3);
* ``pack_tools.presets.flash_v41``: a servable V4.1 model of N real-size Flash layers (tiny-v41's generator,
  written shard by shard);
* ``pack_tools.presets.tiny_demo``: a small vLLM-CPU-runnable demo pack (``synth_tiny_demo``),
  maintained by the vLLM-plugin/server side.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pack_tools.errors import PackError

#: Preset name -> (module, function). Every function is ``fn(out: Path, seed: int = 0, **options) -> Path``.
PRESETS: dict[str, tuple[str, str]] = {
    "tiny-v41": ("pack_tools.presets.tiny_v41", "synth_tiny_v41"),
    "flash-layer": ("pack_tools.presets.flash_layer", "synth_flash_layer"),
    "flash-v41": ("pack_tools.presets.flash_v41", "synth_flash_v41"),
    "tiny-demo": ("pack_tools.presets.tiny_demo", "synth_tiny_demo"),
}

__all__ = ["PRESETS", "synth"]


def synth(preset: str, out: str | Path, seed: int = 0, **options: Any) -> Path:
    """Write preset ``preset`` to ``out``, deterministically by ``seed``; returns the written path.

    Raises
    ------
    PackError for an unknown preset, or one whose module is not installed.
    """
    if preset not in PRESETS:
        raise PackError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    module_name, func = PRESETS[preset]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise PackError(
            f"preset {preset!r} is not available: module {module_name} is not installed "
            "(the tiny-demo preset is provided by the vLLM-plugin/server side)"
        ) from None
    fn = getattr(module, func, None)
    if fn is None:
        raise PackError(f"preset {preset!r}: {module_name} has no function {func}")
    return Path(fn(Path(out), seed=seed, **options))
