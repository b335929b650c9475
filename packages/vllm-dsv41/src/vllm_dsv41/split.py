"""Where a decode step's cache misses run: the CPU tier or the GPU reading the host home over PCIe.

A miss (a routed expert not resident in the VRAM cache) can be computed by the CPU tier from the host home
(its cost: the expert's bytes at the CPU tier's streaming rate for its token count: the tier decodes an expert
once per chunk of up to 8 tokens, but each further token adds multiplies, so 8 tokens cost ~2-3x one on AVX2) or
by the GPU's hit kernel reading the same bytes from the GPU-mapped host home (the expert's bytes at the PCIe
read rate, after the GPU's own hits; bandwidth-bound, so taken as independent of the tokens). Both paths run at
once, so the best split balances their finish times: experts are assigned, most-used first, to whichever path
would finish them earlier (longest-processing-time-first; the rates are measured at startup, ``Rates``). A path
also costs a fixed time once it gets any expert (the CPU tier's job start and wake-up, the PCIe share's launches),
so the balanced split is compared with "all on the CPU" and "all over PCIe" and the fastest of the three is taken.
``split_misses`` is pure (numpy in, numpy out) and deterministic for a given input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

from dma_prefill import chunked_expert_seconds

__all__ = ["PathChooser", "Rates", "SplitPlan", "cpu_share_seconds", "share_quota_table", "split_misses"]


@dataclasses.dataclass(frozen=True, slots=True)
class Rates:
    """The cost model's rates, in bytes per second of expert weights.

    Attributes
    ----------
    cpu_bps : what the CPU tier streams at decode sizes (one token per expert).
    pcie_bps : what the GPU's hit kernel reads from the GPU-mapped host home.
    gpu_bps : what the hit kernel reads from VRAM (to predict when the GPU starts on PCIe work).
    source : where the numbers came from ("measured", "configured", ...), for the log.
    cpu_tokens : the CPU tier's rate at more tokens per expert, ``((m, bytes/s), ...)`` with ``m >= 2`` (expert
        bytes per second of one expert computed for ``m`` tokens; measured at startup at 2, 4 and 8). Empty: an
        expert costs one token's time for up to 8 tokens (the tier's chunk; how it behaves while memory-bound).
    cpu_fixed_s, pcie_fixed_s : seconds a path costs once per layer when it gets any expert, beyond the rates
        (measured at startup from one expert against many: the intercept of time vs experts; 0 when configured).
    """

    cpu_bps: float
    pcie_bps: float
    gpu_bps: float = math.inf
    source: str = "configured"
    cpu_tokens: tuple[tuple[int, float], ...] = ()
    cpu_fixed_s: float = 0.0
    pcie_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cpu_bps", "pcie_bps", "gpu_bps"):
            _rate(f"Rates.{name}", getattr(self, name))
        for name in ("cpu_fixed_s", "pcie_fixed_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < math.inf:
                raise ValueError(f"Rates.{name}: expected a finite number of seconds >= 0, got {v!r}")
        seen = {1}
        for item in self.cpu_tokens:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int) and item[0] >= 2):
                raise ValueError(f"Rates.cpu_tokens: expected (tokens >= 2, bytes/s) pairs, got {item!r}")
            if item[0] in seen:
                raise ValueError(f"Rates.cpu_tokens: tokens {item[0]} given twice")
            seen.add(item[0])
            _rate(f"Rates.cpu_tokens[{item[0]}]", item[1])
            if item[1] == 0:
                raise ValueError(f"Rates.cpu_tokens[{item[0]}]: expected a rate > 0 (bytes/s), got 0")

    def cpu_expert_seconds(self, expert_bytes: int, tokens: int) -> float:
        """The CPU tier's seconds for one expert of ``expert_bytes`` computed for ``tokens`` tokens (inf when the
        tier has no rate): ``cpu_points`` interpolated, counts beyond the largest point as chunks of it
        (dma-prefill's ``chunked_expert_seconds``)."""
        if self.cpu_bps <= 0:
            return math.inf
        return chunked_expert_seconds({m: expert_bytes / v for m, v in self.cpu_points().items()}, tokens)

    def cpu_points(self) -> dict[int, float]:
        """The CPU tier's bytes/s by tokens per expert: ``cpu_bps`` at 1 and ``cpu_tokens``; without
        ``cpu_tokens``, ``cpu_bps`` at 1 and at 8 (one token's time for up to 8, the tier's chunk)."""
        return {1: self.cpu_bps, **(dict(self.cpu_tokens) if self.cpu_tokens else {8: self.cpu_bps})}

    def describe(self) -> str:
        def gbps(v: float) -> str:
            return "inf" if math.isinf(v) else f"{v / 1e9:.2f}"

        more = "".join(f", {m} tokens {gbps(v)}" for m, v in self.cpu_tokens)
        return (f"CPU tier {gbps(self.cpu_bps)} GB/s (1 token per expert{more}) + {self.cpu_fixed_s * 1e3:.2f} ms "
                f"per layer, PCIe reads {gbps(self.pcie_bps)} GB/s + {self.pcie_fixed_s * 1e3:.2f} ms, VRAM hits "
                f"{gbps(self.gpu_bps)} GB/s ({self.source})")  # fmt: skip


def _rate(name: str, v: object) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v < 0:
        raise ValueError(f"{name}: expected a number >= 0 (bytes/s), got {v!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class SplitPlan:
    """The split of one layer's missed experts.

    ``pcie[i]`` is True when missed expert ``experts[i]`` is computed by the GPU from the host home, False when by
    the CPU tier; ``cpu_seconds`` / ``pcie_seconds`` are the model's predicted finish times of the two paths
    (``pcie_seconds`` includes the GPU's hits before it).
    """

    experts: np.ndarray
    pcie: np.ndarray
    cpu_seconds: float
    pcie_seconds: float

    @property
    def predicted_seconds(self) -> float:
        return max(self.cpu_seconds, self.pcie_seconds)


def split_misses(experts: np.ndarray, tokens: np.ndarray, expert_bytes: int, rates: Rates, mode: str = "auto",
                 gpu_busy_seconds: float = 0.0,
                 cpu_time_of: Callable[[int], float] | None = None) -> SplitPlan:  # fmt: skip
    """Split a layer's distinct missed experts between the CPU tier and PCIe reads.

    Parameters
    ----------
    experts : int ``[n]`` distinct missed expert ids.
    tokens : int ``[n]`` tokens routed to each of them in this step (the most used go first; ties by id; on the
        CPU tier an expert's time depends on them, ``Rates.cpu_expert_seconds``).
    expert_bytes : bytes of one expert's weights (all experts of a layer have the same).
    rates : the measured (or configured) rates.
    mode : "auto" (balance the finish times), "cpu" (all on the CPU tier), "pcie" (all read over PCIe).
    gpu_busy_seconds : when the GPU can start on PCIe work (after this layer's hits).
    cpu_time_of : ``rates.cpu_expert_seconds(expert_bytes, m)`` as a function of ``m``, when the caller remembers it
        (the tiered runtime asks for the same few counts every layer call); by default computed here.
    """
    experts = np.asarray(experts)
    tokens = np.asarray(tokens)
    if experts.shape != tokens.shape or experts.ndim != 1:
        raise ValueError(f"experts and tokens: expected two [n] arrays, got {experts.shape} and {tokens.shape}")
    if mode not in ("auto", "cpu", "pcie"):
        raise ValueError(f"mode: expected 'auto', 'cpu' or 'pcie', got {mode!r}")
    n = experts.size
    if n and tokens.min() < 1:
        raise ValueError(f"tokens: every missed expert has >= 1 token, got {tokens.min()}")
    pcie_cost = expert_bytes / rates.pcie_bps if rates.pcie_bps > 0 else math.inf
    cpu_cost = _cpu_costs(tokens, expert_bytes, rates, cpu_time_of)
    cpu_fixed, pcie_fixed = rates.cpu_fixed_s, rates.pcie_fixed_s
    all_cpu = SplitPlan(experts, np.zeros(n, bool), _cpu_share(cpu_cost, rates), gpu_busy_seconds)
    if mode == "cpu" or (mode == "auto" and math.isinf(pcie_cost)):
        return all_cpu
    all_pcie = SplitPlan(experts, np.ones(n, bool), 0.0, gpu_busy_seconds + (pcie_fixed + n * pcie_cost if n else 0.0))
    if mode == "pcie" or rates.cpu_bps <= 0:
        return all_pcie
    order = np.lexsort((experts, -tokens))  # most tokens first, then by id
    pcie = np.zeros(n, bool)
    cpu_t, pcie_t = 0.0, gpu_busy_seconds
    on_cpu = on_pcie = False
    for i in order.tolist():  # a path's fixed cost is paid with its first expert
        to_pcie = pcie_t + pcie_cost + (0.0 if on_pcie else pcie_fixed)
        to_cpu = cpu_t + cpu_cost[i] + (0.0 if on_cpu else cpu_fixed)
        if to_pcie < to_cpu:
            pcie[i] = on_pcie = True
            pcie_t = to_pcie
        else:
            cpu_t, on_cpu = to_cpu, True
    balanced = SplitPlan(experts, pcie, cpu_t, pcie_t)
    # the fixed costs can make one path alone faster than any balance (ties: the balanced split, then the CPU)
    return min((balanced, all_cpu, all_pcie), key=lambda plan: plan.predicted_seconds)


def share_quota_table(expert_bytes: int, rates: Rates, max_tokens: int, topk: int) -> np.ndarray:
    """The no-sync split's quota table (``route_prep.share_misses``): ``q[t, n]``, for a call of ``t`` tokens
    (``1..max_tokens``) whose picks miss ``n`` distinct experts (``0..max_tokens * topk``), how many of those the
    GPU reads from the host home; the CPU tier computes the rest. ``split_misses`` "auto" with one token per missed
    expert (a decode step's common case; the kernel gives the GPU the most-picked first) and the GPU busy first
    with the call's hits: at most ``t * topk - n`` distinct resident experts read from VRAM (an upper bound: tokens
    may share them). Row 0 and the counts a call of ``t`` tokens cannot have (``n > t * topk``) are 0."""
    q = np.zeros((max_tokens + 1, max_tokens * topk + 1), np.int32)
    if rates.pcie_bps <= 0 or rates.cpu_bps <= 0:
        return q
    per_hit = expert_bytes / max(rates.gpu_bps, 1.0)
    cpu_time_of = functools.partial(rates.cpu_expert_seconds, expert_bytes)
    for t in range(1, max_tokens + 1):
        for n in range(1, t * topk + 1):
            plan = split_misses(np.arange(n), np.ones(n, np.int64), expert_bytes, rates, "auto",
                                gpu_busy_seconds=(t * topk - n) * per_hit, cpu_time_of=cpu_time_of)  # fmt: skip
            q[t, n] = int(plan.pcie.sum())
    return q


def cpu_share_seconds(tokens: np.ndarray, expert_bytes: int, rates: Rates,
                      cpu_time_of: Callable[[int], float] | None = None) -> float:  # fmt: skip
    """The CPU tier's predicted seconds for experts with ``tokens`` tokens each: its fixed cost (once, when it gets
    any) plus each expert's time for its count; what ``split_misses`` predicts for the share it gives the CPU tier
    (``SplitPlan.cpu_seconds``). ``cpu_time_of`` as in ``split_misses``."""
    return _cpu_share(_cpu_costs(np.asarray(tokens), expert_bytes, rates, cpu_time_of), rates)


def _cpu_costs(tokens: np.ndarray, expert_bytes: int, rates: Rates,
               cpu_time_of: Callable[[int], float] | None) -> list[float]:  # fmt: skip
    cost = cpu_time_of if cpu_time_of is not None else functools.partial(rates.cpu_expert_seconds, expert_bytes)
    per_count = {m: cost(m) for m in set(tokens.tolist())}  # (decode: one count)
    return [per_count[m] for m in tokens.tolist()]


def _cpu_share(costs: list[float], rates: Rates) -> float:
    return rates.cpu_fixed_s + math.fsum(costs) if costs else 0.0


#: Decode steps of one batch size after which ``PathChooser`` measures both paths again (the cache's contents, the
#: machine's load and the routing drift).
REVISIT_STEPS = 4096


class PathChooser:
    """Which decode path a step of ``t`` tokens takes under split "auto": "split" (the inputs to the host, misses
    split by the cost model between the CPU tier and PCIe) or "device" (every miss read over PCIe by the hit
    kernel, no host sync). Neither cost is known ahead (the split path's host time per layer, the CPU tier beside
    vLLM's threads), so both are measured: per batch size, ``probe`` steps of each (alternating), then the one with
    the lower median step time is kept for ``revisit`` steps, then both are measured again. Pure: the caller times
    the steps (``record``; the tiered runtime times a step's MoE layers, first begin to last finish)."""

    PATHS = ("split", "device")

    def __init__(self, probe: int, revisit: int = REVISIT_STEPS) -> None:
        if probe < 1 or revisit < 1:
            raise ValueError(f"PathChooser: probe and revisit must be >= 1, got {probe}, {revisit}")
        self.probe, self.revisit = probe, revisit
        self._samples: dict[int, dict[str, list[float]]] = {}
        self._kept: dict[int, tuple[str, int]] = {}  # t -> (path, steps since it was chosen)
        self.decisions: list[tuple[int, str, float, float]] = []  # (t, kept, median split, median device)

    def choose(self, t: int) -> str:
        kept = self._kept.get(t)
        if kept is not None and kept[1] < self.revisit:
            self._kept[t] = (kept[0], kept[1] + 1)
            return kept[0]
        samples = self._samples.setdefault(t, {p: [] for p in self.PATHS})
        return min(self.PATHS, key=lambda p: len(samples[p]))  # the one measured less (split first)

    def record(self, t: int, path: str, seconds: float) -> str | None:
        """A finished step of ``t`` tokens on ``path`` took ``seconds``; returns the path kept when this completes
        a measurement (else None)."""
        if path not in self.PATHS:
            raise ValueError(f"PathChooser.record: path must be one of {self.PATHS}, got {path!r}")
        kept = self._kept.get(t)
        if kept is not None and kept[1] < self.revisit:
            return None  # not measuring
        samples = self._samples.setdefault(t, {p: [] for p in self.PATHS})
        samples[path].append(seconds)
        if min(len(v) for v in samples.values()) < self.probe:
            return None
        med = {p: float(np.median(v)) for p, v in samples.items()}
        best = min(self.PATHS, key=lambda p: med[p])
        self._kept[t] = (best, 0)
        self._samples[t] = {p: [] for p in self.PATHS}
        self.decisions.append((t, best, med["split"], med["device"]))
        return best
