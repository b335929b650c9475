"""Hits on the GPU: one MoE layer's routed experts computed from their EXL3 tensors, read through a pointer table.

The tiered runtime keeps every routed expert in the pack's host home and the hottest ones in VRAM slots. A table
``ptrs`` (int64 ``[9, E]``, one row per column of ``home.EXPERT_COLUMNS``: gate/up/down x trellis/suh/svh) holds
the address of each expert's tensors, in a VRAM slot or in the GPU-mapped home (a zero-copy read over PCIe). A
hit kernel computes a decode step's picks of one layer straight through that table, so the experts never need to
sit in one stacked tensor:

    out[t, k] = weights[t, k] * down(swiglu(gate(x[t]), up(x[t])))       (expert ids[t, k])

with DeepSeek's clamped SwiGLU ``silu(min(g, L)) * clamp(u, -L, L)`` (``reference.swiglu``), and exactly 0.0 where
``ids[t, k] == -1``: such a pick's expert is never read (its table entries may be stale, or point anywhere).
``out`` keeps the picks apart (``[T, K, H]`` fp32) so that the caller sums over k in one fixed order, whatever
tier computed which pick.

Backends (``HitKernel``; ``make_hits`` picks one):

* ``ReferenceHits``: the exact reference. Reads the tensors at the addresses (host addresses on the CPU: views
  of the memory, no copy; device or mapped-host addresses on CUDA: views through ``__cuda_array_interface__``),
  decodes them bit-exactly (dma-prefill's torch decode, checked against ``cpu_tier.exl3``) and computes in
  float64. Not graph-safe (it reads the routing on the host). The fake-device path of CPU tests.
* ``Exl3MgemmHits``: exllamav3's pointer-table multi-GEMM (``exl3_mgemm``), one slot per pick (``m = 1``, as
  exllamav3's own decode path does): gate and up as one launch over ``2 * T * K`` slots, our clamped SwiGLU in
  torch, down into ``out``; skipped picks are skipped by the kernel itself (a negative index loads no pointer).
  Activations in fp16 (exllamav3's precision: ~1e-3 relative). exllamav3 autotunes each new slot count on its
  first call, which cannot happen inside a CUDA graph capture: call ``forward`` once eagerly per ``T`` first
  (vLLM's warmup does), or ``warm``; a capture of an unwarmed size raises.
* ``TritonHits``: ours (``hits_kernels``): five (or seven) fixed-grid launches; each expert's trellis is decoded
  once per step in registers and multiplied with the rows of all its picks, activations kept to ~22 bits (fp16
  hi + lo; fp32 for experts with one pick), fp32 sums in a fixed order (deterministic).

Scratch (graph safety): every GPU backend keeps its buffers for a capacity of ``S = T * K`` picks, allocated at
construction (``max_tokens * top_k``) or grown by an eager call; a call inside a CUDA graph capture that would need
more raises instead of allocating. Tables and routing are read on the device only; nothing syncs with the host.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from cpu_tier.exl3 import CODEBOOK_MULT, Codebook, Exl3Tensor

from .home import EXPERT_COLUMNS, LayerExperts

__all__ = [
    "Backend",
    "ExpertPool",
    "Exl3MgemmHits",
    "HitGeometry",
    "HitKernel",
    "ReferenceHits",
    "TritonHits",
    "layer_pointers",
    "make_hits",
    "pointer_problems",
]

_ROLES = ("gate", "up", "down")
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HitKernel(Protocol):
    """One MoE layer's hit computation through a pointer table (see the module docstring)."""

    name: str
    #: bytes every address in ``ptrs`` must be a multiple of (the widest load the kernel issues on a tensor)
    alignment: int

    def forward(
        self, ptrs: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``ptrs`` int64 ``[9, E]``; ``x`` ``[T, H]`` fp32/bf16/fp16; ``ids`` int32 ``[T, K]`` (-1: skip);
        ``weights`` fp32 ``[T, K]``; ``out`` fp32 ``[T, K, H]`` (written whole). All on one device."""
        ...


# ------------------------------------------------------------------------------------------------ geometry


@dataclass(frozen=True, slots=True)
class HitGeometry:
    """What the hit kernels need to know about a layer's experts (all of a layer's experts share it).

    ``bits`` and ``codebooks`` are per projection (gate, up, down); ``swiglu_limit`` is DeepSeek's clamp (None:
    plain SwiGLU).
    """

    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    bits: tuple[float, float, float]
    codebooks: tuple[Codebook, Codebook, Codebook]
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise ValueError(f"layer {self.layer}: num_experts must be positive, got {self.num_experts}")
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v <= 0 or v % 128:
                raise ValueError(f"layer {self.layer}: {name} must be a positive multiple of 128, got {v}")
        if self.swiglu_limit is not None and not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            raise ValueError(f"layer {self.layer}: swiglu_limit must be positive and finite, got {self.swiglu_limit}")

    @classmethod
    def from_layer(cls, experts: LayerExperts, swiglu_limit: float | None = None) -> HitGeometry:
        """The geometry of ``experts``; raises ValueError naming the first expert (and projection, field) that
        differs from expert 0, or that has a bias (the hit kernels compute experts without biases)."""
        lid = experts.layer
        n = experts.num_experts
        if n == 0 or not (len(experts.gate) == len(experts.up) == len(experts.down)):
            raise ValueError(f"layer {lid}: need the same non-zero number of gate/up/down experts, got "
                             f"{len(experts.gate)}/{len(experts.up)}/{len(experts.down)}")  # fmt: skip
        h, i = experts.gate[0].k, experts.gate[0].n
        want = {"gate": (h, i), "up": (h, i), "down": (i, h)}
        first = {r: getattr(experts, r)[0] for r in _ROLES}
        for e in range(n):
            for role in _ROLES:
                t: Exl3Tensor = getattr(experts, role)[e]
                where = f"layer {lid}: expert {e} {role}"
                if (t.k, t.n) != want[role]:
                    raise ValueError(f"{where}: {t.k}x{t.n} (in x out), expert 0 makes it {want[role][0]}x"
                                     f"{want[role][1]}: all experts of a layer must share one shape")  # fmt: skip
                f = first[role]
                if t.bits != f.bits:
                    raise ValueError(f"{where}: {t.bits:g} bits per weight, expert 0 has {f.bits:g}: all experts "
                                     "of a layer must share bits per projection")  # fmt: skip
                if t.codebook != f.codebook:
                    raise ValueError(f"{where}: codebook {t.codebook}, expert 0 has {f.codebook}: all experts of a "
                                     "layer must share the codebook per projection")  # fmt: skip
                if t.bias is not None:
                    raise ValueError(f"{where}: has a bias; the hit kernels compute experts without biases")
        return cls(
            layer=lid, num_experts=n, hidden=h, intermediate=i,
            bits=(first["gate"].bits, first["up"].bits, first["down"].bits),
            codebooks=(first["gate"].codebook, first["up"].codebook, first["down"].codebook),
            swiglu_limit=swiglu_limit,
        )  # fmt: skip

    def column_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of the tensor each pointer-table column addresses (``EXPERT_COLUMNS`` order)."""
        h, i = self.hidden, self.intermediate
        dims = {"gate": (h, i), "up": (h, i), "down": (i, h)}
        out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for role, part in EXPERT_COLUMNS:
            k, n = dims[role]
            bits = self.bits[_ROLES.index(role)]
            if part == "trellis":
                out.append((f"{role}.{part}", (k // 16, n // 16, int(16 * bits)), torch.int16))
            else:
                out.append((f"{role}.{part}", ((k,) if part == "suh" else (n,)), torch.float16))
        return out

    @property
    def trellis_bytes(self) -> int:
        """Trellis bytes of one expert (gate + up + down): what a hit reads from memory, besides ~1% of vectors."""
        return sum(math.prod(s) * 2 for name, s, _ in self.column_specs() if name.endswith("trellis"))

    @property
    def expert_bytes(self) -> int:
        """All bytes of one expert's nine tensors."""
        return sum(math.prod(s) * (2 if dt in (torch.int16, torch.float16) else 4) for _, s, dt in self.column_specs())


# --------------------------------------------------------------------------------------- argument checks


def _check_forward(g: HitGeometry, who: str, ptrs: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:  # fmt: skip
    """Shapes, dtypes, layouts and devices of a forward call (metadata only: no host sync). Returns (T, K)."""
    where = f"{who} (layer {g.layer})"
    cols = len(EXPERT_COLUMNS)
    if ptrs.dtype != torch.int64 or tuple(ptrs.shape) != (cols, g.num_experts) or not ptrs.is_contiguous():
        raise ValueError(f"{where}: ptrs must be a contiguous int64 [{cols}, {g.num_experts}] table (one row per "
                         f"column {[f'{r}.{p}' for r, p in EXPERT_COLUMNS]}), got {ptrs.dtype} "
                         f"{tuple(ptrs.shape)}{'' if ptrs.is_contiguous() else ' (not contiguous)'}")  # fmt: skip
    if x.ndim != 2 or x.shape[1] != g.hidden or x.dtype not in _X_DTYPES or (x.shape[0] and x.stride(1) != 1):
        raise ValueError(f"{where}: x must be [T, {g.hidden}] fp32/bf16/fp16 with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    t = x.shape[0]
    if ids.dtype != torch.int32 or ids.ndim != 2 or ids.shape[0] != t or not ids.is_contiguous():
        raise ValueError(f"{where}: ids must be a contiguous int32 [{t}, K] tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")  # fmt: skip
    k = ids.shape[1]
    if weights.dtype != torch.float32 or tuple(weights.shape) != (t, k) or not weights.is_contiguous():
        raise ValueError(f"{where}: weights must be a contiguous fp32 [{t}, {k}] tensor, got {weights.dtype} "
                         f"{tuple(weights.shape)}")  # fmt: skip
    if out.dtype != torch.float32 or tuple(out.shape) != (t, k, g.hidden) or not out.is_contiguous():
        raise ValueError(f"{where}: out must be a contiguous fp32 [{t}, {k}, {g.hidden}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    dev = ptrs.device
    for name, a in (("x", x), ("ids", ids), ("weights", weights), ("out", out)):
        if a.device != dev:
            raise ValueError(f"{where}: {name} is on {a.device}, ptrs on {dev}: all on the compute device")
    return t, k


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pointer_problems(
    ptrs: torch.Tensor, geometry: HitGeometry, experts: Sequence[int] | None = None, *, alignment: int = 4
) -> list[str]:
    """What is wrong with a pointer table's entries (host-side check, syncs): null or misaligned addresses.

    ``experts``: which experts to check (default all). ``alignment``: bytes every address must be a multiple of
    (trellis words are read as uint32 by ours, with 16-byte vector loads by exllamav3's kernels).
    """
    table = ptrs.detach().cpu().numpy()
    names = [name for name, _, _ in geometry.column_specs()]
    out: list[str] = []
    for e in range(geometry.num_experts) if experts is None else experts:
        for c, name in enumerate(names):
            a = int(table[c, e])
            if a == 0:
                out.append(f"layer {geometry.layer} expert {e} {name}: null pointer")
            elif a % alignment:
                out.append(f"layer {geometry.layer} expert {e} {name}: address {a:#x} is not {alignment}-byte aligned")
    return out


# ---------------------------------------------------------------------------------------------- reference


def _view(addr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor over ``prod(shape)`` elements at ``addr`` (no copy): host memory on the CPU, a device or mapped
    host address on CUDA."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu":
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
    else:
        from dma_prefill._cudart import CudaArray

        raw = torch.as_tensor(CudaArray(addr, nbytes, None), device=device)
    return raw.view(dtype).reshape(shape)


class ReferenceHits:
    """The exact reference: bit-exact decode of the tensors at the addresses, float64 math, on CPU or CUDA.

    Reads the routing and the table on the host (syncs; not for CUDA graphs). Checks every address it reads
    (null, alignment) and names the expert and column at fault.
    """

    name = "reference"
    graph_safe = False
    alignment = 4

    def __init__(self, geometry: HitGeometry, *, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"ReferenceHits: dtype must be float64 or float32, got {dtype}")
        self.geometry = geometry
        self.dtype = dtype

    def expert(
        self, ptrs: torch.Tensor, e: int, device: torch.device | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Expert ``e``'s ``(W_inner, suh, svh)`` per projection (gate, up, down) in ``self.dtype`` on ``device``
        (default ``ptrs``'s), read through the table ``ptrs`` (decoded; the vectors are copies)."""
        from dma_prefill.ops_torch import decode_torch

        g = self.geometry
        problems = pointer_problems(ptrs, g, [e], alignment=self.alignment)
        if problems:
            raise ValueError(f"ReferenceHits: {'; '.join(problems)}")
        specs = g.column_specs()
        dev = ptrs.device if device is None else device
        tensors = [_view(int(ptrs[c, e]), shape, dt, dev) for c, (_, shape, dt) in enumerate(specs)]
        out = []
        for r in range(3):
            trellis, suh, svh = tensors[3 * r : 3 * r + 3]
            w = decode_torch(trellis, g.codebooks[r]).to(self.dtype)
            out.append((w, suh.to(self.dtype), svh.to(self.dtype)))
        return out

    def forward(
        self, ptrs: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        from dma_prefill.ops_torch import linear_torch, swiglu

        g = self.geometry
        t, k = _check_forward(g, "ReferenceHits", ptrs, x, ids, weights, out)
        res = torch.zeros((t, k, g.hidden), dtype=self.dtype, device=x.device)
        xs = x.to(self.dtype)
        w = weights.to(self.dtype)
        ids_h = ids.detach().cpu().numpy()
        table = ptrs.detach().cpu()
        for e in np.unique(ids_h[ids_h >= 0]).tolist():
            if not 0 <= e < g.num_experts:
                raise ValueError(f"ReferenceHits (layer {g.layer}): expert id {e} out of range [0, {g.num_experts})")
            (wg, sg, vg), (wu, su, vu), (wd, sd, vd) = self.expert(table, e, ptrs.device)
            rows, slots = (torch.from_numpy(a).to(x.device) for a in np.nonzero(ids_h == e))
            xe = xs[rows]
            gate = linear_torch(xe, wg, sg, vg, dtype=self.dtype)
            up = linear_torch(xe, wu, su, vu, dtype=self.dtype)
            y = linear_torch(swiglu(gate, up, g.swiglu_limit), wd, sd, vd, dtype=self.dtype)
            res[rows, slots] = y * w[rows, slots, None]
        out.copy_(res)


# ------------------------------------------------------------------------------------------- exllamav3


class Exl3MgemmHits:
    """exllamav3's ``exl3_mgemm`` over one slot per pick (see the module docstring).

    Parameters
    ----------
    geometry : the layer.
    device : a CUDA device.
    max_tokens, top_k : scratch capacity ``max_tokens * top_k`` picks allocated now (0: on the first call).
    """

    name = "exllamav3"
    graph_safe = True
    alignment = 16  # 16-byte vector loads of the trellis and the sign vectors

    def __init__(self, geometry: HitGeometry, device: torch.device | str, *, max_tokens: int = 0,
                 top_k: int = 0) -> None:  # fmt: skip
        from .dense import exllamav3_available

        self.geometry = geometry
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"Exl3MgemmHits: exllamav3's kernels need a CUDA device, got {self.device}")
        if not exllamav3_available():
            raise RuntimeError("Exl3MgemmHits: exllamav3's CUDA extension does not import here "
                               "(pip install exllamav3, or backend 'triton')")  # fmt: skip
        from exllamav3.ext import exllamav3_ext

        self._ext: Any = exllamav3_ext
        e = geometry.num_experts
        # gate and up merged into one table of 2E matrices (one launch), when they share bits and codebook
        self._merged = (geometry.bits[0], geometry.codebooks[0]) == (geometry.bits[1], geometry.codebooks[1])
        cols = [(0, 3), (1, 4), (2, 5)]  # (gate, up) rows of trellis, suh, svh
        self._gu_index = torch.tensor([[a * e + i for i in range(e)] + [b * e + i for i in range(e)] for a, b in cols],
                                      dtype=torch.int64, device=self.device).view(-1)  # fmt: skip
        self._gu_tables = torch.empty((3, 2 * e), dtype=torch.int64, device=self.device)
        self._cap = 0
        self.scratch_version = 0  # +1 at each (re)allocation of the scratch (reserve)
        self._warm: set[int] = set()
        self._tokens: dict[tuple[int, int], torch.Tensor] = {}
        if max_tokens and top_k:
            self.reserve(max_tokens * top_k)

    def _flags(self, role: int) -> tuple[float, bool, bool]:
        cb = self.geometry.codebooks[role]
        return float(self.geometry.bits[role]), cb == "mcg", cb == "mul1"

    def reserve(self, s: int) -> None:
        """Scratch for calls of up to ``s`` picks, allocated now if larger than held (``scratch_version`` then
        changes: what captured the old scratch must be captured again)."""
        if s <= self._cap:
            return
        if _capturing(self.device):
            raise RuntimeError(f"Exl3MgemmHits (layer {self.geometry.layer}): {s} picks exceed the scratch "
                               f"capacity {self._cap} inside a CUDA graph capture; construct with max_tokens and "
                               "top_k, or call forward eagerly at the largest size first")  # fmt: skip
        h, i, dev = self.geometry.hidden, self.geometry.intermediate, self.device
        f16, f32 = torch.float16, torch.float32
        self.x16 = torch.empty((s, h), dtype=f16, device=dev)
        self.a_gu = torch.empty((2 * s, h), dtype=f16, device=dev)
        self.had_gu = torch.empty((2 * s, h), dtype=f16, device=dev)
        self.c_gu = torch.empty((2 * s, i), dtype=f32, device=dev)
        self.act = torch.empty((s, i), dtype=f16, device=dev)
        self.had_d = torch.empty((s, i), dtype=f16, device=dev)
        self.index = torch.empty((2 * s,), dtype=torch.int64, device=dev)
        self.skip = torch.empty((s,), dtype=torch.bool, device=dev)
        self._cap = s
        self.scratch_version += 1

    def _token_index(self, t: int, k: int) -> torch.Tensor:
        """Slot j's token, for the 2S gate/up slots: ``(j mod S) // K`` (persistent per (T, K))."""
        idx = self._tokens.get((t, k))
        if idx is None:
            if _capturing(self.device):
                raise RuntimeError(f"Exl3MgemmHits (layer {self.geometry.layer}): T={t}, K={k} was not run "
                                   "eagerly before this CUDA graph capture (warm it first)")  # fmt: skip
            idx = (torch.arange(2 * t * k, device=self.device) % (t * k)) // k
            self._tokens[(t, k)] = idx
        return idx

    def forward(
        self, ptrs: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        g = self.geometry
        t, k = _check_forward(g, "Exl3MgemmHits", ptrs, x, ids, weights, out)
        if ptrs.device != self.device:
            raise ValueError(f"Exl3MgemmHits (layer {g.layer}): tensors on {ptrs.device}, kernel built for "
                             f"{self.device}")  # fmt: skip
        s = t * k
        if s == 0:
            return
        capturing = _capturing(self.device)
        if capturing and s not in self._warm:
            raise RuntimeError(f"Exl3MgemmHits (layer {g.layer}): {s} picks were never run eagerly; exllamav3 "
                               "autotunes a new size on its first call, which a CUDA graph capture forbids: call "
                               "forward (or warm) once per batch size before capturing")  # fmt: skip
        self.reserve(s)
        e, h, i = g.num_experts, g.hidden, g.intermediate
        ext = self._ext
        # inputs: one fp16 row per slot (gate slots 0..S-1, up slots S..2S-1)
        self.x16[:t].copy_(x)
        a_gu = self.a_gu[: 2 * s]
        torch.index_select(self.x16[:t], 0, self._token_index(t, k), out=a_gu)
        idx = self.index[: 2 * s]
        idx[:s].copy_(ids.view(-1))
        torch.add(idx[:s], e, out=idx[s:])
        torch.lt(idx[s:], e, out=self.skip[:s])
        idx[s:].masked_fill_(self.skip[:s], -1)  # skipped picks stay skipped in the up half
        c_gu = self.c_gu[: 2 * s]
        if self._merged:
            torch.index_select(ptrs.view(-1), 0, self._gu_index, out=self._gu_tables.view(-1))
            bits, mcg, mul1 = self._flags(0)
            tb, ts, tv = self._gu_tables
            ext.exl3_mgemm(a_gu.view(2 * s, 1, h), tb, c_gu.view(2 * s, 1, i), ts,
                           self.had_gu[: 2 * s].view(2 * s, 1, h), tv, idx.view(1, 2 * s), None, bits, -1, mcg,
                           mul1, -1, -1, 0)  # fmt: skip
        else:
            for role, sl in ((0, slice(0, s)), (1, slice(s, 2 * s))):
                bits, mcg, mul1 = self._flags(role)
                ext.exl3_mgemm(a_gu[sl].view(s, 1, h), ptrs[3 * role], c_gu[sl].view(s, 1, i), ptrs[3 * role + 1],
                               self.had_gu[sl].view(s, 1, h), ptrs[3 * role + 2], idx[:s].view(1, s), None, bits,
                               -1, mcg, mul1, -1, -1, 0)  # fmt: skip
        gate, up = c_gu[:s], c_gu[s:]
        lim = g.swiglu_limit
        if lim is not None:  # DeepSeek's clamp: the gate before the activation (exllamav3's silu_mul clamps after)
            gate.clamp_(max=lim)
            up.clamp_(-lim, lim)
        torch.nn.functional.silu(gate, inplace=True)
        act = self.act[:s]
        torch.mul(gate, up, out=act)
        bits, mcg, mul1 = self._flags(2)
        ext.exl3_mgemm(act.view(s, 1, i), ptrs[6], out.view(s, 1, h), ptrs[7], self.had_d[:s].view(s, 1, i),
                       ptrs[8], idx[:s].view(1, s), None, bits, -1, mcg, mul1, -1, -1, 0)  # fmt: skip
        out.mul_(weights.view(t, k, 1))
        skip = self.skip[:s].view(t, k, 1)
        torch.lt(ids.view(t, k, 1), 0, out=skip)
        out.masked_fill_(skip, 0.0)  # the kernel leaves a skipped slot's row as it was
        if not capturing:
            self._warm.add(s)

    def warm(self, ptrs: torch.Tensor, tokens: Sequence[int], top_k: int, experts: Sequence[int]) -> None:
        """Run one eager forward per token count (exllamav3 autotunes each new size), routing to ``experts``
        (whose table entries must be valid) round robin."""
        if not experts:
            raise ValueError("Exl3MgemmHits.warm: needs at least one expert with valid pointers")
        dev, h = self.device, self.geometry.hidden
        for t in tokens:
            picks = torch.tensor([experts[j % len(experts)] for j in range(t * top_k)], dtype=torch.int32)
            ids = picks.view(t, top_k).to(dev)
            x = torch.zeros((t, h), dtype=torch.float32, device=dev)
            w = torch.zeros((t, top_k), dtype=torch.float32, device=dev)
            out = torch.empty((t, top_k, h), dtype=torch.float32, device=dev)
            self.forward(ptrs, x, ids, w, out)
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------------------ triton


class TritonHits:
    """Our Triton kernels (``hits_kernels``; see the module docstring).

    Parameters
    ----------
    geometry : the layer.
    device : a CUDA device, or "cpu" under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
    max_tokens, top_k : scratch capacity ``max_tokens * top_k`` picks allocated now (0: on the first call).
    block_n, block_k : the weight block a program decodes per step (``block_k`` divides 128).
    num_warps : per program (None: 4 where every projection takes the group decode, else 8: the per-element
        decode spills registers to local memory at 4 warps, checked by ptxas for sm_90 and sm_86 in the tests).
    split_k : K splits per projection (None: enough programs for ``programs_per_sm`` per multiprocessor).
        The defaults (4 warps, 16 programs per multiprocessor) were the fastest of a sweep on the H200 (run 8,
        ``results/h200-run8-bench-hits-warps.log``; V4.1 Flash experts, CUDA graph replays, L2 flushed): VRAM
        712 / 908 GB/s at 1 / 4 tokens (8 warps, 4 programs: 533 / 665), the 4-byte-aligned mapped home 41.8 /
        42.3 GB/s (39.7 / 40.1), i.e. 0.77 / 0.76 of the copy engine's 54.6 / 55.4 GB/s.
    prefetch : blocks ahead whose trellis lines each program requests into L2 (CUDA only; 0: none).
    decode : how a weight block is decoded. "groups": per group of 8 consecutive trellis elements from three words
        (one funnel-shifted 64-bit window, constant shifts per element), and experts with one pick in the step
        computed with fp32 FMAs in the trellis order (no dot padded to 16 rows); MUL1 projections of an integer
        K <= 4 only. "elements": two words per element, every expert through ``tl.dot``. "auto": "groups" where
        it applies.
    """

    name = "triton"
    graph_safe = True
    alignment = 4  # trellis words read as uint32, sign vectors as fp16

    def __init__(self, geometry: HitGeometry, device: torch.device | str, *, max_tokens: int = 0, top_k: int = 0,
                 block_n: int = 128, block_k: int = 32, num_warps: int | None = None, split_k: int | None = None,
                 programs_per_sm: int = 16, prefetch: int = 8,
                 decode: Literal["auto", "groups", "elements"] = "auto") -> None:  # fmt: skip
        self.geometry = geometry
        if decode not in ("auto", "groups", "elements"):
            raise ValueError(f"TritonHits: decode must be 'auto', 'groups' or 'elements', got {decode!r}")
        from dma_prefill.triton_ops import group_decode_fits

        fits = [group_decode_fits(b, c) for b, c in zip(geometry.bits, geometry.codebooks, strict=True)]
        if decode == "groups" and not all(fits):
            raise ValueError(f"TritonHits (layer {geometry.layer}): decode 'groups' needs MUL1 projections of an "
                             f"integer K <= 4, got bits {geometry.bits}, codebooks {geometry.codebooks}")  # fmt: skip
        self.groups = tuple(f and decode != "elements" for f in fits)
        self.device = torch.device(device)
        h, i = geometry.hidden, geometry.intermediate
        if block_k not in (16, 32, 64, 128):
            raise ValueError(f"TritonHits: block_k must be 16, 32, 64 or 128 (a divisor of 128), got {block_k}")
        if block_n < 16 or block_n & (block_n - 1) or h % block_n or i % block_n:
            raise ValueError(f"TritonHits: block_n must be a power of two >= 16 dividing {h} and {i}, got {block_n}")
        if split_k is not None and split_k < 1:
            raise ValueError(f"TritonHits: split_k must be >= 1, got {split_k}")
        if num_warps is None:
            num_warps = 4 if all(self.groups) else 8
        if num_warps < 1 or num_warps & (num_warps - 1):
            raise ValueError(f"TritonHits: num_warps must be a power of two, got {num_warps}")
        self.block_n, self.block_k, self.num_warps = block_n, block_k, num_warps
        if prefetch < 0:
            raise ValueError(f"TritonHits: prefetch must be >= 0, got {prefetch}")
        self.split_k = split_k
        self.prefetch = prefetch if self.device.type == "cuda" else 0  # the interpreter has no inline PTX
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        self._target = max(1, programs_per_sm * sms)
        self._cap = 0
        self.scratch_version = 0  # +1 at each (re)allocation of the scratch (reserve)
        # 128-byte lines one run of block_n/16 tiles can touch (the larger bits of gate/up and down), plus one
        words = max(4 * int(round(2 * b)) for b in geometry.bits) * (block_n // 16)
        self._pf_lines = _next_pow2(-(-words // 32) + 1)
        if max_tokens and top_k:
            self.reserve(max_tokens * top_k)

    def splits(self, s: int, proj: Literal["gate_up", "down"]) -> tuple[int, int]:
        """``(splits, k blocks per split)`` for ``s`` picks: enough programs (counting one expert per pick) for the
        target, each split at least one ``block_k`` block."""
        g = self.geometry
        kdim, n, nproj = (g.hidden, g.intermediate, 2) if proj == "gate_up" else (g.intermediate, g.hidden, 1)
        nkb = kdim // self.block_k
        want = self.split_k or max(1, self._target // max(1, s * nproj * (n // self.block_n)))
        per = -(-nkb // min(want, nkb))
        return -(-nkb // per), per

    def reserve(self, s: int) -> None:
        """Scratch for calls of up to ``s`` picks, allocated now if larger than held (``scratch_version`` then
        changes: what captured the old scratch must be captured again)."""
        if s <= self._cap:
            return
        g = self.geometry
        h, i = g.hidden, g.intermediate
        # the partial sums of every pick count up to s (splits vary with the count)
        p_gu = max(self.splits(j, "gate_up")[0] * j for j in range(1, s + 1)) * 2 * i
        p_d = max(self.splits(j, "down")[0] * j for j in range(1, s + 1)) * h
        if _capturing(self.device):
            raise RuntimeError(f"TritonHits (layer {g.layer}): {s} picks exceed the scratch capacity {self._cap} "
                               "inside a CUDA graph capture; construct with max_tokens and top_k, or call forward "
                               "eagerly at the largest size first")  # fmt: skip
        dev, f16, f32, i32 = self.device, torch.float16, torch.float32, torch.int32
        self.rows = torch.zeros((s * s,), dtype=i32, device=dev)
        self.count = torch.zeros((s,), dtype=i32, device=dev)
        self.a_gu_hi = torch.empty((2 * s * h,), dtype=f16, device=dev)
        self.a_gu_lo = torch.empty((2 * s * h,), dtype=f16, device=dev)
        self.a_gu_inv = torch.empty((2 * s * h // 128,), dtype=f32, device=dev)
        self.a_d_hi = torch.empty((s * i,), dtype=f16, device=dev)
        self.a_d_lo = torch.empty((s * i,), dtype=f16, device=dev)
        self.a_d_inv = torch.empty((s * i // 128,), dtype=f32, device=dev)
        self.a_gu32 = torch.empty((2 * s * h,), dtype=f32, device=dev)
        self.a_d32 = torch.empty((s * i,), dtype=f32, device=dev)
        self.p_gu = torch.empty((p_gu,), dtype=f32, device=dev)
        self.p_d = torch.empty((p_d,), dtype=f32, device=dev)
        self._cap = s
        self.scratch_version += 1

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch held now."""
        if not self._cap:
            return 0
        bufs = (self.rows, self.count, self.a_gu_hi, self.a_gu_lo, self.a_gu_inv, self.a_d_hi, self.a_d_lo,
                self.a_d_inv, self.a_gu32, self.a_d32, self.p_gu, self.p_d)  # fmt: skip
        return sum(b.numel() * b.element_size() for b in bufs)

    def forward(
        self, ptrs: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        from . import hits_kernels as hk

        g = self.geometry
        t, k = _check_forward(g, "TritonHits", ptrs, x, ids, weights, out)
        if ptrs.device != self.device:
            raise ValueError(f"TritonHits (layer {g.layer}): tensors on {ptrs.device}, kernel built for {self.device}")
        s = t * k
        if s == 0:
            return
        self.reserve(s)
        e, h, i = g.num_experts, g.hidden, g.intermediate
        asm = self.device.type == "cuda"
        bn, bk, nw = self.block_n, self.block_k, self.num_warps
        bm = 16 if t <= 16 else 32  # rows of one dot; an expert with more picks loops (re-decoding its blocks)
        pf = dict(PREFETCH=self.prefetch, PF_LINES=self._pf_lines) if self.prefetch else {}
        ids1 = ids.view(-1)
        hk.prep_kernel[(s, h // 128)](
            x, x.stride(0), ids1, s, k, ptrs, e, self.rows, self.count, self.a_gu_hi, self.a_gu_lo, self.a_gu_inv,
            self.a_gu32, H=h, S_BLOCK=max(16, _next_pow2(s)), num_warps=1,
        )  # fmt: skip
        ks_gu, per_gu = self.splits(s, "gate_up")
        groups = [(0, 2)] if (g.bits[0], g.codebooks[0]) == (g.bits[1], g.codebooks[1]) else [(0, 1), (1, 1)]
        for first, nproj in groups:
            mult, add = _codebook_ints(g.codebooks[first])
            for picks in _picks_launches(self.groups[first]):
                hk.gemv_kernel[(s, nproj * (i // bn), ks_gu)](
                    ids1, self.rows, self.count, s, ptrs, e, 3 * first, self.a_gu_hi[first * s * h :],
                    self.a_gu_lo[first * s * h :], self.a_gu_inv[first * s * h // 128 :], self.a_gu32[first * s * h :],
                    self.p_gu[first * ks_gu * s * i :], ks_gu, per_gu, mult, add,
                    KDIM=h, N=i, NPROJ=nproj, K2=int(round(2 * g.bits[first])), MUL1=g.codebooks[first] == "mul1",
                    BM=bm, BN=bn, BK=bk, ASM=asm, GROUPS=self.groups[first], PICKS=picks, num_warps=nw, **pf,
                )  # fmt: skip
        lim = g.swiglu_limit
        hk.mid_kernel[(s, i // 128)](
            ids1, s, ptrs, e, self.p_gu, ks_gu, self.a_d_hi, self.a_d_lo, self.a_d_inv, self.a_d32,
            float(lim) if lim is not None else 0.0, I=i, HAS_LIMIT=lim is not None, LIBDEVICE=asm, num_warps=1,
        )  # fmt: skip
        ks_d, per_d = self.splits(s, "down")
        mult, add = _codebook_ints(g.codebooks[2])
        for picks in _picks_launches(self.groups[2]):
            hk.gemv_kernel[(s, h // bn, ks_d)](
                ids1, self.rows, self.count, s, ptrs, e, 6, self.a_d_hi, self.a_d_lo, self.a_d_inv, self.a_d32,
                self.p_d, ks_d, per_d, mult, add, KDIM=i, N=h, NPROJ=1, K2=int(round(2 * g.bits[2])),
                MUL1=g.codebooks[2] == "mul1", BM=bm, BN=bn, BK=bk, ASM=asm, GROUPS=self.groups[2], PICKS=picks,
                num_warps=nw, **pf,
            )  # fmt: skip
        hk.out_kernel[(s, h // 128)](ids1, weights.view(-1), s, ptrs, e, self.p_d, ks_d, out, H=h, num_warps=1)


def _picks_launches(groups: bool) -> tuple[int, ...]:
    """``gemv_kernel``'s ``PICKS`` per launch: with the group decode, the one-pick experts (fp32 FMAs, few
    registers) and the others (the dot) in two launches; else one launch for all."""
    return (1, 2) if groups else (0,)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _codebook_ints(codebook: Codebook) -> tuple[int, int]:
    """The codebook's multiplier and addend as signed int32 (the kernel's product wraps like the uint32 one)."""
    mult, add = CODEBOOK_MULT[codebook]
    return (mult - (1 << 32) if mult >= 1 << 31 else mult), (add - (1 << 32) if add >= 1 << 31 else add)


# ------------------------------------------------------------------------------------------------- factory

Backend = Literal["auto", "exllamav3", "triton", "reference"]


def in_place_backend(backend: str, home_alignment: int) -> Backend | None:
    """The hit kernel "auto" should switch to once the host home's alignment is known, or None to keep ``backend``.

    Misses are computed straight from the pinned home only if the kernel can load its addresses: exllamav3's loads
    16 bytes, ours 4. A checkpoint's safetensors place tensors on 8-byte (Flash packs: 4-byte) boundaries, so with
    exllamav3 every miss would first be copied into transient VRAM slots. Measured served (H200 run 7, 3 real-size
    Flash layers, every miss over PCIe, same machine and pack): exllamav3 with the misses staged 77 / 108 / 91 tok/s
    at 1 / 2 / 4 streams, ours reading them in place 113 / 144 / 162 tok/s; with the CPU tier taking a share
    ("auto" split) 77 / 112 / 99 vs 129 / 147 / 126. So on a home exllamav3 cannot read in place, "auto" is ours.
    """
    if backend != Exl3MgemmHits.name:
        return None
    if home_alignment % Exl3MgemmHits.alignment == 0 or home_alignment % TritonHits.alignment:
        return None
    return "triton"


def make_hits(
    experts: LayerExperts,
    device: torch.device | str,
    backend: Backend = "auto",
    *,
    swiglu_limit: float | None = None,
    max_tokens: int = 0,
    top_k: int = 0,
    **options: Any,
) -> HitKernel:
    """The hit kernel for one layer on ``device``.

    ``backend`` "auto": the reference on the CPU; on CUDA exllamav3's multi-GEMM where its extension imports,
    else ours (the tiered runtime then switches to ours once it sees a host home exllamav3 cannot read in place:
    ``in_place_backend``). ``options`` go to ``TritonHits`` (block sizes, splits). ``max_tokens * top_k`` picks
    of scratch are allocated now (GPU backends).
    """
    geometry = HitGeometry.from_layer(experts, swiglu_limit)
    dev = torch.device(device)
    if backend == "auto":
        if dev.type != "cuda":
            backend = "reference"
        else:
            from .dense import exllamav3_available

            backend = "exllamav3" if exllamav3_available() else "triton"
    if options and backend != "triton":
        raise ValueError(f"make_hits: options {sorted(options)} apply to the 'triton' backend only")
    if backend == "reference":
        return ReferenceHits(geometry)
    if backend == "exllamav3":
        return Exl3MgemmHits(geometry, dev, max_tokens=max_tokens, top_k=top_k)
    if backend == "triton":
        return TritonHits(geometry, dev, max_tokens=max_tokens, top_k=top_k, **options)
    raise ValueError(f"make_hits: unknown backend {backend!r} (auto, exllamav3, triton, reference)")


# ---------------------------------------------------------------------------------- pointer tables, pools


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def layer_pointers(experts: LayerExperts) -> torch.Tensor:
    """The host addresses of a layer's tensors as a pointer table (CPU int64 ``[9, E]``), e.g. the home's views.

    Each tensor must be C-contiguous (the kernels read it as one block)."""
    n = experts.num_experts
    table = np.zeros((len(EXPERT_COLUMNS), n), dtype=np.int64)
    for c, (role, part) in enumerate(EXPERT_COLUMNS):
        for e, t in enumerate(getattr(experts, role)):
            a = getattr(t, part)
            if not a.flags.c_contiguous:
                raise ValueError(f"layer {experts.layer} expert {e} {role}.{part}: not contiguous in memory")
            table[c, e] = _address(a)
    return torch.from_numpy(table)


class ExpertPool:
    """A layer's experts copied into one buffer, and the pointer table into it (tests, benchmarks).

    ``memory``: "device" (a VRAM pool, like the cache's slots), "mapped" (page-locked host memory read by the GPU
    over PCIe, like the registered home: zero copy) or "host" (plain host memory; CPU only). Each tensor starts
    ``offset`` bytes past an ``alignment`` boundary (``offset`` 4: a home as misaligned as a Flash pack's, whose
    safetensors place the experts' tensors on 4-byte boundaries). ``ptrs`` is on ``device``. ``close()`` (or
    ``with``) frees it.
    """

    def __init__(self, experts: LayerExperts, device: torch.device | str, memory: Literal["device", "mapped", "host"],
                 *, alignment: int = 256, offset: int = 0) -> None:  # fmt: skip
        self.device = torch.device(device)
        if memory not in ("device", "mapped", "host"):
            raise ValueError(f"ExpertPool: memory must be 'device', 'mapped' or 'host', got {memory!r}")
        if not 0 <= offset < alignment:
            raise ValueError(f"ExpertPool: offset must be in [0, alignment = {alignment}), got {offset}")
        if (memory == "host") != (self.device.type == "cpu"):
            raise ValueError(f"ExpertPool: memory {memory!r} does not go with device {self.device} "
                             "('host' on the CPU, 'device' or 'mapped' on CUDA)")  # fmt: skip
        self.memory = memory
        n = experts.num_experts
        arrays = [[getattr(getattr(experts, role)[e], part) for role, part in EXPERT_COLUMNS] for e in range(n)]
        offsets = np.zeros((len(EXPERT_COLUMNS), n), dtype=np.int64)
        pos = 0
        for e in range(n):
            for c, a in enumerate(arrays[e]):
                offsets[c, e] = pos
                pos += -(-a.nbytes // alignment) * alignment
        self.nbytes = pos
        raw = np.empty(pos + 2 * alignment, dtype=np.uint8)
        lead = (-_address(raw)) % alignment + offset
        host = raw[lead : lead + pos]
        for e in range(n):
            for c, a in enumerate(arrays[e]):
                o = int(offsets[c, e])
                host[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        self._registered = 0
        if memory == "device":
            self.buffer: Any = torch.from_numpy(host).to(self.device)
            base = self.buffer.data_ptr()
            del raw, host
        else:
            self.buffer = raw
            base = _address(host)
            if memory == "mapped":
                from dma_prefill import _cudart

                _cudart.host_register(base, pos, _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED)
                self._registered = base
                base, _ = _cudart.device_pointer(base)
        self.ptrs = torch.from_numpy(offsets + base).to(self.device)

    def close(self) -> None:
        if self._registered:
            from dma_prefill import _cudart

            _cudart.host_unregister(self._registered)
            self._registered = 0
        self.buffer = None

    def __enter__(self) -> ExpertPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
