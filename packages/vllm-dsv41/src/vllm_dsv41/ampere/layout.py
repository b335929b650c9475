"""KV-cache bytes of DeepSeek-V4.1 attention, the Ampere path's bf16 rows against upstream's packed FP8 records.

V4.1 keeps three kinds of attention state (vLLM 0.32 ``models/deepseek_v41/attention.py``):

* the sliding-window cache: every layer, the last ``sliding_window`` tokens of a request, one row per token;
* the compressed KV cache: only ``kv_source_layer_ids`` own one (the other layers read their source's), one row per
  ``compress_ratio`` tokens of context, for the whole context;
* the indexer key cache: owned by the kv-source layers that are also index sources, one key per compressed entry.

Row sizes (``RECORD_BYTES``): upstream stores the FP8 ``fp8_ds_mla`` record (448 e4m3 NoPE values + 64 bf16 RoPE
values + 8 UE8M0 scale bytes = 584 B on sm_90; 512 MXFP8 bytes + 16 scales = 528 B on sm_100) and FP8 index keys
(128 e4m3 + one fp32 scale = 132 B). Triton cannot write e4m3 below sm_89, so the Ampere path stores plain bf16
rows: ``head_dim * 2`` = 1024 B and ``index_head_dim * 2`` = 256 B, whichever ``kv_rounding`` (``fp8.py``: with
"fp8" the rows hold upstream's FP8-rounded values, in bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["LAYOUTS", "RECORD_BYTES", "KvBytes", "kv_bytes"]

#: (swa row, compressed row, index key) bytes per layout; ``None`` means "derived from the config" (bf16 rows).
RECORD_BYTES: dict[str, tuple[int | None, int | None, int | None]] = {
    "ampere-bf16": (None, None, None),
    "fp8_ds_mla-sm90": (584, 584, 132),  # upstream on Hopper (attention.py: swa_bytes_per_token, indexer head_dim)
    "fp8_ds_mla-sm100": (528, 528, 132),  # upstream's V4.1 MXFP8 record (Blackwell)
}
LAYOUTS = tuple(RECORD_BYTES)


@dataclasses.dataclass(frozen=True)
class KvBytes:
    """Bytes of one request's attention state: ``per_token`` grows with the context, ``fixed`` does not."""

    layout: str
    per_token: float  # compressed rows + index keys, averaged over the context
    swa_per_request: int  # the sliding windows of every layer
    compressed_entries_per_token: float
    index_entries_per_token: float

    def at(self, context: int) -> int:
        """Total bytes of one request of ``context`` tokens (rows only; vLLM's page rounding adds < 0.5 %)."""
        return round(self.per_token * context) + self.swa_per_request


def kv_bytes(config: Mapping[str, Any], layout: str = "ampere-bf16") -> KvBytes:
    """Attention-state bytes of a V4.1 text config (``text_config`` of the nested ``config.json``) in ``layout``."""
    if layout not in RECORD_BYTES:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    cfg = config.get("text_config", config)
    try:
        layers = int(cfg["num_hidden_layers"])
        head_dim, index_dim = int(cfg["head_dim"]), int(cfg["index_head_dim"])
        window = int(cfg["sliding_window"])
        ratios = [int(r) for r in cfg["compress_ratios"]]
        kv_src = [int(i) for i in cfg["kv_source_layer_ids"]]
        idx_src = {int(i) for i in cfg["index_source_layer_ids"]}
    except KeyError as e:
        raise ValueError(f"config: missing field {e.args[0]!r} of a DeepSeek-V4.1 text config") from None
    swa_b, comp_b, index_b = RECORD_BYTES[layout]
    swa_b = 2 * head_dim if swa_b is None else swa_b
    comp_b = 2 * head_dim if comp_b is None else comp_b
    index_b = 2 * index_dim if index_b is None else index_b
    comp = sum(1 / ratios[i] for i in kv_src if i < layers and ratios[i] > 0)
    index = sum(1 / ratios[i] for i in kv_src if i < layers and ratios[i] > 0 and i in idx_src)
    return KvBytes(layout, comp * comp_b + index * index_b, layers * window * swa_b, comp, index)
