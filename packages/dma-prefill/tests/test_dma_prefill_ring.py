"""The staging ring and the runner on the fake device: slot reuse, event order, exactly-once compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dma_prefill import DmaPrefill, FakeDevice, PrefillConfig, PrefillPlan, StagingRing
from dma_prefill.device import FakeOp
from dma_prefill.reference import reference_expert, reference_moe


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _run_layers(pf: DmaPrefill, layers, x, plans, sync_each: bool = True):
    outs = []
    for i, lid in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        outs.append(pf.run_layer(lid, x, plans[i], next_layer=nxt))
        if sync_each:
            pf.device.synchronize()
    pf.device.synchronize()
    return outs


def test_every_routed_expert_once_and_correct(small_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch")  # 4 batches a layer over 2 slots
    dev = FakeDevice(copy_gbps=2.0, launch_cost=2e-4)
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    routes = [make_routing(64, 16, 4, seed=s) for s in (1, 2, 3)]
    plans = [PrefillPlan.build(i, w, 16, 4) for i, w in routes]
    layers = [0, 1, 0]
    outs = _run_layers(pf, layers, x, plans)
    assert dev.violations == []
    for lid, out, (ids, w) in zip(layers, outs, routes, strict=True):
        assert _rel(out, reference_moe(small_store, lid, x, ids, w)) < 2e-6
    done = pf.compute.computed
    assert len(done) == len(set(done)) + 16  # layer 0 ran twice: 16 repeats, nothing else twice
    expected = sorted((lid, int(e)) for lid, p in zip(layers, plans, strict=True) for e in p.gpu_experts)
    assert sorted(done) == expected
    slots = [st.slot for st in pf.ring.history]
    assert slots == [s % 2 for s in range(len(slots))] and len(slots) == 12


def _ops(dev: FakeDevice, kind: str) -> list[FakeOp]:
    return [op for op in dev.trace if op.kind == kind]


def test_event_order_per_slot(small_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=3, experts_per_batch=2, backend="torch")  # 8 batches a layer over 3 slots
    dev = FakeDevice(copy_gbps=1.0, launch_cost=lambda label: 3e-4 if label.endswith("b5") else 1e-4)
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(32, 256)
    plans = [PrefillPlan.build(*make_routing(32, 16, 6, seed=s), 16, 2) for s in (4, 5)]
    _run_layers(pf, [0, 1], x, plans, sync_each=False)
    assert dev.violations == []
    copies = {}
    for op in _ops(dev, "copy"):
        slot, _, (layer, e) = op.writes[0]
        copies.setdefault((layer, e // 2), []).append(op)
    launches = {op.label: op for op in _ops(dev, "launch")}
    hist = pf.ring.history
    for st in hist:
        lab = f"L{st.layer}b{st.batch}"
        cps = copies[(st.layer, st.batch)]
        assert max(c.end for c in cps) <= launches[lab].start  # compute after its copy
    for a, b in zip(hist, hist[cfg.num_slots :], strict=False):
        assert a.slot == b.slot
        reader = launches[f"L{a.layer}b{a.batch}"]
        assert reader.end <= min(c.start for c in copies[(b.layer, b.batch)])  # slot reused only after its reader


class _NoFreeWait(FakeDevice):
    """A broken device that drops the copy stream's waits: the ring's protection is gone."""

    copy_stream_name = "copy"

    def wait(self, stream, event) -> None:
        if stream.name == self.copy_stream_name:
            return
        super().wait(stream, event)


def test_missing_slot_wait_is_detected(small_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch")
    dev = _NoFreeWait(copy_gbps=100.0, launch_cost=1e-3)  # compute much slower than copies
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(64, 256)
    ids, w = make_routing(64, 16, 4, seed=9)
    out = _run_layers(pf, [0], x, [PrefillPlan.build(ids, w, 16, 4)])[0]
    assert any("while a launch reads it" in v for v in dev.violations)
    assert any("expects" in v for v in dev.violations)
    assert _rel(out, reference_moe(small_store, 0, x, ids, w)) > 1e-2  # and the numbers are wrong


def test_ring_refuses_overrun(small_store) -> None:
    dev = FakeDevice()
    ring = StagingRing(small_store, PrefillConfig(num_slots=2, experts_per_batch=4), dev)
    a = ring.issue(0, 0)
    ring.issue(0, 1)
    assert not ring.can_issue()
    with pytest.raises(RuntimeError, match="ring overrun: batch seq 2 needs slot 0"):
        ring.issue(0, 2)
    with pytest.raises(RuntimeError, match="already staged"):
        ring.issue(0, 1)
    ring.acquire(0, 0, dev.current_stream())
    with pytest.raises(RuntimeError, match="acquired twice"):
        ring.acquire(0, 0, dev.current_stream())
    ring.release(a, dev.current_stream())
    with pytest.raises(RuntimeError, match="not staged"):
        ring.release(a, dev.current_stream())
    assert ring.can_issue()
    ring.issue(0, 2)
    with pytest.raises(ValueError, match="outside the batch"):
        StagingRing(small_store, PrefillConfig(num_slots=2, experts_per_batch=4), dev).issue(0, 1, runs=[(0, 2)])
    dev.synchronize()
    assert dev.violations == []


def _busy_fraction(prefetch: int, small_store, make_routing) -> tuple[float, float]:
    """3 layers, 8 batches each, copy 1 ms and compute 0.5 ms per batch, 3 ms of 'attention' between layers."""
    cfg = PrefillConfig(num_slots=4, experts_per_batch=2, prefetch_batches=prefetch, backend="torch")
    stride = small_store.layout(0).stride
    dev = FakeDevice(copy_gbps=2 * stride / 1e-3 / 1e9, launch_cost=lambda lab: 3e-3 if lab == "attn" else 5e-4)
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(64, 256)
    for i, lid in enumerate([0, 1, 0]):
        # the router's output reaches the host only after the compute stream got there (attention included)
        dev.synchronize(dev.current_stream())
        plan = PrefillPlan.build(*make_routing(64, 16, 4, seed=20 + i), 16, 2)
        pf.run_layer(lid, x, plan, next_layer=[1, 0, None][i])
        dev.launch(dev.current_stream(), None, label="attn")
    dev.synchronize()
    assert dev.violations == []
    copies = _ops(dev, "copy")
    t0, t1 = copies[0].start, copies[-1].end
    return dev.busy("copy") / (t1 - t0), dev.busy("launch")


def test_cross_layer_prefetch_keeps_the_copy_engine_busy(small_store, make_routing) -> None:
    with_prefetch, _ = _busy_fraction(4, small_store, make_routing)
    without, _ = _busy_fraction(0, small_store, make_routing)
    assert with_prefetch > 0.999  # the copy engine never waits
    assert without < 0.8  # it idles through every attention block


def test_cpu_tail_batches_are_not_streamed(small_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, cpu_tail_batches=1, prefetch_batches=0, backend="torch")
    dev = FakeDevice()
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(48, 256)
    ids, w = make_routing(48, 16, 2, seed=7)
    plan = PrefillPlan.build(ids, w, 16, 4, cpu_tail_batches=1)
    assert plan.cpu_batches == (3,)
    seen = []
    order = []

    class RefTail:
        swiglu_limit = None

        def begin(self, layer: int, xx: torch.Tensor, p: PrefillPlan) -> PrefillPlan:
            order.append(("begin", len(pf.ring.history)))
            return p

        def finish(self, p: PrefillPlan, out: torch.Tensor) -> None:
            order.append(("finish", len(pf.ring.history)))
            for e in p.cpu_experts.tolist():
                r0, r1 = p.rows(e)
                tok = p.sorted_tokens[r0:r1]
                y = reference_expert(small_store, 0, e, x[tok], dtype=torch.float32)
                out.index_add_(0, tok, y * p.sorted_weights[r0:r1, None])
                seen.append(e)

    with pytest.raises(ValueError, match="no cpu_tail"):
        pf.run_layer(0, x, plan)
    clamped = RefTail()
    clamped.swiglu_limit = 10.0
    with pytest.raises(ValueError, match="clamps SwiGLU"):
        pf.run_layer(0, x, plan, cpu_tail=clamped)
    order.clear()
    out = pf.run_layer(0, x, plan, cpu_tail=RefTail())
    dev.synchronize()
    assert sorted(seen) == [12, 13, 14, 15]
    assert order == [("begin", 0), ("finish", 3)]  # begun before the GPU batches were queued, finished after
    assert {e for _, e in pf.compute.computed} == set(range(12))
    assert all(st.batch != 3 for st in pf.ring.history)
    assert _rel(out, reference_moe(small_store, 0, x, ids, w)) < 2e-6


def test_partial_batches_copy_only_routed_experts(small_store) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, prefetch_batches=0, backend="torch")
    dev = FakeDevice()
    pf = DmaPrefill(small_store, cfg, device=dev)
    ids = torch.tensor([[0, 2], [2, 3], [9, 15]])
    w = torch.full((3, 2), 0.5)
    plan = PrefillPlan.build(ids, w, 16, 4)
    x = torch.randn(3, 256)
    out = pf.run_layer(0, x, plan)
    dev.synchronize()
    assert pf.ring.bytes_issued == 5 * small_store.layout(0).stride  # experts 0, 2, 3, 9, 15
    assert [st.present for st in pf.ring.history] == [(0, 2, 3), (9,), (15,)]
    assert _rel(out, reference_moe(small_store, 0, x, ids, w)) < 2e-6
    assert dev.violations == []


def test_stale_prefetch_is_released(small_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch")
    dev = FakeDevice()
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(40, 256)
    ids, w = make_routing(40, 16, 4, seed=8)
    plan = PrefillPlan.build(ids, w, 16, 4)
    pf.run_layer(0, x, plan, next_layer=1)  # prefetches layer 1 ...
    out = pf.run_layer(0, x, plan)  # ... which never runs
    dev.synchronize()
    assert dev.violations == []
    assert _rel(out, reference_moe(small_store, 0, x, ids, w)) < 2e-6


def test_mixed_codebooks_and_bits(mixed_store, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=3, backend="torch")
    dev = FakeDevice()
    pf = DmaPrefill(mixed_store, cfg, device=dev)
    x = torch.randn(24, 256)
    ids, w = make_routing(24, 8, 3, seed=10)
    out = pf.run_layer(5, x, PrefillPlan.build(ids, w, 8, 3))
    dev.synchronize()
    assert _rel(out, reference_moe(mixed_store, 5, x, ids, w)) < 2e-6


def test_run_layer_validates(small_store, make_routing) -> None:
    pf = DmaPrefill(small_store, PrefillConfig(num_slots=2, experts_per_batch=4, backend="torch"), device=FakeDevice())
    ids, w = make_routing(8, 16, 2, seed=0)
    plan = PrefillPlan.build(ids, w, 16, 4)
    with pytest.raises(ValueError, match=r"x must be \[8, 256\]"):
        pf.run_layer(0, torch.randn(8, 128), plan)
    with pytest.raises(ValueError, match="batches of 8"):
        pf.run_layer(0, torch.randn(8, 256), PrefillPlan.build(ids, w, 16, 8))
    with pytest.raises(ValueError, match="out must be float32"):
        pf.run_layer(0, torch.randn(8, 256), plan, out=torch.zeros(8, 256, dtype=torch.float16))
    assert np.all(np.asarray(pf.compute.computed) == np.zeros((0,)))  # nothing ran


def test_cpu_tier_tail_computes_the_tail_on_the_host(small_store, make_routing) -> None:
    from cpu_tier import CpuTierConfig, ExpertTier
    from dma_prefill import CpuTierTail

    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, cpu_tail_batches=2, prefetch_batches=0, backend="torch")
    dev = FakeDevice()
    pf = DmaPrefill(small_store, cfg, device=dev)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    ids, w = make_routing(40, 16, 3, seed=5)
    plan = PrefillPlan.build(ids, w, 16, 4, cpu_tail_batches=2)
    assert plan.cpu_batches == (2, 3)
    with ExpertTier(CpuTierConfig(threads=1, precision="exact", swiglu_limit=None)) as tier:
        tail = CpuTierTail(small_store, tier, swiglu_limit=None, layers=(0,))
        with pytest.raises(ValueError, match="layer 1 was not registered"):
            pf.run_layer(1, x, PrefillPlan.build(ids, w, 16, 4, cpu_tail_batches=2), cpu_tail=tail)
        out = pf.run_layer(0, x, plan, cpu_tail=tail)
        dev.synchronize()
    assert {e for _, e in pf.compute.computed} == set(range(8))  # batches 0, 1 on the "GPU"
    assert _rel(out, reference_moe(small_store, 0, x, ids, w)) < 1e-5
    # the tail alone equals the reference restricted to experts 8..15
    tail_only = reference_moe(small_store, 0, x, ids, w * (ids >= 8))
    gpu_only = reference_moe(small_store, 0, x, ids, w * (ids < 8))
    assert _rel(out.double() - gpu_only, tail_only) < 1e-5
