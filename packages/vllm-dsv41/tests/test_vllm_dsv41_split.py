"""The miss split's cost model: balanced finish times, the forced modes, determinism, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_dsv41.split import Rates, split_misses

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


def test_bad_input_is_named() -> None:
    r = Rates(cpu_bps=1e9, pcie_bps=1e9)
    with pytest.raises(ValueError, match="mode"):
        split_misses(np.arange(2), np.ones(2), MB, r, "gpu")
    with pytest.raises(ValueError, match="experts and tokens"):
        split_misses(np.arange(2), np.ones(3), MB, r)
    with pytest.raises(ValueError, match="cpu_bps"):
        Rates(cpu_bps=-1, pcie_bps=0)
    assert "GB/s" in r.describe()
