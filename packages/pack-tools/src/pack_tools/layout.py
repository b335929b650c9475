"""Where each tensor of a pack lives: the merged ``model.safetensors.index.json`` and the ``host-plan.json``.

* The index maps every tensor the server loads to exactly one file of the pack: the linked EXL3 shards (minus
  vision tensors and the EXL3 sources the pack replaces by FP16 reconstructions), the generated ``woa-*`` and
  native-dense files, and the linked Engram shards.
* The host plan lists, per MoE layer, the routed experts that are host-resident (pinned RAM).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pack_tools import v41
from pack_tools.errors import PackError
from pack_tools.inputs import BuildInputs
from pack_tools.manifest import INDEX_NAME
from pack_tools.reconstruct import NATIVE_DENSE, DecodePlan
from pack_tools.st import atomic_write_json, read_header

__all__ = ["HOST_PLAN", "host_plan", "write_index"]

HOST_PLAN = "host-plan.json"


def write_index(partial: Path, inputs: BuildInputs, plan: DecodePlan, engram_links: dict[str, str]) -> dict[str, str]:
    """Write the pack's merged index into ``partial``; return its weight map (tensor name -> pack file)."""
    where, ex, en = inputs.where, inputs.ex, inputs.en
    predecoded_sources = plan.predecoded_sources
    weight_map: dict[str, str] = {}
    for name, rel in where.items():
        prefix = name.rpartition(".")[0]
        if v41.is_vision(name) or prefix in predecoded_sources:
            continue
        weight_map[name] = rel
    for root in plan.roots:
        weight_map[f"{root}.attn.wo_a.weight"] = plan.woa_files[root]
    for prefix in plan.dense_predecode:
        weight_map[f"{prefix}.weight"] = NATIVE_DENSE
    for name, file in inputs.engram_keys.items():
        if name in weight_map:
            raise PackError(f"{ex.root.name}/{where[name]}: {name}: the EXL3 checkpoint also has this Engram tensor")
        weight_map[name] = engram_links[file]
    total = 0
    for name, rel in weight_map.items():
        if rel in engram_links.values():
            src = next(f for f, n in engram_links.items() if n == rel)
            total += en.headers[src].tensors[name].nbytes
        elif rel in ex.headers:
            total += ex.headers[rel].tensors[name].nbytes
        else:
            total += read_header(partial / rel, display=rel).tensors[name].nbytes
    atomic_write_json(
        partial / INDEX_NAME,
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    return weight_map


def host_plan(weight_map: dict[str, str], n_layers: Any, host_experts: str) -> dict[str, list[int]]:
    """``model.layers.N.ffn.experts`` -> the host-resident expert ids (all of decoder layers ``< n_layers``)."""
    plan: dict[str, list[int]] = {}
    if host_experts == "all":
        for moe, ids in sorted(v41.moe_layers(weight_map).items(), key=lambda kv: v41.natural_key(kv[0])):
            m = re.match(r"^layers\.(\d+)\.", moe + ".")
            if m and (n_layers is None or int(m[1]) < n_layers):
                plan[f"model.{moe}.experts"] = sorted(ids)
    return plan
