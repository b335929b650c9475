"""The staged prefill inside the tiered runtime, on a CPU "device": dma-prefill's ring on its FakeDevice (every
slot read checked against the copy that filled it) streaming from the pack's mapped home, its memory lent by
the real ExpertCache; against the float64 reference, through decode -> prefill -> decode hand-overs."""

from __future__ import annotations

import numpy as np
import torch

from cpu_tier import CpuTierConfig
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41.config import TieredConfig
from vllm_dsv41.home import ExpertHome
from vllm_dsv41.prefill import Calibration, external_store
from vllm_dsv41.reference import ReferenceExperts
from vllm_dsv41.split import Rates
from vllm_dsv41.tiered import TieredRuntime

LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 8, 2, 256
RATES = Rates(cpu_bps=10e9, pcie_bps=10e9, source="test")


def _slot_bytes(home: ExpertHome) -> int:
    from expert_cache import ExpertCacheConfig

    src = home.cache_home(list(home.layer_ids))
    return ExpertCacheConfig(num_layers=LAYERS, num_experts=EXPERTS, projections=src.projections).slot_stride


def _runtime(home: ExpertHome, slots: int = 12, **tiered: object) -> TieredRuntime:
    fields: dict[str, object] = dict(hit_kernel="reference", replan_every=1, prefill_min_tokens=24,
                                     prefill_ring_slots=2, prefill_experts_per_batch=2, admit_limit=4)  # fmt: skip
    fields.update(tiered)
    t = TieredConfig(**fields)  # type: ignore[arg-type]
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, home, "cpu", rates=RATES, cache_bytes=max(slots * _slot_bytes(home), 1))
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    return rt


