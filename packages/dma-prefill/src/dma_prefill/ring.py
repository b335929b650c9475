"""``StagingRing``: N VRAM staging slots of B expert records, filled by the copy engine on its own stream.

Batch number g (a global sequence over all layers) goes to slot ``g % N``. Per slot two events:

* ``ready[slot]``: recorded on the copy stream after the batch's copies; the compute stream waits on it before
  reading the slot (``acquire``);
* ``free[slot]``: recorded on the compute stream after the last launch that reads the slot (``release``); the
  copy stream waits on it before overwriting the slot with batch ``g + N`` (``issue``).

A CUDA stream waits on the latest record *issued before the wait*, so the host must release batch g before it
issues batch g + N; ``issue`` refuses otherwise (it would wait on an older record and overwrite a slot that is
still being read). The copy engine therefore runs up to N batches ahead of compute and never waits on anything
but a slot that is still in use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import PrefillConfig
from .device import Device, RowTag
from .store import ExpertStore

__all__ = ["Staged", "StagingRing"]


@dataclasses.dataclass(eq=False)
class Staged:
    """One batch in a staging slot: experts ``[e0, e1)`` of ``layer`` (only ``present`` were copied)."""

    layer: int
    batch: int
    seq: int
    slot: int
    e0: int
    e1: int
    present: tuple[int, ...]
    nbytes: int
    acquired: bool = False
    t_start: Any = None  # timing events (copy start/end) when the ring times copies
    t_end: Any = None

    def row(self, expert: int) -> int:
        """Row of ``expert`` inside the slot."""
        if expert not in self.present:
            raise KeyError(f"expert {expert} of layer {self.layer} was not copied into slot {self.slot}")
        return expert - self.e0

    def tags(self, experts: tuple[int, ...] | None = None) -> list[RowTag]:
        return [(self.slot, e - self.e0, (self.layer, e)) for e in (self.present if experts is None else experts)]


class StagingRing:
    """N staging slots x B experts, a copy stream, and the events that order them.

    Parameters
    ----------
    store : the expert store the batches are copied from (``HostExpertStore`` or ``ExternalExpertStore``).
    config : ``PrefillConfig`` (``num_slots``, ``experts_per_batch``).
    device : ``CudaDevice`` or ``FakeDevice``.
    timing : record a timing event pair around every batch's copies (for busy fractions and GB/s).
    buffer : device memory to use for the slots (1-D uint8, at least ``required_bytes``), e.g. VRAM lent by the
        expert cache; default: a new allocation.
    """

    def __init__(
        self,
        store: ExpertStore,
        config: PrefillConfig,
        device: Device,
        *,
        timing: bool = False,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.device = device
        self.timing = timing
        self.num_slots = config.num_slots
        self.experts_per_batch = config.experts_per_batch
        self.stride = max(store.layout(lid).stride for lid in store.layer_ids)
        strides = {store.layout(lid).stride for lid in store.layer_ids}
        if len(strides) != 1:
            raise ValueError(f"StagingRing: all layers must share one record layout, got strides {sorted(strides)}")
        self.slot_bytes = self.experts_per_batch * self.stride
        # One allocation; every slot is followed by at least store tail_pad bytes so no kernel reads past it.
        self._pad = store.tail_pad
        need = self.required_bytes(store, config)
        if buffer is None:
            buffer = device.alloc(need)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
            raise ValueError(
                f"StagingRing: buffer must be a 1-D uint8 tensor of at least {need} bytes "
                f"({self.num_slots} slots x {self.slot_bytes} + {self._pad} pad), got {buffer.dtype} "
                f"{tuple(buffer.shape)}"
            )
        self.buffer = buffer
        self.slots = [self.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(self.num_slots)]
        self.copy_stream = device.new_stream("copy")
        self._ready = [device.new_event() for _ in range(self.num_slots)]
        self._free = [device.new_event() for _ in range(self.num_slots)]
        self._occupant: list[Staged | None] = [None] * self.num_slots
        self._released: list[bool] = [True] * self.num_slots
        self._pending: dict[tuple[int, int], Staged] = {}
        self.seq = 0
        self.bytes_issued = 0
        self.history: list[Staged] = []  # every issued batch (timing events included when ``timing``)
        self.copies = 0  # copy runs issued (each is one or more DMAs: ``store.copy_segments``)

    @staticmethod
    def required_bytes(store: ExpertStore, config: PrefillConfig) -> int:
        """Bytes of the ring's buffer: ``num_slots * experts_per_batch`` records plus the store's tail pad."""
        strides = {store.layout(lid).stride for lid in store.layer_ids}
        if len(strides) != 1:
            raise ValueError(f"StagingRing: all layers must share one record layout, got strides {sorted(strides)}")
        return config.num_slots * config.experts_per_batch * strides.pop() + store.tail_pad

    # ---------------------------------------------------------------------------------------- issue

    def can_issue(self) -> bool:
        """Whether the next batch's slot has been released by its previous batch."""
        return self._released[self.seq % self.num_slots]

    def is_issued(self, layer: int, batch: int) -> bool:
        return (layer, batch) in self._pending

    def pending(self) -> list[Staged]:
        return list(self._pending.values())

    def issue(self, layer: int, batch: int, runs: list[tuple[int, int]] | None = None) -> Staged:
        """Queue the copies of batch ``batch`` of ``layer`` on the copy stream.

        ``runs`` are ranges ``[a, b)`` of experts to copy (default: the whole batch); each is one DMA of
        consecutive host records.
        """
        if (layer, batch) in self._pending:
            raise RuntimeError(f"layer {layer} batch {batch} is already staged")
        slot = self.seq % self.num_slots
        if not self._released[slot]:
            prev = self._occupant[slot]
            raise RuntimeError(
                f"ring overrun: batch seq {self.seq} needs slot {slot}, "
                f"still held by layer {prev.layer if prev else '?'} "
                f"batch {prev.batch if prev else '?'} (release it first)"
            )
        spec = self.store.spec(layer)
        B = self.experts_per_batch
        e0 = batch * B
        e1 = min(spec.num_experts, e0 + B)
        if not 0 <= e0 < spec.num_experts:
            raise IndexError(f"layer {layer}: batch {batch} out of range ({spec.num_experts} experts, B={B})")
        runs = [(e0, e1)] if runs is None else runs
        present: list[int] = []
        for a, b in runs:
            if not e0 <= a < b <= e1:
                raise ValueError(f"layer {layer} batch {batch}: run [{a}, {b}) outside the batch [{e0}, {e1})")
            present.extend(range(a, b))
        if len(set(present)) != len(present):
            raise ValueError(f"layer {layer} batch {batch}: overlapping runs {runs}")
        dev, cs = self.device, self.copy_stream
        dev.wait(cs, self._free[slot])
        st = Staged(layer, batch, self.seq, slot, e0, e1, tuple(sorted(present)), 0)
        if self.timing:
            st.t_start = dev.new_event(timing=True)
            dev.record(st.t_start, cs)
        stride = self.stride
        dst_slot = self.slots[slot]
        for a, b in runs:
            base = (a - e0) * stride
            for src, off in self.store.copy_segments(layer, a, b):
                n = src.numel()
                first, last = (base + off) // stride, (base + off + n - 1) // stride
                writes = [(slot, r, (layer, e0 + r)) for r in range(first, last + 1)]
                dev.copy(cs, dst_slot[base + off : base + off + n], src, writes=writes)
                st.nbytes += n
            self.copies += 1
        dev.record(self._ready[slot], cs)
        if self.timing:
            st.t_end = dev.new_event(timing=True)
            dev.record(st.t_end, cs)
        self._released[slot] = False
        self._occupant[slot] = st
        self._pending[(layer, batch)] = st
        self.seq += 1
        self.bytes_issued += st.nbytes
        self.history.append(st)
        return st

    # ------------------------------------------------------------------------------------ consume

    def acquire(self, layer: int, batch: int, stream: Any) -> Staged:
        """Make ``stream`` wait until the batch's copies are done; returns the staged batch."""
        try:
            st = self._pending[(layer, batch)]
        except KeyError:
            raise RuntimeError(f"layer {layer} batch {batch} was not issued") from None
        if st.acquired:
            raise RuntimeError(f"layer {layer} batch {batch} acquired twice")
        self.device.wait(stream, self._ready[st.slot])
        st.acquired = True
        return st

    def release(self, st: Staged, stream: Any) -> None:
        """The slot may be overwritten once ``stream`` has run everything queued so far."""
        if self._pending.get((st.layer, st.batch)) is not st:
            raise RuntimeError(f"layer {st.layer} batch {st.batch} is not staged (released twice?)")
        self.device.record(self._free[st.slot], stream)
        self._released[st.slot] = True
        del self._pending[(st.layer, st.batch)]

    def slot(self, st: Staged) -> Any:
        return self.slots[st.slot]
