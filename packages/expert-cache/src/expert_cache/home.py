"""The host home of the experts: where every (layer, expert, projection) row of bytes lives.

:class:`ExpertCache` accepts two forms of home:

* **stacked**: ``home[layer][p]``, one host tensor ``[num_experts, *projections[p].shape]`` per layer and
  projection (the rows of a projection are consecutive);
* **address-based**: an :class:`ExpertRows`, whose rows lie anywhere inside a few host buffers (e.g. the ranges of
  a model's safetensors files, memory-mapped and CUDA-registered: the rows are then at scattered addresses, and the
  address a GPU kernel reads may differ from the host address).

The cache turns the stacked form into an :class:`ExpertRows` (:meth:`ExpertRows.from_stacked`) and runs one code
path. A row's *host view* (:meth:`ExpertRows.host_row`) is what a slot fill copies from; its *kernel address*
(:meth:`ExpertRows.kernel_addresses`) is what the pointer table holds while the expert is not resident.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .config import ExpertCacheConfig, ProjectionSpec

__all__ = ["TORCH_DTYPES", "ExpertRows"]

#: ``ProjectionSpec.dtype`` -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "float32": torch.float32,
    "int64": torch.int64,
}


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertRows:
    """An address-based home: each (layer, expert, projection) row is ``nbytes`` bytes somewhere in a host buffer.

    Parameters
    ----------
    buffers
        Host ``uint8`` 1-D contiguous tensors that hold the rows (e.g. one per mapped file range). On a CUDA cache
        each must be page-locked (``pin_memory()`` or ``cudaHostRegister``; torch's ``is_pinned()`` is true for
        both), so that fills are asynchronous DMA and a kernel can read a row in place. The cache never writes them
        (read-only mappings are fine).
    buffer
        Integer ``[num_layers, num_projections, num_experts]``: index into ``buffers`` of the buffer holding each row.
    offset
        Integer ``[num_layers, num_projections, num_experts]``: byte offset of each row inside its buffer; the row is
        ``buffers[b][offset : offset + projections[p].nbytes]``.
    kernel_bases
        Per buffer, the address a kernel must use for the buffer's byte 0 (``cudaHostGetDevicePointer`` of a
        registered mapping); empty means each buffer's own ``data_ptr()`` (pinned memory under unified addressing,
        or a CPU cache).
    owner
        Anything that must stay alive as long as the rows are used (e.g. the object holding the mappings). The cache
        keeps a reference; it does not close it.
    names
        Per buffer, the name errors give it (e.g. ``home[0][1] (scales)`` for :meth:`from_stacked`'s buffers); empty
        means ``rows.buffers[i]``.

    Notes
    -----
    The arrays are projection-major (``[L, P, E]``) like :attr:`ExpertCache.pointer_table`; the rows keep read-only
    copies of them. Every row's host and
    kernel addresses must be multiples of its projection's item size. Validation (:meth:`check`) names the first
    bad (layer, expert, projection).
    """

    buffers: tuple[torch.Tensor, ...]
    buffer: np.ndarray
    offset: np.ndarray
    kernel_bases: tuple[int, ...] = ()
    owner: object = None
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("buffer", "offset"):  # frozen means frozen: read-only copies of the arrays
            a = getattr(self, field)
            if isinstance(a, np.ndarray):
                a = a.copy()
                a.setflags(write=False)
                object.__setattr__(self, field, a)

    # ---- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_stacked(cls, home: Sequence[Sequence[torch.Tensor]], config: ExpertCacheConfig) -> ExpertRows:
        """The stacked form ``home[layer][p]`` (``[num_experts, *shape]`` host tensors) as rows.

        Checks the stacked form first (``home[layer][p] (name): ...`` errors: count, host device, shape, dtype,
        contiguity); pinning is checked by :meth:`check`.
        """
        specs = config.projection_specs
        L, E, P = config.num_layers, config.num_experts, len(specs)
        if len(home) != L:
            raise ValueError(f"home: expected {L} layers, got {len(home)}")
        buffers: list[torch.Tensor] = []
        names: list[str] = []
        buffer = np.empty((L, P, E), np.int32)
        offset = np.empty((L, P, E), np.int64)
        for layer, row in enumerate(home):
            if len(row) != P:
                raise ValueError(f"home[{layer}]: expected {P} projections {[s.name for s in specs]}, got {len(row)}")
            for p, (t, spec) in enumerate(zip(row, specs, strict=True)):
                name = f"home[{layer}][{p}] ({spec.name})"
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
                if t.device.type != "cpu":
                    raise ValueError(f"{name}: must be a host (CPU) tensor, got device {t.device}")
                want = (E, *spec.shape)
                if tuple(t.shape) != want:
                    raise ValueError(f"{name}: shape must be {want}, got {tuple(t.shape)}")
                if t.dtype != TORCH_DTYPES[spec.dtype]:
                    raise ValueError(f"{name}: dtype must be {spec.dtype}, got {t.dtype}")
                if not t.is_contiguous():
                    raise ValueError(f"{name}: must be contiguous")
                buffer[layer, p] = len(buffers)
                offset[layer, p] = np.arange(E, dtype=np.int64) * spec.nbytes
                buffers.append(t.view(-1).view(torch.uint8))
                names.append(name)
        return cls(tuple(buffers), buffer, offset, (), home, tuple(names))

    # ---- validation ------------------------------------------------------------------------------------------

    def check(self, config: ExpertCacheConfig, cuda: bool) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first buffer or (layer, expert, projection) at fault.

        Checks: buffers are host ``uint8`` 1-D contiguous tensors (pinned when ``cuda``); ``buffer``/``offset`` are
        integer arrays ``[num_layers, num_projections, num_experts]``; every row lies inside its buffer; every host
        and kernel address is a multiple of the projection's item size.
        """
        specs = config.projection_specs
        L, E, P = config.num_layers, config.num_experts, len(specs)
        if not isinstance(self.buffers, tuple) or not self.buffers:
            raise TypeError(f"rows.buffers: must be a non-empty tuple of tensors, got {type(self.buffers).__name__}")
        if self.names and len(self.names) != len(self.buffers):
            raise ValueError(f"rows.names: one name per buffer ({len(self.buffers)}) or none, got {len(self.names)}")
        sizes = np.empty(len(self.buffers), np.int64)
        hosts = np.empty(len(self.buffers), np.int64)
        for i, t in enumerate(self.buffers):
            name = self.names[i] if self.names else f"rows.buffers[{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{name}: must be a host (CPU) tensor, got device {t.device}")
            if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"{name}: must be a 1-D contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}")
            if cuda and not t.is_pinned():
                raise ValueError(
                    f"{name}: must be page-locked so the GPU can read it (pin_memory() or cudaHostRegister)"
                )
            sizes[i] = t.numel()
            hosts[i] = t.data_ptr()
        if self.kernel_bases and len(self.kernel_bases) != len(self.buffers):
            raise ValueError(
                f"rows.kernel_bases: one address per buffer ({len(self.buffers)}) or none, got {len(self.kernel_bases)}"
            )
        for field in ("buffer", "offset"):
            a = getattr(self, field)
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
                got = f"dtype {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
                raise TypeError(f"rows.{field}: must be an integer numpy array, got {got}")
            if a.shape != (L, P, E):
                raise ValueError(f"rows.{field}: shape must be [num_layers, projections, experts] = {(L, P, E)}, "
                                 f"got {a.shape}")  # fmt: skip
        buf = self.buffer.astype(np.int64)
        off = self.offset.astype(np.int64)
        nbytes = np.array([s.nbytes for s in specs], np.int64)[None, :, None]
        item = np.array([s.itemsize for s in specs], np.int64)[None, :, None]
        nb = len(self.buffers)
        bad_buf = (buf < 0) | (buf >= nb)
        self._fail(bad_buf, specs, lambda i: f"buffer index {buf[i]} is not in [0, {nb})")
        end = off + nbytes
        size = sizes[buf]
        self._fail(
            (off < 0) | (end > size),
            specs,
            lambda i: f"bytes [{off[i]}, {end[i]}) are not inside buffer {buf[i]} of {size[i]} bytes",
        )
        host = hosts[buf] + off
        self._fail(host % item != 0, specs, lambda i: f"host address {host[i]:#x} is not a multiple of the item size")
        kern = self.kernel_addresses()
        self._fail(kern % item != 0, specs, lambda i: f"kernel address {kern[i]:#x} is not a multiple of the item size")

    @staticmethod
    def _fail(mask: np.ndarray, specs: tuple[ProjectionSpec, ...], what: Callable[[tuple[int, int, int]], str]) -> None:
        if not mask.any():
            return
        layer, p, e = (int(x) for x in np.argwhere(mask)[0])
        raise ValueError(f"rows[layer {layer}, expert {e}, projection {specs[p].name}]: {what((layer, p, e))}")

    # ---- addresses -------------------------------------------------------------------------------------------

    def host_addresses(self) -> np.ndarray:
        """int64 ``[L, P, E]``: the host address of every row (what fills read)."""
        hosts = np.array([t.data_ptr() for t in self.buffers], np.int64)
        return hosts[self.buffer.astype(np.int64)] + self.offset.astype(np.int64)

    def kernel_addresses(self) -> np.ndarray:
        """int64 ``[L, P, E]``: the address a kernel reads for every row (the pointer table's non-resident entries)."""
        bases = self.kernel_bases or tuple(t.data_ptr() for t in self.buffers)
        return np.array(bases, np.int64)[self.buffer.astype(np.int64)] + self.offset.astype(np.int64)

    def host_row(self, layer: int, expert: int, projection: int, nbytes: int) -> torch.Tensor:
        """The host ``uint8`` view ``[nbytes]`` of one row (no copy)."""
        b = int(self.buffer[layer, projection, expert])
        o = int(self.offset[layer, projection, expert])
        return self.buffers[b][o : o + nbytes]

    def copy_expert(self, slot: torch.Tensor, layer: int, expert: int, config: ExpertCacheConfig,
                    non_blocking: bool) -> int:  # fmt: skip
        """Copy every projection of ``(layer, expert)`` into ``slot`` (one ``[slot_stride]`` row of a slot pool, at
        ``config.projection_offsets``) on the current stream; returns the bytes copied. The one fill of a slot, for
        the cache's fills and any borrower's transient slots."""
        n = 0
        for p, (spec, off) in enumerate(zip(config.projection_specs, config.projection_offsets, strict=True)):
            slot[off : off + spec.nbytes].copy_(self.host_row(layer, expert, p, spec.nbytes), non_blocking=non_blocking)
            n += spec.nbytes
        return n
