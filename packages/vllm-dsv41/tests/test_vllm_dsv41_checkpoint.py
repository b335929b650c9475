"""Finding EXL3 modules in a checkpoint, and assembling the tensors vLLM streams into Exl3Tensor objects."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from cpu_tier.exl3 import random_tensor
from vllm_dsv41.checkpoint import TensorStore, exl3_modules, tensor_names


def test_demo_pack_modules(demo_pack: Path) -> None:
    names = tensor_names(demo_pack)
    mods = exl3_modules(names)
    assert "model.layers.1.mlp.experts.7.down_proj" in mods
    assert "model.layers.0.self_attn.q_proj" in mods and "model.layers.0.self_attn.o_proj" in mods
    assert "lm_head" not in mods and "model.layers.0.mlp.gate" not in mods
    assert len(mods) == 2 * (8 * 3 + 4)


def test_index_is_preferred_and_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.trellis": "x.safetensors"}}))
    assert tensor_names(tmp_path) == ["a.trellis"]
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="index.json"):
        tensor_names(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        tensor_names(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError, match="bad.safetensors: safetensors header is not valid JSON"):
        tensor_names(tmp_path)
    with pytest.raises(ValueError, match="local model directory"):
        tensor_names(tmp_path / "missing")


def test_headers_without_index(tmp_path: Path) -> None:
    t = random_tensor(128, 256, 3, "mcg", seed=1)
    save_file({**t.to_tensors("m.proj"), "m.norm.weight": np.ones(4, np.float16)}, str(tmp_path / "w.safetensors"))
    assert sorted(tensor_names(tmp_path)) == sorted([*t.to_tensors("m.proj"), "m.norm.weight"])
    assert exl3_modules(tensor_names(tmp_path)) == {"m.proj"}


def test_tensor_store_builds_validated_tensors() -> None:
    t = random_tensor(128, 256, 4, "mul1", seed=2)
    store = TensorStore("layer")
    for name, a in t.to_tensors("x").items():
        store.put(("e0", "w1"), name.rsplit(".", 1)[1], torch.from_numpy(np.array(a)))
    built = store.build(("e0", "w1"), "model.x")
    assert (built.k, built.n, built.bits, built.codebook) == (128, 256, 4.0, "mul1")
    assert np.array_equal(built.trellis, t.trellis) and np.array_equal(built.svh, t.svh)
    with pytest.raises(ValueError, match="loaded twice"):
        store.put(("e0", "w1"), "suh", torch.from_numpy(t.suh))
    with pytest.raises(ValueError, match="model.y: no EXL3 tensors were loaded"):
        store.build(("e1", "w1"), "model.y")
    bad = TensorStore("layer")
    bad.put(0, "trellis", torch.from_numpy(t.trellis))
    with pytest.raises(ValueError, match="model.z.suh: missing"):
        bad.build(0, "model.z")