def _call(rt: TieredRuntime, layer: int, rng: np.random.Generator, tokens: int, hot: int = EXPERTS) -> tuple:
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    ids = np.stack([rng.choice(hot, size=TOP_K, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, size=(tokens, TOP_K)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    out = torch.full((tokens + 1, HIDDEN), float("nan"))
    rt.forward_into(layer, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
    assert torch.isnan(out[tokens:]).all()
    return layer, x, ids, w, out[:tokens].numpy().copy()


def _check(reference: ReferenceExperts, calls: list[tuple]) -> None:
    for layer, x, ids, w, out in calls:
        expected = reference.forward(layer, x, ids, w)
        np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())


def _pointers_into(cache, loan) -> int:  # type: ignore[no-untyped-def]
    lo = loan.buffer.data_ptr()
    ptrs = cache.pointer_table.numpy()
    return int(((ptrs >= lo) & (ptrs < lo + loan.buffer.numel())).sum())


def test_the_home_as_an_external_store(home: ExpertHome) -> None:
    """dma-prefill reads the pack's mapped files in place: every view is the home's own tensor, two DMAs per
    expert (the pack's scales and trellises are two runs)."""
    layers = {lx.layer: lx for lx in home.layers()}
    st = external_store(home, layers)
    for lid, lx in layers.items():
        for e in (0, EXPERTS - 1):
            for role in ("gate", "up", "down"):
                t = getattr(lx, role)[e]
                v = st.view(lid, e, role)
                assert v.trellis.ctypes.data == t.trellis.ctypes.data  # the same memory, not a copy
                assert v.suh.ctypes.data == t.suh.ctypes.data and v.svh.ctypes.data == t.svh.ctypes.data
        assert len(st.copy_segments(lid, 0, EXPERTS)) <= 2 * EXPERTS


def test_staged_calls_match_the_reference_and_hand_the_memory_back(home: ExpertHome,
                                                                   reference: ReferenceExperts) -> None:  # fmt: skip
    from prometheus_client import REGISTRY

    def metric(name: str, **labels: str) -> float:  # the plugin's dsv41_* series (in-process registry here)
        return REGISTRY.get_sample_value(name, labels) or 0.0

    streamed0, staged0 = metric("dsv41_expert_picks_total", tier="streamed"), metric("dsv41_prefill_staged_bytes_total")
    rt = _runtime(home)
    rng = np.random.default_rng(7)
    try:
        calls = []
        for _ in range(4):  # decode steps: the cache fills
            calls += [_call(rt, layer, rng, 2, hot=4) for layer in range(LAYERS)]
        cache = rt.cache
        pf = rt.prefill
        assert pf is not None and pf.calibration is not None and cache is not None
        calibration_bytes = pf.stats.bytes_copied
        resident = len(cache.resident())
        assert resident > 0 and cache.loan is None
        # a prefill chunk (and a mixed chunk: same rule, on the call's token count)
        for tokens in (40, 31):
            for layer in range(LAYERS):
                calls.append(_call(rt, layer, rng, tokens))
                loan = cache.loan
                assert loan is not None and _pointers_into(cache, loan) == 0  # nothing reads the lent slots
        assert pf.stats.calls == 2 * LAYERS and pf.stats.episodes == 1  # consecutive prefill steps: one loan
        assert len(cache.resident()) < resident or resident <= cache.num_slots - loan.num_slots
        # decode again: the memory goes back at the first call, the ring's bytes in it are never read
        for _ in range(4):
            calls += [_call(rt, layer, rng, 3, hot=4) for layer in range(LAYERS)]
            assert cache.loan is None
        _check(reference, calls)
        assert pf.violations == []  # every slot read found its own copy, none overwritten while read
        assert cache.stats().lends >= 1
        assert rt.stats.picks == TOP_K * (4 * 2 + 4 * 3) * LAYERS  # the decode calls only
        # metrics: the streamed picks and the episode's bytes (not the calibration's)
        assert metric("dsv41_expert_picks_total", tier="streamed") - streamed0 == TOP_K * (40 + 31) * LAYERS
        assert metric("dsv41_prefill_staged_bytes_total") - staged0 == pf.stats.bytes_copied - calibration_bytes > 0
    finally:
        rt.close()


def test_cross_layer_prefetch_order(home: ExpertHome) -> None:
    """While layer 0 finishes, the ring already copies layer 1's first batches (as many as it has slots)."""
    rt = _runtime(home, slots=12, prefill_ring_slots=2, prefill_experts_per_batch=2)
    rng = np.random.default_rng(3)
    try:
        _call(rt, 0, rng, 2)  # creates the cache and calibrates
        pf = rt.prefill
        _call(rt, 0, rng, 64)
        ring = pf._episode.pf.ring
        order = [(st.layer, st.batch) for st in ring.history]
        assert order[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]  # 8 experts, 2 per batch: every batch routed
        assert order[4:] == [(1, 0), (1, 1)]  # issued before layer 1 is called
        _call(rt, 1, rng, 64)
        order = [(st.layer, st.batch) for st in ring.history]
        assert order[4:] == [(1, 0), (1, 1), (1, 2), (1, 3)]  # the prefetched ones were used, not copied again
        assert pf.violations == [] and pf._episode.device.violations == []
    finally:
        rt.close()


def test_the_step_rule(home: ExpertHome) -> None:
    """Below the crossover of the calibrated cost model a call stays on the decode path; above it streams; a
    configured minimum wins; nothing streams before calibration unless configured."""
    rt = _runtime(home, prefill_min_tokens=0)
    rng = np.random.default_rng(1)
    try:
        _call(rt, 0, rng, 1)
        pf = rt.prefill
        c = pf.calibration
        assert c is not None and c.h2d_bps > 0 and c.gpu_expert_s >= 0 and c.gpu_row_s >= 0
        # a machine where a streamed expert costs 10 decode-path experts' time per row: stream only big calls
        pf.calibration = Calibration(h2d_bps=1e9, gpu_expert_s=1e-5, gpu_row_s=1e-7, source="test")
        pf._thresholds.clear()
        model = pf.cost_model(TOP_K)
        lo, _ = pf.thresholds(TOP_K)
        assert 1 < lo < 4096
        assert model.best_path(lo - 1, hybrid=False) == "decode" and model.best_path(lo, hybrid=False) == "dma"
        assert not pf.wants(lo - 1, TOP_K) and pf.wants(lo, TOP_K) and pf.wants(8192, TOP_K)
        assert not pf.wants(1, TOP_K)
    finally:
        rt.close()
    # the decode path's misses at the split's rate: CPU alone (10 GB/s here) is slower than CPU + PCIe (20), so
    # streaming starts at fewer tokens with split "cpu" than with "auto"
    los = {}
    for split in ("cpu", "auto"):
        rt = _runtime(home, prefill_min_tokens=0, split=split)
        try:
            _call(rt, 0, rng, 1)
            rt.prefill.calibration = Calibration(h2d_bps=1e9, gpu_expert_s=1e-5, gpu_row_s=1e-7, source="test")
            rt.prefill._thresholds.clear()
            los[split] = rt.prefill.thresholds(TOP_K)[0]
        finally:
            rt.close()
    assert los["cpu"] < los["auto"]
    rt = _runtime(home, prefill_min_tokens=100)
    try:
        _call(rt, 0, rng, 1)
        assert rt.prefill.thresholds(TOP_K)[0] == 100 and rt.prefill.wants(100, TOP_K)
        assert not rt.prefill.wants(99, TOP_K)
    finally:
        rt.close()
    rt = _runtime(home, prefill=False)
    try:
        _call(rt, 0, rng, 64)
        assert rt.prefill is None and rt.stats.picks == 64 * TOP_K
    finally:
        rt.close()


def test_the_decode_paths_miss_rate_by_tokens_per_expert() -> None:
    """The step rule's decode-path miss rate follows the split and the CPU tier's measured points."""
    from vllm_dsv41.prefill import miss_gbps

    r = Rates(cpu_bps=10e9, pcie_bps=5e9, cpu_tokens=((2, 8e9), (8, 4e9)))
    assert miss_gbps(r, "cpu") == {1: 10.0, 2: 8.0, 8: 4.0}
    assert miss_gbps(r, "pcie") == {1: 5.0, 2: 5.0, 8: 5.0}
    assert miss_gbps(r, "auto") == {1: 15.0, 2: 13.0, 8: 9.0}
    # no measured points: one token's time up to the tier's chunk of 8, not 8 tokens' (the former single point)
    assert miss_gbps(Rates(cpu_bps=10e9, pcie_bps=0), "cpu") == {1: 10.0, 8: 10.0}


def test_cpu_tail_on_hybrid_calls(home: ExpertHome, reference: ReferenceExperts) -> None:
    """With a CPU tail, calls up to the hybrid limit leave their last batches to the CPU tier (same result)."""
    rt = _runtime(home, prefill_cpu_tail_batches=1)
    rng = np.random.default_rng(11)
    try:
        calls = [_call(rt, 0, rng, 2)]
        pf = rt.prefill
        pf._thresholds[TOP_K] = (24, 48)  # streamed from 24 tokens, the CPU tail up to 48
        calls += [_call(rt, layer, rng, 40) for layer in range(LAYERS)]
        calls += [_call(rt, layer, rng, 64) for layer in range(LAYERS)]
        _check(reference, calls)
        assert pf.violations == []
    finally:
        rt.close()
