"""``StagedPrefill``: MoE calls of many tokens run through dma-prefill inside the tiered runtime.

A prefill chunk of thousands of tokens touches nearly every routed expert of a layer, so computing them where they
are (the CPU tier, or the GPU reading the host home over PCIe) costs far more than moving each expert once: the
staged path streams the layer's routed experts from the host home (``ExpertHome``'s mapped, CUDA-registered pack
files: the one host copy, read through dma-prefill's ``ExternalExpertStore``, nothing copied on the host) through
a ring of VRAM slots on the copy engine, computes each batch as GEMMs while the next batches are in flight,
optionally leaves the last batches to the CPU tier (the CPU tail, same tier and home as decode), and prefetches
the next MoE layer's first batches while this layer finishes (cross-layer prefetch).

Which calls stream
------------------
Per MoE call, on its token count (vLLM's chunked prefill and mixed prefill/decode batches are calls of some
token count like any other): at least ``TieredConfig.prefill_min_tokens``, or, when that is 0, the smallest count
at which dma-prefill's ``StepCostModel`` predicts streaming to beat the decode path. The model is calibrated at
startup (``calibrate``) from rates measured on the machine: the copy engine's rate from the home, the staged
compute's time per expert and per routed row (two staged layers timed), the CPU tier's rate (the tiered runtime's
``Rates``) and the expected decode hit rate.

Elastic VRAM
------------
An episode (consecutive steps with streamed calls) borrows the ring and the decode scratch from the VRAM expert
cache (``ExpertCache.lend``: the coldest residents are evicted, hot residents in the lent region move out, every
pointer into the region goes home before the ring may write it); the first step without a streamed call gives
the memory back (``give_back``, after the ring's copy stream is drained) and the cache refills the evicted
experts over the next steps, at most ``rewarm_limit`` (``admit_limit``) fills per step on its side stream. Without
a cache (before vLLM's KV cache exists, or a cache of 0 slots) the episode allocates its own buffer.

On a CPU "device" (tests) the ring runs on dma-prefill's ``FakeDevice``: the copies and the batch computes are
replayed in stream order and every slot read is checked against the copy that filled it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from . import metrics
from .config import TieredConfig
from .home import ExpertHome, LayerExperts
from .split import Rates

__all__ = ["PrefillStats", "StagedPrefill", "external_store"]

logger = logging.getLogger("vllm.dsv41.prefill")  # under "vllm": printed with vLLM's own log lines


def external_store(home: ExpertHome, layers: Mapping[int, LayerExperts]) -> Any:
    """dma-prefill's ``ExternalExpertStore`` over the home's mappings (the cache's address arrays; no copy)."""
    from dma_prefill import ExternalExpertStore, LayerSpec

    ids = sorted(layers)
    rows = home.cache_home(ids).rows
    specs = {}
    for lid in ids:
        lx = layers[lid]
        g, u, d = lx.gate[0], lx.up[0], lx.down[0]
        specs[lid] = LayerSpec(lx.num_experts, lx.hidden, lx.intermediate, bits=(g.bits, u.bits, d.bits),
                               codebooks=(g.codebook, u.codebook, d.codebook))  # fmt: skip
    return ExternalExpertStore(specs, rows.buffers, rows.buffer, rows.offset, owner=rows)


@dataclasses.dataclass(slots=True)
class PrefillStats:
    """Counters of the staged path since start."""

    calls: int = 0
    tokens: int = 0
    episodes: int = 0
    lent_bytes: int = 0  # of the last episode
    bytes_copied: int = 0
    seconds: float = 0.0  # host wall time of the streamed calls

    def describe(self) -> str:
        return (f"{self.calls} streamed MoE calls ({self.tokens} tokens) in {self.episodes} episodes, "
                f"{self.bytes_copied / 1e9:.2f} GB streamed, {self.seconds:.2f} s")  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    """What the step cost model was built from (logged)."""

    h2d_bps: float
    gpu_expert_s: float
    gpu_row_s: float
    source: str


class _Episode:
    def __init__(self, pf: Any, device: Any, loan: Any, fake: bool) -> None:
        self.pf = pf
        self.device = device
        self.loan = loan
        self.fake = fake


class StagedPrefill:
    """The staged path of the tiered runtime (see the module docstring).

    Parameters
    ----------
    config : the tiered runtime's settings (``prefill_*`` fields).
    home : the pack's host home.
    layers : MoE layer id -> its experts (views of ``home``), every layer the runtime serves.
    tier : the tiered runtime's open ``cpu_tier.ExpertTier`` (it already holds these layers; the CPU tail uses it).
    device : the model's device.
    swiglu_limit : the routed experts' SwiGLU clamp (one for all layers).
    """

    def __init__(self, config: TieredConfig, home: ExpertHome, layers: Mapping[int, LayerExperts], tier: Any,
                 device: torch.device, swiglu_limit: float | None) -> None:  # fmt: skip
        from dma_prefill import CpuTierTail, PrefillConfig

        self.tcfg = config
        self.device = device
        self.layer_ids = tuple(sorted(layers))
        self.store = external_store(home, layers)
        self.pcfg = PrefillConfig(
            num_slots=config.prefill_ring_slots,
            experts_per_batch=config.prefill_experts_per_batch,
            swiglu_limit=swiglu_limit,
            backend=config.prefill_backend,  # type: ignore[arg-type]
        )
        self.num_experts = layers[self.layer_ids[0]].num_experts
        self.tail = CpuTierTail(self.store, tier, swiglu_limit=swiglu_limit, layers=self.layer_ids, register=False)
        self.stats = PrefillStats()
        self.calibration: Calibration | None = None
        self._rates: Rates | None = None
        self._thresholds: dict[int, tuple[int, int]] = {}  # top_k -> (min tokens to stream, hybrid max)
        self._episode: _Episode | None = None
        self._episode_t0 = 0.0
        self._calibrating = False
        self.violations: list[str] = []  # FakeDevice's order checks (CPU device)

    # ------------------------------------------------------------------------------------------ sizes

    def _new_device(self) -> Any:
        from dma_prefill import CudaDevice, FakeDevice

        return CudaDevice(self.device) if self.device.type == "cuda" else FakeDevice()

    def required_bytes(self) -> int:
        """VRAM an episode borrows: the staging ring and the batch's decode scratch."""
        from dma_prefill import DmaPrefill

        return int(DmaPrefill.required_bytes(self.store, self.pcfg, self._new_device()))

    # ------------------------------------------------------------------------------------------ rule

    def calibrate(self, rates: Rates, cache: Any = None) -> Calibration:
        """Measure the copy rate from the home and the staged compute's cost (two staged layers of a synthetic
        uniform routing), borrowing the episode memory from ``cache`` when given; configured values win."""
        t = self.tcfg
        lid = self.layer_ids[0]
        h2d = t.prefill_h2d_gbps * 1e9
        if h2d == 0:
            h2d = self._measure_copy(lid)
        self._calibrating = True
        try:
            return self._calibrate(rates, cache, h2d)
        finally:
            self._calibrating = False

    def _calibrate(self, rates: Rates, cache: Any, h2d: float) -> Calibration:
        t = self.tcfg
        lid = self.layer_ids[0]
        E = self.num_experts
        k = min(6, E)
        tokens = (max(E, 64), max(8 * E, 512))
        times = []
        for n in tokens:
            g = torch.Generator().manual_seed(n)
            ids = torch.rand(n, E, generator=g).argsort(dim=1)[:, :k].to(self.device)
            w = torch.full((n, k), 1.0 / k, device=self.device)
            x = torch.randn(n, self.store.spec(lid).hidden, generator=g).to(self.device, torch.bfloat16)
            best = math.inf
            for _ in range(2):
                t0 = time.perf_counter()
                self.run(lid, x, ids, w, None, cache=cache)
                self._sync()
                best = min(best, time.perf_counter() - t0)
            times.append(best)
            self.end_episode(cache)
        (n1, n2), (t1, t2) = tokens, times
        row_s = max((t2 - t1) / ((n2 - n1) * k), 0.0)
        expert_s = max(t1 - row_s * n1 * k, 0.0) / E
        self.calibration = Calibration(h2d, expert_s, row_s, "measured" if t.prefill_h2d_gbps == 0 else "mixed")
        self._rates = rates
        self._thresholds.clear()
        self.stats = PrefillStats()
        return self.calibration

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _measure_copy(self, lid: int) -> float:
        """Bytes per second of copying experts' records from the home into device memory (best of 3)."""
        n = min(self.num_experts, 2 * self.pcfg.experts_per_batch)
        segs = self.store.copy_segments(lid, 0, n)
        size = n * self.store.layout(lid).stride
        dst = torch.empty(size, dtype=torch.uint8, device=self.device)
        cuda = self.device.type == "cuda"
        best = math.inf
        for _ in range(3):
            self._sync()
            t0 = time.perf_counter()
            for src, off in segs:
                dst[off : off + src.numel()].copy_(src, non_blocking=cuda)
            self._sync()
            best = min(best, time.perf_counter() - t0)
        return sum(s.numel() for s, _ in segs) / best

    def cost_model(self, top_k: int) -> Any:
        """dma-prefill's ``StepCostModel`` from the calibration (None before ``calibrate``)."""
        from dma_prefill import StepCostModel

        c, rates = self.calibration, self._rates
        if c is None or rates is None:
            return None
        eb = self.store.layout(self.layer_ids[0]).stride
        return StepCostModel(
            num_experts=self.num_experts, top_k=top_k, expert_bytes=eb, h2d_gbps=c.h2d_bps / 1e9,
            gpu_expert_s=c.gpu_expert_s, gpu_row_s=c.gpu_row_s, cpu_gbps=miss_gbps(rates, self.tcfg.split),
            cache_hit_rate=self.tcfg.prefill_hit_rate,
        )  # fmt: skip

    def thresholds(self, top_k: int) -> tuple[int, int] | None:
        """``(min tokens to stream, largest hybrid call)`` for ``top_k``; None: nothing streams yet (no
        calibration and no configured ``prefill_min_tokens``)."""
        if top_k in self._thresholds:
            return self._thresholds[top_k]
        t = self.tcfg
        tail = t.prefill_cpu_tail_batches > 0
        model = self.cost_model(top_k)
        if model is None:
            if not t.prefill_min_tokens:
                return None
            return (t.prefill_min_tokens, t.prefill_min_tokens - 1)  # no model: no hybrid range
        from dma_prefill import derive_thresholds

        decode_max, hybrid_max = derive_thresholds(model, hybrid=tail)
        lo = t.prefill_min_tokens or decode_max + 1
        out = (lo, hybrid_max if tail else lo - 1)
        self._thresholds[top_k] = out
        logger.info("dsv41 prefill: MoE calls of >= %d tokens stream (top-%d; %s)%s", lo, top_k,
                    "configured" if t.prefill_min_tokens else "step cost model",
                    f", the CPU tier takes the last {t.prefill_cpu_tail_batches} batches up to {hybrid_max} tokens"
                    if tail and hybrid_max >= lo else "")  # fmt: skip
        return out

    def wants(self, tokens: int, top_k: int) -> bool:
        """Whether a MoE call of ``tokens`` tokens runs through the staged path."""
        if not self.tcfg.prefill or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return False
        th = self.thresholds(top_k)
        return th is not None and tokens >= th[0]

    # ------------------------------------------------------------------------------------------ episodes

    @property
    def active(self) -> bool:
        return self._episode is not None

    @property
    def bytes_streamed(self) -> int:
        """Bytes copied from the host home so far, the open episode's included (``stats.bytes_copied`` counts an
        episode when it ends: at the next decode call)."""
        ep = self._episode
        return self.stats.bytes_copied + (int(ep.pf.ring.bytes_issued) if ep is not None else 0)

    def _start(self, cache: Any) -> _Episode:
        from dma_prefill import DmaPrefill

        dev = self._new_device()
        need = self.required_bytes()
        loan = None
        buffer = None
        if cache is not None and cache.pool is not None and cache.num_slots >= cache.slots_for(need):
            loan = cache.lend(need)
            buffer = loan.buffer
        pf = DmaPrefill(self.store, self.pcfg, device=dev, buffer=buffer)
        if loan is not None and loan.ready is not None:
            dev.wait(pf.ring.copy_stream, loan.ready)  # the first slot write after every read of the region
        elif loan is None:  # a fresh ring: its memory may be a block freed on the compute stream and still read there
            fresh = dev.new_event()
            dev.record(fresh, dev.current_stream())
            dev.wait(pf.ring.copy_stream, fresh)
        self.stats.episodes += 1
        self.stats.lent_bytes = need if loan is not None else 0
        self._episode = _Episode(pf, dev, loan, self.device.type != "cuda")
        self._episode_t0 = time.perf_counter()
        return self._episode

    def end_episode(self, cache: Any) -> None:
        """Give the borrowed memory back (the compute stream first waits for the ring's copy stream)."""
        ep = self._episode
        if ep is None:
            return
        self._episode = None
        ev = None
        if ep.fake:
            ep.device.synchronize()
            self.violations += ep.device.violations
        else:
            ev = torch.cuda.Event()
            ev.record(ep.pf.ring.copy_stream)
            torch.cuda.current_stream(self.device).wait_event(ev)
        self.stats.bytes_copied += ep.pf.ring.bytes_issued
        if not self._calibrating:  # dsv41_prefill_staged_*: the episode's bytes over its wall time (queued work
            metrics.staged_prefill(ep.pf.ring.bytes_issued, time.perf_counter() - self._episode_t0)  # included)
        if ep.loan is not None and cache is not None:
            cache.give_back(ep.loan, after=ev)

    def run(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            next_layer: int | None, *, cache: Any = None) -> torch.Tensor:  # fmt: skip
        """One MoE call through the ring: fp32 ``[T, H]`` of ``sum_k w_k expert_k(x)`` (queued on the current
        stream; on a CPU device, computed on return)."""
        from dma_prefill import PrefillPlan

        t0 = time.perf_counter()
        ep = self._episode or self._start(cache)
        T, k = topk_ids.shape
        th = self.thresholds(k)
        tail = self.tcfg.prefill_cpu_tail_batches if th is not None and T <= th[1] else 0
        plan = PrefillPlan.build(topk_ids, topk_weights, self.num_experts, self.pcfg.experts_per_batch, tail)
        out = ep.pf.run_layer(layer, x, plan, next_layer=next_layer, cpu_tail=self.tail if plan.cpu_batches else None)
        if ep.fake:
            ep.device.synchronize()
        self.stats.calls += 1
        self.stats.tokens += T
        if not self._calibrating:
            metrics.picks("streamed", int(plan.counts.sum()))  # (not vLLM's padding rows: id -1)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def describe(self) -> str:
        c = self.calibration
        cal = (f"copy {c.h2d_bps / 1e9:.2f} GB/s, staged compute {1e6 * c.gpu_expert_s:.1f} us/expert + "
               f"{1e9 * c.gpu_row_s:.1f} ns/row ({c.source})") if c else "not calibrated"  # fmt: skip
        return (
            f"ring {self.pcfg.num_slots} x {self.pcfg.experts_per_batch} experts "
            f"({self.required_bytes() / (1 << 30):.2f} GiB with the decode scratch, lent by the cache); {cal}"
        )


def miss_gbps(rates: Rates, split: str) -> dict[int, float]:
    """The decode path's miss rate by tokens per expert (GB/s of expert bytes), for ``StepCostModel.cpu_gbps``:
    the misses go where the split sends them: the CPU tier (``Rates.cpu_points``), PCIe reads (one expert's read
    whatever its tokens: the same rate at 1 and 8, so larger counts run as chunks of 8), or both at once (their
    sum at each point)."""
    cpu = rates.cpu_points()
    pcie = dict.fromkeys(cpu, rates.pcie_bps)
    out = {"cpu": cpu, "pcie": pcie}.get(split) or {m: cpu[m] + pcie[m] for m in cpu}
    return {m: max(v, 1.0) / 1e9 for m, v in out.items()}


def next_moe_layer(layer_ids: tuple[int, ...], layer: int) -> int | None:
    """The MoE layer after ``layer`` (None after the last)."""
    i = layer_ids.index(layer)
    return layer_ids[i + 1] if i + 1 < len(layer_ids) else None
