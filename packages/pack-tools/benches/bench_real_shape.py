"""Build / verify / inspect at DeepSeek-V4.1-Flash's real size, on header-only sparse inputs.

The two inputs are written with the real tensor names, dtypes and shapes (``tiny_v41.FLASH``: 40 layers x 384
experts H=5120 I=2304 mul1 K=3, 3 MTP stages x 128 experts at 4 bpw, Engram tables of 384,006,168 and
384,016,682 rows, ~190k tensors) but as *sparse* files: each shard is a real safetensors header followed by a
hole (zeros; only the 4-byte EXL3 codebook markers are written), so 420 GB of inputs take a few MB of disk.
All-zero trellis bits are a valid EXL3 encoding, so the build decodes the 344 grouped wo_a slices and the
compressor / indexer projections for real: the timings are those of a real build (decode time does not depend
on the bit values), minus reading the data from NVMe.

Shapes the reference does not state (dense bits, compressor width) are derived from the config; see
tiny_v41.FLASH. The sparse header writer below is for this benchmark only (the pack tools write through
safetensors' serializer).

Usage: uv run --package pack-tools python packages/pack-tools/benches/bench_real_shape.py --root /tmp/pt-real [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from pack_tools import build_pack, inspect_pack, verify_pack
from pack_tools.manifest import INDEX_NAME
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import (
    FLASH,
    Spec,
    SpecGen,
    engram_release_tensors,
    exl3_checkpoint_tensors,
    tiny_v41_config,
)
from pack_tools.st import DTYPE_SIZES, atomic_write_json


def write_sparse(path: Path, specs: dict[str, Spec]) -> int:
    """A safetensors file whose data section is a hole; returns its (apparent) size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, s in specs.items():
        n = DTYPE_SIZES[s.dtype] * _prod(s.shape)
        header[name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(start + pos)
        for name, s in specs.items():
            if s.fill is not None:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(struct.pack("<i", s.fill))
    return start + pos


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def make_inputs(root: Path) -> dict[str, Any]:
    ex = root / EXL3.dirname
    en = root / ENGRAM.dirname
    ex.mkdir(parents=True, exist_ok=True)
    en.mkdir(parents=True, exist_ok=True)
    d = FLASH
    specs, groups = exl3_checkpoint_tensors(d, SpecGen())
    total = sum(s.nbytes for s in specs.values())
    target = total / d.exl3_shards
    shards: list[list[str]] = [[]]
    acc = 0
    covered = {n for g in groups for n in g}
    for g in groups + [[n] for n in specs if n not in covered]:
        if acc >= target * len(shards) and len(shards) < d.exl3_shards:
            shards.append([])
        shards[-1].extend(g)
        acc += sum(specs[n].nbytes for n in g)
    wm: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_sparse(ex / fname, {n: specs[n] for n in names})
        wm.update({n: fname for n in names})
    atomic_write_json(ex / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))})
    cfg = tiny_v41_config(d)
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": 3.0, "head_bits": 6, "codebook": "mul1"}
    atomic_write_json(ex / "config.json", cfg)
    en_shards, absent = engram_release_tensors(d, SpecGen())
    en_wm = dict(absent)
    en_bytes = 0
    for num, st in en_shards.items():
        fname = f"model-{num:05d}-of-00048.safetensors"
        en_bytes += write_sparse(en / fname, st)
        en_wm.update({n: fname for n in st})
    atomic_write_json(en / INDEX_NAME, {"metadata": {"total_size": en_bytes}, "weight_map": en_wm})
    atomic_write_json(en / "config.json", tiny_v41_config(d))
    return {"tensors": len(specs), "exl3_bytes": total, "engram_bytes": en_bytes, "exl3_shards": len(shards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="scratch directory (outside the repository)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the rows and environment as JSON")
    a = ap.parse_args()
    a.root.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows: list[tuple[str, float, str]] = []

    t0 = time.perf_counter()
    facts = make_inputs(a.root)
    rows.append(("sparse real-shape inputs", time.perf_counter() - t0, f"{facts['tensors']} tensors"))
    pack = a.root / "pack"
    t0 = time.perf_counter()
    build_pack(a.root / EXL3.dirname, a.root / ENGRAM.dirname, pack, force=True, jobs=a.jobs)
    rows.append((f"build (jobs={a.jobs})", time.perf_counter() - t0, ""))
    t0 = time.perf_counter()
    problems = verify_pack(pack)
    rows.append(("verify", time.perf_counter() - t0, f"{len(problems)} problems"))
    t0 = time.perf_counter()
    info = inspect_pack(pack)
    rows.append(("inspect", time.perf_counter() - t0, ""))
    gen = sum(p.stat().st_size for p in pack.iterdir() if not p.is_symlink())
    print(f"# pack-tools bench_real_shape | git {git} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} cpus | jobs={a.jobs}")  # fmt: skip
    print(f"{'case':<28}{'seconds':>10}  note")
    for case, sec, note in rows:
        print(f"{case:<28}{sec:>10.1f}  {note}")
    gib = 2**30
    print(f"pack (generated files) {gen / 1e9:.3f} GB; manifest {(pack / 'manifest.json').stat().st_size / 1e6:.1f} MB")
    print(f"inspect: layers {info['layers']} (+{info['mtp_layers']} MTP), experts {info['experts']}, "
          f"host pinned {info['host_ram_bytes'] / gib:.2f} GiB, VRAM weights {info['vram_bytes'] / gib:.2f} GiB, "
          f"NVMe Engram {info['nvme_bytes'] / gib:.2f} GiB, not loaded {info['tiers']['not_loaded'] / gib:.2f} GiB, "
          f"disk {info['disk_bytes'] / 1e9:.1f} GB, Engram rows {info['engram_rows']}")  # fmt: skip
    for p in problems[:10]:
        print("problem:", p)
    if a.json:
        a.json.write_text(json.dumps({"git": git, "rows": rows, "facts": facts, "inspect": info,
                                      "pack_bytes": gen, "problems": problems}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
