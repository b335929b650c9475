"""verify: every kind of damage is caught, with one line naming the file (and the tensor)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from pack_tools import verify_pack
from pack_tools.manifest import write_manifest
from pack_tools.st import read_header, write_safetensors

SHARD = "model-00002-of-00003.safetensors"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _patch_header(path: Path, old: str, new: str) -> None:
    """Replace text inside a safetensors header (same length, exactly once)."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    head = data[8 : 8 + n].decode()
    assert head.count(old) == 1, (old, head.count(old))
    data[8 : 8 + n] = head.replace(old, new).encode()
    path.write_bytes(bytes(data))


def _tensor_in(pack: Path, file: str, prefix: str) -> str:
    wm = json.loads((pack / "model.safetensors.index.json").read_text())["weight_map"]
    return next(n for n, f in sorted(wm.items()) if f == file and n.startswith(prefix))


def test_clean(tiny):
    assert verify_pack(tiny.pack) == []


def test_flipped_byte_in_generated_file_names_tensor(tiny):
    p = tiny.pack / "woa-layers-1.safetensors"
    h = read_header(p)
    _flip(p, h.data_start + 1000)
    problems = verify_pack(tiny.pack)
    assert problems == ["woa-layers-1.safetensors: layers.1.attn.wo_a.weight: data sha256 mismatch (corrupted bytes)"]


def test_flipped_byte_in_native_dense_names_the_right_tensor(tiny):
    p = tiny.pack / "native-dense.safetensors"
    h = read_header(p)
    t = h.tensors["layers.3.attn.indexer.wk.weight"]
    _flip(p, h.data_start + t.begin + 7)
    assert verify_pack(tiny.pack) == [
        "native-dense.safetensors: layers.3.attn.indexer.wk.weight: data sha256 mismatch (corrupted bytes)"
    ]


def test_flipped_byte_in_generated_json(tiny):
    p = tiny.pack / "host-plan.json"
    p.write_text(p.read_text().replace("7", "6", 1))
    problems = verify_pack(tiny.pack)
    assert any(x.startswith("host-plan.json: sha256 mismatch") for x in problems)


def test_flipped_byte_in_input_shard_data_needs_deep(tiny):
    """Input shard data is hashed only with deep=True (hundreds of GB for the real inputs)."""
    target = tiny.exl3 / SHARD
    h = read_header(target)
    _flip(target, h.data_start + 12345)
    assert verify_pack(tiny.pack) == []
    deep = verify_pack(tiny.pack, deep=True)
    assert deep == [f"{SHARD}: content sha256 mismatch (flipped or corrupted bytes in the input shard)"]


def test_flipped_byte_in_input_shard_header(tiny):
    target = tiny.exl3 / SHARD
    name = _tensor_in(tiny.pack, SHARD, "layers.")
    _patch_header(target, f'"{name}":', f'"{name[:-1]}X":')
    problems = verify_pack(tiny.pack)
    assert f"{SHARD}: {name}: missing from the shard (manifest.json lists it)" in problems
    assert f"{SHARD}: {name}: named by model.safetensors.index.json but not in the shard" in problems


def test_wrong_dtype_in_input_shard(tiny):
    wm = json.loads((tiny.pack / "model.safetensors.index.json").read_text())["weight_map"]
    trellis = next(n for n, f in sorted(wm.items()) if f == SHARD and ".experts." in n and n.endswith(".trellis"))
    _patch_header(tiny.exl3 / SHARD, f'"{trellis}":{{"dtype":"I16"', f'"{trellis}":{{"dtype":"F16"')
    problems = verify_pack(tiny.pack)
    assert f"{SHARD}: {trellis}: dtype F16, manifest.json says I16" in problems
    assert any(p.startswith(f"{SHARD}: {trellis}: EXL3 trellis must be I16") for p in problems)


