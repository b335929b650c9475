"""inspect: numbers recomputed independently from the tiny dimensions."""

from __future__ import annotations

import json
import os

import pytest

from pack_tools import PackError, inspect_pack
from pack_tools.inspection import format_inspect
from pack_tools.presets.tiny_v41 import TinyV41, expected_engram_rows
from pack_tools.st import read_header


def _trellis_bytes(k: int, n: int, bits: int) -> int:
    return (k // 16) * (n // 16) * 16 * bits * 2


def test_inspect_pack_counts(tiny_session):
    d = TinyV41()
    info = inspect_pack(tiny_session.pack)
    json.dumps(info)  # JSON-serialisable
    assert info["kind"] == "pack"
    assert (info["layers"], info["mtp_layers"], info["experts"]) == (d.layers, d.mtp, d.experts)
    assert info["experts_total"] == d.layers * d.experts == info["host_experts"]
    per_expert = 2 * _trellis_bytes(d.hidden, d.intermediate, 3) + _trellis_bytes(d.intermediate, d.hidden, 3)
    assert info["host_ram_bytes"] == d.layers * d.experts * per_expert
    rows = expected_engram_rows()
    assert info["engram_rows"] == {"1": rows[0], "2": rows[1]}
    assert info["engram_rows_total"] == sum(rows)
    assert info["nvme_bytes"] == sum(r * (256 + 8) for r in rows)
    assert info["bits"]["routed"] == {"3 mul1": d.layers * d.experts * 3}
    assert info["bits"]["mtp"] == {"4 mul1": d.mtp_experts * 3 + 9}  # + wq_a wkv wq_b wo_b shared(3) e/h_proj
    assert info["bits"]["dense"] == {"4 mul1": 32, "6 mul1": 1}
    # one wo_a per layer / MTP stage, compressor wkv + wgate per KV source, indexer wk per index source that is a KV
    # source too (the others reuse its keys)
    owns_k = set(d.index_source_layers) & set(d.kv_source_layers)
    assert info["predecoded_fp16"] == (d.layers + d.mtp) + 2 * len(d.kv_source_layers) + len(owns_k)
    # every indexed byte lands in exactly one tier
    wm = json.loads((tiny_session.pack / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {f: read_header(tiny_session.pack / f) for f in set(wm.values())}
    total = sum(headers[f].tensors[n].nbytes for n, f in wm.items())
    assert sum(info["tiers"].values()) == total
    assert info["vram_bytes"] == info["tiers"]["vram"] > 0
    # disk: generated files + each linked input once
    gen = sum(p.stat().st_size for p in tiny_session.pack.iterdir() if not p.is_symlink())
    linked = sum(p.stat().st_size for p in tiny_session.pack.iterdir() if p.is_symlink())
    assert (info["pack_bytes"], info["linked_bytes"], info["disk_bytes"]) == (gen, linked, gen + linked)
    text = format_inspect(info)
    for needle in ("MoE layers        4 (+ 1 MTP)", "pinned host RAM", "Engram rows", "layer 1: "):
        assert needle in text


def test_inspect_input_directories(tiny_session):
    ex = inspect_pack(tiny_session.exl3)
    assert ex["kind"] == "directory" and ex["host_plan"].startswith("assumed")
    assert ex["bits"]["vision"] == {"4 mul1": 1}
    assert ex["engram_rows"] == {}
    en = inspect_pack(tiny_session.engram)
    assert en["absent_files"] == ["model-00001-of-00048.safetensors", "model-00002-of-00048.safetensors",
                                  "model-00046-of-00048.safetensors"]  # fmt: skip
    assert en["engram_rows"] == {"1": expected_engram_rows()[0], "2": expected_engram_rows()[1]}
    assert "absent" in format_inspect(en)


def test_inspect_errors(tmp_path, tiny):
    with pytest.raises(PackError, match="not a directory"):
        inspect_pack(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackError, match="not a pack or checkpoint"):
        inspect_pack(tmp_path / "empty")
    (tiny.pack / "model-00001-of-00003.safetensors").unlink()
    with pytest.raises(PackError, match="model-00001-of-00003.safetensors: file not found"):
        inspect_pack(tiny.pack)
    assert os.path.exists(tiny.pack / "manifest.json")
