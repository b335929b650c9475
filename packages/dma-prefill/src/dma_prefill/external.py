"""``ExternalExpertStore``: the routed experts read in place from host memory that someone else owns.

A served model keeps one host copy of its experts (e.g. the checkpoint's files memory-mapped and CUDA-registered);
a second copy in a ``HostExpertStore`` would double the host RAM. This store takes the address of every
(layer, expert, projection, tensor) inside a few host buffers instead and copies nothing: the staging ring copies
each batch straight from those buffers into its VRAM slots, the CPU tail and the references read views of them.

The tensors of an expert need not be adjacent in the source (a safetensors file sorts them by dtype, then name:
all scale vectors of a shard before all trellises). The slot record lays the nine tensors out in the order in
which expert 0 of the first layer holds them in the source (16-byte aligned), and ``copy_segments`` merges
the copies of tensors that are adjacent both in the source and in the slot into one DMA. In a pack written by
safetensors that is two DMAs per expert (its three trellises, its six scale vectors), against one per run of
consecutive experts for a ``HostExpertStore``; the scale run is 44.5 KB at V4.1-Flash sizes, ~1% of the expert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from cpu_tier.exl3 import Exl3Tensor

from .config import PROJECTIONS, TENSORS, LayerSpec, Projection
from .layout import ExpertLayout

__all__ = ["COLUMNS", "ExternalExpertStore"]

#: The nine tensors of an expert, in the column order of the address arrays: (proj, tensor) for proj in gate, up,
#: down for tensor in trellis, suh, svh.
COLUMNS: tuple[tuple[Projection, str], ...] = tuple((p, t) for p in PROJECTIONS for t in TENSORS)
_DTYPES = {"trellis": np.int16, "suh": np.float16, "svh": np.float16}
_ALIGN = 16


class ExternalExpertStore:
    """Routed experts at given addresses inside host buffers (read only; the buffers are the caller's).

    Parameters
    ----------
    specs : layer id -> ``LayerSpec``, in the order of the address arrays' first axis.
    buffers : 1-D ``uint8`` host tensors holding the tensors (pinned or CUDA-registered for asynchronous DMA).
    buffer : integer ``[L, 9, E]``: index into ``buffers`` of each tensor (columns in ``COLUMNS`` order).
    offset : integer ``[L, 9, E]``: byte offset of each tensor inside its buffer.
    tail_pad : bytes after every staging slot (kernels may read a little past a record).
    owner : kept alive as long as the store (e.g. the object that maps the buffers).

    Raises ``ValueError`` naming the (layer, expert, tensor) that lies outside its buffer or is misaligned.
    """

    def __init__(
        self,
        specs: Mapping[int, LayerSpec],
        buffers: Sequence[torch.Tensor],
        buffer: np.ndarray,
        offset: np.ndarray,
        *,
        tail_pad: int = 4096,
        owner: object = None,
    ) -> None:
        if not specs:
            raise ValueError("ExternalExpertStore needs at least one layer spec")
        self._ids = tuple(int(x) for x in specs)
        self._specs = {int(k): v for k, v in specs.items()}
        L, P = len(self._ids), len(COLUMNS)
        E = max(s.num_experts for s in self._specs.values())
        buffer = np.asarray(buffer)
        offset = np.asarray(offset)
        if buffer.shape != (L, P, E) or offset.shape != (L, P, E):
            raise ValueError(
                f"ExternalExpertStore: buffer and offset must be [{L} layers, {P} tensors, {E} experts], got "
                f"{buffer.shape} and {offset.shape}"
            )
        for i, b in enumerate(buffers):
            if b.dtype != torch.uint8 or b.dim() != 1 or b.device.type != "cpu":
                raise ValueError(f"ExternalExpertStore: buffers[{i}] must be a 1-D uint8 host tensor, got "
                                 f"{b.dtype} {tuple(b.shape)} on {b.device}")  # fmt: skip
        if tail_pad < 16:
            raise ValueError(f"ExternalExpertStore.tail_pad must be >= 16 bytes, got {tail_pad}")
        self.buffers = tuple(buffers)
        self._tail_pad = int(tail_pad)
        self.owner = owner
        self._buffer = buffer.astype(np.int64)
        self._offset = offset.astype(np.int64)
        # the record order: expert 0 of the first layer's tensors by (buffer, offset) in the source
        order = sorted(range(P), key=lambda c: (int(self._buffer[0, c, 0]), int(self._offset[0, c, 0])))
        self._order = [COLUMNS[c] for c in order]
        self._layouts: dict[int, ExpertLayout] = {}
        self._seg: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for li, lid in enumerate(self._ids):
            spec = self._specs[lid]
            lay = ExpertLayout.build(spec, _ALIGN, self._order)
            self._layouts[lid] = lay
            sizes = [lay.sizes[c] for c in COLUMNS]
            n = spec.num_experts
            for c, (p, t) in enumerate(COLUMNS):
                bi, off = self._buffer[li, c, :n], self._offset[li, c, :n]
                if bi.min() < 0 or bi.max() >= len(self.buffers):
                    e = int(np.flatnonzero((bi < 0) | (bi >= len(self.buffers)))[0])
                    raise ValueError(f"layer {lid} expert {e} {p}.{t}: buffer index {int(bi[e])} out of range")
                ends = off + sizes[c]
                lens = np.array([self.buffers[int(b)].numel() for b in bi])
                bad = np.flatnonzero((off < 0) | (ends > lens) | (off % np.dtype(_DTYPES[t]).itemsize != 0))
                if bad.size:
                    e = int(bad[0])
                    raise ValueError(
                        f"layer {lid} expert {e} {p}.{t}: bytes [{int(off[e])}, {int(ends[e])}) are not an aligned "
                        f"range of buffer {int(bi[e])} ({int(lens[e])} bytes)"
                    )
            # per (expert, tensor): source buffer, source address, destination offset from record 0, size
            exp = np.arange(n, dtype=np.int64)[:, None]
            src_buf = self._buffer[li, :, :n].T  # [n, 9]
            src_off = self._offset[li, :, :n].T
            dst = exp * lay.stride + np.array([lay.offsets[c] for c in COLUMNS], np.int64)[None, :]
            size = np.broadcast_to(np.array(sizes, np.int64)[None, :], (n, P))
            self._seg[lid] = (src_buf, src_off, dst, size)

    # ------------------------------------------------------------------------------------------ basics

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._ids

    @property
    def tail_pad(self) -> int:
        return self._tail_pad

    def _index(self, layer: int) -> int:
        try:
            return self._ids.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer} is not in the store (layers {self._ids})") from None

    def spec(self, layer: int) -> LayerSpec:
        self._index(layer)
        return self._specs[layer]

    def layout(self, layer: int) -> ExpertLayout:
        self._index(layer)
        return self._layouts[layer]

    @property
    def record_order(self) -> tuple[tuple[Projection, str], ...]:
        """The tensors of a slot record, in order (the source's order of expert 0 of the first layer)."""
        return tuple(self._order)

    # ------------------------------------------------------------------------------------------ copies

    def copy_segments(self, layer: int, e0: int, e1: int) -> list[tuple[torch.Tensor, int]]:
        """The DMAs of records ``[e0, e1)``: tensors adjacent in the source and in the slot merge into one."""
        spec = self.spec(layer)
        if not 0 <= e0 < e1 <= spec.num_experts:
            raise IndexError(f"layer {layer}: experts [{e0}, {e1}) outside [0, {spec.num_experts})")
        src_buf, src_off, dst, size = (a[e0:e1].reshape(-1) for a in self._seg[layer])
        order = np.argsort(dst, kind="stable")
        src_buf, src_off, dst, size = src_buf[order], src_off[order], dst[order], size[order]
        # a tensor continues the previous segment when both its source and its destination follow on directly
        cont = np.zeros(dst.size, bool)
        cont[1:] = (
            (src_buf[1:] == src_buf[:-1])
            & (src_off[1:] == src_off[:-1] + size[:-1])
            & (dst[1:] == dst[:-1] + size[:-1])
        )
        starts = np.flatnonzero(~cont)
        ends = np.append(starts[1:], dst.size)
        base = e0 * self._layouts[layer].stride
        out: list[tuple[torch.Tensor, int]] = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            n = int(dst[e - 1] + size[e - 1] - dst[s])
            b, o = int(src_buf[s]), int(src_off[s])
            out.append((self.buffers[b][o : o + n], int(dst[s] - base)))
        return out

    # ------------------------------------------------------------------------------------------- views

    def numpy(self, layer: int, expert: int, proj: Projection, name: str) -> np.ndarray:
        """A read-only numpy view of one tensor in the source."""
        li = self._index(layer)
        spec = self._specs[layer]
        if not 0 <= expert < spec.num_experts:
            raise IndexError(f"layer {layer}: expert {expert} out of range [0, {spec.num_experts})")
        c = COLUMNS.index((proj, name))
        lay = self._layouts[layer]
        b, o = int(self._buffer[li, c, expert]), int(self._offset[li, c, expert])
        raw = self.buffers[b][o : o + lay.sizes[(proj, name)]].numpy()
        arr = raw.view(_DTYPES[name]).reshape(lay.shape(proj, name))
        arr.flags.writeable = False
        return arr

    def tensor(self, layer: int, expert: int, proj: Projection, name: str) -> torch.Tensor:
        """A torch view of one tensor in the source (host; do not write)."""
        li = self._index(layer)
        c = COLUMNS.index((proj, name))
        lay = self._layouts[layer]
        b, o = int(self._buffer[li, c, expert]), int(self._offset[li, c, expert])
        raw = self.buffers[b][o : o + lay.sizes[(proj, name)]]
        dtype = torch.int16 if name == "trellis" else torch.float16
        return raw.view(dtype).view(lay.shape(proj, name))

    def view(self, layer: int, expert: int, proj: Projection) -> Exl3Tensor:
        """One linear as an ``Exl3Tensor`` of views of the source (no copy)."""
        return Exl3Tensor.from_arrays(
            self.numpy(layer, expert, proj, "trellis"),
            self.numpy(layer, expert, proj, "suh"),
            self.numpy(layer, expert, proj, "svh"),
            self._specs[layer].proj(proj).codebook,
            name=f"layer {layer} expert {expert} {proj}",
        )
