"""Presets: tiny-v41's real V4.1 layout, determinism, flash-layer's plan and writer, the lazy tiny-demo hook."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from cpu_tier.exl3 import Exl3Tensor
from pack_tools import PackError, inspect_pack, synth, verify_pack
from pack_tools.manifest import hash_file
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets import PRESETS
from pack_tools.presets._common import V41_SPECIAL_TOKENS
from pack_tools.presets.flash_layer import FlashLayer, flash_layer_plan
from pack_tools.presets.tiny_v41 import TinyV41, expected_engram_rows, synth_tiny_v41
from pack_tools.st import read_header
from pack_tools.v41 import engram_primes


def _all_tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {f: read_header(d / f) for f in set(wm.values()) if (d / f).exists()}
    return {n: (headers[f].tensors[n].dtype, headers[f].tensors[n].shape, f) for n, f in wm.items() if f in headers}


def test_engram_primes_reproduce_the_real_table_sizes():
    """The bucket-prime rule gives DeepSeek-V4.1-Flash's published engram_num_embeddings (the checksum)."""
    primes = engram_primes(16_000_000, 8, 4, 2)
    assert [len(p) for p in primes] == [24, 24]
    assert [sum(p) for p in primes] == [384_006_168, 384_016_682]


def test_tiny_v41_real_names_dtypes_and_layout(tiny_session):
    d = TinyV41()
    t = _all_tensors(tiny_session.exl3)
    H, I = d.hidden, d.intermediate
    assert t["layers.0.ffn.experts.0.w1.trellis"][:2] == ("I16", (H // 16, I // 16, 48))
    assert t["layers.0.ffn.experts.7.w2.trellis"][:2] == ("I16", (I // 16, H // 16, 48))
    assert t["layers.0.ffn.experts.0.w1.suh"][:2] == ("F16", (H,))
    assert t["layers.0.ffn.experts.0.w1.mul1"][:2] == ("I32", ())
    assert t["mtp.0.ffn.experts.0.w3.trellis"][1][2] == 64  # MTP experts are 4 bpw
    assert t["head.trellis"][1][2] == 96  # 6 bpw head
    assert t["layers.3.ffn.shared_experts.w2.trellis"][:2] == ("I16", (I // 16, H // 16, 64))
    woa_rows = d.heads * d.head_dim // d.o_groups  # one slice's input size
    assert t["layers.1.attn.wo_a.slice.1.trellis"][1] == (woa_rows // 16, d.o_lora_rank // 16, 64)
    assert t["embed.weight"][:2] == ("BF16", (d.vocab, H))
    assert t["layers.2.hc_attn_fn"][:2] == ("F32", ((2 + d.hc_mult) * d.hc_mult, d.hc_mult * H))
    assert t["layers.0.ffn.gate.bias"][:2] == ("F32", (d.experts,))
    assert "layers.2.attn.compressor.wkv.trellis" in t and "layers.1.attn.compressor.wkv.trellis" not in t
    assert "layers.3.attn.indexer.wk.trellis" in t and "layers.1.attn.indexer.wk.trellis" not in t
    assert "layers.3.attn.compressor.wkv.trellis" in t  # a ratio-1 layer reads a ratio-1 source
    cols = (d.engram_max_ngram - 1) * d.engram_heads  # hash columns of 256 -> (hc_mult + 1) x hidden
    assert t["layers.1.engram.wkv.trellis"][1] == (cols * 256 // 16, (d.hc_mult + 1) * H // 16, 64)
    # every EXL3 linear decodes with cpu_tier
    with safe_open(str(tiny_session.exl3 / t["layers.0.ffn.experts.3.w2.trellis"][2]), "numpy") as f:
        x = Exl3Tensor.from_safetensors(f, "layers.0.ffn.experts.3.w2")
    assert (x.k, x.n, x.bits, x.codebook) == (I, H, 3, "mul1")
    assert np.isfinite(x.reconstruct()).all()


def test_tiny_v41_engram_tables(tiny_session):
    rows = expected_engram_rows()
    t = _all_tensors(tiny_session.engram)
    assert t["layers.1.engram.embed.weight"][:2] == ("F8_E4M3", (rows[0], 256))
    assert t["layers.1.engram.embed.scale"][:2] == ("F8_E8M0", (rows[0], 8))
    assert t["layers.2.engram.embed.weight"][:2] == ("F8_E4M3", (rows[1], 256))
    cfg = json.loads((tiny_session.engram / "config.json").read_text())
    assert cfg["text_config"]["engram_num_embeddings"] == rows
    # the release index also names shards that were not downloaded
    wm = json.loads((tiny_session.engram / "model.safetensors.index.json").read_text())["weight_map"]
    assert wm["embed.weight"] == "model-00001-of-00048.safetensors"
    assert not (tiny_session.engram / "model-00001-of-00048.safetensors").exists()
    # no NaN bytes in the fp8 table (e4m3fn NaN = 0x7F / 0xFF)
    p = tiny_session.engram / t["layers.1.engram.embed.weight"][2]
    h = read_header(p)
    info = h.tensors["layers.1.engram.embed.weight"]
    data = np.fromfile(p, dtype=np.uint8, count=info.nbytes, offset=h.data_start + info.begin)
    assert not ((data & 0x7F) == 0x7F).any()


def test_tiny_v41_config_and_tokenizer(tiny_session):
    cfg = json.loads((tiny_session.exl3 / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"]
    assert cfg["text_config"]["n_routed_experts"] == TinyV41().experts and cfg["vision_config"]
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_session.exl3 / "tokenizer.json"))
    for i, s in enumerate(V41_SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    # vLLM's V4.1 model wants exactly vocab_size ids, the image placeholder last
    assert tok.get_vocab_size() == cfg["text_config"]["vocab_size"] == cfg["image_token_id"] + 1
    assert tok.token_to_id("<｜deepseek_image｜>") == cfg["image_token_id"]
    from engram_mmap.hashing import build_token_map

    classes = build_token_map(str(tiny_session.exl3 / "tokenizer.json"))[1]
    assert classes == cfg["text_config"]["engram_compressed_vocab_size"]
    ids = tok.encode("<｜User｜>The capital of Japan?<｜Assistant｜></think>").ids
    assert ids[0] == V41_SPECIAL_TOKENS.index("<｜User｜>") and V41_SPECIAL_TOKENS.index("</think>") in ids
    tc = json.loads((tiny_session.exl3 / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == V41_SPECIAL_TOKENS[0] and "<｜Assistant｜>" in tc["chat_template"]


def test_tiny_v41_is_deterministic(tmp_path):
    a = synth("tiny-v41", tmp_path / "a", seed=5)
    b = synth("tiny-v41", tmp_path / "b", seed=5)
    c = synth("tiny-v41", tmp_path / "c", seed=6)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) > 15
    for rel in files:
        assert hash_file(a / rel) == hash_file(b / rel), rel
    shard = Path(EXL3.dirname) / "model-00001-of-00003.safetensors"
    assert hash_file(a / shard) != hash_file(c / shard)
    assert hash_file(a / ENGRAM.dirname / "model-00047-of-00048.safetensors") != hash_file(
        c / ENGRAM.dirname / "model-00047-of-00048.safetensors"
    )


def test_tiny_v41_dims_validate():
    with pytest.raises(ValueError, match="hidden"):
        TinyV41(hidden=200)
    with pytest.raises(ValueError, match="engram"):
        TinyV41(engram_layers=(7,))
    with pytest.raises(ValueError, match="index_source_layers"):
        TinyV41(kv_source_layers=(2,), index_source_layers=(1, 2))  # layer 1 has no kv source at or below it


def test_tiny_v41_index_only_layers_have_no_key_projection(tmp_path):
    """Upstream's V4.1 gives wk / k_norm only to index sources that are KV sources (``owns_k``); an index-only
    layer reuses their keys, and a pack with those tensors there is refused by upstream's weight loader."""
    d = TinyV41(layers=8, kv_source_layers=(2, 5), index_source_layers=(2, 5, 7))
    synth_tiny_v41(tmp_path, dims=d)
    names: set[str] = set()
    for f in (tmp_path / EXL3.dirname).glob("*.safetensors"):
        with safe_open(f, "np") as h:
            names.update(h.keys())
    owns = {i for i in range(d.layers) if any(f"layers.{i}.attn.indexer.k_norm.weight" in n for n in names)}
    index = {i for i in range(d.layers) if any(f"layers.{i}.attn.indexer.weights_proj" in n for n in names)}
    assert owns == {2, 5} and index == {2, 5, 7}


def test_flash_layer_plan_real_shape():
    plan = flash_layer_plan(FlashLayer())
    # reference-system.md section 2: one expert's host row is 13,271,040 B (w13 8,847,360 + w2 4,423,680)
    assert plan["routed_trellis_bytes_per_expert"] == 13_271_040
    assert plan["routed_trellis_bytes"] == 384 * 13_271_040
    scales = 2 * (5120 + 2304) * 2 + 2 * (5120 + 2304) + 3 * 4  # suh+svh fp16 of w1,w3,w2 and 3 markers
    shared = 2 * 5120 * 2304 * 4 // 8 + 2304 * 5120 * 4 // 8 + scales
    router = 384 * 5120 * 2 + 384 * 4
    assert plan["total_bytes"] == 384 * (13_271_040 + scales) + shared + router
    assert 5.0e9 < plan["total_bytes"] < 5.2e9
    assert all(s["bytes"] <= FlashLayer().shard_bytes for s in plan["shards"])
    names = [n for s in plan["shards"] for n, _, _ in s["tensors"]]
    assert len(names) == len(set(names)) == 2 + 4 * 3 + 384 * 4 * 3


def test_flash_layer_small_variant_writes_and_inspects(tmp_path):
    out = synth("flash-layer", tmp_path / "fl", seed=1, experts=6, hidden=256, intermediate=128, shard_bytes=60_000)
    plan = flash_layer_plan(FlashLayer(experts=6, hidden=256, intermediate=128, shard_bytes=60_000))
    assert len(plan["shards"]) > 1
    assert sum((out / s["file"]).stat().st_size for s in plan["shards"]) > plan["total_bytes"]
    info = inspect_pack(out)
    assert (info["layers"], info["experts"]) == (1, 6)
    assert info["bits"] == {"dense": {"4 mul1": 3}, "routed": {"3 mul1": 18}}
    assert info["host_ram_bytes"] == plan["routed_trellis_bytes"]
    with safe_open(str(out / plan["shards"][-1]["file"]), "numpy") as f:
        t = Exl3Tensor.from_safetensors(f, "layers.0.ffn.experts.5.w2")
    assert (t.k, t.n, t.bits) == (128, 256, 3)
    again = synth("flash-layer", tmp_path / "fl2", seed=1, experts=6, hidden=256, intermediate=128, shard_bytes=60_000)
    for s in plan["shards"]:
        assert hash_file(out / s["file"]) == hash_file(again / s["file"])


def test_flash_layer_validates():
    with pytest.raises(ValueError, match="hidden"):
        FlashLayer(hidden=100)
    with pytest.raises(ValueError, match="bits"):
        FlashLayer(bits=2.5, codebook="mcg")


def test_unknown_preset():
    with pytest.raises(PackError, match="unknown preset 'nope'"):
        synth("nope", "/tmp/never-written")


def test_preset_module_missing_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(PRESETS, "tiny-demo", ("pack_tools.presets.tiny_demo_absent_for_test", "synth_tiny_demo"))
    with pytest.raises(PackError, match="preset 'tiny-demo' is not available: module .* is not installed"):
        synth("tiny-demo", tmp_path / "demo")
    assert not (tmp_path / "demo").exists()


def test_presets_package_does_not_import_tiny_demo():
    code = (
        "import sys, pack_tools, pack_tools.presets, pack_tools.cli;"
        "print('pack_tools.presets.tiny_demo' in sys.modules, 'pack_tools.presets.tiny_v41' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.skipif(
    importlib.util.find_spec("pack_tools.presets.tiny_demo") is None,
    reason="tiny_demo.py (written by the server side) is not in this checkout; the missing case is tested above",
)
def test_tiny_demo_pack_verifies(tmp_path):
    """The other side's preset writes a manifest-carrying pack; our verify must accept it."""
    out = synth("tiny-demo", tmp_path / "demo", seed=0)
    assert verify_pack(out) == []
