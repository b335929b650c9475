"""ExpertTier.stream_call: the layer call a device stream drives through two host functions (here run on the test's
thread, as a CPU device does). Each CPU pick's row equals the same picks through ``forward`` bit for bit, every
other row is zero, the deadline and failures list their picks in ``missing``, and bad buffers are refused by name."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cpu_tier import CpuTierConfig, ExpertTier, Picks, runnable_isas
from cpu_tier.testing import ref_moe, rel_rms

ISAS = runnable_isas()
H = 256


def _buffers(rng: np.random.Generator, t: int, k: int, e: int) -> dict[str, np.ndarray]:
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[rng.random((t, k)) < 0.15] = -1  # padding / no pick
    ids[0, 0] = rng.integers(e)
    hit = rng.random((t, k)) < 0.3
    hit[0, 0] = False  # at least one CPU pick
    return {
        "x": (rng.standard_normal((t, H)) * 4).astype(np.float32),
        "ids": ids,
        "weights": rng.uniform(0.05, 1.0, size=(t, k)).astype(np.float32),
        "hit": hit,
        "xrows": np.full((t * k, H), np.nan, np.float32),
        "out": np.full((t * k, H), np.nan, np.float32),
        "missing": np.full((t, k), 7, np.int32),
    }


def _all_cpu_buffers(rng: np.random.Generator, t: int, k: int, e: int) -> dict[str, np.ndarray]:
    """``_buffers`` with every pick real and on the CPU tier (no padding, no hits)."""
    b = _buffers(rng, t, k, e)
    b["ids"][:] = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
    b["hit"][:] = False
    return b


def _cpu_picks(b: dict[str, np.ndarray]) -> np.ndarray:
    return np.flatnonzero((b["ids"].reshape(-1) >= 0) & ~b["hit"].reshape(-1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("t", [1, 5])
def test_rows_equal_forward_of_the_same_picks(small_experts, isa: str, precision: str, t: int) -> None:
    rng = np.random.default_rng(t * 31 + len(isa))
    k = 3
    b = _buffers(rng, t, k, 6)
    cfg = CpuTierConfig(threads=2, isa=isa, precision=precision)  # type: ignore[arg-type]
    with ExpertTier(cfg) as tier:
        tier.add_layer(0, *small_experts)
        call = tier.stream_call(0, **b)
        for _ in range(2):  # a call runs again with the buffers' new contents
            b["x"][:] = (rng.standard_normal((t, H)) * 4).astype(np.float32)
            call.submit()
            call.wait()
            cpu = _cpu_picks(b)
            flat_ids = b["ids"].reshape(-1)
            xr = np.zeros((t * k, H), np.float32)
            xr[cpu] = b["x"][cpu // k]
            want = tier.forward(0, xr, Picks(cpu.astype(np.int32), flat_ids[cpu], b["weights"].reshape(-1)[cpu]))
            np.testing.assert_array_equal(b["out"], want)  # the same picks in the same order: the same bits
            others = np.setdiff1d(np.arange(t * k), cpu)
            assert np.all(b["out"][others] == 0.0)
            assert np.all(b["missing"] == -1)
            ref = ref_moe(xr, Picks(cpu.astype(np.int32), flat_ids[cpu], b["weights"].reshape(-1)[cpu]), small_experts,
                          cfg.swiglu_limit)  # fmt: skip
            assert rel_rms(b["out"], ref) <= (1e-5 if precision == "exact" else 5e-3)
        c = call.counters()
        assert c.calls == 2 and c.picks == 2 * cpu.size and c.errors == 0 and c.missed_picks == 0
        assert c.run_s > 0 and c.span_s >= c.run_s and c.predicted_s == 0.0


def test_host_function_addresses_run_the_call(small_experts) -> None:
    # What a CUDA stream calls: void fn(void*) at submit_fn / wait_fn with the call's address.
    rng = np.random.default_rng(3)
    b = _buffers(rng, 2, 3, 6)
    with ExpertTier(CpuTierConfig(threads=1, isa=ISAS[0])) as tier:
        tier.add_layer(0, *small_experts)
        call = tier.stream_call(0, **b)
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        fn(call.submit_fn)(call.address)
        fn(call.wait_fn)(call.address)
        cpu = _cpu_picks(b)
        assert call.counters().picks == cpu.size
        assert np.isfinite(b["out"]).all() and np.all(b["missing"] == -1)
        assert (np.abs(b["out"][cpu]).sum(axis=1) > 0).all()


def test_deadline_lists_the_picks_not_computed(small_experts) -> None:
    rng = np.random.default_rng(5)
    t, k = 8, 3
    b = _all_cpu_buffers(rng, t, k, 6)
    with ExpertTier(CpuTierConfig(threads=1, isa=ISAS[0], precision="exact")) as tier:
        tier.add_layer(0, *small_experts)
        full = tier.stream_call(0, **{**b, "out": np.empty_like(b["out"]), "missing": np.empty_like(b["missing"])})
        full.submit()
        full.wait()
        # a deadline of ~0: the wait cancels the job at once
        call = tier.stream_call(0, **b, deadline_factor=1.0, deadline_floor_s=0.0, expert_s=[1e-9] * 8)
        call.submit()
        call.wait()
        c = call.counters()
        assert c.deadline_misses == 1 and c.calls == 1
        flat_ids = b["ids"].reshape(-1)
        miss = np.flatnonzero(b["missing"].reshape(-1) >= 0)
        assert miss.size == c.missed_picks > 0
        np.testing.assert_array_equal(b["missing"].reshape(-1)[miss], flat_ids[miss])
        assert np.all(b["out"][miss] == 0.0)
        done = np.setdiff1d(np.arange(t * k), miss)
        full_out = full._keep[5]
        np.testing.assert_array_equal(b["out"][done], full_out[done])  # what it finished is what a full run gives
        assert 0 < c.predicted_s < 1e-6


def test_a_job_stopped_early_lists_the_rest(small_experts) -> None:
    rng = np.random.default_rng(12)
    t, k = 8, 3
    b = _all_cpu_buffers(rng, t, k, 6)
    with ExpertTier(CpuTierConfig(threads=1, isa=ISAS[0])) as tier:
        tier.add_layer(0, *small_experts)
        call = tier.stream_call(0, **b, _test_cancel_after_chunks=2)
        call.submit()
        call.wait()
        c = call.counters()
        miss = np.flatnonzero(b["missing"].reshape(-1) >= 0)
        assert c.deadline_misses == 0 and 0 < c.missed_picks == miss.size < t * k
        assert np.all(b["out"][miss] == 0.0)
        done = np.setdiff1d(np.arange(t * k), miss)
        assert (np.abs(b["out"][done]).sum(axis=1) > 0).all()


def test_bad_expert_ids_and_a_closed_tier_go_to_missing(small_experts) -> None:
    rng = np.random.default_rng(9)
    b = _buffers(rng, 3, 2, 6)
    b["ids"][:] = [[0, 9], [1, -1], [2, 3]]
    b["hit"][:] = False
    tier = ExpertTier(CpuTierConfig(threads=1, isa=ISAS[0]))
    tier.add_layer(0, *small_experts)
    call = tier.stream_call(0, **b)
    call.submit()
    call.wait()
    assert b["missing"].tolist() == [[-1, 9], [-1, -1], [-1, -1]]
    assert call.counters().errors == 1 and "out of range" in call.last_error
    assert np.all(b["out"][1] == 0.0) and np.all(b["out"][3] == 0.0)
    tier.close()  # a call queued after the tier closed: nothing computed, every CPU pick listed, nothing raised
    b["ids"][:] = [[0, 1], [1, -1], [2, 3]]
    call.submit()
    call.wait()
    assert b["missing"].tolist() == [[0, 1], [1, -1], [2, 3]]
    assert np.all(b["out"] == 0.0)
    assert "closed" in call.last_error


def test_bad_buffers_are_refused_by_name(small_experts) -> None:
    rng = np.random.default_rng(1)
    with ExpertTier(CpuTierConfig(threads=1, isa=ISAS[0])) as tier:
        tier.add_layer(0, *small_experts)
        good = _buffers(rng, 2, 3, 6)
        cases = {
            "ids": good["ids"].astype(np.int64),
            "weights": good["weights"][:, :2].copy(),
            "hit": good["hit"].astype(np.int32),
            "xrows": np.zeros((5, H), np.float32),
            "out": np.zeros((6, H + 128), np.float32),
            "missing": good["missing"].astype(np.int64),
        }
        for name, bad in cases.items():
            with pytest.raises(ValueError, match=name):
                tier.stream_call(0, **{**good, name: bad})
        with pytest.raises(ValueError, match="out: must not overlap xrows"):
            tier.stream_call(0, **{**good, "out": good["xrows"]})
        with pytest.raises(ValueError, match="expert_s"):
            tier.stream_call(0, **good, expert_s=[1.0])
        with pytest.raises(ValueError, match="deadline_factor"):
            tier.stream_call(0, **good, deadline_factor=-1.0)
        with pytest.raises(ValueError, match="layer 4"):
            tier.stream_call(4, **good)
