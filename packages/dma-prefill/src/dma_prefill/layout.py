"""The byte layout of one expert record: gate, up, down trellis, then the six scale vectors.

A layer is ``num_experts`` records back to back, so a run of consecutive experts is one contiguous range of
host memory (one DMA), and a staging slot holds records in the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .config import PROJECTIONS, TENSORS, LayerSpec, Projection

__all__ = ["ExpertLayout"]

_DTYPES = {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16}


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Offsets (bytes, from the start of a record) of every tensor of one expert.

    Order: ``gate.trellis, up.trellis, down.trellis, gate.suh, gate.svh, up.suh, up.svh, down.suh,
    down.svh``; each aligned to ``align`` bytes. ``stride`` is the record size.
    """

    spec: LayerSpec
    align: int
    offsets: dict[tuple[Projection, str], int]
    sizes: dict[tuple[Projection, str], int]
    stride: int

    @classmethod
    def build(
        cls, spec: LayerSpec, align: int = 256, order: Sequence[tuple[Projection, str]] | None = None
    ) -> ExpertLayout:
        """The record of ``spec``: its nine tensors in ``order`` (default: the three trellises, then the six
        scale vectors), each starting on an ``align``-byte boundary.

        A store over someone else's memory (``ExternalExpertStore``) passes the order in which an expert's tensors
        lie in its source, so that tensors adjacent there stay adjacent in the record and copy as one run.
        """
        offsets: dict[tuple[Projection, str], int] = {}
        sizes: dict[tuple[Projection, str], int] = {}
        pos = 0
        default = [(p, "trellis") for p in PROJECTIONS] + [(p, t) for p in PROJECTIONS for t in ("suh", "svh")]
        if order is None:
            order = default
        elif sorted(order) != sorted(default):
            raise ValueError(f"ExpertLayout order must list each of {default} once, got {list(order)}")
        for p, t in order:
            ps = spec.proj(p)
            size = ps.trellis_bytes if t == "trellis" else 2 * (ps.k if t == "suh" else ps.n)
            pos = _round_up(pos, align)
            offsets[(p, t)] = pos
            sizes[(p, t)] = size
            pos += size
        return cls(spec, align, offsets, sizes, _round_up(pos, align))

    def shape(self, proj: Projection, tensor: str) -> tuple[int, ...]:
        ps = self.spec.proj(proj)
        if tensor == "trellis":
            return ps.trellis_shape
        if tensor == "suh":
            return (ps.k,)
        if tensor == "svh":
            return (ps.n,)
        raise ValueError(f"unknown tensor {tensor!r}; expected one of {TENSORS}")

    def view(self, buf: torch.Tensor, row: int, proj: Projection, tensor: str) -> torch.Tensor:
        """Typed view of ``tensor`` of record ``row`` inside the uint8 buffer ``buf`` (any device).

        ``buf`` holds records back to back from its first byte (a layer buffer or a staging slot).
        """
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"buf must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown projection {proj!r}; expected one of {PROJECTIONS}")
        off = row * self.stride + self.offsets[(proj, tensor)]
        size = self.sizes[(proj, tensor)]
        if row < 0 or off + size > buf.numel():
            raise IndexError(f"record {row} ({proj}.{tensor}) lies outside a buffer of {buf.numel()} bytes")
        return buf[off : off + size].view(_DTYPES[tensor]).view(self.shape(proj, tensor))

    def elem_offset(self, proj: Projection, tensor: str, itemsize: int) -> int:
        """Offset of ``tensor`` inside a record in units of ``itemsize`` bytes (for kernel pointer math)."""
        off = self.offsets[(proj, tensor)]
        if off % itemsize or self.stride % itemsize:
            raise ValueError(f"{proj}.{tensor} offset {off} is not a multiple of {itemsize}")
        return off // itemsize
