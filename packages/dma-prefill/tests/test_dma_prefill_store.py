from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from cpu_tier import exl3
from dma_prefill import PROJECTIONS, ExpertLayout, HostExpertStore, LayerSpec, StoreConfig


def test_flash_layout_numbers() -> None:
    """DeepSeek-V4.1-Flash: 3 x 4,423,680 B of trellis per expert (13.27 MB) plus 44,544 B of scales."""
    lay = ExpertLayout.build(LayerSpec(384, 5120, 2304), align=256)
    assert [lay.sizes[(p, "trellis")] for p in PROJECTIONS] == [4_423_680] * 3
    assert sum(lay.sizes[(p, t)] for p in PROJECTIONS for t in ("suh", "svh")) == 44_544
    assert lay.stride == 13_271_040 + 44_544
    for (p, t), off in lay.offsets.items():
        assert off % 256 == 0
        assert off + lay.sizes[(p, t)] <= lay.stride
    spans = sorted((off, off + lay.sizes[k]) for k, off in lay.offsets.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap


def test_exact_size_allocation_and_tail_pad(small_store: HostExpertStore) -> None:
    lay = small_store.layout(0)
    payload = 16 * lay.stride
    assert small_store.nbytes(0) == payload
    assert small_store.allocated_bytes(0) == payload + small_store.config.tail_pad
    assert small_store.buffer(0).numel() == payload + small_store.config.tail_pad
    # the mapping is rounded to the page only, never to a power of two
    assert len(small_store._layer(0).mm) - small_store.allocated_bytes(0) < mmap.PAGESIZE
    assert not small_store.buffer(0)[payload:].any()
    assert small_store.records(0).shape == (16, lay.stride)


def test_views_alias_the_store(small_store: HostExpertStore) -> None:
    t = small_store.read(1, 7, "down")
    assert (t.k, t.n, t.bits, t.codebook) == (128, 256, 3, "mul1")
    np.testing.assert_array_equal(small_store.numpy(1, 7, "down", "trellis"), t.trellis)
    off = small_store.offset(1, 7, "down", "svh")
    raw = small_store.buffer(1)[off : off + 2 * 256].view(torch.float16).numpy()
    np.testing.assert_array_equal(raw, t.svh)
    table = small_store.address_table(1)
    assert table.shape == (16, 3, 3)
    base = int(small_store.buffer(1).data_ptr())
    for e in (0, 7, 15):
        for pi, p in enumerate(PROJECTIONS):
            for ti, name in enumerate(("trellis", "suh", "svh")):
                assert table[e, pi, ti] - base == small_store.offset(1, e, p, name)
                assert table[e, pi, ti] == small_store.tensor(1, e, p, name).data_ptr()


def test_write_validates(small_store: HostExpertStore) -> None:
    with pytest.raises(ValueError, match="layer 0 expert 2 gate: shape"):
        small_store.write(0, 2, "gate", exl3.random_tensor(128, 128, 3, "mul1"))
    with pytest.raises(ValueError, match="codebook mcg"):
        small_store.write(0, 2, "gate", exl3.random_tensor(256, 128, 3, "mcg"))
    with pytest.raises(ValueError, match="K = 4"):
        small_store.write(0, 2, "gate", exl3.random_tensor(256, 128, 4, "mul1"))
    with pytest.raises(ValueError, match="bias"):
        small_store.write(0, 2, "gate", exl3.random_tensor(256, 128, 3, "mul1", bias=True))
    with pytest.raises(IndexError, match="expert 16"):
        small_store.tensor(0, 16, "gate", "suh")
    with pytest.raises(KeyError, match="layer 9"):
        small_store.spec(9)


def test_no_cuda_means_plain_memory(small_store: HostExpertStore) -> None:
    assert not small_store.is_registered(0)
    with pytest.raises(RuntimeError, match="no GPU-mapped view"):
        small_store.device_view(0)
    with pytest.raises(RuntimeError, match="not registered"):
        small_store.address_table(0, device=True)


def _write_shards(tmp_path, spec: LayerSpec, layers: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    names = dict(zip(PROJECTIONS, ("w1", "w3", "w2"), strict=True))
    src: dict[tuple[int, int, str], exl3.Exl3Tensor] = {}
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    for lid in layers:
        for e in range(spec.num_experts):
            for p in PROJECTIONS:
                ps = spec.proj(p)
                t = exl3.random_tensor(ps.k, ps.n, ps.bits, ps.codebook, rng)
                src[(lid, e, p)] = t
                shards[e % 2].update(t.to_tensors(f"layers.{lid}.ffn.experts.{e}.{names[p]}"))
    shards[0]["layers.0.attn.wq.weight"] = np.zeros((4, 4), np.float16)  # unrelated tensors are ignored
    paths = []
    for i, sh in enumerate(shards):
        path = tmp_path / f"model-{i:05d}.safetensors"
        save_file(sh, str(path))
        paths.append(path)
    return paths, src


def test_from_safetensors_infers_specs(tmp_path) -> None:
    spec = LayerSpec(6, 256, 128, bits=(2, 3, 4), codebooks=("mcg", "mul1", "3inst"))
    paths, src = _write_shards(tmp_path, spec, [3, 4])
    with HostExpertStore.from_safetensors(paths, StoreConfig(progress=False), use_cuda=False) as store:
        assert store.layer_ids == (3, 4)
        assert store.spec(3) == spec
        for (lid, e, p), t in src.items():
            got = store.read(lid, e, p)
            np.testing.assert_array_equal(got.trellis, t.trellis)
            np.testing.assert_array_equal(got.suh, t.suh)
            np.testing.assert_array_equal(got.svh, t.svh)
            assert got.codebook == t.codebook
    with HostExpertStore.from_safetensors(paths, StoreConfig(progress=False), layers=[4], use_cuda=False) as one:
        assert one.layer_ids == (4,)


def test_from_safetensors_errors_name_the_tensor(tmp_path) -> None:
    spec = LayerSpec(4, 256, 128)
    paths, _ = _write_shards(tmp_path, spec, [0])
    cfg = StoreConfig(progress=False)
    wrong = {0: LayerSpec(4, 256, 128, codebooks=("mcg", "mul1", "mul1"))}
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.\d\.w1: .*codebook mul1, layer spec wants mcg"):
        HostExpertStore.from_safetensors(paths, cfg, specs=wrong, use_cuda=False)
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.1\.w1\.trellis: missing \(searched model-00000"):
        HostExpertStore.from_safetensors(paths[:1], cfg, specs={0: spec}, use_cuda=False)
    with pytest.raises(ValueError, match="not numbered 0..E-1"):
        HostExpertStore.from_safetensors(paths[1:], cfg, use_cuda=False)
    with pytest.raises(ValueError, match="no routed-expert trellis"):
        HostExpertStore.from_safetensors(
            paths, StoreConfig(progress=False, key_template="x.{layer}.{expert}.{proj}.{tensor}"), use_cuda=False
        )
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        HostExpertStore.from_safetensors([tmp_path / "nope.safetensors"], cfg, use_cuda=False)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors: not a readable safetensors"):
        HostExpertStore.from_safetensors([bad], cfg, use_cuda=False)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="align"):
        StoreConfig(align=100)
    with pytest.raises(ValueError, match="key_template"):
        StoreConfig(key_template="layers.{layer}.{expert}")
    with pytest.raises(ValueError, match="LayerSpec.hidden"):
        LayerSpec(4, 200, 128)
    with pytest.raises(ValueError, match=r"LayerSpec.bits\[gate\]: K=2.5"):
        LayerSpec(4, 256, 128, bits=(2.5, 3, 3), codebooks=("mcg", "mul1", "mul1"))
