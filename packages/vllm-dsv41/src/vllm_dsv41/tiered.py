"""``TieredRuntime``: decode with the hottest experts in a VRAM cache, the misses on the CPU tier or over PCIe.

The libraries do the work; this module composes them:

* **expert-cache** (``ExpertCache``): the slot pool, the pointer tables (a resident expert's columns point into
  its VRAM slot, any other expert's into the GPU-mapped host home), the policy observing every step's routing,
  replans between steps with bounded admissions, fills on a side stream;
* **hits** (``vllm_dsv41.hits``): one fused GPU launch per layer computing the picks it is given, reading each
  expert through the pointer table (VRAM for hits; the host home over PCIe for misses sent that way);
* **cpu-tier** (``ExpertTier``): the misses assigned to the CPU, computed from the same host home;
* **split** (``split_misses``): the cost model balancing the misses between the CPU tier and PCIe reads, from
  rates measured at startup (or configured), logged.

One MoE layer's forward (``forward_into``)
------------------------------------------
1. device: ``hit = slot_of[ids] >= 0`` (the cache's table; no host read); the hit picks go to the hit kernel,
   which writes each pick's weighted output into ``y[t, k]`` (exact zeros for the other picks);
2. the activations, routing and hit mask are copied to pinned host memory (one event, the only host wait
   before the CPU starts); the GPU keeps computing the hits meanwhile;
3. host: the misses are split (cost model); the PCIe share is handed to the hit kernel a second time (into a
   second buffer), reading the host home in place (``pcie_read`` mapped) or from transient VRAM slots the copy
   engine filled first (staged: any alignment of the home), the CPU share is submitted to the CPU tier, one
   output row per pick;
4. the CPU tier gets a deadline (``factor * predicted + floor``); picks it has not computed by then are
   computed by the GPU from the host home (counted in ``dsv41_cpu_deadline_misses_total``; never dropped);
5. the CPU rows are copied back and scattered into ``y``; ``out = sum_k y[:, k]`` in a fixed order. Every pick
   lands in exactly one place and the rest are exact zeros, so the result is the same whatever the split (given
   the per-pick values).

Steps. A step begins at the first MoE layer's call (``before_step``, with the step's token count) and ends at
the next step's first call (``after_step``, which may replan: evictions and admissions, copies on the side
stream). The cache is created at the first call allowed to allocate (``allow_cache``; the plugin allows it once
vLLM's KV cache is bound, so the cache takes what vLLM leaves; tests allow it at once).

On a CPU "device" (tests) the same code runs with host tensors: the copies are plain copies, the hit kernel is
the reference one reading host addresses, and the cache lives in host memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from . import metrics
from .config import Dsv41PluginConfig, TieredConfig
from .dev_stage import MAX_PICKS, DeviceStaging
from .devgraphs import DeviceGraphs
from .experts import _check_args, _refuse_capture, in_profile_run
from .home import ExpertHome, LayerExperts
from .route_prep import prepare_routing, share_misses
from .split import PathChooser, Rates, cpu_share_seconds, share_quota_table, split_misses

__all__ = ["TierStats", "TieredRuntime", "hit_seconds"]

logger = logging.getLogger("vllm.dsv41.tiered")  # under "vllm": printed with vLLM's own log lines, in every process

_CPU_RATE_TOKENS = (1, 2, 4, 8)  # tokens per expert at which the CPU tier's rate is measured (it decodes once per <= 8)

GiB = 1 << 30
#: Tokens per hit-kernel call: a larger MoE call (an eager batch below the streaming threshold) runs in chunks of
#: this many, so each layer's hit kernel keeps scratch for at most this many tokens' picks (``hits``: per kernel;
#: exllamav3's (10 H + 12 I) bytes a pick: 16 x 6 picks at Flash's sizes = 7.6 MB a layer, 0.3 GB for 40 layers).
#: Decode (<= 16 tokens a step) is one call.
HIT_CHUNK_TOKENS = 16
#: Steps of routing copies the no-sync paths keep in flight for the trace before its recording waits for one: the
#: trace reads a step's pinned copies once the stream has passed them (an event's query), never by a sync
_TRACE_RING = 4
#: Steps between two folds of the device path's pick counts into ``TierStats`` and Prometheus (a sync each).
_FOLD_EVERY = 64
#: the stream split's quota tables are built again at the split's rates once a path's feedback average has moved by
#: more than this (log ratio) since they were built: a build is ~20-40 ms of host time, not for every small move
_QUOTA_REBUILD = 0.1
#: a probed step's time runs to the next step's start unless that is more than this many times its MoE layers'
#: span (then the gap is idle time between requests, not the step's: the span alone is the sample)
_IDLE_FACTOR = 10.0


@dataclasses.dataclass(slots=True)
class TierStats:
    """Counters since start (picks per path, steps, seconds per part)."""

    steps: int = 0
    layer_calls: int = 0
    hit_picks: int = 0
    cpu_picks: int = 0
    pcie_picks: int = 0
    fallback_picks: int = 0
    deadline_misses: int = 0
    cpu_seconds: float = 0.0  # host wall time from the CPU job's submit to its end
    wait_seconds: float = 0.0  # host time waiting for the inputs' device-to-host copy
    layer_seconds: float = 0.0  # host wall time of whole layer calls
    profile_calls: int = 0  # layer calls of vLLM's dummy forwards, answered with zeros (experts.in_profile_run)
    trace_rows_dropped: int = 0  # token rows left out of the routing trace: they route an expert twice (below)
    pcie_enqueue_seconds: float = 0.0  # host time queuing the PCIe share (after the CPU job is submitted)
    cpu_wait_seconds: float = 0.0  # host time blocked in finish() on the CPU tier's job (the GPU's share done before)
    stream_wait_seconds: float = 0.0  # cpu_drive "stream": the stream's host function blocked on the jobs
    cpu_run_seconds: float = 0.0  # the CPU tier's own run time of those jobs (cpu_seconds less queue and wake-up)
    cpu_pred_seconds: float = 0.0  # what the startup rates predicted for those jobs (decode-size calls; else 0)
    # the host's time in the layer calls by part (where a step's time outside the CPU tier's job goes):
    begin_seconds: float = 0.0  # begin() less the step's bookkeeping: launches, input wait, split, submit
    # the step's bookkeeping (the cache's after_step and replans, the trace): at its last MoE layer's finish, or at
    # the next step's first begin when it did not close there; in neither begin_seconds nor finish_seconds
    bookkeeping_seconds: float = 0.0
    submit_seconds: float = 0.0  # of it, the CPU tier's submit call
    finish_seconds: float = 0.0  # finish() less its wait for the CPU tier (copies, combine, counters)
    device_steps: int = 0  # decode steps on the device path (every miss over PCIe, no host sync per layer)
    stream_steps: int = 0  # decode steps whose CPU share the GPU stream drove (cpu_drive "stream": no host sync)
    cpu_scale: float = 1.0  # the split's correction of the CPU tier's startup rate: measured / predicted seconds
    pcie_scale: float = 1.0  # the same for the PCIe share

    @property
    def picks(self) -> int:
        return self.hit_picks + self.cpu_picks + self.pcie_picks

    @property
    def hit_rate(self) -> float:
        return self.hit_picks / self.picks if self.picks else 0.0

    def describe(self) -> str:
        p = max(self.picks, 1)
        s = max(self.steps, 1)
        return (
            f"{self.steps} steps, {self.picks} picks: hits {self.hit_picks / p:.1%}, CPU {self.cpu_picks / p:.1%}, "
            f"PCIe {self.pcie_picks / p:.1%}; deadline misses {self.deadline_misses} ({self.fallback_picks} picks "
            f"recomputed on the GPU); per step: layers {1e3 * self.layer_seconds / s:.2f} ms, CPU tier "
            f"{1e3 * self.cpu_seconds / s:.2f} ms (running {1e3 * self.cpu_run_seconds / s:.2f} ms, predicted "
            f"{1e3 * self.cpu_pred_seconds / s:.2f} ms), input wait "
            f"{1e3 * self.wait_seconds / s:.2f} ms, PCIe queuing {1e3 * self.pcie_enqueue_seconds / s:.2f} ms, wait "
            f"for the CPU tier {1e3 * self.cpu_wait_seconds / s:.2f} ms (the stream's "
            f"{1e3 * self.stream_wait_seconds / s:.2f} ms), host work in begin {1e3 * self.begin_seconds / s:.2f} ms "
            f"(the CPU tier's submit {1e3 * self.submit_seconds / s:.2f}), in finish "
            f"{1e3 * self.finish_seconds / s:.2f} ms and in the step's bookkeeping "
            f"{1e3 * self.bookkeeping_seconds / s:.2f} ms; {self.device_steps} steps on the device "
            f"path, {self.stream_steps} with the CPU tier driven by the stream; split feedback: CPU tier "
            f"x{self.cpu_scale:.2f}, PCIe x{self.pcie_scale:.2f} of the startup prediction"
        )


@dataclasses.dataclass(slots=True)
class _Pending:
    """A layer between ``begin`` and ``finish``."""

    layer: int
    t: int
    k: int = 0
    b: _Buffers | None = None
    kernel: Any = None
    ptrs: Any = None
    n_hit: int = 0
    n_miss: int = 0
    pcie_picks: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    cpu_picks: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    job: Any = None
    timeout: float | None = None
    submitted: float = 0.0
    t0: float = 0.0
    staged: torch.Tensor | None = None  # the staged prefill's fp32 result (``vllm_dsv41.prefill``)
    profile: bool = False  # a dummy forward's call: zeros
    wait_s: float = 0.0  # this call's parts of TierStats' seconds, added to the counters once in ``finish``
    pcie_enqueue_s: float = 0.0
    device_only: bool = False  # computed by ``_begin_device`` (no host sync)
    stream: Any = None  # the call's cpu_tier.StreamCall (``_begin_stream``: the stream drives the CPU tier)
    graph_key: tuple[Any, ...] | None = None  # layer_graphs: the stream path's begin graph's key (its finish's too)
    cpu_pred: float = 0.0  # the split's predicted seconds of the CPU share at the startup rates (split feedback)
    begin_s: float = 0.0  # host seconds of begin(), its step bookkeeping, its submit, finish()'s wait (TierStats)
    bookkeeping_s: float = 0.0
    submit_s: float = 0.0
    cpu_wait_s: float = 0.0


class _Buffers:
    """Persistent device buffers and their pinned host twins for ``rows`` tokens (grown outside graphs)."""

    def __init__(self, device: torch.device, rows: int, hidden: int, topk: int) -> None:
        self.rows, self.hidden, self.topk = rows, hidden, topk
        cuda = device.type == "cuda"
        f32, i32 = torch.float32, torch.int32
        picks = rows * topk

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=cuda)

        def dev(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        # the routing (ids int32 | weights fp32 | hit mask bool) in one byte buffer per side, so the split path copies
        # it to the host in one copy (of all ``rows``: < 1 KB at decode sizes) rather than three
        self.route = dev((9 * picks,), torch.uint8)
        self.h_route = host((9 * picks,), torch.uint8)
        self.ids, self.w, self.hit = _route_views(self.route, rows, topk)
        self.h_ids, self.h_w, self.h_hit = _route_views(self.h_route, rows, topk)
        self.x32 = dev((rows, hidden), f32)
        self.gpu_ids = dev((rows, topk), i32)
        self.y = dev((rows, topk, hidden), f32)
        self.y2 = dev((rows, topk, hidden), f32)  # PCIe share and deadline fallback
        self.cpu_rows = dev((picks, hidden), f32)
        self.cpu_index = dev((picks,), torch.int64)
        self.second_ids = dev((2, rows, topk), i32)
        self.h_x = host((rows, hidden), f32)
        self.h_second = host((2, rows, topk), i32)
        self.h_xrows = host((picks, hidden), f32)
        self.h_cpu = host((picks, hidden), f32)
        self.h_index = host((picks,), torch.int64)
        # cpu_drive "stream": the CPU tier's picks it did not compute (expert id, -1 elsewhere), for the GPU
        self.h_missing = host((rows, topk), i32)
        self.missing = dev((rows, topk), i32)
        # a prompt's GPU share in pick-major order (``_gpu_picks_sorted``), per staging use: the picks' flat
        # indices and their tokens (pinned, then on the device), and their weights in that order
        self.h_order = host((2, 2, picks), torch.int64)
        self.order = dev((2, 2, picks), torch.int64)
        self.w_sorted = dev((2, picks), f32)
        self.ready = torch.cuda.Event() if cuda else None
        self.arange = np.arange(picks, dtype=np.int32)  # the CPU share's row of each pick (``_PickRows.arange``)
        self.arange.flags.writeable = False
        self._rows: dict[int, _Rows] = {}
        self._picks: dict[int, _PickRows] = {}

    def at(self, t: int) -> _Rows:
        """The views of the first ``t`` token rows, kept for decode sizes (``t <= HIT_CHUNK_TOKENS``: a decode
        call's ~20 slices and numpy views cost ~1-2 us each, on the split path's critical path before the CPU tier
        starts); made afresh for a larger call (a prompt: one set per length would pile up)."""
        v = self._rows.get(t)
        if v is None:
            v = _Rows(self, t)
            if t <= HIT_CHUNK_TOKENS:
                self._rows[t] = v
        return v

    def picks_at(self, n: int) -> _PickRows:
        """The views of the first ``n`` pick rows of the CPU share's buffers, kept for a decode call's counts
        (``n <= HIT_CHUNK_TOKENS * topk``), made afresh beyond."""
        v = self._picks.get(n)
        if v is None:
            v = _PickRows(self, n)
            if n <= HIT_CHUNK_TOKENS * self.topk:
                self._picks[n] = v
        return v


def _route_views(buf: torch.Tensor, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids`` (int32), ``w`` (fp32) and ``hit`` (bool), each ``[rows, topk]``, over one byte buffer in that order."""
    n = rows * topk
    return (buf[: 4 * n].view(torch.int32).view(rows, topk), buf[4 * n : 8 * n].view(torch.float32).view(rows, topk),
            buf[8 * n : 9 * n].view(torch.bool).view(rows, topk))  # fmt: skip


