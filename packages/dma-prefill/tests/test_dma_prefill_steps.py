"""StepCostModel: the step-size rule from measured rates."""

from __future__ import annotations

import dataclasses

import pytest

from dma_prefill import StepCostModel, chunked_expert_seconds, derive_thresholds


def test_h200_model_reproduces_the_measured_layers() -> None:
    m = StepCostModel.h200_session()
    assert m.touched(1) == pytest.approx(6.0)
    assert m.touched(32768) == pytest.approx(384.0)
    assert m.dma_s(2048) == pytest.approx(384 * 13_315_584 / 55.2e9)  # copy-bound: the transfer ceiling
    assert m.dma_s(32768) == pytest.approx(98.0e-3, rel=0.01)  # compute-bound, as measured
    assert m.dma_s(2048) < m.dma_s(32768)


def test_cpu_expert_time_interpolates_and_chunks() -> None:
    m = StepCostModel.h200_session()
    for tok, gbps in m.cpu_gbps.items():
        assert m.cpu_expert_s(tok) == pytest.approx(m.expert_bytes / (gbps * 1e9))
    times = [m.cpu_expert_s(t) for t in range(1, 40)]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert m.cpu_expert_s(16) == pytest.approx(2 * m.cpu_expert_s(8))  # chunks of the largest measured count
    assert m.cpu_expert_s(3) == pytest.approx((m.cpu_expert_s(2) + m.cpu_expert_s(4)) / 2)


def test_chunked_expert_seconds_alone() -> None:
    one = {1: 2.0}  # one point at m = 1: every token costs one expert's time
    assert [chunked_expert_seconds(one, m) for m in (1, 2, 5)] == [2.0, 4.0, 10.0]
    flat = {1: 2.0, 8: 2.0}  # memory-bound up to the chunk of 8
    assert [chunked_expert_seconds(flat, m) for m in (1, 3, 8, 9, 16, 17)] == [2.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    pts = {2: 3.0, 4: 5.0}  # no point at 1: a lone expert costs the smallest point's time
    assert chunked_expert_seconds(pts, 1) == 3.0 and chunked_expert_seconds(pts, 3) == 4.0
    assert chunked_expert_seconds(pts, 5) == pytest.approx(5.0 + 3.0 * 1 / 2)  # 4 + a remainder of 1 (1/2 of m=2)
    assert chunked_expert_seconds(pts, 0) == 0.0
    for bad in ({}, {0: 1.0}, {1: -1.0}):
        with pytest.raises(ValueError, match="chunked_expert_seconds"):
            chunked_expert_seconds(bad, 1)


def test_paths_follow_the_rates() -> None:
    m = StepCostModel.h200_session()
    # everything cached: no transfer, no CPU work: decode wins small steps
    cached = dataclasses.replace(m, cache_hit_rate=1.0)
    assert cached.best_path(1) == "decode" and cached.best_path(64) == "decode"
    # a slow link and no cache: the CPU tier takes small steps alone
    slow = dataclasses.replace(m, h2d_gbps=0.01, cache_hit_rate=0.0)
    assert slow.best_path(1) == "decode" and slow.best_path(64) == "decode"
    # a slow CPU: stream everything once the step touches every expert
    weak = dataclasses.replace(m, cpu_gbps={1: 0.5, 8: 0.1}, cache_hit_rate=0.0)
    assert weak.best_path(4096) == "dma"
    # big chunks: the CPU's per-token cost leaves it nothing to take
    assert m.best_path(32768) == "dma" and m.hybrid_s(32768)[1] == 0.0


def test_derive_thresholds_agrees_with_best_path() -> None:
    cached = dataclasses.replace(StepCostModel.h200_session(), cache_hit_rate=0.9)
    d, h = derive_thresholds(cached, max_tokens=16384)
    assert 0 < d < h < 16384
    assert all(cached.best_path(t) == "decode" for t in (1, d // 2, d))
    assert cached.best_path(d + 1) != "decode"
    assert cached.best_path(h) == "hybrid" and cached.best_path(2 * h) == "dma"
    d2, h2 = derive_thresholds(StepCostModel.h200_session())
    assert (d2, h2) == (0, 8192)  # this machine: copy engine + CPU together beat either alone below ~8k tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_k", 0, "top_k"),
        ("expert_bytes", 0, "expert_bytes"),
        ("h2d_gbps", -1.0, "h2d_gbps"),
        ("gpu_row_s", -1e-6, "gpu_row_s"),
        ("cpu_gbps", {}, "cpu_gbps"),
        ("cpu_gbps", {0: 5.0}, "cpu_gbps"),
        ("cache_hit_rate", 1.5, "cache_hit_rate"),
    ],
)
def test_bad_parameters_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(StepCostModel.h200_session(), **{field: value})
    with pytest.raises(ValueError, match="tokens"):
        StepCostModel.h200_session().best_path(-1)