def test_wrong_dtype_of_engram_table(tiny):
    f = "engram-model-00047-of-00048.safetensors"
    _patch_header(tiny.engram / "model-00047-of-00048.safetensors",
                  '"layers.1.engram.embed.weight":{"dtype":"F8_E4M3"',
                  '"layers.1.engram.embed.weight":{"dtype":"F8_E5M2"')  # fmt: skip
    problems = verify_pack(tiny.pack)
    assert f"{f}: layers.1.engram.embed.weight: dtype F8_E5M2, manifest.json says F8_E4M3" in problems
    assert any(p.startswith(f"{f}: layers.1.engram.embed.weight: Engram table must be F8_E4M3") for p in problems)


def test_truncated_shard_names_tensors(tiny):
    target = tiny.exl3 / SHARD
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size - 5000)
    problems = verify_pack(tiny.pack)
    assert problems[0] == f"{SHARD}: size {size - 5000} bytes, manifest.json says {size} (truncated file)"
    cut = [p for p in problems if "(truncated shard)" in p]
    assert cut and all(p.startswith(f"{SHARD}: layers.") or p.startswith(f"{SHARD}: mtp.") for p in cut)


def test_truncated_inside_header(tiny):
    target = tiny.exl3 / SHARD
    with open(target, "r+b") as f:
        f.truncate(100)
    problems = verify_pack(tiny.pack)
    assert any(p.startswith(f"{SHARD}: truncated inside the header") for p in problems)


def test_missing_shard(tiny):
    (tiny.pack / SHARD).unlink()
    problems = verify_pack(tiny.pack)
    assert len(problems) == 1
    assert problems[0].startswith(f"{SHARD}: missing (link to an input file listed in manifest.json); ")
    assert "indexed tensors unavailable, e.g. layers." in problems[0]


def test_missing_generated_file(tiny):
    (tiny.pack / "woa-mtp-0.safetensors").unlink()
    assert verify_pack(tiny.pack) == [
        "woa-mtp-0.safetensors: missing (generated file listed in manifest.json); "
        "1 indexed tensors unavailable, e.g. mtp.0.attn.wo_a.weight"
    ]


def test_dangling_link(tiny):
    (tiny.engram / "model-00048-of-00048.safetensors").unlink()
    problems = verify_pack(tiny.pack)
    f = "engram-model-00048-of-00048.safetensors"
    assert problems == [
        f"{f}: dangling link -> ../DeepSeek-V4.1-Flash-engram/model-00048-of-00048.safetensors (target does not "
        "exist); 2 indexed tensors unavailable, e.g. layers.2.engram.embed.scale"
    ]


def test_link_replaced_by_a_copy(tiny):
    p = tiny.pack / SHARD
    real = p.resolve()
    p.unlink()
    shutil.copyfile(real, p)
    assert verify_pack(tiny.pack) == [
        f"{SHARD}: expected a link to ../Mia-DeepSeek-V4.1-Flash-EXL3-3.0bpw/{SHARD}, found a regular file "
        "(copied input?)"
    ]


def test_link_retargeted(tiny):
    p = tiny.pack / SHARD
    p.unlink()
    os.symlink("../Mia-DeepSeek-V4.1-Flash-EXL3-3.0bpw/model-00003-of-00003.safetensors", p)
    problems = verify_pack(tiny.pack)
    assert problems[0].startswith(f"{SHARD}: link points to ../Mia-DeepSeek-V4.1-Flash-EXL3-3.0bpw/model-00003")
    assert len(problems) > 1  # its header and tensors differ too


def test_untracked_file(tiny):
    (tiny.pack / "extra.safetensors").write_bytes(b"")
    problems = verify_pack(tiny.pack)
    assert "extra.safetensors: not listed in manifest.json (untracked file)" in problems


def test_missing_or_broken_manifest(tiny):
    m = tiny.pack / "manifest.json"
    m.write_text("{not json")
    assert verify_pack(tiny.pack)[0].startswith("manifest.json: not valid JSON")
    m.unlink()
    assert verify_pack(tiny.pack) == ["manifest.json: missing (not a finished pack)"]