class _Rows:
    """``_Buffers``' views of ``t`` token rows: device, pinned host, and the host ones as numpy arrays."""

    __slots__ = ("ids", "w", "x32", "gpu_ids", "hit", "y", "y_flat", "y2", "h_x", "np_x", "np_ids", "np_ids_flat",
                 "np_w_flat", "np_hit_flat")  # fmt: skip

    def __init__(self, b: _Buffers, t: int) -> None:
        self.ids, self.w, self.x32, self.gpu_ids, self.hit = b.ids[:t], b.w[:t], b.x32[:t], b.gpu_ids[:t], b.hit[:t]
        self.y, self.y2 = b.y[:t], b.y2[:t]
        self.y_flat = self.y.view(-1, b.hidden)
        self.h_x = b.h_x[:t]
        self.np_x, self.np_ids = self.h_x.numpy(), b.h_ids[:t].numpy()
        self.np_ids_flat = self.np_ids.reshape(-1)
        self.np_w_flat = b.h_w[:t].numpy().reshape(-1)
        self.np_hit_flat = b.h_hit[:t].numpy().reshape(-1)


class _PickRows:
    """``_Buffers``' views of ``n`` rows of the CPU share (one row per pick)."""

    __slots__ = ("h_cpu", "h_index", "cpu_index", "cpu_rows", "np_xrows", "np_cpu", "np_index", "arange")

    def __init__(self, b: _Buffers, n: int) -> None:
        self.h_cpu, self.h_index = b.h_cpu[:n], b.h_index[:n]
        self.cpu_index, self.cpu_rows = b.cpu_index[:n], b.cpu_rows[:n]
        self.np_xrows, self.np_cpu, self.np_index = b.h_xrows[:n].numpy(), self.h_cpu.numpy(), self.h_index.numpy()
        self.arange = b.arange[:n]


