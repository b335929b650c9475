"""The miss split's cost model: balanced finish times, the forced modes, determinism, bad input."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest

from vllm_dsv41.split import Rates, share_quota_table, split_misses

MB = 1_000_000


def _brute_best(n: int, cost_cpu: float, cost_pcie: float, busy: float) -> float:
    """The best makespan over every count of experts sent over PCIe (experts cost the same)."""
    return min(max((n - p) * cost_cpu, busy + p * cost_pcie) for p in range(n + 1))


@pytest.mark.parametrize("seed", range(20))
def test_auto_split_is_optimal_for_equal_experts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    experts = rng.choice(384, size=n, replace=False)
    tokens = rng.integers(1, 8, size=n)
    rates = Rates(cpu_bps=float(rng.uniform(5, 100)) * 1e9, pcie_bps=float(rng.uniform(5, 50)) * 1e9)
    busy = float(rng.uniform(0, 2e-3))
    plan = split_misses(experts, tokens, 13 * MB, rates, "auto", gpu_busy_seconds=busy)
    assert plan.pcie.shape == (n,) and plan.pcie.dtype == bool
    c, p = 13 * MB / rates.cpu_bps, 13 * MB / rates.pcie_bps
    k = int(plan.pcie.sum())
    assert math.isclose(plan.cpu_seconds, (n - k) * c) and math.isclose(plan.pcie_seconds, busy + k * p)
    # greedy on equal jobs is optimal up to one job's cost
    assert plan.predicted_seconds <= _brute_best(n, c, p, busy) + 1e-12 + min(c, p)
    # the same input gives the same plan
    again = split_misses(experts, tokens, 13 * MB, rates, "auto", gpu_busy_seconds=busy)
    assert np.array_equal(plan.pcie, again.pcie)


def test_most_used_experts_go_first() -> None:
    rates = Rates(cpu_bps=10e9, pcie_bps=10e9)
    experts = np.array([5, 9, 2, 7])
    tokens = np.array([1, 4, 1, 3])
    plan = split_misses(experts, tokens, 10 * MB, rates, "auto")
    # equal rates, in the order 9 (4 tokens), 7 (3), 2 (1), 5 (1; ties by id): ties go to the CPU, so 9 -> CPU,
    # 7 -> PCIe, 2 -> CPU, 5 -> PCIe
    assert plan.pcie.tolist() == [True, False, False, True]


def test_forced_modes_and_missing_rates() -> None:
    experts, tokens = np.arange(6), np.ones(6, int)
    r = Rates(cpu_bps=50e9, pcie_bps=20e9)
    assert not split_misses(experts, tokens, MB, r, "cpu").pcie.any()
    assert split_misses(experts, tokens, MB, r, "pcie").pcie.all()
    # no PCIe rate (a CPU device): everything stays on the CPU in auto
    assert not split_misses(experts, tokens, MB, Rates(cpu_bps=50e9, pcie_bps=0), "auto").pcie.any()
    # a much faster PCIe path takes most of it
    fast = split_misses(experts, tokens, MB, Rates(cpu_bps=1e9, pcie_bps=100e9), "auto")
    assert fast.pcie.sum() >= 5
    empty = split_misses(np.empty(0, int), np.empty(0, int), MB, r, "auto")
    assert empty.pcie.size == 0 and empty.predicted_seconds == 0


def test_cpu_cost_follows_the_tokens_per_expert() -> None:
    # one token at 10 GB/s, 8 tokens at 4 GB/s (2.5x the time: each further token adds multiplies on the CPU),
    # PCIe at 10 GB/s whatever the tokens: the 8-token expert goes over PCIe; with flat CPU costs it stayed
    rates = Rates(cpu_bps=10e9, pcie_bps=10e9, cpu_tokens=((2, 9e9), (4, 7e9), (8, 4e9)))
    experts, tokens = np.array([3, 5, 7]), np.array([8, 1, 1])
    plan = split_misses(experts, tokens, 10 * MB, rates, "auto")
    assert plan.pcie.tolist() == [True, False, False]
    assert math.isclose(plan.cpu_seconds, 2e-3) and math.isclose(plan.pcie_seconds, 1e-3)
    flat = split_misses(experts, tokens, 10 * MB, Rates(cpu_bps=10e9, pcie_bps=10e9), "auto")
    assert flat.pcie.tolist() == [False, True, False]
    assert math.isclose(rates.cpu_expert_seconds(10 * MB, 8), 10 * MB / 4e9)
    assert math.isclose(rates.cpu_expert_seconds(10 * MB, 3), (10 * MB / 9e9 + 10 * MB / 7e9) / 2)
    assert math.isclose(rates.cpu_expert_seconds(10 * MB, 16), 2 * 10 * MB / 4e9)  # chunks of 8
    cpu_only = split_misses(experts, tokens, 10 * MB, rates, "cpu")
    assert math.isclose(cpu_only.cpu_seconds, 10 * MB / 4e9 + 2 * 10 * MB / 10e9)
    assert "8 tokens 4.00" in rates.describe()


def test_fixed_costs_keep_small_shares_on_one_path() -> None:
    # equal rates, 2 experts: the balance would send one each way; a PCIe launch cost of 3 experts' time makes the
    # CPU alone faster, a CPU wake-up cost the PCIe path alone
    experts, tokens = np.array([1, 2]), np.array([1, 1])
    cost = 10 * MB / 10e9
    free = split_misses(experts, tokens, 10 * MB, Rates(cpu_bps=10e9, pcie_bps=10e9), "auto")
    assert int(free.pcie.sum()) == 1
    slow_pcie = split_misses(experts, tokens, 10 * MB, Rates(10e9, 10e9, pcie_fixed_s=3 * cost), "auto")
    assert not slow_pcie.pcie.any() and math.isclose(slow_pcie.cpu_seconds, 2 * cost)
    slow_cpu = split_misses(experts, tokens, 10 * MB, Rates(10e9, 10e9, cpu_fixed_s=3 * cost), "auto")
    assert slow_cpu.pcie.all() and math.isclose(slow_cpu.pcie_seconds, 2 * cost)
    # many experts: both paths pay their fixed cost once and still share the work
    many = np.arange(40)
    both = split_misses(many, np.ones(40, int), 10 * MB, Rates(10e9, 10e9, cpu_fixed_s=cost, pcie_fixed_s=cost))
    k = int(both.pcie.sum())
    assert 0 < k < 40 and math.isclose(both.pcie_seconds, cost + k * cost)
    assert math.isclose(both.cpu_seconds, cost + (40 - k) * cost)
    # the forced modes pay their path's fixed cost
    forced = split_misses(many, np.ones(40, int), 10 * MB, Rates(10e9, 10e9, cpu_fixed_s=cost), "cpu")
    assert math.isclose(forced.cpu_seconds, 41 * cost)
    assert "ms per layer" in Rates(10e9, 10e9, cpu_fixed_s=cost).describe()


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_auto_split_is_near_the_best(seed: int, fixed: bool) -> None:
    """Costs by tokens per expert, with or without fixed costs per path: greedy longest-first (or one path alone)
    is within one job of the best assignment (brute force), and never worse than either path alone."""
    rng = np.random.default_rng(100 * fixed + seed)
    n = int(rng.integers(1, 11))
    experts = rng.choice(384, size=n, replace=False)
    tokens = rng.integers(1, 9, size=n)
    cpu1 = float(rng.uniform(5, 50)) * 1e9
    f_cpu, f_pcie = (float(rng.uniform(0, 3e-3)), float(rng.uniform(0, 3e-3))) if fixed else (0.0, 0.0)
    rates = Rates(cpu_bps=cpu1, pcie_bps=float(rng.uniform(5, 50)) * 1e9,
                  cpu_tokens=((2, cpu1 / 1.2), (4, cpu1 / 1.7), (8, cpu1 / 2.6)), cpu_fixed_s=f_cpu,
                  pcie_fixed_s=f_pcie)  # fmt: skip
    busy = float(rng.uniform(0, 1e-3))
    plan = split_misses(experts, tokens, 13 * MB, rates, "auto", gpu_busy_seconds=busy)
    c = np.array([rates.cpu_expert_seconds(13 * MB, int(m)) for m in tokens])
    p = 13 * MB / rates.pcie_bps

    def makespan(mask: np.ndarray) -> float:
        cpu = c[~mask].sum() + (f_cpu if (~mask).any() else 0.0)
        return max(cpu, busy + mask.sum() * p + (f_pcie if mask.any() else 0.0))

    assert math.isclose(plan.predicted_seconds, makespan(plan.pcie), rel_tol=1e-12)
    best = min(makespan(np.array([(b >> i) & 1 for i in range(n)], bool)) for b in range(1 << n))
    assert plan.predicted_seconds <= best + max(c.max(), p) + 1e-12
    assert plan.predicted_seconds <= min(makespan(np.zeros(n, bool)), makespan(np.ones(n, bool))) + 1e-12


def test_bad_input_is_named() -> None:
    r = Rates(cpu_bps=1e9, pcie_bps=1e9)
    with pytest.raises(ValueError, match="mode"):
        split_misses(np.arange(2), np.ones(2), MB, r, "gpu")
    with pytest.raises(ValueError, match="experts and tokens"):
        split_misses(np.arange(2), np.ones(3), MB, r)
    with pytest.raises(ValueError, match="cpu_bps"):
        Rates(cpu_bps=-1, pcie_bps=0)
    for bad, what in ((((1, 1e9),), "tokens >= 2"), (((2, 1e9), (2, 2e9)), "given twice"),
                      (((2, -1.0),), r"cpu_tokens\[2\]"), (((4, 0.0),), r"cpu_tokens\[4\]"),
                      ((2, 1e9), "pairs")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            Rates(cpu_bps=1e9, pcie_bps=0, cpu_tokens=bad)  # type: ignore[arg-type]
    for name in ("cpu_fixed_s", "pcie_fixed_s"):
        with pytest.raises(ValueError, match=name):
            Rates(cpu_bps=1e9, pcie_bps=0, **{name: -1.0})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=name):
            Rates(cpu_bps=1e9, pcie_bps=0, **{name: math.inf})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 1 token"):
        split_misses(np.arange(2), np.array([1, 0]), MB, r)
    assert "GB/s" in r.describe()


def test_cpu_share_seconds_is_what_the_split_predicts_for_the_cpu_share() -> None:
    from vllm_dsv41.split import cpu_share_seconds

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rates = Rates(cpu_bps=7e9, pcie_bps=20e9, cpu_tokens=((2, 6e9), (4, 5e9), (8, 3e9)), cpu_fixed_s=2e-4)
    for n in (0, 1, 5, 40):
        tokens = rng.integers(1, 12, n)
        plan = split_misses(np.arange(n), tokens, 13_000_000, rates, "cpu")
        assert cpu_share_seconds(tokens, 13_000_000, rates) == plan.cpu_seconds
        assert (cpu_share_seconds(tokens, 13_000_000, rates) > 0) == (n > 0)


def test_share_quota_table_is_the_split_of_one_token_experts_after_the_hits() -> None:
    """``q[t, n]``: ``split_misses`` "auto" of n one-token experts with the GPU first busy with the call's at most
    t x top-k - n hits; 0 where a call cannot have n misses, and everywhere without a PCIe or CPU rate."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    eb, k = 13_000_000, 6
    rates = Rates(cpu_bps=float(rng.uniform(5e9, 80e9)), pcie_bps=float(rng.uniform(5e9, 50e9)),
                  gpu_bps=float(rng.uniform(100e9, 900e9)), cpu_fixed_s=float(rng.uniform(0, 3e-4)),
                  pcie_fixed_s=float(rng.uniform(0, 2e-4)))  # fmt: skip
    q = share_quota_table(eb, rates, 16, k)
    assert q.shape == (17, 16 * k + 1) and q.dtype == np.int32
    assert not q[0].any() and not q[:, 0].any()
    for t in (1, 2, 5, 16):
        assert not q[t, t * k + 1 :].any()
        for n in rng.integers(1, t * k + 1, 4).tolist():
            plan = split_misses(np.arange(n), np.ones(n, np.int64), eb, rates, "auto",
                                gpu_busy_seconds=(t * k - n) * eb / rates.gpu_bps)  # fmt: skip
            assert q[t, n] == plan.pcie.sum() and 0 <= q[t, n] <= n
    assert not share_quota_table(eb, Rates(cpu_bps=1e9, pcie_bps=0.0), 4, k).any()
    assert not share_quota_table(eb, Rates(cpu_bps=0.0, pcie_bps=1e9), 4, k).any()
    # a faster PCIe read never gets a smaller share
    fast = share_quota_table(eb, dataclasses.replace(rates, pcie_bps=2 * rates.pcie_bps), 16, k)
    assert (fast >= q).all()
