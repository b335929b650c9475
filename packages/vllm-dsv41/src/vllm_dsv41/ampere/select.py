"""Which V4.1 attention a model gets: upstream's (FlashMLA + DeepGEMM, sm_90+) or the plugin's Triton path.

``Dsv41PluginConfig.attention``: "triton" and "upstream" force one; "auto" takes ours below compute capability
9.0 (where upstream's cannot run) and upstream's from Hopper on. ``triton_attention_scope`` is how the choice
reaches vLLM: upstream's decoder layers pick their attention class through
``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls``; while our model class builds its layers, that
module attribute answers ``DeepseekV41TritonAttention`` (a subclass of upstream's ``DeepseekV4Attention``), and
it is restored right after. No vLLM file is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["device_capability", "triton_attention_scope", "wants_triton"]


def wants_triton(mode: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``mode`` ("auto" | "upstream" | "triton") on a device of ``capability`` (None: no CUDA device)
    selects the plugin's Triton attention."""
    if mode == "triton":
        return True
    if mode == "upstream":
        return False
    if mode != "auto":
        raise ValueError(f"attention: expected 'auto', 'upstream' or 'triton', got {mode!r}")
    return capability is not None and tuple(capability) < (9, 0)


def device_capability() -> tuple[int, int] | None:
    """The compute capability vLLM's platform reports (None off CUDA)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else (int(cap.major), int(cap.minor))


@contextlib.contextmanager
def triton_attention_scope(enabled: bool) -> Iterator[Any]:
    """While active (and ``enabled``), upstream's V4.1 decoder layers are built with ``DeepseekV41TritonAttention``.

    Yields the attention class in use, or None when not enabled.
    """
    if not enabled:
        yield None
        return
    from vllm.models.deepseek_v41.nvidia import model as nv

    from .layer import DeepseekV41TritonAttention

    original = nv._select_dsv4_attn_cls

    def select(vllm_config: Any) -> type:
        return DeepseekV41TritonAttention

    nv._select_dsv4_attn_cls = select
    try:
        yield DeepseekV41TritonAttention
    finally:
        nv._select_dsv4_attn_cls = original
