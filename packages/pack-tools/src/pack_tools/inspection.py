"""``inspect_pack``: what a pack (or an input directory) holds and what the server will need to serve it.

Every number comes from the safetensors headers (no tensor data is read). Tiers follow the serving design:

* **host pinned RAM**: the trellis of every routed expert the host plan lists (``host-plan.json``; for a
  directory without one, every routed expert of the decoder layers);
* **NVMe (memory-mapped)**: the Engram tables ``layers.N.engram.embed.{weight,scale}``;
* **VRAM**: everything else the index names: dense and pre-decoded weights, embeddings, head, routers,
  the routed experts' ``suh``/``svh`` and markers, experts not in the host plan;
* not loaded: MTP tensors (``mtp.*``; used only by speculative decoding).

``vram_bytes`` counts weights only; the KV cache, activations and the expert cache come on top.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pack_tools import v41
from pack_tools.errors import PackError
from pack_tools.manifest import INDEX_NAME, MANIFEST_NAME
from pack_tools.st import Header, read_header

__all__ = ["format_inspect", "inspect_pack"]

_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _load(path: Path, strict: bool) -> tuple[dict[str, str], dict[str, Header], list[str]]:
    """(tensor -> file, file -> header, files the index names that are absent).

    ``strict`` (a pack): an absent file is an error; otherwise (a partial download) it is skipped.
    """
    headers: dict[str, Header] = {}
    absent: list[str] = []
    idx = path / INDEX_NAME
    if idx.exists():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise PackError(f"{idx}: cannot read weight_map ({e})") from None
        for file in sorted(set(wm.values())):
            if not strict and not (path / file).exists():
                absent.append(file)
                continue
            headers[file] = read_header(path / file, display=file)
        wm = {n: f for n, f in wm.items() if f in headers}
        for name, file in wm.items():
            if name not in headers[file].tensors:
                raise PackError(f"{file}: {name}: named by {INDEX_NAME} but not in the shard")
        return dict(wm), headers, absent
    where: dict[str, str] = {}
    for p in sorted(path.rglob("*.safetensors")):
        rel = p.relative_to(path).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        headers[rel] = read_header(p, display=rel)
        for name in headers[rel].tensors:
            where.setdefault(name, rel)
    if not where:
        raise PackError(f"{path}: no {INDEX_NAME} and no *.safetensors files: not a pack or checkpoint")
    return where, headers, absent


def inspect_pack(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a pack or an input directory (EXL3 checkpoint, Engram release, synthetic layer).

    Returns
    -------
    JSON-serialisable dict with at least:

    * ``layers`` (int): decoder MoE layers; ``mtp_layers`` (int);
    * ``experts`` (int): routed experts per MoE layer (the largest count); ``experts_total`` (int);
    * ``bits`` ({group: {"<K> <codebook>": number of EXL3 linears}}), groups ``routed``, ``dense``,
      ``mtp``, ``vision``; ``predecoded_fp16`` (int): FP16 tensors decoded by the build;
    * ``tiers`` ({"vram", "host_pinned", "nvme", "not_loaded"}: bytes);
    * ``host_ram_bytes``, ``vram_bytes`` (weights only), ``disk_bytes`` (pack + every input file it links,
      or the directory's files);
    * ``engram_rows`` ({layer id as str: rows}); ``engram_rows_total`` (int).
    """
    p = Path(path)
    if not p.is_dir():
        raise PackError(f"{p}: not a directory")
    is_pack = (p / MANIFEST_NAME).exists()
    where, headers, absent = _load(p, strict=is_pack)
    cfg: dict[str, Any] = {}
    if (p / "config.json").exists():
        try:
            cfg = json.loads((p / "config.json").read_text())
        except ValueError as e:
            raise PackError(f"{p / 'config.json'}: not valid JSON ({e})") from None
    tc = v41.text_config(cfg)
    n_layers = tc.get("num_hidden_layers")
    first_layer = int(tc.get("first_layer_id", 0))

    def is_mtp(name: str) -> bool:
        if name.startswith("mtp."):
            return True
        m = _LAYER_RE.match(name)
        return bool(m and n_layers is not None and int(m[1]) >= first_layer + n_layers)

    plan_path = p / "host-plan.json"
    moe = v41.moe_layers(where)
    if plan_path.exists():
        try:
            plan_raw = json.loads(plan_path.read_text())
        except ValueError as e:
            raise PackError(f"{plan_path}: not valid JSON ({e})") from None
        host: dict[str, set[int]] = {}
        for key, ids in plan_raw.items():
            native = key.removesuffix(".experts")
            for cand in (native, native.removeprefix("model.")):
                if cand in moe:
                    host[cand] = set(ids)
        plan_source = "host-plan.json"
    else:
        host = {m: set(ids) for m, ids in moe.items() if not is_mtp(m + ".")}
        plan_source = "assumed: every routed expert of the decoder layers"

    tiers = Counter({"vram": 0, "host_pinned": 0, "nvme": 0, "not_loaded": 0})
    engram_rows: dict[str, int] = {}
    for name, file in where.items():
        t = headers[file].tensors[name]
        if (m := v41.ENGRAM_TABLE_RE.match(name)) is not None:
            tiers["nvme"] += t.nbytes
            if m["part"] == "weight":
                engram_rows[m["layer"]] = t.shape[0] if t.shape else 0
            continue
        if is_mtp(name) or v41.is_vision(name):
            tiers["not_loaded"] += t.nbytes
            continue
        em = v41.EXPERT_RE.match(name)
        if em and em["part"] == "trellis" and int(em["expert"]) in host.get(em["moe"], set()):
            tiers["host_pinned"] += t.nbytes
        else:
            tiers["vram"] += t.nbytes

    bits: dict[str, Counter[str]] = defaultdict(Counter)
    for prefix, parts in v41.exl3_modules(where).items():
        tname = prefix + ".trellis"
        t = headers[where[tname]].tensors[tname]
        k = t.shape[-1] / 16 if t.shape else 0
        cb = "mul1" if "mul1" in parts else "mcg" if "mcg" in parts else "3inst"
        group = (
            "vision" if v41.is_vision(tname)
            else "mtp" if is_mtp(tname)
            else "routed" if v41.EXPERT_RE.match(tname)
            else "dense"
        )  # fmt: skip
        bits[group][f"{int(k) if float(k).is_integer() else k} {cb}"] += 1
    predecoded = sum(
        1 for n, f in where.items() if n.endswith(".weight") and headers[f].tensors[n].dtype == "F16"
        and (f.startswith("woa-") or f == "native-dense.safetensors")
    )  # fmt: skip

    decoder_moe = {m: ids for m, ids in moe.items() if not is_mtp(m + ".")}
    mtp_moe = {m: ids for m, ids in moe.items() if is_mtp(m + ".")}
    disk, pack_bytes, linked_bytes = _disk(p)
    info: dict[str, Any] = {
        "path": str(p),
        "kind": "pack" if is_pack else "directory",
        "absent_files": absent,
        "architecture": (cfg.get("architectures") or [None])[0],
        "layers": len(decoder_moe),
        "mtp_layers": len(mtp_moe),
        "experts": max((len(ids) for ids in decoder_moe.values()), default=0),
        "experts_total": sum(len(ids) for ids in decoder_moe.values()),
        "host_plan": plan_source,
        "host_experts": sum(len(ids) for ids in host.values()),
        "bits": {g: dict(sorted(c.items())) for g, c in sorted(bits.items())},
        "predecoded_fp16": predecoded,
        "tensors": len(where),
        "tiers": dict(tiers),
        "host_ram_bytes": tiers["host_pinned"],
        "vram_bytes": tiers["vram"],
        "nvme_bytes": tiers["nvme"],
        "disk_bytes": disk,
        "pack_bytes": pack_bytes,
        "linked_bytes": linked_bytes,
        "engram_rows": dict(sorted(engram_rows.items(), key=lambda kv: int(kv[0]))),
        "engram_rows_total": sum(engram_rows.values()),
        "notes": [
            "vram_bytes is weights only: KV cache, activations, CUDA graphs and the VRAM expert cache come on top",
            "Engram tables stay on NVMe (memory-mapped); their page cache is reclaimable host RAM",
        ],
    }
    return info


