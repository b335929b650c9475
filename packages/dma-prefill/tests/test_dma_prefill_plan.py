from __future__ import annotations

import numpy as np
import pytest
import torch

from dma_prefill import PrefillConfig, PrefillPlan, choose_path
from dma_prefill.triton_compute import make_tiles


def test_plan_sorts_routes_by_expert(make_routing) -> None:
    ids, w = make_routing(100, 16, 4, seed=0)
    plan = PrefillPlan.build(ids, w, 16, 4)
    flat = ids.reshape(-1).numpy()
    np.testing.assert_array_equal(plan.counts, np.bincount(flat, minlength=16))
    assert plan.offsets[-1] == 400
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(plan.sorted_tokens.numpy(), order // 4)
    np.testing.assert_array_equal(plan.sorted_experts.numpy(), flat[order])
    np.testing.assert_array_equal(plan.sorted_weights.numpy(), w.reshape(-1).numpy()[order])
    for e in range(16):
        r0, r1 = plan.rows(e)
        assert (plan.sorted_experts[r0:r1] == e).all()
        toks = plan.sorted_tokens[r0:r1]
        assert (toks[1:] > toks[:-1]).all()  # stable: token order kept inside an expert
    assert plan.num_batches == 4 and plan.gpu_batches == (0, 1, 2, 3) and plan.cpu_batches == ()


def test_batches_runs_and_cpu_tail() -> None:
    # experts 0, 1, 3, 8, 9, 10, 11 routed; batch 1 (4..7) empty; B = 4, 16 experts
    ids = torch.tensor([[0, 1], [3, 8], [9, 10], [11, 0]])
    w = torch.full((4, 2), 0.5)
    plan = PrefillPlan.build(ids, w, 16, 4)
    assert plan.gpu_batches == (0, 2)
    assert plan.runs(0) == [(0, 2), (3, 4)] and plan.runs(2) == [(8, 12)] and plan.runs(1) == []
    assert plan.batch_rows(2) == (4, 8)
    tail = PrefillPlan.build(ids, w, 16, 4, cpu_tail_batches=1)
    assert tail.gpu_batches == (0,) and tail.cpu_batches == (2,)
    np.testing.assert_array_equal(tail.cpu_experts, [8, 9, 10, 11])
    np.testing.assert_array_equal(tail.gpu_experts, [0, 1, 3])
    everything = PrefillPlan.build(ids, w, 16, 4, cpu_tail_batches=5)
    assert everything.gpu_batches == () and everything.cpu_batches == (0, 2)


def test_gemm_tiles_cover_every_row_once(make_routing) -> None:
    ids, w = make_routing(300, 16, 3, seed=1)
    plan = PrefillPlan.build(ids, w, 16, 4)
    tiles, ranges = make_tiles(plan, 32)
    for b in plan.gpu_batches:
        t0, t1 = ranges[b]
        br0, br1 = plan.batch_rows(b)
        covered = np.zeros(br1 - br0, dtype=int)
        for le, a, c in tiles[t0:t1]:
            assert 0 < c - a <= 32
            covered[a:c] += 1
            e = plan.batch_range(b)[0] + le
            r0, r1 = plan.rows(e)
            assert r0 - br0 <= a and c <= r1 - br0
        assert (covered == 1).all()


def test_negative_ids_route_nowhere() -> None:
    """vLLM's padding rows (expert id -1): no batch reads them, the real routes plan as without them."""
    ids = torch.tensor([[3, -1], [-1, -1], [0, 3], [5, 1]])
    w = torch.rand(4, 2)
    plan = PrefillPlan.build(ids, w, 8, 4)
    assert plan.counts.tolist() == [1, 1, 0, 2, 0, 1, 0, 0]
    for e in range(8):
        r0, r1 = plan.rows(e)
        assert (plan.sorted_experts[r0:r1] == e).all() and r1 - r0 == plan.counts[e]
        for r in range(r0, r1):
            t = int(plan.sorted_tokens[r])
            j = int((ids[t] == e).nonzero()[0, 0])
            assert float(plan.sorted_weights[r]) == float(w[t, j])
    assert plan.gpu_batches == (0, 1) and plan.rows(0)[0] == 3  # the three -1 routes come first, unread


def test_plan_errors() -> None:
    w = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"topk_ids: 1 expert ids outside \[0, 16\)"):
        PrefillPlan.build(torch.tensor([[0, 16], [1, 2]]), w, 16, 4)
    with pytest.raises(ValueError, match="topk_weights shape"):
        PrefillPlan.build(torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 3), 16, 4)
    with pytest.raises(ValueError, match="integer"):
        PrefillPlan.build(torch.ones(2, 2), w, 16, 4)
    with pytest.raises(ValueError, match=r"\[T, top_k\]"):
        PrefillPlan.build(torch.tensor([0, 1]), torch.ones(2), 16, 4)


def test_step_path_rule() -> None:
    cfg = PrefillConfig(cpu_tail_batches=6)
    assert choose_path(1, 1, cfg) == "decode"
    assert choose_path(512, 4, cfg) == "decode"
    assert choose_path(513, 1, cfg) == "hybrid"
    assert choose_path(2048, 1, cfg) == "hybrid"
    assert choose_path(2048, 2, cfg) == "dma"
    assert choose_path(2049, 1, cfg) == "dma"
    assert choose_path(1000, 1, PrefillConfig()) == "dma"  # no CPU tail configured: no hybrid
    with pytest.raises(ValueError, match="prefetch_batches"):
        PrefillConfig(num_slots=4, prefetch_batches=5)
    with pytest.raises(ValueError, match="decode_max_tokens"):
        PrefillConfig(decode_max_tokens=4096, hybrid_max_tokens=2048)
