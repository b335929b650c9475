"""Triton kernels of ``hits.TritonHits``: a decode step's picks of one MoE layer, read through a pointer table.

Importing this module needs Triton (present wherever torch has CUDA; on the CPU its interpreter runs these kernels
under ``TRITON_INTERPRET=1``). The EXL3 bit-stream helpers and constants (funnel shift, byte sum, the fp32
Hadamard butterflies, the power-of-two row scale) are dma-prefill's (``dma_prefill.triton_kernels``); the format
itself is ``cpu_tier.exl3``'s.

One layer is five launches (seven with the group decode) over the ``S = T*K`` picks (``p = t*K + k``), every grid
fixed by ``T`` and ``K`` alone (graph-safe; the routing is read on the device only):

1. ``prep_kernel`` (picks x 128-column blocks of H): the plan (for each pick, whether it is the first pick of its
   expert, how many picks share that expert and their list) and the gate/up input transforms
   ``H128(x[t] * suh)`` of every pick, split into fp16 ``hi + lo`` with a power-of-two scale per 128 block;
2. ``gemv_kernel`` (picks x N blocks x K splits) for gate and up: the program of an expert's first pick decodes
   each trellis block once (in registers, never to memory) and multiplies it with the rows of all that expert's
   picks (``tl.dot`` of the exact fp16 weights with ``hi`` and ``lo``: ~22-bit activations, fp32 sums); other
   picks' programs return at once. Partial sums per split go to scratch (a fixed-order sum later: deterministic).
   With ``GROUPS`` (MUL1, integer K <= 4) a block is decoded per group of 8 consecutive trellis elements (three
   words, one 64-bit window, constant shifts: ~5 integer instructions per weight instead of ~15 with two loads
   per weight) and put in place by a fixed permutation; an expert with one pick skips the dot (16 rows padded
   for 1) for fp32 FMAs in the trellis order with the rows summed after the k loop. That path and the dot path
   are two launches (``PICKS`` 1 and 2), so the one-pick launch holds 48 registers per thread instead of the
   dot's 128 (255 in the per-element kernel): 5x the resident warps to hide the trellis reads' latency;
3. ``mid_kernel`` (picks x 128-column blocks of I): sum of the splits, output transforms and ``* svh``, DeepSeek's
   clamped SwiGLU, then the down projection's input transform (split like 1.);
4. ``gemv_kernel`` for down;
5. ``out_kernel`` (picks x 128-column blocks of H): ``out[p] = w[p] * H128(sum of splits) * svh``, and exact
   zeros for skipped picks (``ids == -1``), whose pointers are never loaded.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from cpu_tier.exl3 import MUL1_BIAS, MUL1_SCALE
from dma_prefill.triton_kernels import (
    _LOP3_AND_I32,
    _LOP3_XOR,
    _bytesum,
    _decode_groups,
    _f16x2,
    _fwht128,
    _group_offsets,
    _mul1_value,
    _row_scale,
    _trellis_rows,
    _trellis_to_block,
    _window16,
    tile_element,
    window_words,
)

__all__ = ["gemv_kernel", "mid_kernel", "out_kernel", "prep_kernel"]

_R128 = tl.constexpr(0.08838834764831845)  # 1/sqrt(128)


@triton.jit
def _block_offsets(BK: tl.constexpr, BN: tl.constexpr, TN: tl.constexpr, K2: tl.constexpr):
    """For each element (kk, nn) of a [BK, BN] weight block whose first tile is the block's origin: the uint32
    word offsets of the two words holding its 16-bit state window, and the window's bit offset in the first.

    Element (r, c) of a 16x16 tile is trellis element ``t = 8q + j`` (the inverse tensor-core permutation);
    its window ends ``S(t)`` bits into the tile's tail-biting stream of ``128 * K2`` bits (``cpu_tier.exl3``)."""
    kk = tl.arange(0, BK)[:, None]
    nn = tl.arange(0, BN)[None, :]
    NWORDS: tl.constexpr = 4 * K2
    i0, i1, sh = window_words(tile_element(kk % 16, nn % 16), K2)
    tile = ((kk // 16) * TN + nn // 16) * NWORDS
    return tile + i0, tile + i1, sh


# (1024 + bs) * MUL1_SCALE + MUL1_BIAS for two byte sums: the fp16 bits of 1024 + bs are 0x6400 | bs (bs <= 1020)
_MUL1_PAIR_ASM = tl.constexpr(
    "{ .reg .b32 t, m, c; prmt.b32 t, $1, $2, 0x5410; or.b32 t, t, 0x64006400; "
    f"mov.b32 m, {_f16x2(MUL1_SCALE)}; mov.b32 c, {_f16x2(MUL1_BIAS)}; fma.rn.f16x2 $0, t, m, c; }}"
)


@triton.jit
def _mul1_pair(bs):
    """MUL1 values of byte sums, two per instruction (``_MUL1_PAIR_ASM``): one ``fma.rn.f16x2`` rounds each
    exactly once, as exllamav3's hfma (``cpu_tier.exl3.MUL1_SCALE`` / ``MUL1_BIAS``)."""
    return tl.inline_asm_elementwise(_MUL1_PAIR_ASM, "=r,r,r", [bs], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _opaque(ptr, ASM: tl.constexpr):
    """``ptr`` through a register move the compiler cannot see into: offsets added to it afterwards stay 32-bit
    (one wide multiply-add per address) instead of being merged into 64-bit index math."""
    if ASM:
        ptr = tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [ptr.to(tl.int64)], dtype=tl.int64,
                                        is_pure=True, pack=1).to(ptr.dtype)  # fmt: skip
    return ptr


@triton.jit
def _decode(base, off0, off1, sh, MULT, ADD, MUL1: tl.constexpr, ASM: tl.constexpr):
    """fp16 ``W_inner`` values of a block (bit-exact): the 16-bit state window from the words at ``base + off0``
    and ``base + off1`` (the second matters only where ``sh > 16``), then the codebook (``cpu_tier.exl3``)."""
    a = tl.load(base + off0).to(tl.uint32, bitcast=True)
    b = tl.load(base + off1).to(tl.uint32, bitcast=True)
    state = _window16(a, b, sh, ASM)
    p = state.to(tl.int32, bitcast=True) * MULT + ADD  # wraps modulo 2^32
    if MUL1:
        bs = _bytesum(p.to(tl.uint32, bitcast=True), ASM)
        if ASM:
            v = _mul1_pair(bs)
        else:
            v = _mul1_value(bs)
    else:
        x = (p & _LOP3_AND_I32) ^ _LOP3_XOR  # LOP3
        lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((x >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v = (lo + hi).to(tl.float16)  # both halves in [0.125, 2): exact fp32 sum, one rounding
    return v


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (PTX ``prefetch.global.L2``: no fault, no register written)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _store_split(v, row, cb, A_HI, A_LO, A_INV, A32, KDIM: tl.constexpr):
    """``H128(v)`` of one row's 128-block ``cb`` ([1, 128] fp32), stored as fp16 ``hi + lo`` of ``h * s`` and
    ``1/s`` (``s`` a power of two with ``|h * s| < 2^14``), and as the fp32 ``(hi + lo) / s`` (the same value)."""
    h = _fwht128(v) * _R128
    scale, inv = _row_scale(tl.sum(h * h, axis=1))
    y = h * scale[:, None]
    hi = y.to(tl.float16)
    lo = (y - hi.to(tl.float32)).to(tl.float16)
    off = row * KDIM + cb * 128 + tl.arange(0, 128)[None, :]
    tl.store(A_HI + off, hi)
    tl.store(A_LO + off, lo)
    tl.store(A_INV + row * (KDIM // 128) + cb + tl.arange(0, 1), inv)
    tl.store(A32 + off, (hi.to(tl.float32) + lo.to(tl.float32)) * inv[:, None])


@triton.jit(do_not_specialize=["stride_x", "S", "TOPK", "E"])
def prep_kernel(
    X,  # [T, H] activations (fp32/bf16/fp16), rows contiguous
    stride_x,
    IDS,  # int32* [S]: expert of each pick, -1 = skipped
    S,
    TOPK,
    PTRS,  # int64* [9, E]: tensor addresses (home.EXPERT_COLUMNS)
    E,
    ROWS,  # int32* [S, S]: ROWS[f, r] = r-th pick of the expert whose first pick is f
    COUNT,  # int32* [S]: picks of the expert at each first pick, else 0
    A_HI,  # fp16* [2, S, H]: gate / up input transforms, hi part
    A_LO,  # fp16* [2, S, H]: lo part
    A_INV,  # fp32* [2, S, H/128]
    A32,  # fp32* [2, S, H]
    H: tl.constexpr,
    S_BLOCK: tl.constexpr,  # power of two >= S
):
    p = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.load(IDS + p)
    if cb == 0:
        idx = tl.arange(0, S_BLOCK)
        ids = tl.load(IDS + idx, mask=idx < S, other=-1)
        match = (ids == e) & (e >= 0)
        first = tl.min(tl.where(match, idx, S_BLOCK), axis=0)
        rank = tl.sum((match & (idx < p)).to(tl.int32), axis=0)
        count = tl.sum(match.to(tl.int32), axis=0)
        tl.store(COUNT + p, tl.where(first == p, count, 0))
        if e >= 0:
            tl.store(ROWS + first.to(tl.int64) * S + rank, p)
    if e >= 0:
        e64 = e.to(tl.int64)
        t = (p // TOPK).to(tl.int64)
        cols = cb * 128 + tl.arange(0, 128)
        x = tl.load(X + t * stride_x + cols[None, :]).to(tl.float32)
        for proj in tl.static_range(2):  # gate, up: their own suh
            suh = tl.load(PTRS + (3 * proj + 1) * E + e64).to(tl.pointer_type(tl.float16))
            v = x * tl.load(suh + cols[None, :]).to(tl.float32)
            row = proj * S + p.to(tl.int64)
            _store_split(v, row, cb, A_HI, A_LO, A_INV, A32, H)


@triton.jit(do_not_specialize=["S", "E", "KS", "KPER", "MULT", "ADD"])
def gemv_kernel(
    IDS,  # int32* [S]
    ROWS,  # int32* [S, S]
    COUNT,  # int32* [S]
    S,
    PTRS,  # int64* [9, E]
    E,
    COL0,  # the trellis column of this launch's first projection (0 gate, 3 up, 6 down)
    A_HI,  # fp16* [NPROJ, S, KDIM]
    A_LO,
    A_INV,  # fp32* [NPROJ, S, KDIM/128]
    A32,  # fp32* [NPROJ, S, KDIM]: (hi + lo) * inv, for the one-row path of GROUPS
    P,  # fp32* [NPROJ, KS, S, N]: partial sums per K split
    KS,
    KPER,  # BK blocks per split
    MULT,  # codebook multiplier as a signed int32
    ADD,  # codebook addend (3INST), signed int32
    KDIM: tl.constexpr,
    N: tl.constexpr,
    NPROJ: tl.constexpr,  # 2: gate and up in one launch (same bits and codebook), else 1
    K2: tl.constexpr,  # 2 * bits per weight
    MUL1: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ASM: tl.constexpr,  # PTX funnel shift + dp4a (GPU); plain integer ops (interpreter)
    GROUPS: tl.constexpr = False,  # decode per group of 8 elements from 3 words (MUL1, integer K <= 4)
    PICKS: tl.constexpr = 0,  # experts this launch computes: 0 all, 1 those with one pick, 2 those with more
    PREFETCH: tl.constexpr = 0,  # BK blocks ahead whose trellis lines are requested into L2 (0: none; GPU only)
    PF_LINES: tl.constexpr = 1,  # a power of two >= the 128-byte lines of one run of BN/16 tiles, plus one
):
    """``P[proj, ks, rows, n-block] = A[proj, rows, k-split] @ W_inner[e]`` for the rows of all picks of expert
    ``e``, in the program of its first pick; the other programs return without a load beyond ``COUNT``. With
    ``GROUPS``, an expert with one pick takes the fp32-FMA path; ``PICKS`` 1 / 2 compiles only that path / only
    the dot path (two launches, each with the registers of its own path: the dot path's would halve the one-row
    path's occupancy).

    A block's trellis is ``BK/16`` runs of ``BN/16`` consecutive tiles; with ``PREFETCH`` the program asks L2 for
    the runs ``PREFETCH`` blocks ahead (one request per 128-byte line), so that its decode waits on L2 rather
    than on memory (or on PCIe, for mapped host memory)."""
    pid = tl.program_id(0)
    NB: tl.constexpr = N // BN
    proj = tl.program_id(1) // NB
    n0 = (tl.program_id(1) % NB) * BN
    ks = tl.program_id(2)
    cnt = tl.load(COUNT + pid)
    if PICKS == 1:
        cnt = tl.where(cnt == 1, cnt, 0)
    elif PICKS == 2:
        cnt = tl.where(cnt >= 2, cnt, 0)
    if cnt > 0:
        e = tl.load(IDS + pid).to(tl.int64)
        TN: tl.constexpr = N // 16
        NWORDS: tl.constexpr = 4 * K2
        words = tl.load(PTRS + (COL0 + 3 * proj) * E + e).to(tl.pointer_type(tl.int32)) + (n0 // 16) * NWORDS
        if GROUPS:
            off0, off1, off2, sh = _group_offsets(BK, BN, TN, K2)
        else:
            off0, off1, sh = _block_offsets(BK, BN, TN, K2)
            off2 = off1
        sh = sh.to(tl.uint32)
        STEP: tl.constexpr = (BK // 16) * TN * NWORDS  # words between consecutive k blocks
        NKB: tl.constexpr = KDIM // BK
        kb0 = ks * KPER
        kb1 = tl.minimum(kb0 + KPER, NKB)
        r = tl.arange(0, BM)
        kc = tl.arange(0, BK)
        nc = n0 + tl.arange(0, BN)
        if PREFETCH > 0:
            RUN: tl.constexpr = (BN // 16) * NWORDS  # words of one run of tiles
            # one word in each 128-byte line a run can touch (and its last word)
            line = tl.minimum(tl.arange(0, PF_LINES) * 32, RUN - 1)
            pf = (tl.arange(0, BK // 16) * (TN * NWORDS))[:, None] + line[None, :]
            for kb in range(kb0, tl.minimum(kb0 + PREFETCH, kb1)):
                _prefetch_l2(words + kb * STEP + pf)
        if GROUPS and PICKS != 2 and cnt == 1:
            # one row (most decode experts): fp32 FMAs in the trellis order, no dot padded to BM rows; the rows
            # are summed once after the k loop
            arow1 = proj * S + tl.load(ROWS + pid.to(tl.int64) * S).to(tl.int64)
            a7 = A32 + arow1 * KDIM + _trellis_rows(BK)
            acc7 = tl.zeros([BN // 16, BK // 16, 8, 4, 2, 2, 2], dtype=tl.float32)
            for kb in range(kb0, kb1):
                if PREFETCH > 0:
                    if kb + PREFETCH < kb1:
                        _prefetch_l2(words + (kb + PREFETCH) * STEP + pf)
                w7 = _decode_groups(_opaque(words + kb * STEP, ASM), off0, off1, off2, sh, MULT, BK, BN, K2, ASM)
                acc7 += w7.to(tl.float32) * tl.load(a7 + kb * BK)
            acc3 = tl.sum(tl.sum(tl.sum(tl.sum(acc7, axis=5), axis=4), axis=3), axis=1)  # nt, q_hi, j2
            y = tl.reshape(tl.permute(acc3, (0, 2, 1)), (BN,))
            tl.store(P + ((proj * KS + ks) * S + tl.load(ROWS + pid.to(tl.int64) * S)) * N + nc, y)
            cnt = 0
        for m0 in range(0, cnt if PICKS != 1 else 0, BM):
            rmask = m0 + r < cnt
            rows = tl.load(ROWS + pid.to(tl.int64) * S + m0 + r, mask=rmask, other=0).to(tl.int64)
            arow = proj * S + rows
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for kb in range(kb0, kb1):
                k0 = kb * BK
                if PREFETCH > 0:
                    if kb + PREFETCH < kb1:
                        _prefetch_l2(words + (kb + PREFETCH) * STEP + pf)
                if GROUPS:
                    w = _decode_groups(_opaque(words + kb * STEP, ASM), off0, off1, off2, sh, MULT, BK, BN, K2, ASM)
                    w = _trellis_to_block(w, BK, BN)
                else:
                    w = _decode(_opaque(words + kb * STEP, ASM), off0, off1, sh, MULT, ADD, MUL1, ASM)
                a_off = arow[:, None] * KDIM + k0 + kc[None, :]
                a_hi = tl.load(A_HI + a_off, mask=rmask[:, None], other=0.0)
                a_lo = tl.load(A_LO + a_off, mask=rmask[:, None], other=0.0)
                inv = tl.load(A_INV + arow * (KDIM // 128) + k0 // 128, mask=rmask, other=0.0)
                part = tl.dot(a_hi, w, out_dtype=tl.float32)
                part = tl.dot(a_lo, w, part, out_dtype=tl.float32)
                acc += part * inv[:, None]
            prow = ((proj * KS + ks) * S + rows) * N
            tl.store(P + prow[:, None] + nc[None, :], acc, mask=rmask[:, None])


@triton.jit(do_not_specialize=["S", "E", "KS", "limit"])
def mid_kernel(
    IDS,  # int32* [S]
    S,
    PTRS,  # int64* [9, E]
    E,
    P,  # fp32* [2, KS, S, I]: gate / up partial sums
    KS,
    A_HI,  # fp16* [S, I]: the down projection's input transform, hi part
    A_LO,
    A_INV,  # fp32* [S, I/128]
    A32,  # fp32* [S, I]
    limit,
    I: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # accurate exp (GPU); the interpreter has no libdevice
):
    """``a = silu(min(g, L)) * clamp(u, -L, L)`` with ``g, u = H128(sum of splits) * svh``, then
    ``H128(a * suh_down)`` split for the down projection."""
    p = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.load(IDS + p)
    if e >= 0:
        e64 = e.to(tl.int64)
        cols = cb * 128 + tl.arange(0, 128)[None, :]
        tg = tl.zeros([1, 128], dtype=tl.float32)
        tu = tl.zeros([1, 128], dtype=tl.float32)
        for ks in range(0, KS):  # fixed order: the same bits whatever the launch interleaving
            tg += tl.load(P + (ks * S + p) * I + cols)
            tu += tl.load(P + ((KS + ks) * S + p) * I + cols)
        svh_g = tl.load(PTRS + 2 * E + e64).to(tl.pointer_type(tl.float16))
        svh_u = tl.load(PTRS + 5 * E + e64).to(tl.pointer_type(tl.float16))
        suh_d = tl.load(PTRS + 7 * E + e64).to(tl.pointer_type(tl.float16))
        g = _fwht128(tg) * _R128 * tl.load(svh_g + cols).to(tl.float32)
        u = _fwht128(tu) * _R128 * tl.load(svh_u + cols).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if LIBDEVICE:  # libdevice exp (~1 ulp) and a round-to-nearest division (dma-prefill's post_swiglu)
            a = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
        else:
            a = g / (1.0 + tl.exp(-g)) * u
        _store_split(a * tl.load(suh_d + cols).to(tl.float32), p.to(tl.int64), cb, A_HI, A_LO, A_INV, A32, I)


@triton.jit(do_not_specialize=["S", "E", "KS"])
def out_kernel(
    IDS,  # int32* [S]
    W,  # fp32* [S]: routing weights
    S,
    PTRS,  # int64* [9, E]
    E,
    P,  # fp32* [KS, S, H]: down partial sums
    KS,
    OUT,  # fp32* [S, H]
    H: tl.constexpr,
):
    """``OUT[p] = W[p] * H128(sum of splits) * svh_down``; exact zeros for a skipped pick."""
    p = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.load(IDS + p)
    cols = cb * 128 + tl.arange(0, 128)[None, :]
    y = tl.zeros([1, 128], dtype=tl.float32)
    if e >= 0:
        t = tl.zeros([1, 128], dtype=tl.float32)
        for ks in range(0, KS):
            t += tl.load(P + (ks * S + p) * H + cols)
        svh = tl.load(PTRS + 8 * E + e.to(tl.int64)).to(tl.pointer_type(tl.float16))
        y = _fwht128(t) * _R128 * tl.load(svh + cols).to(tl.float32) * tl.load(W + p)
    tl.store(OUT + p.to(tl.int64) * H + cols, y)