def _disk(p: Path) -> tuple[int, int, int]:
    """(total, generated, linked) bytes: files of the directory, following links once per target."""
    seen: set[str] = set()
    gen = linked = 0
    for root, dirs, files in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for f in files:
            full = Path(root) / f
            if full.is_symlink():
                if not full.exists():
                    continue
                real = os.path.realpath(full)
                if real not in seen:
                    seen.add(real)
                    linked += full.stat().st_size
            else:
                gen += full.stat().st_size
    return gen + linked, gen, linked


def _gib(n: int) -> str:
    return f"{n / 2**30:9.3f} GiB  ({n:,} B)"


def format_inspect(info: dict[str, Any]) -> str:
    """Human-readable form of :func:`inspect_pack`'s result."""
    lines = [
        f"{info['kind']}: {info['path']}",
        f"architecture      {info['architecture']}",
        f"MoE layers        {info['layers']} (+ {info['mtp_layers']} MTP)",
        f"routed experts    {info['experts']} per layer, {info['experts_total']} in all; "
        f"host-resident {info['host_experts']} ({info['host_plan']})",
        f"tensors           {info['tensors']} indexed; {info['predecoded_fp16']} pre-decoded FP16",
        "EXL3 linears (bits codebook: count)",
    ]
    for group, counts in info["bits"].items():
        lines.append(f"  {group:<8} " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    lines += [
        "bytes per tier",
        f"  VRAM (weights)       {_gib(info['vram_bytes'])}",
        f"  pinned host RAM      {_gib(info['host_ram_bytes'])}",
        f"  NVMe (Engram, mmap)  {_gib(info['nvme_bytes'])}",
        f"  not loaded (MTP/vision) {_gib(info['tiers']['not_loaded'])}",
        "Engram rows       "
        + (", ".join(f"layer {k}: {v:,}" for k, v in info["engram_rows"].items()) or "none")
        + f" (total {info['engram_rows_total']:,})",
        "server needs",
        f"  host RAM (pinned)    {_gib(info['host_ram_bytes'])}",
        f"  VRAM (weights only)  {_gib(info['vram_bytes'])}",
        f"  disk                 {_gib(info['disk_bytes'])}  (generated {info['pack_bytes']:,} B + "
        f"linked inputs {info['linked_bytes']:,} B)",
    ]
    if info["absent_files"]:
        lines.append(
            f"note: {len(info['absent_files'])} files named by the index are absent (partial download); "
            "counted without them"
        )
    lines += [f"note: {n}" for n in info["notes"]]
    return "\n".join(lines)
