"""``flash-layer``: one DeepSeek-V4.1-Flash-shaped MoE layer, for benchmarks.

384 routed experts of H=5120, I=2304 at mul1 K=3 (``layers.0.ffn.experts.E.w{1,2,3}``), the shared expert,
and the router (``gate.weight`` BF16, ``gate.bias`` FP32): 5.1 GB. It is written shard by shard
(``shard_bytes`` each) so memory stays bounded, with a progress bar, into an EXL3-checkpoint-like directory
(config.json with ``num_hidden_layers`` 1, index, shards). Smaller variants (fewer experts, smaller dims) use
the same code; :func:`flash_layer_plan` gives the layout without writing anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cpu_tier.geometry import V41_FLASH
from pack_tools.manifest import INDEX_NAME
from pack_tools.presets import _common as c
from pack_tools.st import RawTensor, atomic_write_json, write_safetensors

__all__ = ["FlashLayer", "flash_layer_plan", "synth_flash_layer"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlashLayer:
    """Shape of the layer; the defaults are DeepSeek-V4.1-Flash's (``cpu_tier.geometry.V41_FLASH``)."""

    experts: int = V41_FLASH.num_experts
    hidden: int = V41_FLASH.hidden
    intermediate: int = V41_FLASH.intermediate
    bits: float = V41_FLASH.bits
    codebook: str = V41_FLASH.codebook
    shared_bits: float = V41_FLASH.shared_bits
    layer: int = 0
    shard_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        from cpu_tier.exl3 import SUPPORTED_BITS

        for f in ("hidden", "intermediate"):
            v = getattr(self, f)
            if v <= 0 or v % 128:
                raise ValueError(f"FlashLayer.{f}: must be a positive multiple of 128, got {v}")
        if self.experts <= 0:
            raise ValueError(f"FlashLayer.experts: must be positive, got {self.experts}")
        if self.codebook not in SUPPORTED_BITS or self.bits not in SUPPORTED_BITS[self.codebook]:
            raise ValueError(f"FlashLayer.bits: {self.bits} not supported for codebook {self.codebook!r}")
        if self.shard_bytes <= 0:
            raise ValueError("FlashLayer.shard_bytes: must be positive")


