"""flash-v41: the plan at Flash's real size (nothing written), the same code at small sizes through build + verify,
and the streamed writer making one shard at a time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pack_tools import build_pack, verify_pack
from pack_tools.cli import main
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.flash_layer import FlashLayer, flash_layer_plan
from pack_tools.presets.flash_v41 import MIN_LAYERS, flash_v41_dims, flash_v41_plan, synth_flash_v41
from pack_tools.presets.tiny_v41 import FLASH, DataGen, Lazy, Spec, TinyV41, tiny_v41_config, write_streamed_shards
from pack_tools.st import read_header

GiB = 1 << 30


def test_plan_at_the_real_size_has_flash_shapes_without_writing(tmp_path: Path) -> None:
    plan = flash_v41_plan(flash_v41_dims(4), shard_bytes=GiB)
    t = plan["tensors"]
    H, I = FLASH.hidden, FLASH.intermediate  # 5120, 2304
    for layer in range(4):
        for e in (0, FLASH.experts - 1):
            p = f"layers.{layer}.ffn.experts.{e}."
            assert t[p + "w1.trellis"] == Spec("I16", (H // 16, I // 16, 48))  # 3 bpw: 48 words per 16x16 tile
            assert t[p + "w3.trellis"] == Spec("I16", (H // 16, I // 16, 48))
            assert t[p + "w2.trellis"] == Spec("I16", (I // 16, H // 16, 48))
            assert t[p + "w2.svh"] == Spec("F16", (H,))
        assert f"layers.{layer}.ffn.experts.{FLASH.experts}.w1.trellis" not in t
        assert t[f"layers.{layer}.ffn.gate.weight"] == Spec("BF16", (FLASH.experts, H))
        assert t[f"layers.{layer}.attn.wq_b.trellis"].shape == (FLASH.q_lora_rank // 16, 64 * 512 // 16, 64)
    assert not any(n.startswith(("layers.4.", "mtp.")) for n in t)
    assert "layers.1.engram.wkv.trellis" in t and not any(".engram." in n for n in t if not n.startswith("layers.1."))
    assert "layers.2.attn.compressor.wkv.trellis" in t and "layers.3.attn.indexer.wk.trellis" in t
    assert "layers.1.attn.compressor.wkv.trellis" not in t
    assert t["head.trellis"].shape == (H // 16, 8192 // 16, 96)  # the reduced vocabulary at 6 bpw
    # the routed experts of one layer: 384 x (trellis of flash-layer's expert + suh/svh + markers)
    per_expert = flash_layer_plan(FlashLayer())["routed_trellis_bytes_per_expert"]
    assert per_expert == 13_271_040
    extra = 3 * 2 * (H + I) + 3 * 4  # suh + svh (F16, H + I values) of each of the three linears, three markers
    assert plan["routed_bytes_per_layer"] == [FLASH.experts * (per_expert + extra)] * 4
    shards = plan["shards"]
    assert all(s["bytes"] <= GiB for s in shards) and plan["total_bytes"] == sum(s["bytes"] for s in shards)
    assert 20e9 < plan["total_bytes"] < 22e9
    assert sum(len(s["tensors"]) for s in shards) == len(t)
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere we gave it


def test_dims_topology_and_config() -> None:
    cfg = tiny_v41_config(flash_v41_dims(4))["text_config"]
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"],
            cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"], cfg["o_lora_rank"]) == (
            5120, 2304, 384, 6, 64, 512, 1280, 1024)  # fmt: skip
    assert cfg["num_hidden_layers"] == 4 and cfg["num_nextn_predict_layers"] == 0 and cfg["vocab_size"] == 8192
    assert cfg["compress_ratios"] == [0, 0, 2, 1] and cfg["kv_source_layer_ids"] == [2, 3]
    assert cfg["index_source_layer_ids"] == [2, 3] and cfg["engram_layer_ids"] == [1]
    assert cfg["engram_num_embeddings"][0] * 264 < 1e9  # the reduced Engram table (rows x (256 + 8) bytes)
    # every compressed layer reads the nearest source below it, and that source has its own ratio
    for n in range(MIN_LAYERS, 9):
        c = tiny_v41_config(flash_v41_dims(n))["text_config"]
        r, src = c["compress_ratios"], c["kv_source_layer_ids"]
        assert len(r) == n and src
        for i in range(n):
            if r[i]:
                assert r[max(s for s in src if s <= i)] == r[i], (n, i)
    with pytest.raises(ValueError, match="layers must be an integer >= 3"):
        flash_v41_dims(2)


def test_small_flash_v41_builds_verifies_and_matches_its_plan(tmp_path: Path) -> None:
    base = TinyV41(experts=8)
    shard = 1 << 20
    out = synth_flash_v41(tmp_path / "in", seed=3, layers=3, vocab=1024, engram_vocab=1000, shard_bytes=shard,
                          base=base)  # fmt: skip
    ex = out / EXL3.dirname
    plan = flash_v41_plan(flash_v41_dims(3, vocab=1024, engram_vocab=1000, base=base), shard_bytes=shard)
    index = json.loads((ex / "model.safetensors.index.json").read_text())["weight_map"]
    for s in plan["shards"]:  # the files are the plan: names, tensors, dtypes, shapes
        h = read_header(ex / s["file"])
        assert {n: (h.tensors[n].dtype, h.tensors[n].shape) for n in h.tensors} == {
            n: (sp.dtype, sp.shape) for n, sp in s["tensors"]}  # fmt: skip
        assert s["bytes"] <= shard or len(s["units"]) == 1
        assert all(index[n] == s["file"] for n, _ in s["tensors"])
    # the streamed bytes are the in-memory generator's
    from safetensors import safe_open

    name = "layers.2.ffn.experts.5.w2.trellis"
    with safe_open(ex / index[name], "np") as f:
        got = f.get_tensor(name)
    want = DataGen(3).exl3("layers.2.ffn.experts.5.w2", base.intermediate, base.hidden, 3)[name]
    np.testing.assert_array_equal(got, want)
    pack = build_pack(ex, out / ENGRAM.dirname, tmp_path / "pack", jobs=1)
    assert verify_pack(pack) == []
    cfg = json.loads((pack / "config.json").read_text())["text_config"]
    assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 0
    assert cfg["kv_source_layer_ids"] == [2] and cfg["compress_ratios"] == [0, 0, 1] and cfg["engram_layer_ids"] == [1]
    assert cfg["n_routed_experts"] == 8 and cfg["vocab_size"] == 1024
    receipt = json.loads((ex / ".pack-tools-input.json").read_text())
    assert receipt["preset"] == "flash-v41" and receipt["dims"]["layers"] == 3


def test_streamed_writer_makes_each_shard_just_before_writing_it(tmp_path: Path) -> None:
    made: list[tuple[str, int]] = []

    def unit(name: str, n: int) -> dict[str, Lazy]:
        def make() -> dict[str, np.ndarray]:
            made.append((name, len(list(tmp_path.glob("*.safetensors")))))
            return {f"{name}.{i}": np.full(256, i, np.float32) for i in range(n)}

        return {f"{name}.{i}": Lazy(Spec("F32", (256,)), name, make) for i in range(n)}

    tensors = {**unit("a", 2), **unit("b", 1), **unit("c", 3), **unit("d", 1)}  # 1 KiB per tensor
    wm = write_streamed_shards(tmp_path, tensors, shard_bytes=3 * 1024)
    # a+b fill shard 1, c alone fills shard 2, d is shard 3; each unit made once, when the shards before it exist
    assert made == [("a", 0), ("b", 0), ("c", 1), ("d", 2)]
    assert wm["a.1"] == wm["b.0"] == "model-00001-of-00003.safetensors" and wm["d.0"].startswith("model-00003")
    bad = {"x": Lazy(Spec("F32", (3,)), "x", lambda: {"x": np.zeros(4, np.float32)})}
    with pytest.raises(AssertionError, match="x: made F32 \\(4,\\), planned"):
        write_streamed_shards(tmp_path / "bad", bad, 1024)


def test_cli_layers_only_for_flash_v41(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "--preset", "tiny-v41", "--out", str(tmp_path / "x"), "--layers", "3"]) == 2
    assert "--layers: only for --preset flash-v41" in capsys.readouterr().err
