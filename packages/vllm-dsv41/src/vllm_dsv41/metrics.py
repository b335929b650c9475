"""The plugin's Prometheus metrics (``dsv41_*``) and the small API the expert runtimes record through.

Where they are read
-------------------
The expert runtimes (and later the VRAM cache, staged-DMA prefill and Engram) run in vLLM's **engine-core**
process; ``/metrics`` is served by the **API-server** process. The values cross that boundary through
prometheus-client's multiprocess mode: the application sets ``PROMETHEUS_MULTIPROC_DIR`` to an empty
directory before vLLM (and so prometheus-client) is first imported; every process then keeps its values in
memory-mapped files there, and vLLM's ``/metrics`` (``get_prometheus_registry()``) collects them all. This
module reads no environment variable: without that directory the metrics simply live in the process's own
default registry (in-process use, tests).

Metrics
-------
========================================  =========  ========  ================================================
name                                      type       labels    what
========================================  =========  ========  ================================================
``dsv41_expert_forward_seconds``          histogram  tier      one runtime forward of one MoE layer on ``tier``
                                                               (``_count``: calls, ``_sum``: seconds)
``dsv41_expert_picks_total``              counter    tier      (token, expert) picks computed on ``tier``
``dsv41_expert_cache_lookups_total``      counter    result    VRAM expert-cache lookups, ``hit`` or ``miss``
``dsv41_expert_cache_fills_total``        counter              experts copied into the VRAM cache
``dsv41_expert_cache_fill_bytes_total``   counter              bytes copied by those fills
``dsv41_prefill_staged_bytes_total``      counter              expert bytes streamed to VRAM by staged-DMA prefill
``dsv41_prefill_staged_seconds_total``    counter              seconds those transfers took
``dsv41_prefill_staged_gbps``             histogram            GB/s (1e9 B/s) of each staged transfer
``dsv41_cpu_deadline_misses_total``       counter              CPU-tier forwards that missed their deadline
``dsv41_cpu_recomputed_picks_total``      counter              picks of those forwards recomputed on the GPU
``dsv41_engram_gather_seconds``           histogram            one Engram table gather
========================================  =========  ========  ================================================

Tiers (``TIERS``): ``cpu`` (host-RAM experts computed by cpu-tier), ``gpu`` (experts resident in VRAM for the
whole run), ``gpu_cache`` (VRAM expert-cache hits), ``pcie`` (cache misses the GPU computes by reading the
host home over PCIe), ``streamed`` (experts copied to VRAM for this step, the staged-DMA prefill). Every
tier's series exist from start-up, at zero.

Derived values, in PromQL: cache hit rate
``rate(dsv41_expert_cache_lookups_total{result="hit"}[5m]) / rate(dsv41_expert_cache_lookups_total[5m])``
(``sum`` over ``result`` in the denominator); staged-prefill GB/s over a window
``rate(dsv41_prefill_staged_bytes_total[5m]) / rate(dsv41_prefill_staged_seconds_total[5m]) / 1e9``; mean
seconds per call ``rate(dsv41_expert_forward_seconds_sum[5m]) / rate(dsv41_expert_forward_seconds_count[5m])``.

Recording
---------
A runtime binds its tier once (``tier("cpu")``) and records each forward with ``TierMetrics.forward``; the
other events have one function each (``cache_lookups``, ``cache_fill``, ``staged_prefill``,
``cpu_deadline_miss``, ``engram_gather``). Each call costs a few microseconds (a lock and a write into the
memory map per series touched).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import Counter, Histogram

__all__ = [
    "TIERS",
    "TierMetrics",
    "cache_fill",
    "cache_lookups",
    "cpu_deadline_miss",
    "engram_gather",
    "picks",
    "staged_prefill",
    "tier",
]

#: Where a routed expert's pick can be computed (the ``tier`` label's values).
TIERS: tuple[str, ...] = ("cpu", "gpu", "gpu_cache", "pcie", "streamed")

#: Seconds: one layer's forward is ~50 us (a decode step on a small model) to seconds (a long prefill on CPU).
_FORWARD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0)  # fmt: skip
#: GB/s of one host->VRAM transfer: PCIe 3/4/5 x16 peak at about 13/26/52 GB/s.
_GBPS_BUCKETS = (1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0, 28.0, 32.0, 40.0, 48.0, 56.0, 64.0)
#: Seconds: one Engram gather is a few pages of a memory-mapped table (page cache: ~10 us; NVMe: ~100 us+).
_GATHER_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)

EXPERT_FORWARD_SECONDS = Histogram(
    "dsv41_expert_forward_seconds",
    "Seconds of one expert-runtime forward of one MoE layer, per tier (_count: calls, _sum: seconds)",
    ["tier"],
    buckets=_FORWARD_BUCKETS,
)
EXPERT_PICKS = Counter(
    "dsv41_expert_picks", "Routed (token, expert) picks computed, per tier (cpu, gpu, gpu_cache, streamed)", ["tier"]
)
CACHE_LOOKUPS = Counter("dsv41_expert_cache_lookups", "VRAM expert-cache lookups by result (hit, miss)", ["result"])
CACHE_FILLS = Counter("dsv41_expert_cache_fills", "Experts copied into the VRAM expert cache")
CACHE_FILL_BYTES = Counter("dsv41_expert_cache_fill_bytes", "Bytes copied into the VRAM expert cache")
PREFILL_STAGED_BYTES = Counter(
    "dsv41_prefill_staged_bytes", "Expert bytes streamed host->VRAM by the staged-DMA prefill"
)
PREFILL_STAGED_SECONDS = Counter(
    "dsv41_prefill_staged_seconds", "Seconds the staged-DMA prefill's host->VRAM transfers took"
)
PREFILL_STAGED_GBPS = Histogram(  # a histogram, not a gauge: multiprocess gauges show no series until first set
    "dsv41_prefill_staged_gbps", "GB/s (1e9 bytes/s) of each staged-DMA prefill transfer", buckets=_GBPS_BUCKETS
)
CPU_DEADLINE_MISSES = Counter("dsv41_cpu_deadline_misses", "CPU-tier forwards that missed their deadline")
CPU_RECOMPUTED_PICKS = Counter(
    "dsv41_cpu_recomputed_picks", "Picks of CPU-tier forwards that missed their deadline, recomputed on the GPU"
)
ENGRAM_GATHER_SECONDS = Histogram(
    "dsv41_engram_gather_seconds", "Seconds of one Engram table gather", buckets=_GATHER_BUCKETS
)

for _t in TIERS:  # every tier's series exist from the start (at zero), so dashboards and tests see them
    EXPERT_FORWARD_SECONDS.labels(tier=_t)
    EXPERT_PICKS.labels(tier=_t)
for _r in ("hit", "miss"):
    CACHE_LOOKUPS.labels(result=_r)
_HITS, _MISSES = CACHE_LOOKUPS.labels(result="hit"), CACHE_LOOKUPS.labels(result="miss")


@dataclasses.dataclass(frozen=True, slots=True)
class TierMetrics:
    """The series of one tier, bound once (``tier(name)``) so that recording is two increments."""

    name: str
    _seconds: Any = dataclasses.field(repr=False)
    _picks: Any = dataclasses.field(repr=False)

    def forward(self, seconds: float, picks: int) -> None:
        """One forward of one MoE layer on this tier: ``seconds`` of wall time, ``picks`` (token, expert) pairs."""
        self._seconds.observe(seconds)
        self._picks.inc(picks)


def tier(name: str) -> TierMetrics:
    """The recorder of tier ``name`` (one of ``TIERS``)."""
    if name not in TIERS:
        raise ValueError(f"tier: expected one of {TIERS}, got {name!r}")
    return TierMetrics(name, EXPERT_FORWARD_SECONDS.labels(tier=name), EXPERT_PICKS.labels(tier=name))


def picks(tier_name: str, n: int) -> None:
    """``n`` picks computed on ``tier_name`` by work whose time is not the host's to measure (GPU kernels)."""
    if n:
        EXPERT_PICKS.labels(tier=tier_name).inc(n)


