"""Computing the routed experts of one staged batch: a Triton backend (GPU) and a pure-torch backend.

Both read the expert records straight out of the staging slot and add ``weight * expert(x)`` of every route of
the batch's experts into the fp32 layer output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from cpu_tier.exl3 import CODEBOOK_MULT

from .config import PROJECTIONS, PrefillConfig
from .device import Device
from .layout import ExpertLayout
from .ops_torch import decode_torch, expert_torch, hadamard_pm1
from .plan import PrefillPlan
from .ring import Staged, StagingRing
from .store import HostExpertStore

__all__ = [
    "BatchCompute",
    "LayerPrep",
    "TorchCompute",
    "TritonCompute",
    "decode_into",
    "decode_triton",
    "grouped_gemm",
    "post_swiglu",
    "row_hadamard",
    "row_sumsq",
]


@dataclasses.dataclass(eq=False)
class LayerPrep:
    """Per-layer device data derived from a plan once (counts, GEMM tiles)."""

    plan: PrefillPlan
    counts: torch.Tensor | None = None  # int64 [E] on the device
    tiles: torch.Tensor | None = None  # int32 [n, 3]
    tile_ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    bm: int = 64


class BatchCompute:
    """Base: ``prepare`` once per layer, ``run_batch`` once per staged batch; ``computed`` logs (layer, expert)."""

    def __init__(self, store: HostExpertStore, config: PrefillConfig, device: Device) -> None:
        self.store = store
        self.config = config
        self.device = device
        self.computed: list[tuple[int, int]] = []

    def prepare(self, plan: PrefillPlan, x: torch.Tensor) -> LayerPrep:
        return LayerPrep(plan)

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        raise NotImplementedError

    def _staged(self, ring: StagingRing, st: Staged, prep: LayerPrep) -> tuple[tuple[int, ...], ExpertLayout, torch.Tensor]:
        """The batch's routed experts, the layer's record layout and the staging slot holding them."""
        return tuple(int(e) for e in prep.plan.routed(st.batch)), self.store.layout(st.layer), ring.slot(st)


class TorchCompute(BatchCompute):
    """Per expert: decode from the slot (bit-exact), then the EXL3 forward in float32 with torch.

    ``config.exact=False`` rounds the Hadamard-basis activations to fp16 before each GEMM (the precision of a
    plain fp16 path), which the tests use as the inexact comparison point.
    """

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        plan = prep.plan
        routed, layout, slot = self._staged(ring, st, prep)
        cfg = self.config

        def fn() -> None:
            for e in routed:
                row = st.row(e)
                weights = {
                    p: (
                        decode_torch(layout.view(slot, row, p, "trellis"), layout.spec.proj(p).codebook),
                        layout.view(slot, row, p, "suh"),
                        layout.view(slot, row, p, "svh"),
                    )
                    for p in PROJECTIONS
                }
                r0, r1 = plan.rows(e)
                tok = plan.sorted_tokens[r0:r1]
                w = plan.sorted_weights[r0:r1]
                y = expert_torch(
                    x[tok], weights, limit=cfg.swiglu_limit, dtype=torch.float32, fp16_activations=not cfg.exact
                )
                out.index_add_(0, tok, y * w[:, None])
                self.computed.append((st.layer, e))

        self.device.launch(stream, fn, reads=st.tags(routed), label=f"L{st.layer}b{st.batch}")


# ------------------------------------------------------------------------------------------- Triton


def _triton() -> Any:
    from . import triton_kernels

    return triton_kernels


def decode_into(
    src32: torch.Tensor,
    expert_stride: int,
    offset: int,
    counts: torch.Tensor,
    out: torch.Tensor,
    k: int,
    n: int,
    bits: float,
    codebook: str,
    *,
    block_tn: int = 16,
) -> None:
    """Decode the trellis of ``counts.numel()`` consecutive records into ``out`` (fp16 ``[E, k, n]``).

    ``src32`` is the records viewed as int32; ``expert_stride`` and ``offset`` are in int32 units. Records
    whose count is 0 are skipped (their ``out`` rows are left as they were).
    """
    tk = _triton()
    ne = counts.numel()
    if out.dtype != torch.float16 or out.dim() != 3 or out.shape[0] < ne or tuple(out.shape[1:]) != (k, n):
        raise ValueError(f"decode out must be fp16 [>={ne}, {k}, {n}], got {out.dtype} {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("decode out must be contiguous")
    mult, add = (c - (1 << 32) if c >= 1 << 31 else c for c in CODEBOOK_MULT[codebook])  # as signed int32
    grid = (ne, k // 16, -(-(n // 16) // block_tn))
    tk.decode_kernel[grid](
        src32, expert_stride, offset, counts, out, k * n, n // 16, mult, add,
        K2=int(round(2 * bits)), MUL1=codebook == "mul1", BLOCK_TN=block_tn, ASM=out.is_cuda, num_warps=4,
    )  # fmt: skip


def decode_triton(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Standalone GPU decode of one trellis (int16 ``[k/16, n/16, 16*K]`` on CUDA) to fp16 ``(k, n)``."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"trellis must be int16 [k/16, n/16, 16*K], got {trellis.dtype} {tuple(trellis.shape)}")
    tk_, tn_, words = trellis.shape
    bits = words / 16
    k, n = 16 * tk_, 16 * tn_
    src = trellis.contiguous().view(-1).view(torch.int32)
    out = torch.empty((1, k, n), dtype=torch.float16, device=trellis.device)
    counts = torch.ones(1, dtype=torch.int64, device=trellis.device)
    decode_into(src, 0, 0, counts, out, k, n, bits, codebook)
    return out[0]


def row_sumsq(
    x: torch.Tensor,
    n: int,
    rows: int,
    grp: torch.Tensor,
    grp_base: int,
    out: torch.Tensor,
    *,
    src: torch.Tensor | None = None,
    vec: torch.Tensor | None = None,
    vec_stride: int = 0,
    pre_offs: tuple[int, ...] = (),
    block_r: int = 4,
) -> None:
    """``out[i, r] = sum_c (x[src[r], c] * pre_i[grp[r], c])^2`` for up to two pre-vectors (or plain ``x``)."""
    tk = _triton()
    if rows == 0:
        return
    if len(pre_offs) > 2:
        raise ValueError("row_sumsq: at most two pre-multiplier vectors")
    if x.stride(-1) != 1:
        raise ValueError("row_sumsq: rows must be contiguous")
    block_n = next(b for b in (512, 256, 128) if n % b == 0)
    offs = (*pre_offs, 0, 0)
    tk.row_sumsq_kernel[(-(-rows // block_r),)](
        x, x.stride(0), src if src is not None else grp, grp, grp_base,
        vec if vec is not None else x, vec_stride, offs[0], offs[1], out, rows, n,
        HAS_SRC=src is not None, HAS_PRE=len(pre_offs) > 0, TWO=len(pre_offs) == 2,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


def row_hadamard(
    x: torch.Tensor,
    n: int,
    rows: int,
    grp: torch.Tensor,
    grp_base: int,
    hpm: torch.Tensor,
    ss: torch.Tensor,
    *,
    mode: int,
    src: torch.Tensor | None = None,
    vec: torch.Tensor | None = None,
    vec_stride: int = 0,
    pre_off: int | None = None,
    post_off: int | None = None,
    split: bool = True,
    o_hi: torch.Tensor | None = None,
    o_lo: torch.Tensor | None = None,
    o_inv: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    dst: torch.Tensor | None = None,
    block_r: int = 64,
    cpb: int = 4,
    num_warps: int = 4,
    fwht: bool = False,
) -> None:
    """Launch ``row_hadamard_kernel`` (see its docstring) over ``rows x n/128`` blocks (``cpb`` column blocks
    per program); ``ss`` holds each row's sum of squares (``row_sumsq``); unused pointers get a dummy tensor."""
    tk = _triton()
    if rows == 0:
        return
    dummy32 = o_inv if o_inv is not None else out
    if dummy32 is None:
        raise ValueError("row_hadamard: needs o_inv (mode 0) or out (modes 1, 2)")
    if x.stride(-1) != 1 or (o_hi is not None and o_hi.stride(-1) != 1) or (out is not None and out.stride(-1) != 1):
        raise ValueError("row_hadamard: rows must be contiguous")
    if n % 128:
        raise ValueError(f"row_hadamard: n={n} is not a multiple of 128")
    stride_oa = o_hi.stride(0) if o_hi is not None else 0
    tk.row_hadamard_kernel[(-(-rows // block_r), -(-(n // 128) // cpb))](
        x, x.stride(0), src if src is not None else grp, grp, grp_base,
        vec if vec is not None else hpm, vec_stride, pre_off or 0, post_off or 0, ss, hpm,
        o_hi if o_hi is not None else hpm, o_lo if o_lo is not None else hpm, dummy32, stride_oa,
        out if out is not None else dummy32, out.stride(0) if out is not None else 0,
        w if w is not None else dummy32, dst if dst is not None else grp,
        rows, n,
        HAS_SRC=src is not None, HAS_PRE=pre_off is not None, HAS_POST=post_off is not None,
        MODE=mode, SPLIT=split, BLOCK_R=block_r, CPB=cpb, FWHT=fwht, num_warps=num_warps,
    )  # fmt: skip


def post_swiglu(
    tg: torch.Tensor,
    tu: torch.Tensor,
    ss: torch.Tensor,
    grp: torch.Tensor,
    grp_base: int,
    vec: torch.Tensor,
    vec_stride: int,
    svh_offs: tuple[int, int],
    hpm: torch.Tensor,
    act: torch.Tensor,
    limit: float | None,
    *,
    block_r: int = 64,
    cpb: int = 4,
    num_warps: int = 4,
    fwht: bool = False,
) -> None:
    """``act = silu(min(g, L)) * clamp(u, -L, L)`` with ``g, u = H128(tg, tu) * svh`` (``ss``: [2, R] sums of
    squares of ``tg`` and ``tu`` rows)."""
    tk = _triton()
    R, n = tg.shape
    if R == 0:
        return
    if tu.shape != tg.shape or act.shape != tg.shape or tu.stride() != tg.stride():
        raise ValueError("post_swiglu: tg, tu and act must have one shape and layout")
    tk.post_swiglu_kernel[(-(-R // block_r), -(-(n // 128) // cpb))](
        tg, tu, tg.stride(0), ss, grp, grp_base, vec, vec_stride, svh_offs[0], svh_offs[1], hpm, act, act.stride(0),
        float(limit) if limit is not None else 0.0, R, n,
        HAS_LIMIT=limit is not None, BLOCK_R=block_r, CPB=cpb, LIBDEVICE=act.is_cuda, FWHT=fwht, num_warps=num_warps,
    )  # fmt: skip


def grouped_gemm(
    a_hi: torch.Tensor,
    a_lo: torch.Tensor | None,
    a_inv: torch.Tensor,
    w: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    *,
    bm: int,
    bn: int = 128,
    bk: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    promote: bool = True,
    ss: torch.Tensor | None = None,
    lo_acc: bool = False,
) -> None:
    """``out[rows] = (a_hi + a_lo)[rows] @ w[e] * a_inv[rows]`` per tile ``(e, row0, row1)``; ``promote`` adds
    every BK-deep tensor-core partial sum into an fp32 register accumulator (round to nearest); ``ss`` (fp32
    ``[R]``, zeroed by the caller) receives the sum of squares of every output row."""
    tk = _triton()
    ntiles = tiles.shape[0]
    if ntiles == 0:
        return
    _, K, N = w.shape
    if K % bk:
        raise ValueError(f"grouped_gemm: K={K} is not a multiple of BK={bk}")
    if a_hi.shape[1] != K or out.shape[1] != N:
        raise ValueError(f"grouped_gemm: a {tuple(a_hi.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} disagree")
    tk.grouped_gemm_kernel[(ntiles, -(-N // bn))](
        a_hi, a_lo if a_lo is not None else a_hi, a_inv, a_hi.stride(0), w, w.stride(0), out, out.stride(0),
        tiles, ss if ss is not None else a_inv, K, N, HAS_SS=ss is not None, SPLIT=a_lo is not None,
        PROMOTE=promote, BM=bm, BN=bn, BK=bk, LO_ACC=lo_acc, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def make_tiles(plan: PrefillPlan, bm: int) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """GEMM row tiles ``(local expert, row0, row1)`` (rows local to the batch) for every GPU batch."""
    out: list[tuple[int, int, int]] = []
    ranges: dict[int, tuple[int, int]] = {}
    for b in plan.gpu_batches:
        start = len(out)
        e0, _ = plan.batch_range(b)
        br0, _ = plan.batch_rows(b)
        for e in plan.routed(b).tolist():
            r0, r1 = plan.rows(e)
            for s in range(r0, r1, bm):
                out.append((e - e0, s - br0, min(s + bm, r1) - br0))
        ranges[b] = (start, len(out))
    return np.array(out, dtype=np.int32).reshape(-1, 3), ranges


class TritonCompute(BatchCompute):
    """Per batch: decode the B experts' three projections into fp16 scratch, then for all rows of the batch
    at once: input transforms (split), grouped GEMM gate and up (their epilogues sum the squares of the output
    rows), output transforms + SwiGLU, input transform, grouped GEMM down, output transform with the routing
    weight, atomically added into the layer output. 13 kernels (and two small memsets) per batch, none per
    expert; with ``stage_events`` set, CUDA events between the stages time them (``stage_times``)."""

    #: GEMM tile configs by BM: (BN, BK, num_warps, num_stages)
    gemm_configs: dict[int, tuple[int, int, int, int]] = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
    promote: bool = True
    #: Hadamard transforms as fp32 butterflies (True: per-expert error equal to a plain fp32 evaluation, 1.03e-6
    #: vs 1.04e-6 BLAS / 1.20e-6 sequential; 32k chunk 101.5 ms) or split fp16 tensor-core products (False: 2.9e-6,
    #: the tensor cores do not round to nearest while they accumulate; same speed within noise), results/h200-0d83cad-*
    fwht: bool = True
    #: row transforms: (rows per program, 128-column blocks per program, num_warps) for the GEMM inputs, the
    #: gate/up outputs + SwiGLU, and the down output + weighted add
    #: (defaults from scripts/kernel_tune.py on the H200 at the 32k-chunk shape, R = 4096 rows per batch)
    transform_config: tuple[int, int, int] = (64, 2, 4)
    swiglu_config: tuple[int, int, int] = (16, 4, 4)
    out_config: tuple[int, int, int] = (64, 2, 4)
    decode_block_tn: int = 8

    def __init__(self, store: HostExpertStore, config: PrefillConfig, device: Device, torch_device: torch.device) -> None:
        super().__init__(store, config, device)
        self.torch_device = torch_device
        #: when a list, every batch appends ``(stage, cuda event)`` marks (``stage_times`` sums them); profiling only
        self.stage_events: list[tuple[str, Any]] | None = None
        self.hpm = hadamard_pm1(torch.float16, torch_device)
        spec = store.spec(store.layer_ids[0])
        B = config.experts_per_batch
        self.w = {p: torch.empty((B, spec.proj(p).k, spec.proj(p).n), dtype=torch.float16, device=torch_device) for p in PROJECTIONS}

    def prepare(self, plan: PrefillPlan, x: torch.Tensor) -> LayerPrep:
        busy = plan.counts[plan.counts > 0]
        bm = 64 if busy.size == 0 or busy.mean() <= 96 else 128
        tiles, ranges = make_tiles(plan, bm)
        return LayerPrep(
            plan,
            counts=torch.from_numpy(plan.counts).to(self.torch_device),
            tiles=torch.from_numpy(tiles).to(self.torch_device),
            tile_ranges=ranges,
            bm=bm,
        )

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        routed, layout, slot = self._staged(ring, st, prep)
        self.device.launch(
            stream,
            lambda: self._batch(layout, slot, st, prep, routed, x, out),
            reads=st.tags(routed),
            label=f"L{st.layer}b{st.batch}",
        )

    def _mark(self, stage: str) -> None:
        if self.stage_events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stage_events.append((stage, ev))

    def stage_times(self) -> dict[str, float]:
        """Milliseconds per stage summed over the batches marked since ``stage_events`` was set (synchronizes)."""
        if not self.stage_events:
            return {}
        torch.cuda.synchronize()
        out: dict[str, float] = {}
        prev = None
        for stage, ev in self.stage_events:
            if stage != "start" and prev is not None:
                out[stage] = out.get(stage, 0.0) + prev.elapsed_time(ev)
            prev = ev
        return out

    def _batch(
        self,
        layout: ExpertLayout,
        slot: torch.Tensor,
        st: Staged,
        prep: LayerPrep,
        routed: tuple[int, ...],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        plan = prep.plan
        spec = layout.spec
        cfg = self.config
        assert prep.counts is not None and prep.tiles is not None
        ne = st.e1 - st.e0
        counts = prep.counts[st.e0 : st.e1]
        slot32 = slot.view(torch.int32)
        slot16 = slot.view(torch.float16)
        s4, s2 = layout.stride // 4, layout.stride // 2
        self._mark("start")
        for p in PROJECTIONS:
            ps = spec.proj(p)
            decode_into(
                slot32, s4, layout.elem_offset(p, "trellis", 4), counts, self.w[p], ps.k, ps.n, ps.bits, ps.codebook,
                block_tn=self.decode_block_tn,
            )  # fmt: skip
        self._mark("decode")
        r0, r1 = plan.batch_rows(st.batch)
        R = r1 - r0
        tok = plan.sorted_tokens[r0:r1]
        grp = plan.sorted_experts[r0:r1]
        wts = plan.sorted_weights[r0:r1]
        t0, t1 = prep.tile_ranges[st.batch]
        tiles = prep.tiles[t0:t1]
        H, I = spec.hidden, spec.intermediate
        dev = self.torch_device
        split = cfg.exact

        def kcfg(c: tuple[int, int, int]) -> dict[str, int]:
            return {"block_r": c[0], "cpb": c[1], "num_warps": c[2]}

        tcfg = {**kcfg(self.transform_config), "fwht": self.fwht}

        def gemm(
            hi: torch.Tensor, lo: torch.Tensor | None, inv: torch.Tensor, p: str, n: int, ss: torch.Tensor
        ) -> torch.Tensor:
            t = torch.empty((R, n), dtype=torch.float32, device=dev)
            bn, bk, nw, ns = self.gemm_configs[prep.bm]
            grouped_gemm(
                hi, lo, inv, self.w[p][:ne], tiles, t, bm=prep.bm, bn=bn, bk=bk, num_warps=nw, num_stages=ns,
                promote=self.promote, ss=ss,
            )  # fmt: skip
            return t

        def transform_in(inp: torch.Tensor, n: int, p: str, src: torch.Tensor | None, ss: torch.Tensor):
            hi = torch.empty((R, n), dtype=torch.float16, device=dev)
            lo = torch.empty((R, n), dtype=torch.float16, device=dev) if split else None
            inv = torch.empty(R, dtype=torch.float32, device=dev)
            row_hadamard(
                inp, n, R, grp, st.e0, self.hpm, ss, mode=0, src=src, vec=slot16, vec_stride=s2,
                pre_off=layout.elem_offset(p, "suh", 2), split=split, o_hi=hi, o_lo=lo, o_inv=inv, **tcfg,
            )  # fmt: skip
            return hi, lo, inv

        def sumsq(inp: torch.Tensor, n: int, pres: tuple[str, ...], src: torch.Tensor | None) -> torch.Tensor:
            ss = torch.empty((max(1, len(pres)), R), dtype=torch.float32, device=dev)
            offs = tuple(layout.elem_offset(p, "suh", 2) for p in pres)
            row_sumsq(inp, n, R, grp, st.e0, ss, src=src, vec=slot16, vec_stride=s2, pre_offs=offs)
            return ss

        ss_in = sumsq(x, H, ("gate", "up"), tok)
        self._mark("row norms")
        ss_gu = torch.zeros((2, R), dtype=torch.float32, device=dev)  # filled by the GEMM epilogues
        tgu = []
        for i, p in enumerate(("gate", "up")):
            a = transform_in(x, H, p, tok, ss_in[i])
            self._mark("transform in")
            tgu.append(gemm(*a, p, I, ss_gu[i]))
            del a
            self._mark("gemm gate/up")
        tg, tu = tgu
        act = torch.empty((R, I), dtype=torch.float32, device=dev)
        svh = (layout.elem_offset("gate", "svh", 2), layout.elem_offset("up", "svh", 2))
        post_swiglu(
            tg, tu, ss_gu, grp, st.e0, slot16, s2, svh, self.hpm, act, cfg.swiglu_limit, **kcfg(self.swiglu_config),
            fwht=self.fwht,
        )  # fmt: skip
        del tg, tu, tgu
        self._mark("post + swiglu")
        ss_act = sumsq(act, I, ("down",), None)[0]
        self._mark("row norms")
        a = transform_in(act, I, "down", None, ss_act)
        self._mark("transform in")
        ss_t = torch.zeros(R, dtype=torch.float32, device=dev)
        t = gemm(*a, "down", H, ss_t)
        del a
        self._mark("gemm down")
        row_hadamard(
            t, H, R, grp, st.e0, self.hpm, ss_t, mode=2, vec=slot16, vec_stride=s2,
            post_off=layout.elem_offset("down", "svh", 2), out=out, w=wts, dst=tok, **kcfg(self.out_config),
            fwht=self.fwht,
        )  # fmt: skip
        self._mark("post + weighted add")
        self.computed.extend((st.layer, e) for e in routed)