def _linear_specs(prefix: str, k: int, n: int, bits: float, codebook: str) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [
        (f"{prefix}.trellis", "I16", (k // 16, n // 16, int(16 * bits))),
        (f"{prefix}.suh", "F16", (k,)),
        (f"{prefix}.svh", "F16", (n,)),
    ]
    if codebook in ("mcg", "mul1"):
        out.append((f"{prefix}.{codebook}", "I32", ()))
    return out


def _units(f: FlashLayer) -> Iterator[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
    """(unit name, [(tensor, dtype, shape)]) in file order: router, shared expert, then each routed expert."""
    p = f"layers.{f.layer}.ffn"
    yield "router", [(f"{p}.gate.weight", "BF16", (f.experts, f.hidden)), (f"{p}.gate.bias", "F32", (f.experts,))]
    shared = []
    for proj, k, n in (
        ("w1", f.hidden, f.intermediate),
        ("w3", f.hidden, f.intermediate),
        ("w2", f.intermediate, f.hidden),
    ):
        shared += _linear_specs(f"{p}.shared_experts.{proj}", k, n, f.shared_bits, f.codebook)
    yield "shared", shared
    for e in range(f.experts):
        specs = []
        for proj, k, n in (
            ("w1", f.hidden, f.intermediate),
            ("w3", f.hidden, f.intermediate),
            ("w2", f.intermediate, f.hidden),
        ):
            specs += _linear_specs(f"{p}.experts.{e}.{proj}", k, n, f.bits, f.codebook)
        yield f"expert {e}", specs


def flash_layer_plan(f: FlashLayer = FlashLayer()) -> dict[str, Any]:
    """The layout without writing: shards (file name, tensors, bytes) and byte totals.

    ``routed_trellis_bytes_per_expert`` is what one expert's host row holds (13,271,040 B for the real shape).
    """
    from pack_tools.st import DTYPE_SIZES

    shards: list[dict[str, Any]] = []
    cur: dict[str, Any] = {"tensors": [], "bytes": 0}
    for _unit, specs in _units(f):
        size = sum(DTYPE_SIZES[dt] * int(np.prod(sh, dtype=np.int64)) for _, dt, sh in specs)
        if cur["tensors"] and cur["bytes"] + size > f.shard_bytes:
            shards.append(cur)
            cur = {"tensors": [], "bytes": 0}
        cur["tensors"].extend(specs)
        cur["bytes"] += size
    shards.append(cur)
    n = len(shards)
    for i, s in enumerate(shards, start=1):
        s["file"] = f"model-{i:05d}-of-{n:05d}.safetensors"
    trellis_per_expert = 2 * (f.hidden // 16) * (f.intermediate // 16) * int(16 * f.bits) * 2 + (
        (f.intermediate // 16) * (f.hidden // 16) * int(16 * f.bits) * 2
    )
    return {
        "shards": shards,
        "total_bytes": sum(s["bytes"] for s in shards),
        "routed_trellis_bytes_per_expert": trellis_per_expert,
        "routed_trellis_bytes": trellis_per_expert * f.experts,
    }


def _tensors_for(
    f: FlashLayer, seed: int, specs: list[tuple[str, str, tuple[int, ...]]]
) -> dict[str, RawTensor | np.ndarray]:
    out: dict[str, RawTensor | np.ndarray] = {}
    prefixes = sorted({n.rsplit(".", 1)[0] for n, _, _ in specs if n.endswith(".trellis")})
    for prefix in prefixes:
        tr = next(sh for n, _, sh in specs if n == prefix + ".trellis")
        bits = tr[2] / 16
        out.update(c.exl3(seed, prefix, tr[0] * 16, tr[1] * 16, bits, f.codebook))
    for name, dtype, shape in specs:
        if name in out:
            continue
        if dtype == "BF16":
            out[name] = c.bf16(seed, name, shape)
        elif dtype == "F32":
            out[name] = c.f32(seed, name, shape, 0.01)
        else:  # pragma: no cover - plan and writer disagree
            raise AssertionError(f"no generator for {name} {dtype}")
    return out


def synth_flash_layer(
    out: Path, seed: int = 0, *, progress: bool = False, layer: FlashLayer | None = None, **dims: Any
) -> Path:
    """Write the layer into ``out`` (an EXL3-checkpoint-like directory); returns ``out``.

    ``dims`` override :class:`FlashLayer` fields (``experts=8, hidden=256, intermediate=128`` for a test).
    """
    f = layer or FlashLayer(**dims)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = flash_layer_plan(f)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=plan["total_bytes"], unit="B", unit_scale=True, desc=f"flash-layer -> {out}")
    weight_map: dict[str, str] = {}
    for shard in plan["shards"]:
        tensors = _tensors_for(f, seed, shard["tensors"])
        ordered = {name: tensors[name] for name, _, _ in shard["tensors"]}
        write_safetensors(out / shard["file"], ordered, {"format": "pt"})
        weight_map.update({name: shard["file"] for name in ordered})
        del tensors, ordered
        if bar is not None:
            bar.update(shard["bytes"])
    if bar is not None:
        bar.close()
    atomic_write_json(out / INDEX_NAME, {"metadata": {"total_size": plan["total_bytes"]},
                                         "weight_map": dict(sorted(weight_map.items()))})  # fmt: skip
    text = {
        "model_type": "deepseek_v41",
        "hidden_size": f.hidden,
        "moe_intermediate_size": f.intermediate,
        "n_routed_experts": f.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 1,
        "first_layer_id": f.layer,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
    }
    atomic_write_json(out / "config.json", {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "quantization_config": {"quant_method": "exl3", "bits": f.bits, "codebook": f.codebook,
                                "note": "synthetic flash-layer preset: random valid trellis"},
    })  # fmt: skip
    c.write_input_receipt(
        out, source="synth", hash_files=False,
        extra={"preset": "flash-layer", "seed": seed, "dims": dataclasses.asdict(f)},
    )  # fmt: skip
    return out