def cache_lookups(hits: int, misses: int) -> None:
    """VRAM expert-cache lookups of one step: ``hits`` found resident, ``misses`` not."""
    _HITS.inc(hits)
    _MISSES.inc(misses)


def cache_fill(experts: int, nbytes: int) -> None:
    """``experts`` experts (``nbytes`` bytes in all) copied into the VRAM expert cache."""
    CACHE_FILLS.inc(experts)
    CACHE_FILL_BYTES.inc(nbytes)


def staged_prefill(nbytes: int, seconds: float) -> None:
    """One staged-DMA prefill transfer: ``nbytes`` expert bytes host->VRAM in ``seconds``."""
    PREFILL_STAGED_BYTES.inc(nbytes)
    PREFILL_STAGED_SECONDS.inc(seconds)
    if seconds > 0:
        PREFILL_STAGED_GBPS.observe(nbytes / seconds / 1e9)


def cpu_deadline_miss(recomputed_picks: int) -> None:
    """One CPU-tier forward missed its deadline; ``recomputed_picks`` of its picks were recomputed on the GPU."""
    CPU_DEADLINE_MISSES.inc()
    CPU_RECOMPUTED_PICKS.inc(recomputed_picks)


def engram_gather(seconds: float) -> None:
    """One Engram table gather took ``seconds``."""
    ENGRAM_GATHER_SECONDS.observe(seconds)