class _Stager:
    """Transient VRAM slots for the GPU's reads of the host home (``pcie_read`` staged): the copy engine copies
    up to ``round_size`` experts into them on its own stream, and the hit kernel reads them through a copy of the
    layer's pointer table whose columns of those experts point into the slots. Slot layout and alignment are the
    cache's (``slot_alignment``), so any home alignment works.

    Double buffering: with ``n >= 2`` slots the rounds alternate between two groups of ``n // 2``, so the copies
    of round r + 1 (one group) run on the copy engine while the kernel of round r reads the other group (run 4 on
    the H200: one group, every round's copy waited for the previous round's kernel).

    Ordering: the copies into a group wait for the last kernel that read that group (``done``), the compute stream
    waits for the copies; ``ptrs`` is rewritten on the compute stream, after the kernel queued before it. The
    experts' ids reach the device from a pinned buffer with one place per (``use``, round) of a layer (the runtime's
    two staging pairs), so no copy is pageable (a pageable one would make the host wait for the stream) and no round
    overwrites ids a queued copy has yet to read; the next layer writes them only after its own input event, which
    the stream orders after these copies.
    The slots' addresses are computed once."""

    def __init__(self, config: Any, rows: Any, n: int, device: torch.device) -> None:
        from expert_cache import slot_pool

        self.n = n
        self.groups = 2 if n >= 2 else 1
        self.round_size = n // self.groups  # experts per round (a stage call)
        self._group = self.groups - 1  # the group the last stage filled (done() marks it; the next takes the other)
        self.device = device
        self.cuda = device.type == "cuda"
        self.config = config
        self.stride = config.slot_stride
        self.offs = np.asarray(config.projection_offsets, np.int64)
        self.rows = rows
        self.pool = slot_pool(config, n, device)
        self.base = self.pool.data_ptr()
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # its copies write the pool: not handed out again before they are done
            self.pool.record_stream(self.stream)
            # and not before what the compute stream queued on the block's former tensors is done
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self._free: list[Any] = [None] * self.groups  # per group: event after the last kernel that read it
        self.ptrs: torch.Tensor | None = None
        # [P, n]: the address of projection p of slot j
        addr = self.base + np.arange(n, dtype=np.int64)[None, :] * self.stride + self.offs[:, None]
        self.slot_addr = torch.from_numpy(np.ascontiguousarray(addr)).to(device)
        rounds = -(-config.num_experts // self.round_size)
        self.h_cols = torch.empty((2, rounds, n), dtype=torch.int64, pin_memory=self.cuda)
        self.d_cols = torch.empty(n, dtype=torch.int64, device=device)
        self.cols = self.d_cols[:0]  # the device ids of the experts the last ``stage`` placed
        self.bytes_copied = 0
        self.rounds = 0

    @property
    def nbytes(self) -> int:
        return int(self.pool.untyped_storage().nbytes())

    def stage(self, layer_index: int, experts: np.ndarray, table: torch.Tensor, use: int = 0,
              round_: int = 0) -> torch.Tensor:  # fmt: skip
        """Copy ``experts`` (at most ``round_size``) of cache layer ``layer_index`` into the next group's slots; the
        pointer table to read them with (``table`` with their columns repointed), valid on the compute stream.
        ``use`` and ``round_`` say which staging of the layer this is (its pinned place for the ids)."""
        if experts.size > self.round_size:
            raise ValueError(f"staged read: {experts.size} experts for rounds of {self.round_size} transient slots")
        g = self._group = (self._group + 1) % self.groups
        base = g * self.round_size
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            assert self.stream is not None
            if self._free[g] is not None:
                self.stream.wait_event(self._free[g])
            ctx: Any = torch.cuda.stream(self.stream)
        else:
            ctx = torch.no_grad()
        with ctx:
            for j, e in enumerate(experts.tolist()):
                self.bytes_copied += self.rows.copy_expert(self.pool[base + j], layer_index, e, self.config,
                                                           self.cuda)  # fmt: skip
        if self.cuda:
            assert compute is not None and self.stream is not None
            ready = torch.cuda.Event()
            ready.record(self.stream)
            compute.wait_event(ready)
        if self.ptrs is None or self.ptrs.shape != table.shape:
            self.ptrs = torch.empty_like(table)
        self.ptrs.copy_(table)
        k = experts.size
        h = self.h_cols[use, round_, :k]
        h.numpy()[:] = experts
        self.cols = self.d_cols[:k]
        self.cols.copy_(h, non_blocking=self.cuda)
        self.ptrs[:, self.cols] = self.slot_addr[:, base : base + k]
        self.rounds += 1
        return self.ptrs

    def done(self) -> None:
        """After the kernel that read the last stage's slots was queued: the next copies into them wait for it."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._free[self._group] = ev

    def claim_all(self) -> None:
        """After the device path wrote and read every slot on the compute stream (``dev_stage``): the next copies
        into any group wait for that. (Its writes need no wait of their own: the compute stream waited for every
        earlier round's copies before the kernel that read them.)"""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._free = [ev] * self.groups


class TieredRuntime:
    """Routed experts of every MoE layer split between a VRAM cache (GPU), the CPU tier and PCIe reads.

    Parameters
    ----------
    config : the plugin configuration (``config.tiered`` and ``config.cpu`` are used).
    home : the pack's host home (its mappings must outlive the runtime; CUDA-registered on a GPU model), or a
        callable returning it (the plugin builds the runtime before its loader maps the home).
    device : the model's device ("cuda" on a GPU model; "cpu" runs the same composition on host tensors).
    rates : the cost model's rates; None measures them when the cache is created (or takes ``config.tiered``'s).
    hits_factory : ``(layer_experts, device) -> HitKernel`` (default: ``vllm_dsv41.hits.make_hits`` with
        ``config.tiered.hit_kernel``); tests inject the reference.
    graph_factory : ``() -> devgraphs.Graph`` for ``config.tiered.layer_graphs`` (default: CUDA graphs, on a CUDA
        device only); tests inject one to run the graph bookkeeping on the CPU.
    activation_dtype : the model's dtype: the CPU tier's "auto" precision runs "fast" for bf16/fp16 activations,
        "exact" for float32 ones (``CpuTierConfig.resolved_precision``).
    cache_bytes : the cache's size in bytes, overriding ``config.tiered.cache_gib`` (tests, benchmarks).
    device_budget_bytes : the device memory this process may use in all (default ``config.tiered.device_gib``;
        0/None: the card). With ``cache_gib`` 0 the cache takes ``min(free memory, budget - memory PyTorch has
        reserved)`` minus ``cache_margin_gib``: a 24 GB card mimicked on a larger one.
    vllm_share_bytes : vLLM's share of the device (``gpu_memory_utilization`` x total; the plugin passes it): the
        part of it PyTorch does not hold when the cache is sized (the activations of forwards larger than the
        one running, the sampler's) stays out of the automatic size.
    """

    name = "tiered"
    graph_safe = False

    def __init__(
        self,
        config: Dsv41PluginConfig,
        home: ExpertHome | Callable[[], ExpertHome],
        device: torch.device | str,
        *,
        rates: Rates | None = None,
        hits_factory: Callable[[LayerExperts, torch.device], Any] | None = None,
        cache_bytes: int | None = None,
        device_budget_bytes: int | None = None,
        vllm_share_bytes: int | None = None,
        graph_factory: Callable[[], Any] | None = None,
        activation_dtype: torch.dtype | str = torch.float32,
    ) -> None:
        from cpu_tier import ExpertTier, Picks

        self.config = config
        self.tcfg: TieredConfig = config.tiered
        self.home = home
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._picks_cls = Picks
        self._tier = ExpertTier(config.cpu, activation_dtype=str(activation_dtype))
        self.isa: str = self._tier.isa
        #: The CPU tier's arithmetic, "exact" or "fast" (``config.cpu.precision`` resolved for the activations).
        self.precision: str = self._tier.precision
        self._layers: dict[int, LayerExperts] = {}
        self._hidden: dict[int, int] = {}
        self._expert_bytes: dict[int, int] = {}  # per layer, bytes of one expert (the split's unit)
        self._hits: dict[int, Any] = {}
        self._hits_factory = hits_factory
        self._cache_bytes = cache_bytes
        self._device_budget = device_budget_bytes or int(self.tcfg.device_gib * GiB) or None
        self._vllm_share = vllm_share_bytes
        self._rates = rates
        self._cache: Any = None
        self._index: dict[int, int] = {}  # MoE layer id -> cache layer index
        self._allowed = self.device.type == "cpu"  # on a GPU model: once vLLM's KV cache exists (allow_cache)
        self._step_open = False
        self._cache_step = False  # the cache's before_step was called for the open step
        self._step_tokens = 0
        self._buffers: dict[tuple[int, int, bool], _Buffers] = {}  # (hidden, top-k, decode-size)
        self._stats = TierStats()
        # The same counters for decode-size calls only (at most ``HIT_CHUNK_TOKENS`` tokens: a decode step's layer
        # calls), so the per-step figures are not mixed with prompts computed on the decode path.
        self._stats_decode = TierStats()
        # the device-only decode path's pick counts (hits, all picks), on the device until the stats are read
        self._dev_counts: torch.Tensor | None = None
        # the no-sync paths' routing for the trace: per (ring slot, MoE layer) a pinned copy; the open step's slot
        self._trace_h: dict[tuple[int, int], torch.Tensor] = {}
        self._trace_slot = 0
        self._trace_slot_open = False
        # cpu_drive "stream": per (MoE layer, tokens) the cpu_tier.StreamCall over the buffers of that size, the
        # stream path's pick counts on the device (hits, picks, picks given to the GPU's PCIe reads), the calls'
        # counters already folded, and per (expert bytes, top-k) the PCIe share's quota tables (stream_share:
        # the device's [tokens, distinct misses] table, its pinned source, the host copy, and the feedback
        # averages (CPU tier, PCIe) it was built at)
        self._stream_calls: dict[tuple[int, int], Any] = {}
        self._stream_counts: torch.Tensor | None = None
        self._stream_quota: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor, np.ndarray, tuple[float, float]]
        ] = {}
        self._stream_seen: dict[tuple[int, int], Any] = {}
        self._host_fn: Any = None  # vllm_dsv41.hostfn's launcher (CUDA), made at the first stream call
        # split "auto": per decode batch size, the split path or the device path, whichever measures faster
        self._chooser = (
            PathChooser(self.tcfg.split_probe) if self.tcfg.split == "auto" and self.tcfg.split_probe else None
        )
        self._step_path = "split"
        self._step_probed = False  # the open step's path is under the chooser (its time is reported to it)
        # a probed step's marks: its first MoE layer's begin, its last one's finish, the next step's first MoE begin:
        # CUDA events (read once the stream passed them) or host seconds on a CPU device, until reported
        self._step_start: Any = None
        self._step_spans: list[tuple[int, str, Any, Any, Any]] = []  # (t, path, start, last MoE's end, next start)
        self._span_open: tuple[int, str, Any, Any] | None = None  # a probed step waiting for the next one's start
        self._trace_ready: Any = None
        self._m_cpu = metrics.tier("cpu")
        self._recorder: Any = None  # expert_cache.TraceRecorder, created at the first recorded step
        self._step_ids: dict[int, np.ndarray] = {}
        # the steps whose routing waits to be recorded into the trace (ids per layer, tokens, the no-sync paths' copy
        # event or None, their ring slot or -1), oldest first: recorded once their copies are done (off the CPU
        # tier's critical path, never by a sync until the ring is full or the runtime closes)
        self._trace_pending: collections.deque[tuple[dict[int, np.ndarray], int, Any, int]] = collections.deque()
        self._pending: _Pending | None = None
        self._closed = False
        self._limits: dict[int, float | None] = {}
        self._prefill: Any = None  # vllm_dsv41.prefill.StagedPrefill, built with the cache
        self._stager: _Stager | None = None  # the staged read's transient slots (pcie_read staged; with the cache)
        self._dstage: DeviceStaging | None = None  # the device path's staged read over the same slots (dev_stage)
        self._last_k = 0  # the last call's top-k (the device path's picks are bounded: dev_stage.MAX_PICKS)
        # split feedback (TieredConfig.split_feedback): measured / predicted per path, the rates the split uses now,
        # and the PCIe shares queued on the GPU whose timing events are read once the stream has passed them
        self._scale = {"cpu": 1.0, "pcie": 1.0}
        self._split_rates: tuple[tuple[float, float], Rates] | None = None
        self._pcie_timed: list[tuple[Any, Any, float]] = []
        self._pcie_events: list[tuple[Any, Any]] = []
        # layer_graphs: the no-sync paths' layer calls as CUDA graphs (devgraphs), and per MoE layer the hit
        # kernel's scratch version the graphs were captured with (a new one drops them)
        self._graph_factory = graph_factory
        self._graphs: DeviceGraphs | None = None
        self._graphs_refused = False  # a hit kernel is not graph safe (logged once)
        self._graph_scratch: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------------------------------------ setup

    def add_layer(self, experts: LayerExperts, swiglu_limit: float | None) -> None:
        if self._cache is not None:
            raise RuntimeError(f"MoE layer {experts.layer}: layers must be added before the first forward")
        self._tier.add_layer(experts.layer, list(experts.gate), list(experts.up), list(experts.down),
                             swiglu_limit=swiglu_limit)  # fmt: skip
        self._layers[experts.layer] = experts
        self._hidden[experts.layer] = experts.hidden
        self._expert_bytes[experts.layer] = _expert_bytes(experts)
        self._limits[experts.layer] = swiglu_limit
        factory = self._hits_factory
        if factory is None:
            from .hits import make_hits

            kernel = self.tcfg.hit_kernel

            def factory(lx: LayerExperts, dev: torch.device) -> Any:
                return make_hits(lx, dev, backend=kernel, swiglu_limit=swiglu_limit)

        self._hits[experts.layer] = factory(experts, self.device)

    def allow_cache(self) -> None:
        """Let the next forward create the VRAM cache (the plugin calls it once vLLM's KV cache is allocated)."""
        self._allowed = True

    @property
    def cache_allowed(self) -> bool:
        return self._allowed

    @property
    def cache(self) -> Any:
        """The ``expert_cache.ExpertCache`` (None until created)."""
        return self._cache

    @property
    def rates(self) -> Rates | None:
        return self._rates

    @property
    def stats(self) -> TierStats:
        """Counters since start (the device-only and stream paths' counts folded in: a sync when they ran)."""
        self._fold_device_counts()
        self._fold_stream_counts()
        return self._stats

    @property
    def stats_decode(self) -> TierStats:
        """The counters of decode-size calls only (at most ``HIT_CHUNK_TOKENS`` tokens)."""
        self._fold_device_counts()
        self._fold_stream_counts()
        return self._stats_decode

    def _fold_device_counts(self) -> None:
        c = self._dev_counts
        if c is None:
            return
        hits, picks = (int(v) for v in c.tolist())
        with torch.inference_mode():  # made in the model's forward: an inference tensor, updated in place only there
            c.zero_()
        for st in (self._stats, self._stats_decode):
            st.hit_picks += hits
            st.pcie_picks += picks - hits
        metrics.cache_lookups(hits, picks - hits)
        metrics.picks("gpu_cache", hits)
        metrics.picks("pcie", picks - hits)

    def _fold_stream_counts(self, rebuild: bool = True) -> None:
        """Fold the stream path's counters into ``TierStats``: its hits (on the device: a sync) and each
        ``StreamCall``'s picks, jobs' times and deadline misses since the last fold; the jobs' times into the split
        feedback, and (``rebuild``: not when closing) the shared split's quota built again if a rate moved."""
        c = self._stream_counts
        if c is None:
            return
        hits, picks, pcie = (int(v) for v in c.tolist())
        with torch.inference_mode():  # (an inference tensor, as _dev_counts)
            c.zero_()
        d = dict.fromkeys(("calls", "picks", "deadline_misses", "missed_picks", "errors", "run_s", "wait_s", "span_s",
                           "predicted_s"), 0.0)  # fmt: skip
        for key, call in self._stream_calls.items():
            now = call.counters()
            before = self._stream_seen.get(key)
            for f in d:
                d[f] += getattr(now, f) - (getattr(before, f) if before is not None else 0)
            self._stream_seen[key] = now
        cpu, missed, misses = int(d["picks"]), int(d["missed_picks"]), int(d["deadline_misses"])
        if d["calls"] and d["run_s"] > 0:  # the split feedback: the jobs' run time against the startup rates' model
            self._feedback("cpu", d["run_s"], d["predicted_s"], samples=int(d["calls"]))
            if rebuild:
                self._refresh_stream_quota()
        for st in (self._stats, self._stats_decode):
            st.hit_picks += hits
            st.cpu_picks += cpu
            st.pcie_picks += pcie
            st.deadline_misses += misses
            st.fallback_picks += missed
            st.cpu_seconds += d["span_s"]
            st.cpu_run_seconds += d["run_s"]
            st.stream_wait_seconds += d["wait_s"]
            st.cpu_pred_seconds += d["predicted_s"]
        metrics.cache_lookups(hits, picks - hits)
        metrics.picks("gpu_cache", hits)
        metrics.picks("pcie", pcie)
        if missed or d["errors"]:
            errors = [c.last_error for c in self._stream_calls.values() if c.last_error]
            metrics.cpu_deadline_miss(missed)
            logger.warning("dsv41 tiered: the stream-driven CPU tier left %d pick(s) to the GPU (%d deadline "
                           "miss(es), %d failure(s)%s); computed from the host home", missed, misses,
                           int(d["errors"]), f": {errors[-1]}" if errors else "")  # fmt: skip

    def _create_cache(self) -> None:
        from expert_cache import ExpertCache, ExpertCacheConfig, policy_config

        layer_ids = sorted(self._layers)
        home = self.home if isinstance(self.home, ExpertHome) else self.home()
        src = home.cache_home(layer_ids)
        self._index = {lid: i for i, lid in enumerate(src.layer_ids)}
        t = self.tcfg
        budget = self._cache_bytes
        if budget is None and t.cache_gib > 0:
            budget = int(t.cache_gib * GiB)
        if budget is None and self.device.type != "cuda":
            raise ValueError("tiered runtime: on a CPU device the cache size must be given (cache_gib > 0)")
        cfg = ExpertCacheConfig(
            num_layers=len(layer_ids),
            num_experts=self._layers[layer_ids[0]].num_experts,
            projections=src.projections,
            # a given size is the budget itself; auto: the device's free memory minus the margin
            vram_budget_bytes=budget or 0,
            margin_bytes=0 if budget is not None else int(t.cache_margin_gib * GiB),
            max_slots=0,
            policy=policy_config(t.policy),  # type: ignore[arg-type]
            replan_every=t.replan_every,
            admit_limit=t.admit_limit,
        )
        home_alignment = _home_alignment(src.rows)
        self._hits_for_home(home_alignment)
        alignment = self._read_staged(home_alignment)
        if alignment:
            self._stager = _Stager(cfg, src.rows, t.pcie_stage_slots, self.device)
            nbytes = [spec.nbytes for spec in cfg.projection_specs]
            if not t.device_stage:
                logger.info("dsv41 tiered: device_stage off: decode calls stage their misses on the split path")
            elif DeviceStaging.supported(alignment, nbytes):  # (without Triton on a GPU: its warm-up fails, logged)
                self._dstage = self._device_staging(nbytes, cfg.num_experts)
            else:
                logger.info("dsv41 tiered: no device path: the home's %d-byte alignment or its projections' sizes "
                            "(%s bytes) are not 4-byte words", alignment, nbytes)  # fmt: skip
            if budget is not None:  # the transient slots come out of a given budget
                budget = max(1, budget - self._stager.nbytes)
                cfg = dataclasses.replace(cfg, vram_budget_bytes=budget)
        free = None
        if budget is None and self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if self._vllm_share:  # what of vLLM's share it does not hold now stays vLLM's
                free = max(0, free - max(0, self._vllm_share - torch.cuda.memory_reserved(self.device)))
            if self._device_budget:
                free = max(0, min(free, self._device_budget - torch.cuda.memory_reserved(self.device)))
        self._cache = ExpertCache(cfg, src.rows, self.device, free_bytes=free)
        if self._rates is None:
            self._rates = self._measure_rates()
        if self.tcfg.prefill:
            self._prefill_setup(home)
        slots = self._cache.num_slots
        if free is not None and slots < 0.05 * cfg.num_keys:
            logger.warning("dsv41 tiered: the automatically sized expert cache holds only %d of %d experts (%.2f GiB "
                           "free for it): vLLM's share of the GPU (gpu_memory_utilization) leaves little; lower it to "
                           "what the weights and the KV cache need, or set cache_gib", slots, cfg.num_keys,
                           free / GiB)  # fmt: skip
        logger.info("dsv41 tiered: VRAM expert cache of %d slots (%.2f GiB, %.1f%% of %d experts), policy %s; %s",
                    slots, slots * cfg.slot_stride / GiB, 100.0 * slots / cfg.num_keys, cfg.num_keys, t.policy,
                    self._rates.describe())  # fmt: skip

    def _device_staging(self, nbytes: list[int], num_experts: int) -> DeviceStaging | None:
        """The device path's staged read over the stager's slots, its kernels compiled now (one empty call: a
        compile in a request would stall it); None, logged, if they cannot run here (the split path stages)."""
        assert self._stager is not None
        try:
            ds = DeviceStaging(self._stager.slot_addr, nbytes, num_experts)
            table = torch.zeros((len(nbytes), num_experts), dtype=torch.int64, device=self.device)
            ids = torch.full((1, 1), -1, dtype=torch.int32, device=self.device)
            ds.plan(ids, torch.zeros((1, 1), dtype=torch.bool, device=self.device), table)
            ds.copy(table, 0)  # (no expert: every program returns)
        except Exception as exc:  # no Triton, or a kernel Triton cannot build or launch on this GPU
            logger.warning("dsv41 tiered: no device path on this staged home: its staging kernels failed (%s: %s)",
                           type(exc).__name__, exc)  # fmt: skip
            return None
        logger.info("dsv41 tiered: the device path stages its misses itself, %d transient slots a round",
                    self._stager.n)  # fmt: skip
        return ds

    def _hits_for_home(self, home_alignment: int) -> None:
        """With ``hit_kernel`` and ``pcie_read`` both "auto": if the hit kernels cannot read the home in place but
        ours can, the layers get ours (``hits.in_place_backend``: staging every miss cost more than it gained in
        H200 run 7)."""
        if self.tcfg.hit_kernel != "auto" or self.tcfg.pcie_read != "auto" or self._hits_factory is not None:
            return
        from .hits import in_place_backend, make_hits

        names = {getattr(k, "name", "") for k in self._hits.values()}
        to = in_place_backend(names.pop(), home_alignment) if len(names) == 1 else None
        if to is None:
            return
        for layer, lx in self._layers.items():
            self._hits[layer] = make_hits(lx, self.device, backend=to, swiglu_limit=self._limits[layer])
        logger.info("dsv41 tiered: hit kernel 'auto': %s, which reads the host home in place (its tensors are %d-byte "
                    "aligned; exllamav3 would stage every miss through VRAM slots)", to, home_alignment)  # fmt: skip

    def _read_staged(self, alignment: int) -> int:
        """Whether the GPU reads the home through transient slots (``pcie_read``): "auto" stages when a hit kernel
        cannot read the home's addresses in place (a checkpoint's safetensors files place tensors on 8-byte
        boundaries; exllamav3's kernel loads 16 bytes). ``alignment``: the home's (``_home_alignment``). Returns
        the home's alignment when it stages, else 0."""
        need = max((getattr(k, "alignment", 1) for k in self._hits.values()), default=1)
        mode = self.tcfg.pcie_read
        if mode == "mapped" and alignment % need:
            raise ValueError(f"tiered runtime: pcie_read 'mapped' needs the host home's tensors {need}-byte aligned "
                             f"for the {self.tcfg.hit_kernel} hit kernel, but they are only {alignment}-byte aligned; "
                             "use pcie_read 'staged' or 'auto'")  # fmt: skip
        staged = mode == "staged" or (mode == "auto" and alignment % need != 0)
        logger.info("dsv41 tiered: the GPU reads the host home %s (its tensors are %d-byte aligned, the hit kernel "
                    "loads %d bytes)", f"through {self.tcfg.pcie_stage_slots} transient VRAM slots" if staged
                    else "in place (zero-copy)", alignment, need)  # fmt: skip
        return alignment if staged else 0

    def _prefill_setup(self, home: ExpertHome) -> None:
        """The staged prefill (``vllm_dsv41.prefill``), its step rule calibrated now (memory lent by the cache)."""
        from .prefill import StagedPrefill

        limits = set(self._limits.values())
        if len(limits) != 1:
            raise ValueError(f"staged prefill: the MoE layers clamp SwiGLU differently ({sorted(map(str, limits))})")
        assert self._rates is not None
        self._prefill = StagedPrefill(self.tcfg, home, self._layers, self._tier, self.device, limits.pop())
        self._prefill.calibrate(self._rates, self._cache)
        logger.info("dsv41 prefill: %s", self._prefill.describe())

    @property
    def prefill(self) -> Any:
        """The staged prefill (``vllm_dsv41.prefill.StagedPrefill``; None until the cache exists or when off)."""
        return self._prefill

    def _measure_rates(self) -> Rates:
        """Rates from the configuration, measured where 0 (CPU tier: forwards over distinct experts at 1, 2, 4 and
        8 tokens per expert; PCIe: the hit kernel over non-resident experts)."""
        t = self.tcfg
        cpu = t.cpu_gbps * 1e9
        pcie = t.pcie_gbps * 1e9
        lx = self._layers[min(self._layers)]
        expert_bytes = _expert_bytes(lx)
        more: tuple[tuple[int, float], ...] = ()
        cpu_fixed = pcie_fixed = 0.0
        if cpu == 0:
            n = min(lx.num_experts, 32)
            one = self._cpu_seconds(lx, 1, 1)
            by_tokens = {m: self._cpu_seconds(lx, n, m) for m in _CPU_RATE_TOKENS}
            per, cpu_fixed = _affine(one, by_tokens[1], n)
            cpu = expert_bytes / per
            more = tuple((m, n * expert_bytes / max(v - cpu_fixed, 1e-9)) for m, v in by_tokens.items() if m > 1)
        if pcie == 0 and self.device.type == "cuda":
            pcie, pcie_fixed = self._measure_pcie(lx, expert_bytes)
        source = "configured" if t.cpu_gbps and (t.pcie_gbps or self.device.type != "cuda") else "measured"
        return Rates(cpu_bps=cpu, pcie_bps=pcie, source=source, cpu_tokens=more, cpu_fixed_s=cpu_fixed,
                     pcie_fixed_s=pcie_fixed)  # fmt: skip

    def _cpu_seconds(self, lx: LayerExperts, n: int, m: int) -> float:
        """Best of 3 (after a warm-up) CPU tier forwards of ``n`` distinct experts with ``m`` tokens each."""
        x = np.random.default_rng(m).standard_normal((n * m, lx.hidden)).astype(np.float32)
        rows = np.arange(n * m, dtype=np.int32)
        picks = self._picks_cls(rows, rows % n, np.ones(n * m, np.float32))
        out = np.empty_like(x)
        self._tier.forward(lx.layer, x, picks, out=out)  # warm the pages and the pool
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            self._tier.forward(lx.layer, x, picks, out=out)
            best = min(best, time.perf_counter() - t0)
        return best

    def _measure_pcie(self, lx: LayerExperts, expert_bytes: int) -> tuple[float, float]:
        """The hit kernel over non-resident experts (pointers into the host home), one expert and many: the PCIe
        read rate (bytes/s) and the fixed seconds per layer."""
        n = min(lx.num_experts, 16)
        li = self._index[lx.layer]
        table = self._cache.layer_pointers(li)  # nothing resident yet: all point into the home
        stager = self._stager
        times = {}
        for k in (1, n):
            if stager is not None:
                k = min(k, stager.round_size)
                experts = np.arange(k, dtype=np.int64)
                times[k] = hit_seconds(self._hits[lx.layer], functools.partial(stager.stage, li, experts, table), k,
                                       lx.hidden, self.device)  # fmt: skip
                stager.done()
            else:
                times[k] = hit_seconds(self._hits[lx.layer], table, k, lx.hidden, self.device)
        n = max(times)
        per, fixed = _affine(times[1], times[n], n)
        return expert_bytes / per, fixed

    # ------------------------------------------------------------------------------------------ steps

    def _begin_layer(self, layer: int, tokens: int) -> None:
        first = layer == min(self._layers)
        cache = self._cache
        if cache is None and self._allowed and not _capturing():
            self._create_cache()
            cache = self._cache
            if self._step_open and not first:  # created inside a step: the cache's step opens here
                cache.before_step(self._step_tokens)
                self._cache_step = True
        if not first:
            return
        if self._step_open:
            self._end_step()
        if self._span_open is not None:  # the last probed step's sample ends where this step's MoE work starts
            self._step_spans.append((*self._span_open, self._span_mark() if self._span_open[0] == tokens else None))
            self._span_open = None
        self._report_step_spans()
        if self._stats.steps % _FOLD_EVERY == 0:  # (Prometheus' counters too; at a step's start the GPU has little
            if self._dev_counts is not None:  # queued)
                self._fold_device_counts()
            if self._stream_counts is not None:
                self._fold_stream_counts()
        self._step_tokens = tokens
        self._step_path, self._step_probed = "split", False
        if self._chooser is not None and self._device_path_possible(tokens):
            self._step_path, self._step_probed = self._chooser.choose(tokens), True
            self._step_start = self._span_mark()
        for st in self._counters(tokens):
            st.steps += 1
        if cache is not None:
            cache.before_step(tokens)
            self._cache_step = True
        self._step_open = True
        if self.tcfg.stats_every and self._stats.steps % self.tcfg.stats_every == 0:
            logger.info("dsv41 tiered: %s", self.stats.describe())

    def _end_step(self, replan: bool = True) -> None:
        self._step_open = False
        cache_step, self._cache_step = self._cache_step, False
        if cache_step and replan:  # (the cache's tensors may be inference tensors: replans run in the model's
            before = self._cache.fills_issued  # forward, never at close)
            self._cache.after_step()
            if (n := self._cache.fills_issued - before) > 0:
                metrics.cache_fill(n, n * self._cache.config.expert_bytes)
        if self._step_ids:
            slot = self._trace_slot if self._trace_slot_open else -1
            self._trace_pending.append((self._step_ids, self._step_tokens, self._trace_ready, slot))
            self._step_ids, self._trace_ready, self._trace_slot_open = {}, None, False
            self._flush_trace()

    def _flush_trace(self, free_slot: int = -1, block: bool = False) -> None:
        """Record the waiting steps' routing into the trace, oldest first, while their copies are done (an event's
        query: no sync). ``free_slot``: every step that still reads that ring slot is recorded, waiting for its
        copies if need be (a new step is about to write it); ``block``: all of them (close)."""
        pending = self._trace_pending
        last = max((i for i, p in enumerate(pending) if p[3] == free_slot), default=-1) if free_slot >= 0 else -1
        while pending:
            ready = pending[0][2]
            if not (block or last >= 0 or ready is None or ready.query()):
                break
            self._record_step(*pending.popleft()[:3])
            last -= 1

    def _record_step(self, step_ids: dict[int, np.ndarray], step_tokens: int, ready: Any) -> None:
        layers = sorted(self._layers)
        if any(lid not in step_ids for lid in layers):
            return  # a step that did not reach every MoE layer (cannot happen in a model forward)
        if ready is not None:  # the device-only path's copies of the routing
            ready.synchronize()
        ids = np.stack([step_ids[lid] for lid in layers], axis=1)  # [T, L, K]
        real = (ids >= 0).all(axis=(1, 2))  # not the rows vLLM pads a CUDA graph's batch with (ids -1)
        padded = int(ids.shape[0] - real.sum())
        ids = ids[real]
        # A trace routes distinct experts per row and layer (expert_cache.Trace). vLLM 0.32's warm-up forwards that
        # carry attention metadata (its JIT / mixed-batch attention warm-ups: not dummy forwards to
        # experts.in_profile_run) can route a row to one expert twice (run 3 on the H200: [0, 0], likely the top-k of
        # equal scores): computed as routed, but left out of the trace, counted and logged, never silently.
        from expert_cache import repeated_experts

        twice = repeated_experts(ids).any(axis=1)
        if twice.any():
            n = int(twice.sum())
            if self._stats.trace_rows_dropped == 0:
                logger.warning("dsv41 tiered: %d token row(s) of step %d route an expert twice in a layer (first: %s); "
                               "left out of the routing trace (counted in trace_rows_dropped)", n, self._stats.steps,
                               ids[np.flatnonzero(twice)[0]].tolist())  # fmt: skip
            self._stats.trace_rows_dropped += n
            ids = ids[~twice]
        if self._recorder is None:
            from expert_cache import TraceRecorder

            self._recorder = TraceRecorder(len(layers), self._layers[layers[0]].num_experts, ids.shape[2],
                                           meta={"layers": layers, "runtime": self.name})  # fmt: skip
        self._recorder.record_step(step_tokens - padded, ids)

    # ------------------------------------------------------------------------------------------ forward

    def _buffers_for(self, hidden: int, topk: int, t: int) -> _Buffers:
        """The persistent buffers of a call of ``t`` tokens: decode-size calls (``t <= HIT_CHUNK_TOKENS``) have
        their own, of that many rows, which never grow (the no-sync paths' graphs and the stream path's calls read
        them); longer calls share a set that grows (doubling)."""
        decode = t <= HIT_CHUNK_TOKENS
        key = (hidden, topk, decode)
        b = self._buffers.get(key)
        if b is None or b.rows < t:
            b = _Buffers(self.device, HIT_CHUNK_TOKENS if decode else max(t, 2 * b.rows if b else 32), hidden, topk)
            self._buffers[key] = b
        return b

    def forward_into(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        t = _check_args(self._hidden, layer, x, topk_ids, topk_weights, out)
        if t == 0:
            return
        self.begin(layer, x, topk_ids, topk_weights)
        self.finish(layer, out)

    def begin(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """First half of a layer's forward: the hits (and the PCIe share) queued on the GPU, the CPU share
        submitted to the CPU tier; returns without waiting for them. The model may queue other GPU work (the
        shared expert) before ``finish``."""
        t = _check_args(self._hidden, layer, x, topk_ids, topk_weights, x)
        if x.device != self.device:
            raise ValueError(f"MoE layer {layer}: activations on {x.device}, the tiered runtime runs on {self.device}")
        if self.device.type == "cuda":
            _refuse_capture(self.name)
        if self._pending is not None:
            raise RuntimeError(f"MoE layer {layer}: begin() while layer {self._pending.layer} is not finished")
        t0 = time.perf_counter()
        if in_profile_run():  # a dummy batch: no step, no cache, no buffers grown, no host work on unset inputs
            self._stats.profile_calls += 1
            self._pending = _Pending(layer, t, t0=t0, profile=True)
            return
        self._last_k = topk_ids.shape[1]
        self._begin_layer(layer, t)
        bookkeeping_s = time.perf_counter() - t0
        pf = self._prefill
        if pf is not None and t and pf.wants(t, topk_ids.shape[1]):  # the staged prefill (vllm_dsv41.prefill)
            if self._cache is not None:
                self._cache.observe(self._index[layer], topk_ids)
            lids = tuple(sorted(self._layers))
            nxt = lids[lids.index(layer) + 1] if layer != lids[-1] else None
            self._step_probed = False  # a streamed step is neither path's: not a sample
            with _mark("dsv41.tiered.staged_prefill"):
                staged = pf.run(layer, x, topk_ids, topk_weights, nxt, cache=self._cache)
            self._pending = _Pending(layer, t, staged=staged)
        else:
            if pf is not None and pf.active:  # the first call after a prefill episode: the cache gets its VRAM back
                pf.end_episode(self._cache)
            with _mark("dsv41.tiered.begin"):
                if not t:
                    self._pending = _Pending(layer, 0, t0=t0)
                elif self._device_only(t):
                    self._pending = self._begin_device(layer, x, topk_ids, topk_weights, t)
                elif self._stream_path(t):
                    self._pending = self._begin_stream(layer, x, topk_ids, topk_weights, t)
                else:
                    self._pending = self._begin(layer, x, topk_ids, topk_weights, t)
        self._flush_trace()  # (the routing trace: the last step's, while the CPU tier works)
        self._pending.t0 = t0
        self._pending.bookkeeping_s = bookkeeping_s
        self._pending.begin_s = time.perf_counter() - t0 - bookkeeping_s

    def finish(self, layer: int, out: torch.Tensor) -> None:
        """Second half: wait for the CPU share (deadline, GPU fallback) and write ``out[:T]``."""
        tf = time.perf_counter()
        p = self._pending
        if p is None or p.layer != layer:
            raise RuntimeError(f"MoE layer {layer}: finish() without its begin()")
        bookkeeping_begin = p.bookkeeping_s
        self._pending = None
        sts = (self._stats,) if p.profile or p.staged is not None else self._counters(p.t)
        if p.t:
            h = self._hidden[layer]
            if out.ndim != 2 or out.shape[0] < p.t or out.shape[1] != h or out.device != self.device:
                raise ValueError(f"MoE layer {layer}: out must be [>= {p.t}, {h}] on {self.device}, got "
                                 f"{tuple(out.shape)} on {out.device}")  # fmt: skip
            if p.profile:
                out[: p.t].zero_()
            elif p.staged is not None:
                out[: p.t].copy_(p.staged)
            elif p.device_only:
                assert p.b is not None
                _combine(p.b, p.t, out)
            elif p.stream is not None:
                self._finish_stream(p, out)
            else:
                with _mark("dsv41.tiered.finish"):
                    self._finish(p, out, sts)
        if self._step_probed and layer == max(self._layers) and self._step_start is not None:
            self._span_open = (self._step_tokens, self._step_path, self._step_start, self._span_mark())
            self._step_start = None
        if self._step_open and layer == max(self._layers) and not p.profile:
            # the step's bookkeeping (the cache's after_step, a replan when due, the trace) at its last MoE layer
            # rather than at the next step's first: with no host sync (the device and stream paths) the host does
            # it while the GPU and the CPU tier still work through the queued layers, not while they wait for the
            # next step's first launches
            tb = time.perf_counter()
            self._end_step()
            p.bookkeeping_s += time.perf_counter() - tb
        now = time.perf_counter()
        dt, finish_s = now - p.t0, now - tf - p.cpu_wait_s - (p.bookkeeping_s - bookkeeping_begin)
        for st in sts:
            st.layer_calls += 1
            st.layer_seconds += dt
            st.begin_seconds += p.begin_s
            st.bookkeeping_seconds += p.bookkeeping_s
            st.submit_seconds += p.submit_s
            st.finish_seconds += finish_s
            st.wait_seconds += p.wait_s
            st.pcie_enqueue_seconds += p.pcie_enqueue_s

    def _begin(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               t: int) -> _Pending:  # fmt: skip
        cuda = self.device.type == "cuda"
        k = topk_ids.shape[1]
        b = self._buffers_for(x.shape[1], k, t)
        r = b.at(t)
        ids, w, hit = r.ids, r.w, r.hit
        cache = self._cache
        kernel = self._hits[layer]
        if cache is not None:
            ptrs = self._prepare(layer, topk_ids, topk_weights, r, self._observe(layer, r), gpu_ids=True)
        else:  # no cache yet (before vLLM's KV cache exists): everything is a miss, computed by the CPU tier
            ptrs = None
            ids.copy_(topk_ids)
            w.copy_(topk_weights)
            hit.zero_()
            r.gpu_ids.fill_(-1)
        # 1-2. inputs to the host (one event; the hits are queued after the CPU tier's submit, below).
        x32 = r.x32
        x32.copy_(x)
        r.h_x.copy_(x32, non_blocking=cuda)
        b.h_route.copy_(b.route, non_blocking=cuda)  # ids, weights and hit mask of every row: one copy
        if b.ready is not None:
            b.ready.record(torch.cuda.current_stream(self.device))
        tw = time.perf_counter()
        if b.ready is not None:
            with _mark("dsv41.tiered.input_wait"):
                b.ready.synchronize()
        wait_s = time.perf_counter() - tw
        flat_ids, h_hit = r.np_ids_flat, r.np_hit_flat
        n_hit = int(np.count_nonzero(h_hit))
        miss = np.flatnonzero(~h_hit & (flat_ids >= 0))  # flat pick indices t * k + j
        # 3. split the misses (per distinct expert) between the CPU tier and PCIe reads.
        pcie_picks = _NO_PICKS
        cpu_picks = miss
        cpu_pred = pcie_pred = 0.0
        cpu_raw: float | None = None  # the CPU share's predicted seconds at the split's rates (for its deadline)
        lx = self._layers[layer]
        if miss.size and ptrs is not None and self.tcfg.split != "cpu":
            # per-expert counts by bincount over the layer's experts (a decode call's few dozen picks: several
            # times cheaper than np.unique / np.isin's sorts)
            miss_ids = flat_ids[miss]
            per_expert = np.bincount(miss_ids, minlength=lx.num_experts)
            experts = np.flatnonzero(per_expert)
            counts = per_expert[experts]
            rates = self.split_rates()
            eb = self._expert_bytes[layer]
            busy_experts = np.count_nonzero(np.bincount(flat_ids[h_hit], minlength=lx.num_experts))
            busy = busy_experts * eb / max(rates.gpu_bps, 1.0)
            plan = split_misses(experts, counts, eb, rates, self.tcfg.split, gpu_busy_seconds=busy,
                                cpu_time_of=functools.partial(_cpu_expert_seconds, rates, eb))  # fmt: skip
            cpu_raw = plan.cpu_seconds
            cpu_pred = plan.cpu_seconds / self._scale["cpu"]
            pcie_pred = max(plan.pcie_seconds - busy, 0.0) / self._scale["pcie"]
            if t > HIT_CHUNK_TOKENS:  # the feedback learns from decode-size calls (the PCIe model has no tokens term)
                cpu_pred = pcie_pred = 0.0
            elif self.tcfg.split == "auto":  # a path given nothing learns nothing: its average returns toward 1, so
                if not plan.pcie.any():  # a slow spell does not shut it out for good
                    self._decay("pcie")
                if plan.pcie.all():
                    self._decay("cpu")
            if plan.pcie.any():
                to_pcie = np.zeros(lx.num_experts, bool)
                to_pcie[experts[plan.pcie]] = True
                on_pcie = to_pcie[miss_ids]
                pcie_picks, cpu_picks = miss[on_pcie], miss[~on_pcie]
        p = _Pending(layer, t, k=k, b=b, kernel=kernel, ptrs=ptrs, n_hit=n_hit, n_miss=int(miss.size),
                     pcie_picks=pcie_picks, cpu_picks=cpu_picks, wait_s=wait_s, cpu_pred=cpu_pred)  # fmt: skip
        # 4. the CPU share, submitted now (the workers start at once); waited for in finish(). Its deadline is
        # computed after the submit (it is needed only at the wait).
        if cpu_picks.size:
            n = cpu_picks.size
            pr = b.picks_at(n)
            np.take(r.np_x, cpu_picks // k, axis=0, out=pr.np_xrows)
            experts_c = flat_ids[cpu_picks]
            picks_obj = self._picks_cls(pr.arange, experts_c, r.np_w_flat[cpu_picks])
            p.submitted = time.perf_counter()
            p.job = self._tier.submit(layer, pr.np_xrows, picks_obj, out=pr.np_cpu)
            p.submit_s = time.perf_counter() - p.submitted
            if ptrs is not None and cpu_raw is None:  # split "cpu": the share's prediction, for its deadline and
                # the feedback, made once the job runs (the split itself needed none)
                cpu_raw = self._cpu_share_seconds(layer, experts_c)
                p.cpu_pred = cpu_raw / self._scale["cpu"] if t <= HIT_CHUNK_TOKENS else 0.0
            if ptrs is not None:  # (before the cache exists the GPU has no table to recompute missed picks from:
                # the CPU tier's share is waited for whole; a deadline there raised under load, CI's tiered test)
                assert cpu_raw is not None  # (with the table, the split or the line above predicted the share)
                p.timeout = self._deadline(cpu_raw)
        # the hits on the GPU, queued once the CPU tier has its share (its start is the critical path; the hits
        # are a small part of the GPU's work), before the PCIe share adds into the same output
        if ptrs is not None:
            _hits_forward(kernel, ptrs, x32, r.gpu_ids, w, r.y)
        else:
            r.y.zero_()
        if self.tcfg.trace_path:
            self._step_ids[layer] = r.np_ids.copy()
        self._read_pcie_timings()  # the stream has passed the earlier layers' PCIe shares (this input follows them)
        # 5. the PCIe share queued after the CPU job is submitted: its copies' host-side queuing (per projection)
        # overlaps the CPU tier's work instead of delaying its start.
        if pcie_picks.size:
            tq = time.perf_counter()
            ev = self._pcie_event_pair() if cuda else None
            if ev is not None:
                ev[0].record(torch.cuda.current_stream(self.device))
            with _mark("dsv41.tiered.pcie_share"):
                self._gpu_picks(b, 0, kernel, ptrs, x32, w, t, pcie_picks, layer)
            p.pcie_enqueue_s = time.perf_counter() - tq
            if ev is not None:  # read at a later layer's input sync (no wait here)
                ev[1].record(torch.cuda.current_stream(self.device))
                self._pcie_timed.append((ev[0], ev[1], pcie_pred))
            else:  # a CPU device computes it synchronously
                self._feedback("pcie", p.pcie_enqueue_s, pcie_pred)
        return p

    def _span_mark(self) -> Any:
        """A point of a probed step's span: a CUDA timing event on the compute stream (the GPU's timeline: no idle
        time between requests, the split path's host bubbles included), or host seconds on a CPU device."""
        if self.device.type != "cuda":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _report_step_spans(self) -> None:
        """Give the chooser the times of probed steps the stream has finished (the device path runs ahead).

        A step's time is from its first MoE layer's start to the next step's (same token count), on the GPU's
        timeline: that includes what follows its last MoE layer, where the split path's host waits cost the
        overlap of vLLM's own host work with the GPU (H200 run 7: 4-token steps measured from first to last MoE
        layer kept the split path, which served 126 tok/s against the device path's 162). Where no next step of
        the same size follows, or the gap to it is idle time (more than ``_IDLE_FACTOR`` x the MoE layers' span:
        between requests), the sample is the span alone."""
        if self._chooser is None:
            return
        left = []
        for t, path, start, end, nxt in self._step_spans:
            last = nxt if nxt is not None else end
            if isinstance(last, float):
                span, whole = end - start, (nxt - start if nxt is not None else None)
            elif last.query():
                span = start.elapsed_time(end) / 1e3
                whole = start.elapsed_time(nxt) / 1e3 if nxt is not None else None
            else:
                left.append((t, path, start, end, nxt))
                continue
            seconds = whole if whole is not None and whole <= _IDLE_FACTOR * span else span
            kept = self._chooser.record(t, path, seconds)
            if kept is not None:
                _, _, split_s, device_s = self._chooser.decisions[-1]
                logger.info("dsv41 tiered: %d-token decode steps: split path %.2f ms, device path %.2f ms (medians "
                            "of %d steps each, first MoE layer to the next step's): the %s path kept for the next %d "
                            "steps", t, 1e3 * split_s, 1e3 * device_s, self._chooser.probe, kept,
                            self._chooser.revisit)  # fmt: skip
        self._step_spans = left

    def _trace_copy(self, layer: int, b: _Buffers, ids: torch.Tensor, t: int, k: int) -> None:
        """A no-sync path's routing for the trace: copied to a pinned buffer of the layer in the step's ring slot,
        read when the step is recorded (once the event recorded at the step's last MoE layer has passed)."""
        if not self.tcfg.trace_path:
            return
        if not self._trace_slot_open:  # the step's first copy: a slot no waiting step still reads
            self._trace_slot = (self._trace_slot + 1) % _TRACE_RING
            self._flush_trace(free_slot=self._trace_slot)
            self._trace_slot_open = True
        key = (self._trace_slot, layer)
        h = self._trace_h.get(key)
        if h is None or h.shape[0] < t or h.shape[1] != k:
            h = self._trace_h[key] = torch.empty((b.rows, k), dtype=torch.int32,
                                                 pin_memory=self.device.type == "cuda")  # fmt: skip
        h[:t].copy_(ids, non_blocking=True)
        self._step_ids[layer] = h[:t].numpy()
        if layer == max(self._layers):  # the step's copies are done by then
            self._trace_ready = self._trace_event()

    def _trace_event(self) -> Any:
        """An event on the compute stream the trace's copies precede (None on a CPU device: copies are done)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _stream_path(self, t: int) -> bool:
        """A call of ``t`` tokens has the stream drive its CPU share (``cpu_drive`` "stream"; ``_begin_stream``):
        decode-size, once the cache exists, split "cpu" or "auto" (its split side, with the PCIe share of
        ``_share_quota``), on a home the hit kernel reads in place (the GPU's fallback for the picks the CPU tier
        misses, and the PCIe share, read it with no staging)."""
        return (self.tcfg.cpu_drive == "stream" and self._cache is not None and 0 < t <= HIT_CHUNK_TOKENS
                and self._stager is None and self.tcfg.split in ("cpu", "auto"))  # fmt: skip

    def _begin_stream(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      t: int) -> _Pending:  # fmt: skip
        """A decode-size call whose CPU share the GPU stream drives, queued with no host sync: the routing (hit
        mask from the cache's table, one launch; under split "auto" the PCIe share marked hit: ``share_misses``) and
        the inputs copied to pinned buffers, a host function that gives the other misses to the CPU tier
        (``cpu_tier.StreamCall.submit_fn``), then the hits (and the share, from the host home) on the GPU while the
        CPU tier works. ``finish`` queues the wait (the stream holds until the job is done or its deadline passed)
        and the combine. The same per-pick values and fixed-order sums as the host-driven split path."""
        k = topk_ids.shape[1]
        b = self._buffers_for(x.shape[1], k, t)
        r = b.at(t)
        r.x32.copy_(x)
        if self._stream_counts is None:
            self._stream_counts = torch.zeros(3, dtype=torch.int64, device=self.device)
        if layer == min(self._layers):
            for st in self._counters(t):
                st.stream_steps += 1
        quota = self._share_quota(layer, t, k)
        call = self._stream_call(layer, b, t, k)
        kernel = self._hits[layer]
        graphs = self._layer_graphs()
        sc = self._stream_counts
        if graphs is not None:  # the inputs into the persistent buffers, the rest one graph (the same work)
            counts = self._graph_inputs(layer, topk_ids, topk_weights, r)
            ptrs = self._cache.layer_pointers(self._index[layer])

            def work() -> None:
                self._prepare(layer, r.ids, r.w, r, counts, gpu_ids=True, dev_counts=sc[:2])
                self._stream_begin_work(b, r, quota, call, kernel, ptrs)

            key = self._graph_key("stream begin", layer, r, counts, kernel, 0 if quota is None else quota.data_ptr(),
                                  id(call))  # fmt: skip
            self._graph_ran(graphs.run(key, work))
            self._trace_copy(layer, b, r.ids, t, k)
            return _Pending(layer, t, k=k, b=b, kernel=kernel, ptrs=ptrs, stream=call, graph_key=key)
        ptrs = self._prepare(layer, topk_ids, topk_weights, r, self._observe(layer, r), gpu_ids=True,
                             dev_counts=sc[:2])  # fmt: skip
        self._trace_copy(layer, b, r.ids, t, k)
        submit_s = self._stream_begin_work(b, r, quota, call, kernel, ptrs)
        return _Pending(layer, t, k=k, b=b, kernel=kernel, ptrs=ptrs, stream=call, submit_s=submit_s)

    def _stream_begin_work(self, b: _Buffers, r: _Rows, quota: torch.Tensor | None, call: Any, kernel: Any,
                           ptrs: torch.Tensor) -> float:  # fmt: skip
        """The stream path's begin after the routing's preparation: the PCIe share marked hit (``share_misses``),
        the inputs and routing copied to pinned memory, the CPU tier's submit (a host function), the hits (and the
        share) on the GPU. Device work and host functions only (a graph). Returns the host seconds of queuing the
        submit."""
        cuda = self.device.type == "cuda"
        assert self._stream_counts is not None
        if quota is not None:  # the PCIe share: picks the hit kernel reads from the host home, the CPU tier skips
            share_misses(r.ids, r.hit, r.gpu_ids, quota, self._stream_counts[2:])
        r.h_x.copy_(r.x32, non_blocking=cuda)
        b.h_route.copy_(b.route, non_blocking=cuda)
        ts = time.perf_counter()
        self._run_host(call, submit=True)
        submit_s = time.perf_counter() - ts
        _hits_forward(kernel, ptrs, r.x32, r.gpu_ids, r.w, r.y)
        return submit_s

    def _finish_stream(self, p: _Pending, out: torch.Tensor) -> None:
        """The stream path's second half, queued: the wait for the CPU tier (a host function), its rows added to
        the hits' (each pick's row is zero on the side that did not compute it), the picks it missed computed by the
        hit kernel from the host home, the fixed-order combine."""
        b, t = p.b, p.t
        assert b is not None
        r = b.at(t)
        key = p.graph_key
        graphs = self._layer_graphs() if key is not None else None
        if graphs is None or key is None:
            self._stream_finish_work(p, b, r)
        else:
            graphs.run(("stream finish", *key[1:]), lambda: self._stream_finish_work(p, b, r))
        out[:t].copy_(r.x32)

    def _stream_finish_work(self, p: _Pending, b: _Buffers, r: _Rows) -> None:
        """The stream path's finish up to the output: the wait for the CPU tier (a host function), its rows added to
        the hits', the picks it missed computed by the hit kernel from the host home, the fixed-order sum into
        ``r.x32``. Device work and host functions only (a graph)."""
        cuda = self.device.type == "cuda"
        t, k = p.t, p.k
        self._run_host(p.stream, submit=False)
        pr = b.picks_at(t * k)
        pr.cpu_rows.copy_(pr.h_cpu, non_blocking=cuda)
        r.y_flat.add_(pr.cpu_rows)
        miss = b.missing[:t]
        miss.copy_(b.h_missing[:t], non_blocking=cuda)
        _hits_forward(p.kernel, p.ptrs, r.x32, miss, r.w, r.y2)
        r.y.add_(r.y2)
        torch.sum(r.y, dim=1, out=r.x32)

    def _share_quota(self, layer: int, t: int, k: int) -> torch.Tensor | None:
        """The stream path's PCIe share at ``t`` tokens of ``layer`` (``stream_share`` with split "auto"): the row
        of ``split.share_quota_table`` for ``t`` (per count of the call's distinct missed experts, how many the GPU
        reads from the host home while the CPU tier computes the rest), on the device so that ``share_misses``
        applies it with no host sync. One table per (expert bytes, top-k), built at the first call and copied from
        pinned memory without a sync. None: no share (not asked, no rates, or none for ``t``)."""
        if not (self.tcfg.stream_share and self.tcfg.split == "auto" and self._rates is not None):
            return None
        key = (self._expert_bytes[layer], k)
        tables = self._stream_quota.get(key)
        if tables is None:
            q, pinned, scale = self._quota_table(key)
            tables = self._stream_quota[key] = (pinned.to(self.device, non_blocking=True), pinned, q, scale)
            logger.info("dsv41 tiered: stream-driven split (%.2f MB experts, top-%d): of n distinct missed experts the "
                        "GPU reads %s from the host home at 1 token (n = 1..%d), %s at 4 (n = 1..%d); the CPU tier "
                        "the rest", key[0] / 1e6, k, q[1, 1 : k + 1].tolist(), k, q[4, 1 : 4 * k + 1].tolist(),
                        4 * k)  # fmt: skip
        dev, _, q, _ = tables
        return dev[t] if q[t].any() else None

    def _quota_table(self, key: tuple[int, int]) -> tuple[np.ndarray, torch.Tensor, tuple[float, float]]:
        """The shared split's quota table for (expert bytes, top-k) at the split's rates now (``split_rates``),
        its pinned copy (the source of the device table's copies), and the feedback averages it was built at."""
        q = share_quota_table(key[0], self.split_rates(), HIT_CHUNK_TOKENS, key[1])
        pinned = torch.from_numpy(q).pin_memory() if self.device.type == "cuda" else torch.from_numpy(q)
        return q, pinned, (self._scale["cpu"], self._scale["pcie"])

    def _refresh_stream_quota(self) -> None:
        """The stream split's quota tables built again at the split's rates now (``split_rates``: the startup rates
        with the feedback), once a path's average has moved by more than ``_QUOTA_REBUILD`` since they were built.
        Each device table is overwritten in place on the compute stream, after the calls queued before that read
        it (the layer graphs keep its address); a count whose row gains or loses its share takes another graph."""
        now = (self._scale["cpu"], self._scale["pcie"])
        for key, (dev, pinned, q, built) in list(self._stream_quota.items()):
            if all(abs(math.log(v / w)) <= _QUOTA_REBUILD for v, w in zip(now, built, strict=True)):
                continue
            q_new, pinned_new, scale = self._quota_table(key)
            if not np.array_equal(q_new, q):
                with torch.inference_mode():  # (made in the model's forward: an inference tensor)
                    dev.copy_(pinned_new, non_blocking=self.device.type == "cuda")
                q, pinned = q_new, pinned_new
                logger.info("dsv41 tiered: stream-driven split (%.2f MB experts, top-%d) at the measured rates (CPU "
                            "tier x%.2f, PCIe x%.2f of the startup prediction): of n distinct missed experts the GPU "
                            "reads %s from the host home at 1 token, %s at 4", key[0] / 1e6, key[1], scale[0],
                            scale[1], q[1, 1 : key[1] + 1].tolist(), q[4, 1 : 4 * key[1] + 1].tolist())  # fmt: skip
            self._stream_quota[key] = (dev, pinned, q, scale)

    def _stream_call(self, layer: int, b: _Buffers, t: int, k: int) -> Any:
        """The ``cpu_tier.StreamCall`` of ``layer`` at ``t`` tokens over ``b``'s pinned buffers (made once): its
        jobs' predicted times from the startup rates (the split feedback's reference, ``_fold_stream_counts``) and,
        with ``deadline_factor``, the deadline model on them, as the host path's ``_deadline``."""
        key = (layer, t)
        call = self._stream_calls.get(key)
        if call is not None:
            return call
        rates, tc = self._rates, self.tcfg
        factor = floor = fixed = 0.0
        per_m: list[float] = []
        if rates is not None and rates.cpu_bps > 0:
            eb = self._expert_bytes[layer]
            fixed = rates.cpu_fixed_s
            per_m = [_cpu_expert_seconds(rates, eb, m) for m in range(1, self._tier.chunk_tokens + 1)]
            if tc.deadline_factor > 0:
                factor, floor = tc.deadline_factor, tc.deadline_floor_ms / 1e3
        call = self._tier.stream_call(
            layer, b.h_x[:t], b.h_ids[:t], b.h_w[:t], b.h_hit[:t].view(torch.uint8), b.h_xrows[: t * k],
            b.h_cpu[: t * k], b.h_missing[:t], deadline_factor=factor, deadline_floor_s=floor, fixed_s=fixed,
            expert_s=per_m,
        )  # fmt: skip
        self._stream_calls[key] = call
        return call

    def _run_host(self, call: Any, submit: bool) -> None:
        """Queue the call's submit or wait on the compute stream (a CUDA host function); on a CPU device, run it."""
        if self.device.type != "cuda":
            (call.submit if submit else call.wait)()
            return
        if self._host_fn is None:
            from .hostfn import HostFunctions

            self._host_fn = HostFunctions()
        self._host_fn.launch(torch.cuda.current_stream(self.device), call.submit_fn if submit else call.wait_fn,
                             call.address)  # fmt: skip

    def _device_path_possible(self, t: int) -> bool:
        """A call of ``t`` tokens can run on the device path: decode-size, the cache exists, the misses read in place
        (mapped) or staged by the device (``dev_stage``: at most ``MAX_PICKS`` picks of the top-k ``begin`` saw
        last, ``_last_k``, set before this is asked)."""
        if self._cache is None or not 0 < t <= HIT_CHUNK_TOKENS:
            return False
        return self._stager is None or (self._dstage is not None and t * self._last_k <= MAX_PICKS)

    def _device_only(self, t: int) -> bool:
        """Whether a call runs with no host sync (``_begin_device``): every miss read over PCIe by the hit kernel
        (in place, or staged by the device: ``dev_stage``), at decode sizes, once the cache exists: always with
        split "pcie", and on the steps split "auto" gives the device path (``PathChooser``)."""
        if not self._device_path_possible(t):
            return False
        return self.tcfg.split == "pcie" or (self.tcfg.split == "auto" and self._step_path == "device")

    def _begin_device(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      t: int) -> _Pending:  # fmt: skip
        """A decode-size call with every miss over PCIe, queued on the device with no host sync: the layer's pointer
        table sends each pick to its VRAM slot (a hit) or to its bytes in the mapped host home (a miss), so one hit
        kernel call computes them all; on a staged home (``self._dstage``) the GPU first copies the misses into
        the transient slots, in rounds of them, and the hit kernel runs per round. The same result as the split
        path's two calls (each pick is computed alone; sums in a fixed order). Its hit and pick counts stay on the
        device until the stats are read; the routing trace is copied to pinned memory and read when the step is
        recorded."""
        k = topk_ids.shape[1]
        b = self._buffers_for(x.shape[1], k, t)
        r = b.at(t)
        if self._dev_counts is None:
            self._dev_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        if layer == min(self._layers):  # a step that ran on the device path (not one the staged prefill took)
            for st in self._counters(t):
                st.device_steps += 1
        dc = self._dev_counts
        graphs = self._layer_graphs()
        r.x32.copy_(x)
        try:
            if graphs is None:
                ptrs = self._prepare(layer, topk_ids, topk_weights, r, self._observe(layer, r), dev_counts=dc)
                self._trace_copy(layer, b, r.ids, t, k)
                self._device_work(layer, r, ptrs)
            else:  # the inputs into the persistent buffers, the rest one graph (the same work: _device_work)
                counts = self._graph_inputs(layer, topk_ids, topk_weights, r)

                def work() -> None:
                    self._device_work(layer, r, self._prepare(layer, r.ids, r.w, r, counts, dev_counts=dc))

                self._graph_ran(graphs.run(self._graph_key("device", layer, r, counts, self._hits[layer]), work))
                self._trace_copy(layer, b, r.ids, t, k)
        finally:  # (also after a failed launch: what was queued on the slots orders the next staged copies)
            if self._dstage is not None:
                assert self._stager is not None
                self._stager.claim_all()
        return _Pending(layer, t, k=k, b=b, device_only=True)

    def _device_work(self, layer: int, r: _Rows, ptrs: torch.Tensor) -> None:
        """The device path's GPU work after the routing's preparation (``r``: ids, weights, hit mask, fp32
        activations; ``ptrs``: the layer's pointer table): one hit kernel call over every pick, or on a staged home
        (``self._dstage``) the plan and per round the misses' copies into the transient slots and the hit kernel
        (the first round: and the hits). Device work only, the same launches for the same shapes (a graph)."""
        ds = self._dstage
        if ds is None:
            _hits_forward(self._hits[layer], ptrs, r.x32, r.ids, r.w, r.y)
            return
        with _mark("dsv41.tiered.device_stage"):
            ids_r = ds.plan(r.ids, r.hit, ptrs)
        for rd in range(ids_r.shape[0]):
            ds.copy(ptrs, rd)
            _hits_forward(self._hits[layer], ds.table_d, r.x32, ids_r[rd], r.w, r.y if rd == 0 else r.y2)
            if rd:
                r.y.add_(r.y2)

    def _layer_graphs(self) -> DeviceGraphs | None:
        """The no-sync paths' graphs (``layer_graphs``: on a CUDA device whose hit kernels are all graph safe, or
        with an injected ``graph_factory``), made at the first decode-size call of such a path."""
        if self._graphs is None and self.tcfg.layer_graphs and not self._graphs_refused:
            # room for every shape: MoE layers x decode sizes x graphs a call (device path 1, stream path 2)
            limit = max(64, 3 * HIT_CHUNK_TOKENS * len(self._layers))
            if self._graph_factory is not None:
                self._graphs = DeviceGraphs(self.device, max_graphs=limit, factory=self._graph_factory)
            elif self.device.type == "cuda":
                unsafe = sorted({type(k).__name__ for k in self._hits.values() if not getattr(k, "graph_safe", False)})
                if unsafe:
                    self._graphs_refused = True
                    logger.warning("dsv41 tiered: layer_graphs: off, the hit kernel %s syncs with the host (not graph "
                                   "safe); the layer calls run eagerly", ", ".join(unsafe))  # fmt: skip
                    return None
                self._graphs = DeviceGraphs(self.device, max_graphs=limit)
                logger.info("dsv41 tiered: layer_graphs: the decode-size layer calls of the device path (one graph "
                            "a call) and the stream-driven split (two) run as CUDA graphs, captured on a shape's "
                            "second call (at most %d graphs)", limit)  # fmt: skip
        return self._graphs

    def _graph_ran(self, result: str) -> None:
        """A layer call's graph result: a call run eagerly that its graph will replace (a key's first call, or the
        capture's) makes the step no sample of the path chooser (its time is not the path's steady one)."""
        if result in ("first", "captured"):
            self._step_probed = False

    def _graph_scratch_version(self, layer: int, kernel: Any, k: int) -> tuple[int, int]:
        """The hit kernel's scratch, reserved for the device path's largest call (``HIT_CHUNK_TOKENS * k`` picks)
        before a graph reads it, as (kernel, version): a graph is captured against one; a new one (the kernel
        replaced, its scratch grown by a larger call elsewhere) drops the graphs."""
        reserve = getattr(kernel, "reserve", None)
        if reserve is not None:
            reserve(HIT_CHUNK_TOKENS * k)
        version = (id(kernel), int(getattr(kernel, "scratch_version", 0)))
        old = self._graph_scratch.get(layer)
        if old is not None and old != version and self._graphs is not None:
            self._graphs.clear()
        self._graph_scratch[layer] = version
        return version

    def _observe(self, layer: int, r: _Rows) -> torch.Tensor | None:
        """The cache's counts this call's routing is added to (``ExpertCache.observe_counts``: host bookkeeping, so
        outside a graph), None when the step does not observe."""
        return self._cache.observe_counts(self._index[layer], r.ids.shape[0])

    def _prepare(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, r: _Rows,
                 counts: torch.Tensor | None, gpu_ids: bool = False,
                 dev_counts: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The call's routing into ``r``'s buffers (``ids``, ``w``; ``hit``: which picks are resident, a negative
        id, vLLM's padding rows, being no pick; ``gpu_ids`` if asked: the hits' ids, -1 elsewhere), the cache's
        observation of it added to ``counts`` (``_observe``) and, if given, the call's hit / pick counts added to
        ``dev_counts``: one launch on a GPU (``route_prep``). Returns the layer's pointer table."""
        cache = self._cache
        li = self._index[layer]
        prepare_routing(topk_ids, topk_weights, cache.slot_of[li], counts, dev_counts, r.ids, r.w, r.hit,
                        r.gpu_ids if gpu_ids else None)  # fmt: skip
        return cache.layer_pointers(li)

    def _graph_inputs(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      r: _Rows) -> torch.Tensor | None:  # fmt: skip
        """A graphed call's routing copied into ``r``'s persistent buffers (its graph reads those, whatever tensors
        vLLM passes), and the cache's counts it adds to (``_observe``)."""
        r.ids.copy_(topk_ids)
        r.w.copy_(topk_weights)
        return self._observe(layer, r)

    def _graph_key(self, kind: str, layer: int, r: _Rows, counts: torch.Tensor | None, kernel: Any,
                   *extra: Hashable) -> tuple[Hashable, ...]:  # fmt: skip
        """A graphed call's key: its kind, layer and shape, and what its work's addresses depend on (the buffers,
        the cache's counts, ``extra``, the hit kernel's scratch: ``_graph_scratch_version``)."""
        t, k = r.ids.shape
        return (kind, layer, t, k, r.ids.data_ptr(), 0 if counts is None else counts.data_ptr(), *extra,
                self._graph_scratch_version(layer, kernel, k))  # fmt: skip

    def _counters(self, tokens: int) -> tuple[TierStats, ...]:
        """The counters a layer call or step of ``tokens`` tokens adds to: the totals, and the decode-size ones
        when it has at most ``HIT_CHUNK_TOKENS`` (a decode step's)."""
        return (self._stats, self._stats_decode) if 0 < tokens <= HIT_CHUNK_TOKENS else (self._stats,)

    def _finish(self, p: _Pending, out: torch.Tensor, sts: tuple[TierStats, ...]) -> None:
        cuda = self.device.type == "cuda"
        b, t = p.b, p.t
        assert b is not None
        # the call's counters first, while the CPU tier may still be working (after its wait is the critical path)
        for st in sts:
            st.hit_picks += p.n_hit
            st.cpu_picks += int(p.cpu_picks.size)
            st.pcie_picks += int(p.pcie_picks.size)
        metrics.cache_lookups(p.n_hit, p.n_miss)
        metrics.picks("gpu_cache", p.n_hit)
        metrics.picks("pcie", int(p.pcie_picks.size))
        if p.job is not None:
            n = p.cpu_picks.size
            pr = b.picks_at(n)
            pr.np_index[:] = p.cpu_picks  # (the rows' places do not wait for the job: queued before its wait)
            pr.cpu_index.copy_(pr.h_index, non_blocking=cuda)
            remaining = None if p.timeout is None else max(0.0, p.timeout - (time.perf_counter() - p.submitted))
            missing = np.empty(0, np.int64)
            tw = time.perf_counter()
            with _mark("dsv41.tiered.cpu_wait"):
                done = p.job.wait(remaining)
            if not done:
                missing = p.job.missing()  # cancels, waits for the workers to stop
            else:
                p.job.result()
            t_wait = time.perf_counter() - tw
            p.cpu_wait_s = t_wait
            if missing.size:  # their rows were never written (stale bytes): zeros, then the GPU's values added
                pr.np_cpu[missing] = 0.0
            pr.cpu_rows.copy_(pr.h_cpu, non_blocking=cuda)
            b.at(t).y_flat.index_copy_(0, pr.cpu_index, pr.cpu_rows)
            if missing.size:
                for st in sts:
                    st.deadline_misses += 1
                    st.fallback_picks += int(missing.size)
                metrics.cpu_deadline_miss(int(missing.size))
                logger.warning("dsv41 tiered: MoE layer %d: the CPU tier missed its deadline (%.2f ms); %d of %d "
                               "picks recomputed on the GPU from the host home", p.layer, 1e3 * (p.timeout or 0),
                               missing.size, n)  # fmt: skip
                r = b.at(t)
                self._gpu_picks(b, 1, p.kernel, p.ptrs, r.x32, r.w, t, p.cpu_picks[missing], p.layer)
            _combine(b, t, out)  # queued first; the feedback and counters below run while the GPU combines
            if done:  # the job's end: seen now when the host waited for it, else its own run time (no wake-up)
                self._feedback("cpu", tw + t_wait - p.submitted if t_wait > 1e-4 else p.job.elapsed_s, p.cpu_pred)
            else:  # missed its deadline: what it took for the picks it did, scaled to all (a lower bound if none)
                done_picks = max(n - missing.size, 1)
                self._feedback("cpu", (tw + t_wait - p.submitted) * n / done_picks, p.cpu_pred)
            dt = tw + t_wait - p.submitted
            for st in sts:
                st.cpu_wait_seconds += t_wait
                st.cpu_run_seconds += p.job.elapsed_s
                st.cpu_pred_seconds += p.cpu_pred
                st.cpu_seconds += dt
            self._m_cpu.forward(dt, picks=n - missing.size)
            return
        _combine(b, t, out)

    def _gpu_picks(self, b: _Buffers, use: int, kernel: Any, ptrs: Any, x: torch.Tensor, w: torch.Tensor, t: int,
                   picks: np.ndarray, layer: int) -> None:  # fmt: skip
        """The GPU kernel on ``picks`` (flat indices) read from the host home, added into ``y`` (disjoint from what
        is there): in place through ``ptrs`` (mapped), or through the transient slots (staged, in rounds of their
        count). ``use`` picks the staging pair (0: the PCIe share, 1: the deadline fallback), so the two never
        share a pinned buffer within a layer; the next layer writes them only after its own input event, which
        the stream orders after these copies."""
        if ptrs is None:  # cannot happen: PCIe picks and fallbacks need the table, which exists with the cache
            raise RuntimeError("tiered runtime: GPU picks before the expert cache exists")
        r = b.at(t)
        flat = r.np_ids_flat
        if t > HIT_CHUNK_TOKENS:
            self._gpu_picks_sorted(b, use, kernel, ptrs, x, w, t, picks, layer, flat)
            return
        h = b.h_second[use, :t].numpy()
        h.fill(-1)
        h.reshape(-1)[picks] = flat[picks]
        ids2 = b.second_ids[use, :t]
        ids2.copy_(b.h_second[use, :t], non_blocking=self.device.type == "cuda")
        y2 = r.y2
        stager = self._stager
        if stager is None:
            _hits_forward(kernel, ptrs, x, ids2, w, y2)
            r.y.add_(y2)
            return
        experts = np.unique(flat[picks])
        li = self._index[layer]
        rs = stager.round_size
        for r0 in range(0, experts.size, rs):
            chunk = experts[r0 : r0 + rs]
            with _mark("dsv41.tiered.stage_copies"):
                table = stager.stage(li, chunk, ptrs, use, r0 // rs)
            if chunk.size < experts.size:  # this round's picks only
                sub = torch.where(torch.isin(ids2, stager.cols), ids2, torch.full_like(ids2, -1))
            else:
                sub = ids2
            _hits_forward(kernel, table, x, sub, w, y2)
            stager.done()
            r.y.add_(y2)

    def _gpu_picks_sorted(self, b: _Buffers, use: int, kernel: Any, ptrs: Any, x: torch.Tensor, w: torch.Tensor,
                          t: int, picks: np.ndarray, layer: int, flat: np.ndarray) -> None:  # fmt: skip
        """``_gpu_picks`` for a call of more tokens than one hit-kernel call takes (a short prompt on the decode
        path): the picks as rows of one pick each, sorted by expert, so each kernel call of ``HIT_CHUNK_TOKENS x
        top_k`` rows (the same scratch) covers a run of experts and each expert is read about once, not once per
        chunk of tokens that picks it (H200 run 5, a 100-token prompt: the mapped reads took 131 ms a layer for
        ~250 experts read ~500 times); a staged round's picks are one run of rows. Results go to their picks in
        ``y`` (where the CPU share's go: ``y`` holds zeros there). Buffers: ``cpu_rows`` holds the gathered inputs
        (the stream runs this after any earlier use of it), ``y2`` the rows' results."""
        k, h = b.topk, b.hidden
        cuda = self.device.type == "cuda"
        experts_of = flat[picks]
        perm = np.argsort(experts_of, kind="stable")
        n = picks.size
        ho = b.h_order[use, :, :n].numpy()
        ho[0] = picks[perm]
        ho[1] = ho[0] // k
        hi = b.h_second[use].view(-1)[:n].numpy()
        hi[:] = experts_of[perm]
        pick_d, tok_d = b.order[use, 0, :n], b.order[use, 1, :n]
        pick_d.copy_(b.h_order[use, 0, :n], non_blocking=cuda)
        tok_d.copy_(b.h_order[use, 1, :n], non_blocking=cuda)
        ids = b.second_ids[use].view(-1)[:n]
        ids.copy_(b.h_second[use].view(-1)[:n], non_blocking=cuda)
        xs = b.cpu_rows[:n]
        torch.index_select(x, 0, tok_d, out=xs)
        ws = b.w_sorted[use, :n]
        torch.index_select(w.reshape(-1), 0, pick_d, out=ws)
        ys = b.y2.view(-1, h)[:n].view(n, 1, h)
        rows = HIT_CHUNK_TOKENS * k
        stager = self._stager
        if stager is None:
            _hits_forward(kernel, ptrs, xs, ids.view(n, 1), ws.view(n, 1), ys, rows)
        else:
            sorted_experts = experts_of[perm]
            experts = np.unique(sorted_experts)
            li = self._index[layer]
            rs = stager.round_size
            for r0 in range(0, experts.size, rs):
                chunk = experts[r0 : r0 + rs]
                a0 = int(np.searchsorted(sorted_experts, chunk[0], side="left"))
                a1 = int(np.searchsorted(sorted_experts, chunk[-1], side="right"))
                with _mark("dsv41.tiered.stage_copies"):
                    table = stager.stage(li, chunk, ptrs, use, r0 // rs)
                _hits_forward(kernel, table, xs[a0:a1], ids[a0:a1].view(-1, 1), ws[a0:a1].view(-1, 1), ys[a0:a1],
                              rows)  # fmt: skip
                stager.done()
        b.y[:t].view(-1, h).index_copy_(0, pick_d, ys.view(n, h))

    def split_rates(self) -> Rates:
        """The rates the split uses now: the startup rates with each path's rate divided, and its fixed cost
        multiplied, by its measured / predicted average (``TieredConfig.split_feedback``; rebuilt when an average
        has moved by more than 2 %)."""
        assert self._rates is not None
        key = (self._scale["cpu"], self._scale["pcie"])
        kept = self._split_rates
        if kept is None or any(abs(math.log(v / w)) > 0.02 for v, w in zip(key, kept[0], strict=True)):
            r, (c, q) = self._rates, key
            scaled = dataclasses.replace(
                r, cpu_bps=r.cpu_bps / c, pcie_bps=r.pcie_bps / q, cpu_fixed_s=r.cpu_fixed_s * c,
                pcie_fixed_s=r.pcie_fixed_s * q, cpu_tokens=tuple((m, v / c) for m, v in r.cpu_tokens),
            )  # fmt: skip
            kept = self._split_rates = (key, scaled)
        return kept[1]

    def _feedback(self, path: str, measured: float, predicted: float, samples: int = 1) -> None:
        """One layer call's measured seconds of a path against what the startup rates predicted for it; or
        ``samples`` calls' sums (the stream path's, folded every ``_FOLD_EVERY`` steps), weighted as that many
        calls of their average ratio."""
        a = 1 - (1 - self.tcfg.split_feedback) ** max(samples, 1)
        if a == 0 or predicted <= 0 or not math.isfinite(measured) or measured < 0:
            return
        # a geometric average: one freak sample moves it by at most its ratio to the power a
        self._set_scale(
            path, math.exp((1 - a) * math.log(self._scale[path]) + a * math.log(max(measured, 1e-9) / predicted))
        )

    def _decay(self, path: str) -> None:
        """A layer call that gave ``path`` nothing: its average moves toward 1 by an eighth of the feedback's weight
        (slower than it learns: the path gets a probe share now and then, not every other call)."""
        a = self.tcfg.split_feedback / 8
        if a:
            self._set_scale(path, math.exp((1 - a) * math.log(self._scale[path])))

    def _set_scale(self, path: str, v: float) -> None:
        self._scale[path] = v
        if path == "cpu":
            self._stats.cpu_scale = self._stats_decode.cpu_scale = v
        else:
            self._stats.pcie_scale = self._stats_decode.pcie_scale = v

    def _pcie_event_pair(self) -> tuple[Any, Any]:
        if self._pcie_events:
            return self._pcie_events.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _read_pcie_timings(self) -> None:
        """The GPU seconds of the PCIe shares queued before (their events are done once a later input was synced)."""
        for start, end, pred in self._pcie_timed:
            if end.query():
                self._feedback("pcie", start.elapsed_time(end) / 1e3, pred)
            self._pcie_events.append((start, end))
        self._pcie_timed.clear()

    def _cpu_share_seconds(self, layer: int, expert_ids: np.ndarray) -> float:
        """The CPU tier's predicted seconds (at the split's rates) for picks of ``expert_ids`` (one id per pick):
        its fixed cost plus each distinct expert's time for its token count."""
        rates = self.split_rates()
        per_expert = np.bincount(expert_ids, minlength=self._layers[layer].num_experts)
        eb = self._expert_bytes[layer]
        cost = functools.partial(_cpu_expert_seconds, rates, eb)
        return cpu_share_seconds(per_expert[per_expert > 0], eb, rates, cost)

    def _deadline(self, predicted: float) -> float | None:
        """The CPU tier's deadline for a share predicted to take ``predicted`` seconds: ``factor * predicted +
        floor`` (None: no deadline)."""
        t = self.tcfg
        if t.deadline_factor == 0 or self._rates is None or self._rates.cpu_bps <= 0:
            return None
        return t.deadline_factor * predicted + t.deadline_floor_ms / 1e3

    # ------------------------------------------------------------------------------------------ end

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending is not None and self._pending.job is not None:
            self._pending.job.cancel()
            self._pending.job.wait()
        self._pending = None
        if self._prefill is not None:
            self._prefill.end_episode(self._cache)
            if self._prefill.stats.calls:
                logger.info("dsv41 prefill: %s", self._prefill.stats.describe())
        if self._step_open:
            self._end_step(replan=False)
        self._flush_trace(block=True)
        self._fold_device_counts()
        self._fold_stream_counts(rebuild=False)  # (a sync: no host function of the stream path runs after this)
        if self._recorder is not None:
            path = Path(self.tcfg.trace_path)
            self._recorder.trace().save(path)
            logger.info("dsv41 tiered: routing trace of %d steps written to %s", self._stats.steps, path)
        if self._stats.steps:
            logger.info("dsv41 tiered: %s", self._stats.describe())
        if self._stats_decode.steps:
            logger.info("dsv41 tiered: decode-size calls only: %s", self._stats_decode.describe())
        if self._graphs is not None:
            if self._graphs.captures:
                logger.info("dsv41 tiered: layer_graphs: %d graphs captured, %d replays, %d calls eager",
                            self._graphs.captures, self._graphs.replays, self._graphs.eager)  # fmt: skip
            self._graphs.clear()
        self._tier.close()
        self._cache = None
        self._buffers.clear()


def _combine(b: _Buffers, t: int, out: torch.Tensor) -> None:
    """``out[:t]``: the fixed-order sum over the picks of each token (``y``: one pick per row, zeros elsewhere)."""
    r = b.at(t)
    torch.sum(r.y, dim=1, out=r.x32)
    out[:t].copy_(r.x32)


def _mark(name: str) -> Any:
    """A ``torch.profiler`` range of the runtime's parts when a profiler runs (``record_function`` costs ~7 us a
    range even with none; a layer call marks 3-4)."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _hits_forward(kernel: Any, table: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                  y: torch.Tensor, rows: int = 0) -> None:  # fmt: skip
    """``kernel.forward`` over the tokens in chunks of ``rows`` (default ``HIT_CHUNK_TOKENS``; row slices:
    contiguous views)."""
    t = x.shape[0]
    rows = rows or HIT_CHUNK_TOKENS
    for a in range(0, t, rows):
        b = min(t, a + rows)
        kernel.forward(table, x[a:b], ids[a:b], w[a:b], y[a:b])


def hit_seconds(kernel: Any, ptrs: torch.Tensor | Callable[[], torch.Tensor], n: int, hidden: int,
                device: torch.device, reps: int = 3) -> float:  # fmt: skip
    """Best wall seconds (of ``reps``, after one warm-up) of ``kernel`` computing experts ``0..n-1`` at one token
    each through the pointer table ``ptrs``, fp32 activations as the runtime passes them. ``ptrs`` may be a
    callable returning the table, timed with the kernel (the staged read: its copies into transient slots)."""
    ids = torch.arange(n, dtype=torch.int32, device=device).view(n, 1)
    x = torch.randn((n, hidden), dtype=torch.float32, device=device)
    w = torch.ones((n, 1), dtype=torch.float32, device=device)
    y = torch.empty((n, 1, hidden), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    table = ptrs if callable(ptrs) else (lambda: ptrs)
    kernel.forward(table(), x, ids, w, y)
    if cuda:
        torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel.forward(table(), x, ids, w, y)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _affine(one: float, many: float, n: int) -> tuple[float, float]:
    """Seconds per expert and fixed seconds from the time of 1 expert and of ``n`` (``t = fixed + n * per``); the
    fixed part is 0 when the two do not show one (noise, or ``n == 1``)."""
    if n > 1 and many > one:
        per = (many - one) / (n - 1)
        return per, max(one - per, 0.0)
    return many / n, 0.0


@functools.lru_cache(maxsize=256)
def _cpu_expert_seconds(rates: Rates, expert_bytes: int, tokens: int) -> float:
    """``rates.cpu_expert_seconds``, remembered (the split asks it for the same few token counts every layer call;
    ``split_rates`` keeps one ``Rates`` until the feedback moves it)."""
    return rates.cpu_expert_seconds(expert_bytes, tokens)


_NO_PICKS = np.empty(0, np.int64)
_NO_PICKS.flags.writeable = False


def _home_alignment(rows: Any) -> int:
    """The largest power of two (at most 4096) dividing every address the hit kernels read in the host home."""
    addr = np.asarray(rows.kernel_addresses(), np.int64)
    acc = int(np.bitwise_or.reduce(addr.reshape(-1))) | 4096 if addr.size else 4096
    return acc & -acc


def _expert_bytes(lx: LayerExperts) -> int:
    """Bytes of one expert's EXL3 tensors (trellis, suh, svh of gate, up and down)."""
    g, u, d = lx.gate[0], lx.up[0], lx.down[0]
    return sum(a.trellis.nbytes + a.suh.nbytes + a.svh.nbytes for a in (g, u, d))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
