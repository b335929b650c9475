"""``ExternalExpertStore``: experts read in place from a safetensors file's bytes (no second copy), streamed
through the ring with two DMAs per expert, computed exactly like from a ``HostExpertStore``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dma_prefill import (
    PROJECTIONS,
    DmaPrefill,
    ExternalExpertStore,
    FakeDevice,
    HostExpertStore,
    PrefillConfig,
    PrefillPlan,
    StagingRing,
)
from dma_prefill.external import COLUMNS
from dma_prefill.reference import reference_moe

_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def _external(store: HostExpertStore, path: Path) -> ExternalExpertStore:
    """Write ``store``'s experts as one safetensors file (its serializer orders tensors by dtype, then name) and
    build an external store over the file's bytes."""
    tensors = {}
    for lid in store.layer_ids:
        for e in range(store.spec(lid).num_experts):
            for p in PROJECTIONS:
                for t in ("trellis", "suh", "svh"):
                    tensors[f"layers.{lid}.ffn.experts.{e}.{_NAMES[p]}.{t}"] = store.numpy(lid, e, p, t).copy()
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = torch.frombuffer(bytearray(raw[8 + n :]), dtype=torch.uint8)
    L, E = len(store.layer_ids), store.spec(store.layer_ids[0]).num_experts
    buffer = np.zeros((L, 9, E), np.int64)
    offset = np.zeros((L, 9, E), np.int64)
    for li, lid in enumerate(store.layer_ids):
        for c, (p, t) in enumerate(COLUMNS):
            for e in range(E):
                offset[li, c, e] = header[f"layers.{lid}.ffn.experts.{e}.{_NAMES[p]}.{t}"]["data_offsets"][0]
    return ExternalExpertStore({lid: store.spec(lid) for lid in store.layer_ids}, [data], buffer, offset)


@pytest.fixture(scope="module")
def external(small_store, tmp_path_factory) -> ExternalExpertStore:
    return _external(small_store, tmp_path_factory.mktemp("ext") / "experts.safetensors")


def test_views_are_the_source_bytes(small_store, external) -> None:
    for lid in small_store.layer_ids:
        for e in (0, 7, 15):
            for p in PROJECTIONS:
                for t in ("trellis", "suh", "svh"):
                    np.testing.assert_array_equal(external.numpy(lid, e, p, t), small_store.numpy(lid, e, p, t))
                v = external.view(lid, e, p)
                assert v.k == small_store.spec(lid).proj(p).k and v.n == small_store.spec(lid).proj(p).n


def test_two_dmas_per_expert_and_records_match(small_store, external) -> None:
    # safetensors puts every fp16 scale of the file before every int16 trellis: the record follows that order
    assert [t for _, t in external.record_order[:6]] == ["suh", "svh"] * 3
    lay = external.layout(0)
    for e0, e1 in ((0, 16), (3, 4), (5, 11)):
        segs = external.copy_segments(0, e0, e1)
        assert len(segs) == 2 * (e1 - e0)
        slot = torch.zeros((e1 - e0) * lay.stride, dtype=torch.uint8)
        for src, off in segs:
            slot[off : off + src.numel()] = src
        for e in range(e0, e1):
            for p in PROJECTIONS:
                for t in ("trellis", "suh", "svh"):
                    got = lay.view(slot, e - e0, p, t)
                    assert torch.equal(got, small_store.tensor(0, e, p, t)), (e, p, t)


def test_staged_prefill_from_the_external_store(small_store, external, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch")
    dev = FakeDevice(copy_gbps=2.0, launch_cost=1e-4)
    pf = DmaPrefill(external, cfg, device=dev)
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    for lid, seed in ((0, 1), (1, 2)):
        ids, w = make_routing(48, 16, 4, seed=seed)
        out = pf.run_layer(lid, x, PrefillPlan.build(ids, w, 16, 4), next_layer=1 - lid)
        dev.synchronize()
        ref = reference_moe(small_store, lid, x, ids, w)
        assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-6
    assert dev.violations == []
    assert pf.ring.copies > 0


def test_ring_on_a_given_buffer(small_store, external, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch")
    need = StagingRing.required_bytes(external, cfg)
    assert need == 2 * 4 * external.layout(0).stride + external.tail_pad
    with pytest.raises(ValueError, match="at least"):
        DmaPrefill(external, cfg, device=FakeDevice(), buffer=torch.zeros(need - 1, dtype=torch.uint8))
    lent = torch.zeros(need + 64, dtype=torch.uint8)
    dev = FakeDevice()
    pf = DmaPrefill(external, cfg, device=dev, buffer=lent)
    assert pf.ring.buffer.data_ptr() == lent.data_ptr()
    ids, w = make_routing(16, 16, 4, seed=9)
    x = torch.randn(16, 256)
    out = pf.run_layer(0, x, PrefillPlan.build(ids, w, 16, 4))
    dev.synchronize()
    ref = reference_moe(small_store, 0, x, ids, w)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-6
    assert lent.any()  # the ring wrote the given memory


def test_bad_addresses_are_named(small_store, external) -> None:
    buf = external.buffers[0]
    L, E = 2, 16
    offset = np.zeros((L, 9, E), np.int64)
    offset[1, 3, 5] = buf.numel() - 2  # layer 1 expert 5 up.trellis runs past the buffer
    with pytest.raises(ValueError, match=r"layer 1 expert 5 up\.trellis"):
        ExternalExpertStore({0: small_store.spec(0), 1: small_store.spec(1)}, [buf], np.zeros((L, 9, E)), offset)
    with pytest.raises(ValueError, match=r"must be \[2 layers, 9 tensors, 16 experts\]"):
        ExternalExpertStore({0: small_store.spec(0), 1: small_store.spec(1)}, [buf], np.zeros((2, 9, 3)), offset)
