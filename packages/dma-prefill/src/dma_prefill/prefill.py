"""``DmaPrefill``: run one MoE layer of a prefill chunk by streaming its experts through the staging ring."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from .compute import BatchCompute, TorchCompute
from .config import PrefillConfig
from .cpu_tail import CpuTail
from .device import CudaDevice, Device
from .plan import PrefillPlan
from .ring import StagingRing
from .store import ExpertStore
from .triton_compute import TritonCompute

__all__ = ["DmaPrefill", "PipelineStats"]


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """Timing of a window of layers (from ``DmaPrefill.start_window`` to ``stats``).

    ``copy_busy_s``/``compute_busy_s``: union of the copy intervals / batch-compute intervals;
    ``copy_gbps``: bytes over the copy engine's busy time; ``effective_gbps``: bytes over the wall time.
    """

    wall_s: float
    copy_busy_s: float
    compute_busy_s: float
    bytes_copied: int
    batches: int
    layers: int

    @property
    def copy_fraction(self) -> float:
        return self.copy_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def compute_fraction(self) -> float:
        return self.compute_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def copy_gbps(self) -> float:
        return self.bytes_copied / self.copy_busy_s / 1e9 if self.copy_busy_s > 0 else 0.0

    @property
    def effective_gbps(self) -> float:
        return self.bytes_copied / self.wall_s / 1e9 if self.wall_s > 0 else 0.0


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


class DmaPrefill:
    """Staged-DMA prefill of routed experts.

    Parameters
    ----------
    store : the expert store (``HostExpertStore`` or ``ExternalExpertStore``; all layers share one record layout).
    config : ``PrefillConfig``.
    device : ``CudaDevice`` (default when CUDA is available) or ``FakeDevice``.
    timing : record timing events around every copy batch and every batch compute (for ``stats``).
    buffer : device memory for the staging slots and the Triton backend's decode scratch (1-D uint8 of
        ``required_bytes``), e.g. lent by the VRAM expert cache; default: new allocations.

    Examples
    --------
    >>> pf = DmaPrefill(store, PrefillConfig())
    >>> plan = PrefillPlan.build(topk_ids, topk_weights, 384, pf.config.experts_per_batch)
    >>> out = pf.run_layer(layer=3, x=hidden, plan=plan, next_layer=4)  # fp32 [T, H], weighted expert sum
    """

    def __init__(
        self,
        store: ExpertStore,
        config: PrefillConfig | None = None,
        *,
        device: Device | None = None,
        timing: bool = False,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.store = store
        self.config = config or PrefillConfig()
        self.device: Device = device if device is not None else CudaDevice()
        self.timing = timing
        backend = self.resolve_backend(self.config, self.device)
        ring_bytes = StagingRing.required_bytes(store, self.config)
        scratch = None
        if buffer is not None:
            need = self.required_bytes(store, self.config, self.device)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
                raise ValueError(f"DmaPrefill: buffer must be 1-D uint8 of at least {need} bytes (ring and "
                                 f"scratch), got {buffer.dtype} {tuple(buffer.shape)}")  # fmt: skip
            scratch = buffer[ring_bytes:need] if backend == "triton" else None
            buffer = buffer[:ring_bytes]
        self.ring = StagingRing(store, self.config, self.device, timing=timing, buffer=buffer)
        self.backend = backend
        self.compute: BatchCompute
        if backend == "triton":
            tdev = self.device.device if isinstance(self.device, CudaDevice) else torch.device("cpu")
            self.compute = TritonCompute(store, self.config, self.device, tdev, scratch=scratch)
        else:
            self.compute = TorchCompute(store, self.config, self.device)
        self._batch_events: list[tuple[Any, Any]] = []
        self._window: tuple[Any, int, int, int] | None = None
        self.layers_run = 0

    @staticmethod
    def resolve_backend(config: PrefillConfig, device: Device) -> str:
        """The backend ``config.backend`` means on ``device`` ("auto": triton on CUDA, else torch)."""
        if config.backend == "auto":
            return "triton" if isinstance(device, CudaDevice) else "torch"
        return config.backend

    @classmethod
    def required_bytes(cls, store: ExpertStore, config: PrefillConfig, device: Device) -> int:
        """Device bytes the runner's persistent buffers take: the staging ring, plus the Triton backend's decode
        scratch (``buffer`` must hold this many). Per-batch and per-layer activations come on top."""
        n = StagingRing.required_bytes(store, config)
        if cls.resolve_backend(config, device) == "triton":
            n += TritonCompute.scratch_bytes(store, config)
        return n

    # --------------------------------------------------------------------------------------- layers

    def prefetch(self, layer: int) -> int:
        """Copy the first ``config.prefetch`` batches of ``layer`` (all their experts) ahead of its routing.

        Returns how many were issued (fewer when the ring is full).
        """
        spec = self.store.spec(layer)
        nb = -(-spec.num_experts // self.config.experts_per_batch)
        issued = 0
        for b in range(min(self.config.prefetch, nb)):
            if self.ring.is_issued(layer, b):
                continue
            if not self.ring.can_issue():
                break
            self.ring.issue(layer, b)
            issued += 1
        return issued

    def run_layer(
        self,
        layer: int,
        x: torch.Tensor,
        plan: PrefillPlan,
        *,
        out: torch.Tensor | None = None,
        next_layer: int | None = None,
        cpu_tail: CpuTail | None = None,
    ) -> torch.Tensor:
        """Add ``sum_k weight_k * expert_k(x)`` over the routes of ``plan`` into ``out`` (fp32 ``[T, H]``).

        Parameters
        ----------
        layer : the store's layer id.
        x : ``[T, H]`` fp16/bf16/fp32 activations (the MoE input), on the device.
        plan : the layer's ``PrefillPlan`` (built with ``experts_per_batch == config.experts_per_batch``).
        out : fp32 ``[T, H]`` to accumulate into; zeros when None.
        next_layer : prefetch this layer's first batches once this layer's work is queued.
        cpu_tail : computes the experts of ``plan.cpu_batches`` (``CpuTierTail``): ``begin`` before the GPU
            batches are queued, ``finish`` after them.

        Work is queued on the device's current stream; nothing here waits for the GPU except the plan's counts.
        """
        spec = self.store.spec(layer)
        T = plan.num_tokens
        if x.dim() != 2 or x.shape != (T, spec.hidden):
            raise ValueError(f"x must be [{T}, {spec.hidden}] for layer {layer}, got {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"x must be floating point, got {x.dtype}")
        if plan.num_experts != spec.num_experts or plan.experts_per_batch != self.config.experts_per_batch:
            raise ValueError(
                f"plan for {plan.num_experts} experts in batches of {plan.experts_per_batch}, layer {layer} has "
                f"{spec.num_experts} and the ring batches of {self.config.experts_per_batch}"
            )
        if plan.cpu_batches and cpu_tail is None:
            raise ValueError(f"plan leaves batches {plan.cpu_batches} to the CPU tier but no cpu_tail was given")
        if cpu_tail is not None and cpu_tail.swiglu_limit != self.config.swiglu_limit:
            raise ValueError(
                f"cpu_tail clamps SwiGLU at {cpu_tail.swiglu_limit}, PrefillConfig.swiglu_limit is "
                f"{self.config.swiglu_limit}"
            )
        if out is None:
            out = torch.zeros((T, spec.hidden), dtype=torch.float32, device=x.device)
        elif out.shape != (T, spec.hidden) or out.dtype != torch.float32:
            raise ValueError(f"out must be float32 [{T}, {spec.hidden}], got {out.dtype} {tuple(out.shape)}")
        x = x.contiguous()
        dev, ring = self.device, self.ring
        stream = dev.current_stream()
        gpu = list(plan.gpu_batches)
        wanted = set(gpu)
        # prefetched batches this plan does not compute (or stale ones of another layer) free their slots
        for st in sorted(ring.pending(), key=lambda s: s.seq):
            if st.layer != layer or st.batch not in wanted:
                ring.release(st, stream)
        tail = cpu_tail.begin(layer, x, plan) if cpu_tail is not None and plan.cpu_batches else None
        prep = self.compute.prepare(plan, x)
        todo = deque(b for b in gpu if not ring.is_issued(layer, b))

        def pump() -> None:
            while todo and ring.can_issue():
                b = todo.popleft()
                ring.issue(layer, b, runs=plan.runs(b))

        pump()
        for b in gpu:
            st = ring.acquire(layer, b, stream)
            ev = None
            if self.timing:
                ev = (dev.new_event(timing=True), dev.new_event(timing=True))
                dev.record(ev[0], stream)
            self.compute.run_batch(ring, st, prep, x, out, stream)
            if ev is not None:
                dev.record(ev[1], stream)
                self._batch_events.append(ev)
            ring.release(st, stream)
            pump()
        if todo:
            raise RuntimeError(f"layer {layer}: batches {list(todo)} were never issued")
        if cpu_tail is not None and plan.cpu_batches:
            cpu_tail.finish(tail, out)
        if next_layer is not None:
            self.prefetch(next_layer)
        self.layers_run += 1
        return out

    # ---------------------------------------------------------------------------------------- stats

    def start_window(self) -> None:
        """Start a timing window (call after a device synchronize so both streams are idle)."""
        if not self.timing:
            raise RuntimeError("DmaPrefill was built with timing=False")
        origin = self.device.new_event(timing=True)
        self.device.record(origin, self.device.current_stream())
        self._window = (origin, len(self.ring.history), len(self._batch_events), self.layers_run)

    def stats(self) -> PipelineStats:
        """Busy times and bytes since ``start_window`` (synchronizes the device)."""
        if self._window is None:
            raise RuntimeError("call start_window() first")
        origin, h0, b0, l0 = self._window
        self.device.synchronize()
        el = self.device.elapsed_ms
        copies = [(el(origin, st.t_start) / 1e3, el(origin, st.t_end) / 1e3) for st in self.ring.history[h0:]]
        comps = [(el(origin, a) / 1e3, el(origin, b) / 1e3) for a, b in self._batch_events[b0:]]
        ends = [e for _, e in copies + comps]
        return PipelineStats(
            wall_s=max(ends) if ends else 0.0,
            copy_busy_s=_union(copies),
            compute_busy_s=_union(comps),
            bytes_copied=sum(st.nbytes for st in self.ring.history[h0:]),
            batches=len(comps),
            layers=self.layers_run - l0,
        )
