"""What the pack tells a model loader: ``config.json`` and ``quantization_config.json``.

The one place that decides the pack's model configuration (reference-system.md section 8, step 3):

* ``config.json``: the checkpoint's config with the architecture vLLM serves (``PackConfig.text_architecture``),
  no ``vision_config`` (text only), and the EXL3 ``quantization_config`` at the top level and in ``text_config``;
* ``quantization_config.json``: the same quantization config alone (:func:`quant_config`).

Tokenizer and chat-template files are not rewritten: the pack links them from the EXL3 checkpoint like every
other input file except :data:`WRITTEN_BY_PACK` (the files the pack writes itself instead of linking).
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pack_tools import v41
from pack_tools.errors import PackError
from pack_tools.manifest import INDEX_NAME
from pack_tools.st import Header, atomic_write_json

__all__ = ["WRITTEN_BY_PACK", "pack_model_config", "quant_config", "write_model_config"]

#: Input files the pack does not link because it writes its own version of them.
WRITTEN_BY_PACK = frozenset({"config.json", "quantization_config.json", INDEX_NAME})


def write_model_config(
    partial: Path,
    source_cfg: dict[str, Any],
    tc: Any,
    modules: dict[str, set[str]],
    where: dict[str, str],
    headers: dict[str, Header],
    predecoded: set[str],
    architecture: str,
) -> dict[str, Any]:
    """Write ``config.json`` and ``quantization_config.json`` into ``partial``; return the quantization config."""
    quant = quant_config(source_cfg, tc, modules, where, headers, predecoded)
    atomic_write_json(partial / "config.json", pack_model_config(source_cfg, quant, architecture))
    atomic_write_json(partial / "quantization_config.json", quant)
    return quant


def pack_model_config(source_cfg: dict[str, Any], quant: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The pack's ``config.json``: the checkpoint's, text-only, with ``quant`` as its quantization config."""
    new_cfg = copy.deepcopy(source_cfg)
    new_cfg["architectures"] = [architecture]
    new_cfg.pop("vision_config", None)  # text-only: the vision tower is left out of the pack
    new_cfg["quantization_config"] = quant
    if isinstance(new_cfg.get("text_config"), dict) and new_cfg["text_config"]:
        new_cfg["text_config"]["quantization_config"] = quant
        if "architectures" in new_cfg["text_config"]:
            new_cfg["text_config"]["architectures"] = [architecture]
    return new_cfg


def quant_config(
    source_cfg: dict[str, Any],
    tc: Any,
    modules: dict[str, set[str]],
    where: dict[str, str],
    headers: dict[str, Header],
    predecoded: set[str],
) -> dict[str, Any]:
    """The ``quantization_config`` of the text-only pack (reference-system.md section 8, step 3)."""
    n_layers = int(tc.get("num_hidden_layers", 0))
    routed_bits: dict[str, dict[str, float]] = defaultdict(dict)
    routed_codebooks: Counter[str] = Counter()
    dense: dict[str, dict[str, Any]] = {}
    dense_members: dict[str, str] = {}
    dense_codebooks: Counter[str] = Counter()
    for prefix, parts in modules.items():
        if v41.is_vision(prefix + ".trellis") or prefix in predecoded:
            continue
        codebook = "mul1" if "mul1" in parts else "mcg" if "mcg" in parts else "3inst"
        bits = _bits(where, headers, prefix)
        if m := v41.EXPERT_RE.match(prefix + ".trellis"):
            layer = v41.serving_module_name(m["moe"], n_layers).split(".")
            idx = layer[2] if len(layer) > 2 and layer[1] == "layers" else m["moe"]
            prev = routed_bits[idx].get(m["proj"])
            if prev is not None and prev != bits:
                raise PackError(
                    f"{where[prefix + '.trellis']}: {prefix}.trellis: {bits} bits, other experts of this "
                    f"projection have {prev} (the fused kernels need one K per projection and layer)"
                )
            routed_bits[idx][m["proj"]] = bits
            routed_codebooks[codebook] += 1
            continue
        name = v41.serving_module_name(prefix, n_layers)
        spec = {"bits": _int_if_whole(bits), "codebook": codebook}
        if name in dense and (dense[name]["bits"], dense[name]["codebook"]) != (spec["bits"], codebook):
            raise PackError(
                f"{where[prefix + '.trellis']}: {prefix}: {bits} bits {codebook}, but {dense_members[name]} fused "
                f"into the same module {name} has {dense[name]['bits']} bits {dense[name]['codebook']}"
            )
        dense[name] = spec
        dense_members[name] = prefix
        dense_codebooks[codebook] += 1
    if len(routed_codebooks) > 1:
        raise PackError(f"routed experts mix codebooks {dict(routed_codebooks)}; the expert kernels need one")
    per_layer: dict[str, Any] = {}
    for idx, projs in routed_bits.items():
        vals = set(projs.values())
        per_layer[idx] = (
            _int_if_whole(vals.pop()) if len(vals) == 1 else {k: _int_if_whole(v) for k, v in projs.items()}
        )
    scalar = [v for v in per_layer.values() if not isinstance(v, dict)]
    main_bits = Counter(scalar).most_common(1)[0][0] if scalar else None
    layer_bits = {k: v for k, v in sorted(per_layer.items(), key=lambda kv: v41.natural_key(kv[0])) if v != main_bits}
    dense_cb = dense_codebooks.most_common(1)[0][0] if dense_codebooks else None
    layers = {}
    for name in sorted(dense, key=v41.natural_key):
        spec = {"bits": dense[name]["bits"]}
        if dense[name]["codebook"] != dense_cb:
            spec["codebook"] = dense[name]["codebook"]
        layers[name] = spec
    quant: dict[str, Any] = {
        "quant_method": "exl3",
        "bits": main_bits,
        "codebook": next(iter(routed_codebooks), None),
        "scope": "dsv41_native_exl3",
        "layer_bits": layer_bits,
        "non_routed_exl3": {"codebook": dense_cb, "layers": layers},
        "non_routed_dtype_policy": "bf16_as_stored",
    }
    src_q = source_cfg.get("quantization_config") or {}
    for k in ("version", "head_bits", "out_scales", "calibration"):
        if k in src_q:
            quant[k] = src_q[k]
    return quant


def _bits(where: dict[str, str], headers: dict[str, Header], prefix: str) -> float:
    """K of an EXL3 linear: the trellis's last dimension is ``16 * K``."""
    name = prefix + ".trellis"
    t = headers[where[name]].tensors[name]
    if t.dtype != "I16" or len(t.shape) != 3:
        raise PackError(f"{where[name]}: {name}: EXL3 trellis must be I16 3-D, got {t.dtype} {list(t.shape)}")
    return t.shape[2] / 16


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x
