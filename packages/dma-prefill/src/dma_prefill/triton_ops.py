"""Launchers of the Triton kernels (:mod:`dma_prefill.triton_kernels`): argument checks, grids, dummy pointers.

Importing this module does not import Triton; the first launch does (Triton is present wherever torch has CUDA,
and on the CPU its interpreter runs the kernels: ``TRITON_INTERPRET=1``, CPU tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from cpu_tier.exl3 import CODEBOOK_MULT, Codebook

__all__ = [
    "decode_into",
    "decode_triton",
    "group_decode_fits",
    "grouped_gemm",
    "post_swiglu",
    "row_hadamard",
    "row_sumsq",
]


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
    codebook: Codebook,
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
    groups = group_decode_fits(bits, codebook) and (n // 16) % block_tn == 0
    tk.decode_kernel[grid](
        src32, expert_stride, offset, counts, out, k * n, n // 16, mult, add,
        K2=int(round(2 * bits)), MUL1=codebook == "mul1", BLOCK_TN=block_tn, ASM=out.is_cuda, GROUPS=groups,
        num_warps=4,
    )  # fmt: skip


def group_decode_fits(bits: float, codebook: str) -> bool:
    """Whether the kernels' group decode applies (``triton_kernels._decode_groups``): MUL1 at an integer K <= 4,
    whose 8 consecutive windows span at most 44 bits (three words)."""
    return codebook == "mul1" and float(bits).is_integer() and 1 <= bits <= 4


def decode_triton(trellis: torch.Tensor, codebook: Codebook) -> torch.Tensor:
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
