"""synth tiny-v41 -> build -> verify, the pack's content, resumable / atomic builds, bad inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import pack_tools.build as build_mod
import pack_tools.reconstruct as reconstruct_mod
from cpu_tier.exl3 import Exl3Tensor, linear
from pack_tools import PackConfig, PackError, build_pack, verify_pack
from pack_tools.manifest import hash_file
from pack_tools.presets.tiny_v41 import TinyV41
from pack_tools.st import read_header


def _index(pack: Path) -> dict[str, str]:
    return json.loads((pack / "model.safetensors.index.json").read_text())["weight_map"]


def test_built_pack_verifies_clean(tiny_session):
    assert verify_pack(tiny_session.pack) == []
    assert verify_pack(tiny_session.pack, deep=True) == []


def test_links_not_copies_and_relative(tiny_session):
    pack = tiny_session.pack
    for name in ("model-00001-of-00003.safetensors", "tokenizer.json", "engram-model-00047-of-00048.safetensors"):
        p = pack / name
        assert p.is_symlink(), name
        target = os.readlink(p)
        assert not os.path.isabs(target)
        assert target.startswith("../")
    assert os.path.samefile(pack / "engram-model-00048-of-00048.safetensors",
                            tiny_session.engram / "model-00048-of-00048.safetensors")  # fmt: skip
    # generated files are regular files; the source config / index are not linked
    for name in ("config.json", "model.safetensors.index.json", "woa-layers-0.safetensors", "manifest.json"):
        assert (pack / name).is_file() and not (pack / name).is_symlink(), name
    assert not list(pack.glob("*.partial-*")) and not list(pack.parent.glob("pack.partial-*"))


def test_index_names_exactly_what_the_server_loads(tiny_session):
    wm = _index(tiny_session.pack)
    d = TinyV41()
    assert not [n for n in wm if ".wo_a.slice." in n]
    assert not [n for n in wm if n.startswith(("vision.", "aligner.")) or n.startswith("image_")]
    # the pre-decoded EXL3 sources are replaced by FP16 .weight tensors
    assert "layers.2.attn.compressor.wkv.trellis" not in wm
    assert wm["layers.2.attn.compressor.wkv.weight"] == "native-dense.safetensors"
    assert wm["layers.3.attn.indexer.wk.weight"] == "native-dense.safetensors"
    assert "layers.3.attn.indexer.wq_b.trellis" in wm  # not pre-decoded: stays EXL3
    for root in [f"layers.{i}" for i in range(d.layers)] + ["mtp.0"]:
        assert wm[f"{root}.attn.wo_a.weight"] == f"woa-{root.replace('.', '-')}.safetensors"
    # Engram tables from the Engram shards, through the engram- links; the rest from the EXL3 checkpoint
    assert wm["layers.1.engram.embed.weight"] == "engram-model-00047-of-00048.safetensors"
    assert wm["layers.2.engram.embed.scale"] == "engram-model-00048-of-00048.safetensors"
    assert wm["mtp.0.norm.weight"].startswith("model-0000")  # also in Engram shard 48: must not shadow
    assert "layers.1.engram.wkv.weight" not in wm  # the release's FP8 copy is not used
    assert wm["layers.1.engram.wkv.trellis"].startswith("model-0000")
    # every routed expert is there, EXL3
    for i in range(d.layers):
        for e in range(d.experts):
            for proj in ("w1", "w2", "w3"):
                for part in ("trellis", "suh", "svh", "mul1"):
                    assert f"layers.{i}.ffn.experts.{e}.{proj}.{part}" in wm
    total = json.loads((tiny_session.pack / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    headers = {f: read_header(tiny_session.pack / f) for f in set(wm.values())}
    assert total == sum(headers[f].tensors[n].nbytes for n, f in wm.items())


def test_config_is_text_only_with_exl3_quant_config(tiny_session):
    cfg = json.loads((tiny_session.pack / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"]  # vLLM's V4.1 name (the plugin registers under it)
    assert "vision_config" not in cfg
    q = cfg["quantization_config"]
    assert cfg["text_config"]["quantization_config"] == q
    assert q == json.loads((tiny_session.pack / "quantization_config.json").read_text())
    assert (q["quant_method"], q["bits"], q["codebook"]) == ("exl3", 3, "mul1")
    assert q["layer_bits"] == {"4": 4}  # the MTP stage (model.layers.4) has 4-bit experts
    layers = q["non_routed_exl3"]["layers"]
    assert layers["lm_head"] == {"bits": 6}
    assert layers["model.layers.0.attn.fused_wqa_wkv"] == {"bits": 4}
    assert layers["model.layers.0.ffn.shared_experts.gate_up_proj"] == {"bits": 4}
    assert layers["model.layers.4.attn.wo_b"] == {"bits": 4}
    assert not [k for k in layers if "compressor" in k or "indexer.wk" in k or "wo_a" in k or "vision" in k]
    assert not [k for k in layers if ".experts." in k]


def test_host_plan_lists_every_decoder_expert(tiny_session):
    plan = json.loads((tiny_session.pack / "host-plan.json").read_text())
    d = TinyV41()
    assert plan == {f"model.layers.{i}.ffn.experts": list(range(d.experts)) for i in range(d.layers)}


def test_woa_matches_the_exl3_forward(tiny_session):
    """Each wo_a group block of the FP16 weight applies like the EXL3 slice it came from (y = x @ W)."""
    d = TinyV41()
    src = tiny_session.exl3
    wm_src = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tiny_session.pack / "woa-layers-1.safetensors"), "numpy") as f:
        w = f.get_tensor("layers.1.attn.wo_a.weight")
    assert w.dtype == np.float16 and w.shape == (d.o_groups * d.o_lora_rank, d.heads * d.head_dim // d.o_groups)
    rng = np.random.default_rng(1)
    for g in range(d.o_groups):
        prefix = f"layers.1.attn.wo_a.slice.{g}"
        with safe_open(str(src / wm_src[prefix + ".trellis"]), "numpy") as f:
            t = Exl3Tensor.from_safetensors(f, prefix)
        x = rng.standard_normal((3, t.k)).astype(np.float32)
        ref = linear(x, t.trellis, t.suh, t.svh, t.codebook)
        got = x @ w[g * d.o_lora_rank : (g + 1) * d.o_lora_rank].astype(np.float32).T
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * float(np.abs(ref).max()))


def test_native_dense_matches_the_exl3_forward(tiny_session):
    src = tiny_session.exl3
    wm_src = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "layers.2.attn.compressor.wgate"
    with safe_open(str(tiny_session.pack / "native-dense.safetensors"), "numpy") as f:
        w = f.get_tensor(prefix + ".weight")
    with safe_open(str(src / wm_src[prefix + ".trellis"]), "numpy") as f:
        t = Exl3Tensor.from_safetensors(f, prefix)
    assert w.shape == (t.n, t.k) and w.dtype == np.float16
    x = np.random.default_rng(2).standard_normal((2, t.k)).astype(np.float32)
    ref = linear(x, t.trellis, t.suh, t.svh, t.codebook)
    np.testing.assert_allclose(x @ w.astype(np.float32).T, ref, rtol=0, atol=2e-3 * float(np.abs(ref).max()))


def test_rebuild_is_deterministic_and_force_replaces(tiny):
    before = {p.name: hash_file(p) for p in tiny.pack.iterdir() if p.is_file() and not p.is_symlink()}
    with pytest.raises(PackError, match="already exists"):
        tiny.build()
    tiny.build(force=True)
    after = {p.name: hash_file(p) for p in tiny.pack.iterdir() if p.is_file() and not p.is_symlink()}
    assert after == before  # byte-identical, manifest included
    assert verify_pack(tiny.pack) == []
    assert not list(tiny.root.glob("pack.old-*")) and not list(tiny.root.glob("pack.partial-*"))


def test_parallel_build_is_identical(tiny, tmp_path):
    """jobs > 1 decodes in worker processes; the pack is byte-identical."""
    other = tiny.root / "pack2"
    build_pack(tiny.exl3, tiny.engram, other, jobs=2)
    for p in tiny.pack.iterdir():
        if p.is_file() and not p.is_symlink():
            assert hash_file(p) == hash_file(other / p.name), p.name
    with pytest.raises(PackError, match="jobs"):
        build_pack(tiny.exl3, tiny.engram, tmp_path / "x", jobs=0)


def test_fp16_reconstruction_is_correctly_rounded():
    """decode.reconstruct_fp16 vs cpu_tier's float64 reference: equal, or (rarely) the reference is the one
    off by a double rounding (float64 -> float32 -> float16); checked against an 80-bit evaluation."""
    from cpu_tier.exl3 import decode, random_tensor
    from pack_tools.decode import fwht128, reconstruct_fp16

    x = np.random.default_rng(0).standard_normal((256, 384))
    h = np.ones((1, 1))
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    np.testing.assert_allclose(fwht128(x, 1)[:, :128], x[:, :128] @ h, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fwht128(x, 0)[128:, :], h @ x[128:, :], rtol=0, atol=1e-12)
    t = random_tensor(1024, 512, 3, "mul1", 3)
    mine = reconstruct_fp16(t.trellis, t.suh, t.svh, "mul1")
    ref = t.reconstruct().T.astype(np.float16)
    assert mine.shape == (512, 1024)
    diff = np.argwhere(mine != ref)
    assert len(diff) < mine.size * 1e-3
    wi = decode(t.trellis, "mul1").astype(np.longdouble)
    hl = h.astype(np.longdouble)
    for o, i in diff[:50]:
        blk = wi[(i // 128) * 128 : (i // 128 + 1) * 128, (o // 128) * 128 : (o // 128 + 1) * 128]
        exact = hl[i % 128] @ blk @ hl[:, o % 128] / 128 * np.longdouble(t.suh[i]) * np.longdouble(t.svh[o])
        assert np.float16(np.float64(exact)) == mine[o, i]
        assert abs(float(mine[o, i]) - float(ref[o, i])) <= float(np.spacing(np.float16(abs(mine[o, i]))))


def test_interrupted_build_leaves_no_valid_pack_and_resumes(tiny_inputs, monkeypatch):
    d = TinyV41()
    real = reconstruct_mod._decode_linear
    calls: list[str] = []

    def flaky(reader, where, prefix):
        calls.append(prefix)
        if len(calls) == d.o_groups + 1:  # the first slice of the second wo_a root
            raise KeyboardInterrupt
        return real(reader, where, prefix)

    monkeypatch.setattr(reconstruct_mod, "_decode_linear", flaky)
    with pytest.raises(KeyboardInterrupt):
        tiny_inputs.build()
    assert not tiny_inputs.pack.exists()
    partials = list(tiny_inputs.root.glob("pack.partial-*"))
    assert len(partials) == 1
    problems = verify_pack(partials[0])
    assert any("unfinished build" in p for p in problems)
    assert any(p.startswith("manifest.json: missing") for p in problems)
    assert (partials[0] / "woa-layers-0.safetensors").is_file()

    # rerun: resumes in the same partial directory, keeps the finished root, completes, renames
    calls.clear()
    monkeypatch.setattr(reconstruct_mod, "_decode_linear", lambda r, w, p: (calls.append(p), real(r, w, p))[1])
    tiny_inputs.build()
    assert not [c for c in calls if c.startswith("layers.0.")]  # layers.0's wo_a was not decoded again
    owns_k = set(d.index_source_layers) & set(d.kv_source_layers)  # index sources with their own wk
    predecoded = 2 * len(d.kv_source_layers) + len(owns_k)  # compressor wkv/wgate, indexer wk
    assert len(calls) == (d.layers + d.mtp) * d.o_groups + predecoded - d.o_groups
    assert verify_pack(tiny_inputs.pack) == []
    assert not list(tiny_inputs.root.glob("pack.partial-*"))


def test_interrupt_while_writing_the_manifest(tiny_inputs, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(build_mod, "write_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        tiny_inputs.build()
    assert not tiny_inputs.pack.exists()
    (partial,) = tiny_inputs.root.glob("pack.partial-*")
    assert verify_pack(partial) != []
    monkeypatch.undo()
    tiny_inputs.build()
    assert verify_pack(tiny_inputs.pack) == []


def test_stale_partial_with_other_inputs_is_removed(tiny_inputs):
    stale = tiny_inputs.root / "pack.partial-0123456789abcdef"
    stale.mkdir()
    (stale / "junk").write_text("x")
    logs: list[str] = []
    tiny_inputs.build(log=logs.append)
    assert not stale.exists()
    assert any("stale partial" in m for m in logs)


def test_absolute_links_and_no_host_plan(tiny_inputs):
    build_pack(tiny_inputs.exl3, tiny_inputs.engram, tiny_inputs.pack,
               config=PackConfig(link_mode="absolute", host_experts="none"))  # fmt: skip
    assert os.path.isabs(os.readlink(tiny_inputs.pack / "model-00001-of-00003.safetensors"))
    assert json.loads((tiny_inputs.pack / "host-plan.json").read_text()) == {}
    assert verify_pack(tiny_inputs.pack) == []


def test_pack_config_validates_fields():
    with pytest.raises(ValueError, match="host_experts"):
        PackConfig(host_experts="some")
    with pytest.raises(ValueError, match="link_mode"):
        PackConfig(link_mode="hard")
    with pytest.raises(ValueError, match="predecode"):
        PackConfig(predecode=("(",))
    with pytest.raises(ValueError, match="engram_link_prefix"):
        PackConfig(engram_link_prefix="a/b")


# --------------------------------------------------------------------------------------- bad inputs


def _build_error(t) -> str:
    with pytest.raises(PackError) as ei:
        t.build()
    assert not t.pack.exists()
    return str(ei.value)


def test_missing_engram_shard_is_named(tiny_inputs):
    (tiny_inputs.engram / "model-00048-of-00048.safetensors").unlink()
    msg = _build_error(tiny_inputs)
    assert "model-00048-of-00048.safetensors" in msg and "missing Engram shard" in msg
    assert "layers.2.engram.embed" in msg


def test_missing_exl3_config_is_named(tiny_inputs):
    (tiny_inputs.exl3 / "config.json").unlink()
    assert re.search(r"config\.json: missing", _build_error(tiny_inputs))


def test_engram_rows_disagreeing_with_config(tiny_inputs):
    cfg_path = tiny_inputs.exl3 / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["engram_num_embeddings"][1] += 1
    cfg_path.write_text(json.dumps(cfg))
    (tiny_inputs.exl3 / ".pack-tools-input.json").unlink()  # a hand-edited input has no receipt
    msg = _build_error(tiny_inputs)
    assert "layers.2.engram.embed.weight" in msg and "engram_num_embeddings[1]" in msg


def test_truncated_input_shard_caught_by_receipt(tiny_inputs):
    p = tiny_inputs.exl3 / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 100)
    msg = _build_error(tiny_inputs)
    assert "model-00002-of-00003.safetensors" in msg and "download receipt" in msg


def test_index_naming_a_tensor_not_in_its_shard(tiny_inputs):
    idx_path = tiny_inputs.exl3 / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"]["layers.0.ffn.experts.0.w1.trellis"] = "model-00003-of-00003.safetensors"
    idx_path.write_text(json.dumps(idx))
    (tiny_inputs.exl3 / ".pack-tools-input.json").unlink()
    msg = _build_error(tiny_inputs)
    assert "layers.0.ffn.experts.0.w1.trellis" in msg and "model-00003-of-00003.safetensors" in msg


def test_not_a_directory(tmp_path):
    with pytest.raises(PackError, match="config.json: missing"):
        build_pack(tmp_path / "nope", tmp_path / "nope2", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_models_root_reached_through_a_symlink(tiny_inputs, tmp_path):
    """Out given through a symlinked directory: the relative links are computed on physical paths."""
    alias = tmp_path / "a" / "b" / "alias"  # a different depth than the physical directory
    alias.parent.mkdir(parents=True)
    alias.symlink_to(tiny_inputs.root, target_is_directory=True)
    build_pack(alias / tiny_inputs.exl3.name, alias / tiny_inputs.engram.name, alias / "pack")
    assert verify_pack(tiny_inputs.root / "pack") == []
    assert verify_pack(alias / "pack") == []


def test_copy_of_inputs_elsewhere_gives_working_relative_links(tiny_session, tmp_path):
    """Links are relative to the pack's parent: moving the whole models root keeps the pack valid."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny_session.root, moved, symlinks=True)
    assert verify_pack(moved / "pack") == []