def test_index_naming_missing_tensor(tiny):
    """An index edited after the build: the manifest hash and the missing tensor are both reported."""
    idx = tiny.pack / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["layers.0.ffn.experts.99.w1.trellis"] = "model-00001-of-00003.safetensors"
    idx.write_text(json.dumps(doc))
    problems = verify_pack(tiny.pack)
    assert "model.safetensors.index.json: sha256 mismatch (content differs from manifest.json)" in problems
    assert ("model-00001-of-00003.safetensors: layers.0.ffn.experts.99.w1.trellis: named by "
            "model.safetensors.index.json but not in the shard") in problems  # fmt: skip


def test_host_plan_with_unknown_expert(tiny):
    plan_path = tiny.pack / "host-plan.json"
    plan = json.loads(plan_path.read_text())
    plan["model.layers.0.ffn.experts"].append(42)
    plan["model.layers.9.ffn.experts"] = [0]
    plan_path.write_text(json.dumps(plan))
    write_manifest(tiny.pack)  # re-sign: only the plan's content is wrong now
    assert verify_pack(tiny.pack) == [
        "host-plan.json: model.layers.0.ffn.experts: experts [42] not in model.safetensors.index.json",
        "host-plan.json: model.layers.9.ffn.experts: no such MoE layer in model.safetensors.index.json",
    ]


def test_exl3_set_problems_in_a_generic_pack(tmp_path):
    """A pack without an index (e.g. a demo pack): EXL3 sets are checked over every tensor, markers by value."""
    from cpu_tier.exl3 import random_tensor

    pack = tmp_path / "demo"
    pack.mkdir()
    t = random_tensor(128, 256, 3, "mul1", 0).to_tensors("model.layers.0.mlp.experts.0.gate_proj")
    t["model.layers.0.mlp.experts.0.gate_proj.mul1"] = np.array(7, dtype=np.int32)  # wrong marker value
    del t["model.layers.0.mlp.experts.0.gate_proj.svh"]
    write_safetensors(pack / "model.safetensors", t)
    (pack / "config.json").write_text(json.dumps({"architectures": ["Demo"]}))
    write_manifest(pack)
    problems = verify_pack(pack)
    assert problems == [
        "model.safetensors: model.layers.0.mlp.experts.0.gate_proj.svh: missing (EXL3 linear "
        "model.layers.0.mlp.experts.0.gate_proj has a trellis)",
        "model.safetensors: model.layers.0.mlp.experts.0.gate_proj.mul1: marker value 7, expected -2082680531",
    ]


def test_generic_pack_without_index_flipped_byte(tmp_path):
    pack = tmp_path / "demo"
    pack.mkdir()
    write_safetensors(pack / "model.safetensors", {"a": np.arange(64, dtype=np.float32), "b": np.ones(8, np.int16)})
    write_manifest(pack)
    assert verify_pack(pack) == []
    h = read_header(pack / "model.safetensors")
    _flip(pack / "model.safetensors", h.data_start + h.tensors["b"].begin)
    assert verify_pack(pack) == ["model.safetensors: b: data sha256 mismatch (corrupted bytes)"]


def test_partial_directory_name_is_never_valid(tiny):
    partial = tiny.root / "pack.partial-abc"
    os.replace(tiny.pack, partial)
    problems = verify_pack(partial)
    assert problems[0].startswith("pack.partial-abc: unfinished build directory")


def test_not_a_pack(tmp_path):
    assert verify_pack(tmp_path / "nope") == [f"{tmp_path / 'nope'}: does not exist"]
    (tmp_path / "f").write_text("x")
    assert verify_pack(tmp_path / "f") == [f"{tmp_path / 'f'}: not a directory"]


@pytest.mark.parametrize("cap", [1, 3])
def test_line_cap_per_file(tiny, cap):
    target = tiny.exl3 / SHARD
    with open(target, "r+b") as f:
        f.truncate(read_header(target).data_start + 10)
    problems = verify_pack(tiny.pack, max_lines_per_file=cap)
    cut = [p for p in problems if "(truncated shard)" in p]
    assert len(cut) == cap
    assert any(p.startswith(f"{SHARD}: ... and ") for p in problems)
