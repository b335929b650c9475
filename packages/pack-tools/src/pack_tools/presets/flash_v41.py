"""``flash-v41``: the two pack inputs of a DeepSeek-V4.1-Flash-shaped model with N real-size layers, for serving.

Every decoder layer has Flash's real dimensions (:data:`~pack_tools.presets.tiny_v41.FLASH`: hidden 5120, 64 heads
of 512, q/o LoRA ranks 1280/1024, 384 routed experts of intermediate 2304 at 3 bpw, top-6, a shared expert, the
hyper-connections), written with tiny-v41's generator (real tensor names and layout) and built with
``pack_tools.build_pack`` like any download. What differs from the real model, and why:

* ``layers`` decoder layers (default 4) instead of 40: each layer's routed experts are 5.1 GB (384 x 13.27 MB),
  so host RAM bounds N (the H200 host has ~125 GiB);
* the topology is tiny-v41's rule at N layers: layers 0-1 pure sliding window, then ratio-2 layers, then ratio-1
  layers (``compress_ratios``); the KV- and index-source layers are the first layer of each compressed run (a
  consumer reads the nearest source below it, which must be of its own ratio). vLLM 0.32's V4.1 needs at least
  one KV source, so N >= 3;
* one Engram layer (layer 1, Flash's first; its second is layer 14) with a reduced hashing vocabulary
  (``engram_vocab``, default 100,000: a 0.6 GB table instead of 98 GB);
* a reduced token vocabulary (``vocab``, default 8192; Flash: 129,280), so the head and embedding are smaller;
* no MTP layers (``num_nextn_predict_layers`` 0: speculative decoding is not served).

The EXL3 checkpoint is written shard by shard (``shard_bytes`` each, default 1 GiB) with a progress bar, each
shard's tensors made just before it is written, so memory stays near one shard (plus the Engram release,
made in memory: ~0.8 GB at the default ``engram_vocab``). :func:`flash_v41_plan` gives the layout without writing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pack_tools.presets.tiny_v41 import FLASH, LazyGen, TinyV41, exl3_checkpoint_tensors, plan_shards, tiny_v41_config

__all__ = ["MIN_LAYERS", "flash_v41_dims", "flash_v41_plan", "synth_flash_v41"]

#: Fewest layers vLLM's V4.1 serves with tiny-v41's topology rule (layers 0-1 uncompressed, one KV source).
MIN_LAYERS = 3


def flash_v41_dims(layers: int = 4, *, vocab: int = 8192, engram_vocab: int = 100_000,
                   base: TinyV41 = FLASH) -> TinyV41:  # fmt: skip
    """``base`` (Flash's dimensions) at ``layers`` layers with the topology, vocabularies and MTP of this preset.

    Tests pass a small ``base`` (same code, small tensors); only its layer-independent dimensions are used.
    """
    if not isinstance(layers, int) or layers < MIN_LAYERS:
        raise ValueError(f"flash-v41: layers must be an integer >= {MIN_LAYERS} (vLLM's V4.1 needs a KV-source "
                         f"layer after the two sliding-window layers), got {layers!r}")  # fmt: skip
    bare = dataclasses.replace(base, layers=layers, mtp=0, engram_layers=(), kv_source_layers=(),
                               index_source_layers=())  # fmt: skip
    ratios = tiny_v41_config(bare)["text_config"]["compress_ratios"]
    sources = tuple(i for i in range(layers) if ratios[i] and (i == 0 or ratios[i - 1] != ratios[i]))
    return dataclasses.replace(bare, vocab=vocab, engram_layers=(1,), engram_vocab=engram_vocab,
                               kv_source_layers=sources, index_source_layers=sources,
                               candidate_source_layer=-1)  # fmt: skip


def flash_v41_plan(dims: TinyV41 | None = None, shard_bytes: int = 1 << 30) -> dict[str, Any]:
    """The EXL3 checkpoint's layout without writing: shards (file, tensors with their specs, bytes), totals, and
    ``routed_bytes_per_layer`` (the routed experts' EXL3 tensors of one decoder layer)."""
    d = dims or flash_v41_dims()
    tensors, _ = exl3_checkpoint_tensors(d, LazyGen(0))
    shards = plan_shards(tensors, shard_bytes)
    routed = [sum(lz.spec.nbytes for n, lz in tensors.items() if n.startswith(f"layers.{i}.ffn.experts."))
              for i in range(d.layers)]  # fmt: skip
    return {
        "dims": d,
        "shards": shards,
        "total_bytes": sum(s["bytes"] for s in shards),
        "routed_bytes_per_layer": routed,
        "tensors": {n: lz.spec for n, lz in tensors.items()},
    }


def synth_flash_v41(out: Path, seed: int = 0, *, layers: int = 4, vocab: int = 8192, engram_vocab: int = 100_000,
                    shard_bytes: int = 1 << 30, progress: bool = False, base: TinyV41 = FLASH) -> Path:  # fmt: skip
    """Write the EXL3 checkpoint and the Engram release of a ``layers``-layer Flash-shaped model under ``out`` (the
    same two directories as tiny-v41: ``build_pack(out / EXL3.dirname, out / ENGRAM.dirname, PACK)``)."""
    from pack_tools.presets.tiny_v41 import synth_tiny_v41

    d = flash_v41_dims(layers, vocab=vocab, engram_vocab=engram_vocab, base=base)
    return synth_tiny_v41(Path(out), seed, d, shard_bytes=shard_bytes, progress=progress, preset="flash-v41")
