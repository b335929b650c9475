"""DeepSeek-V4.1-Flash naming rules: native tensor names, EXL3 modules, the serving-side module names.

The EXL3 checkpoint keeps DeepSeek's native namespace (``layers.N.ffn.experts.E.w1.trellis``,
``layers.N.attn.wo_a.slice.G.trellis``, ``mtp.S.*``, ``head.*``, ``embed.weight``); the Engram release keeps
``layers.N.engram.embed.{weight,scale}``. The serving side (a vLLM model) names modules
``model.layers.N.*`` / ``lm_head`` and fuses some projections; :func:`serving_module_name` is that map
(reference-system.md section 8, step 2).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from engram_mmap.config import next_prime
from pack_tools.errors import PackError

__all__ = [
    "ENGRAM_TABLE_RE",
    "EXL3_PARTS",
    "EXPERT_RE",
    "engram_primes",
    "exl3_modules",
    "is_vision",
    "moe_layers",
    "natural_key",
    "serving_module_name",
    "text_config",
    "woa_slice_root",
]

#: Tensors of one EXL3 linear (``<prefix>.<part>``), cpu_tier.exl3's set.
EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

#: A routed expert's tensor: ``<moe>.experts.<e>.<proj>.<part>`` where ``<moe>`` is the MoE module path
#: (``layers.3.ffn``, ``mtp.0.ffn``, ``model.layers.3.mlp``).
EXPERT_RE = re.compile(r"^(?P<moe>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<part>[A-Za-z0-9_]+)$")

#: An Engram hash table: ``layers.N.engram.embed.weight`` (F8_E4M3 [rows, 256]) or ``.scale`` (F8_E8M0).
ENGRAM_TABLE_RE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.engram\.embed\.(?P<part>weight|scale)$")

_WOA_SLICE_RE = re.compile(r"^(?P<root>.+)\.attn\.wo_a\.slice\.(?P<group>\d+)$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: ``cfg["text_config"]`` for the nested V4.1 layout, else ``cfg`` itself."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, Mapping) and tc else cfg


def is_vision(name: str) -> bool:
    """Tensors of the vision tower / aligner / image tokens, which a text-only pack drops."""
    return name.startswith(("vision.", "aligner.", "model.vision", "visual.", "image_")) or ".image_" in name


def natural_key(name: str) -> list[Any]:
    """Sort key that orders module names by their numbers: ``layers.2`` before ``layers.10``."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def woa_slice_root(prefix: str) -> tuple[str, int] | None:
    """``layers.3.attn.wo_a.slice.5`` -> ``("layers.3", 5)``; None for anything else."""
    m = _WOA_SLICE_RE.match(prefix)
    return (m["root"], int(m["group"])) if m else None


def exl3_modules(names: Iterable[str]) -> dict[str, set[str]]:
    """Group tensor names into EXL3 linears: ``{prefix: {parts}}`` for every prefix that has a ``.trellis``."""
    parts: dict[str, set[str]] = defaultdict(set)
    for n in names:
        prefix, _, part = n.rpartition(".")
        if part in EXL3_PARTS and prefix:
            parts[prefix].add(part)
    return {p: s for p, s in parts.items() if "trellis" in s}


def serving_module_name(native: str, num_hidden_layers: int) -> str:
    """Map a native module prefix to the serving model's (fused) module name.

    ``head`` -> ``lm_head``; ``layers.N.x`` -> ``model.layers.N.x``; ``mtp.S.x`` ->
    ``model.layers.{num_hidden_layers + S}.x``; then fusions: ``shared_experts.w1|w3`` ->
    ``shared_experts.gate_up_proj``, ``shared_experts.w2`` -> ``shared_experts.down_proj``,
    ``attn.wq_a|wkv`` -> ``attn.fused_wqa_wkv``, ``compressor.wkv|wgate`` -> ``compressor.fused_wkv_wgate``.
    """
    if native == "head":
        return "lm_head"
    if m := _LAYER_RE.match(native):
        name = f"model.layers.{m[1]}.{m[2]}"
    elif m := _MTP_RE.match(native):
        name = f"model.layers.{num_hidden_layers + int(m[1])}.{m[2]}"
    else:
        name = f"model.{native}"
    for pat, rep in (
        (r"\.shared_experts\.w[13]$", ".shared_experts.gate_up_proj"),
        (r"\.shared_experts\.w2$", ".shared_experts.down_proj"),
        (r"\.attn\.(?:wq_a|wkv)$", ".attn.fused_wqa_wkv"),
        (r"\.attn\.compressor\.(?:wkv|wgate)$", ".attn.compressor.fused_wkv_wgate"),
    ):
        name, n = re.subn(pat, rep, name)
        if n:
            break
    return name


def engram_primes(vocab_size: int, n_heads: int, max_ngram: int, n_layers: int) -> list[list[int]]:
    """The Engram bucket primes, per Engram layer: ``(max_ngram - 1) * n_heads`` primes each.

    Primes are drawn in order above ``vocab_size - 1`` and never reused (exl3-format.md section 8.3); a
    layer's table has ``sum(primes)`` rows, which is how ``engram_num_embeddings`` is checked.
    """
    if vocab_size < 2 or n_heads < 1 or max_ngram < 2 or n_layers < 0:
        raise ValueError("engram_primes: need vocab_size >= 2, n_heads >= 1, max_ngram >= 2")
    out: list[list[int]] = []
    p = vocab_size - 1
    for _ in range(n_layers):
        layer: list[int] = []
        for _ in range((max_ngram - 1) * n_heads):
            p = next_prime(p)  # engram-mmap's deterministic Miller-Rabin search
            layer.append(p)
        out.append(layer)
    return out


def moe_layers(names: Iterable[str]) -> dict[str, set[int]]:
    """``{moe_module: {expert ids}}`` over every routed-expert tensor name."""
    out: dict[str, set[int]] = defaultdict(set)
    for n in names:
        if m := EXPERT_RE.match(n):
            out[m["moe"]].add(int(m["expert"]))
    return dict(out)


def check_engram_table_shape(name: str, dtype: str, shape: tuple[int, ...], file: str) -> None:
    """Raise PackError unless an Engram table tensor has the real layout.

    ``embed.weight``: F8_E4M3 ``[rows, 256]``; ``embed.scale``: F8_E8M0 ``[rows, 256 / 32]``.
    """
    m = ENGRAM_TABLE_RE.match(name)
    if not m:
        raise PackError(f"{file}: {name}: not an Engram table name")
    if m["part"] == "weight":
        if dtype != "F8_E4M3" or len(shape) != 2:
            raise PackError(f"{file}: {name}: Engram table must be F8_E4M3 [rows, dim], got {dtype} {list(shape)}")
    elif dtype not in ("F8_E8M0", "U8") or len(shape) != 2:
        raise PackError(f"{file}: {name}: Engram scales must be F8_E8M0 [rows, dim/32], got {dtype} {list(shape)}")
