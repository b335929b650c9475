"""The host home: the pack's expert bytes mapped in place (no copy anywhere), and the loader that never reads them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from vllm_dsv41.home import ExpertHome, expert_tensor, process_memory, resident_bytes


@pytest.fixture(scope="module")
def flash_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Flash-shaped layer, small: 48 experts of 1024 x 512 (about 19 MB of EXL3)."""
    from pack_tools import synth
    from pack_tools.presets.flash_layer import FlashLayer

    out = tmp_path_factory.mktemp("home") / "flash"
    return synth("flash-layer", out, seed=1, layer=FlashLayer(layer=5, experts=48, hidden=1024, intermediate=512,
                                                              shard_bytes=8 << 20))  # fmt: skip


def test_expert_tensor_names() -> None:
    assert expert_tensor("layers.3.ffn.experts.17.w2.trellis") == (3, 17, "down", "trellis")
    assert expert_tensor("model.layers.0.mlp.experts.5.gate_proj.suh") == (0, 5, "gate", "suh")
    assert expert_tensor("layers.3.ffn.shared_experts.w1.trellis") is None
    assert expert_tensor("mtp.0.ffn.experts.1.w1.trellis") is None  # MTP experts are not served
    assert expert_tensor("layers.3.ffn.experts.1.w9.trellis") is None


def test_home_maps_in_place_with_no_private_copy(flash_pack: Path) -> None:
    def rss_anon() -> int:
        return process_memory()["RssAnon"]

    anon0 = rss_anon()
    with ExpertHome(flash_pack, populate=True) as home:
        nbytes = home.stats.expert_bytes
        assert nbytes > 15 << 20 and home.stats.files >= 2  # several shards
        r = resident_bytes(home)
        # every expert byte is resident, as page-cache pages of the pack's files: none is anonymous (a copy would be)
        assert r["Rss"] >= nbytes and r["Anonymous"] == 0
        assert rss_anon() - anon0 < nbytes // 4
        # the views are the file's bytes
        lx = home.layer(5)
        name = "layers.5.ffn.experts.47.w3.trellis"
        rel = json.loads((flash_pack / "model.safetensors.index.json").read_text())["weight_map"][name]
        with safe_open(str(flash_pack / rel), framework="numpy") as f:
            np.testing.assert_array_equal(lx.up[47].trellis, f.get_tensor(name))
        with pytest.raises(ValueError):
            lx.up[47].trellis[0, 0, 0] = 1  # read-only views
        # page sharing: a second home of the same files maps the same physical pages
        with ExpertHome(flash_pack, populate=True) as again:
            r2 = resident_bytes(again)
            assert r2["Anonymous"] == 0 and r2["Shared_Clean"] >= nbytes
            assert resident_bytes(home)["Shared_Clean"] >= nbytes


def test_home_tail_pad_reads_as_zeros(flash_pack: Path) -> None:
    with ExpertHome(flash_pack, tail_pad=8192) as home:
        for m in home._mappings:
            end = m.array.size
            assert (m.array[end - 4096 :] == 0).all() or m.file_offset + end > os.path.getsize(m.path)


def test_home_errors_name_the_file(flash_pack: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(flash_pack, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = next(n for n in index["weight_map"] if n.endswith("experts.3.w1.trellis"))
    index["weight_map"]["layers.5.ffn.experts.999.w1.trellis"] = index["weight_map"][victim]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"experts\.999\.w1\.trellis: named by the index but not in the file"):
        ExpertHome(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model.safetensors.index.json and no"):
        ExpertHome(empty)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM trips torch's own deprecations
def test_loader_never_reads_routed_experts(flash_pack: Path) -> None:
    from vllm_dsv41.loader import Dsv41ModelLoader

    class Mapper:  # drops what upstream's V4.1 mapper drops
        def apply_list(self, names: list[str]) -> list[str]:
            return [n for n in names if not n.startswith("mtp.")]

    counts = {"tensors": 0, "bytes": 0}
    names = [n for n, _ in Dsv41ModelLoader._dense_weights(None, flash_pack, Mapper(), counts)]  # type: ignore[arg-type]
    assert names and not [n for n in names if expert_tensor(n) is not None]
    assert {"layers.5.ffn.gate.weight", "layers.5.ffn.shared_experts.w1.trellis"} <= set(names)
    assert counts["tensors"] == len(names)
