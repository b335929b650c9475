"""Triton kernels for the GPU expert path: EXL3 decode, the Hadamard row transforms, the grouped GEMM.

Importing this module needs Triton (present wherever torch has CUDA; absent on the CPU CI machine).

Accuracy scheme ("exact" mode). ``W_inner`` is exactly fp16. An fp32 activation row ``a`` is scaled by a power
of two ``s`` (so that ``|a*s| < 2^14``) and split ``a*s = hi + lo`` with ``hi = fp16(a*s)`` and
``lo = fp16(a*s - hi)``; ``hi + lo`` carries ~22 significant bits. ``hi*w`` and ``lo*w`` are exact fp16 x fp16
products, the tensor cores add them in fp32, and ``1/s`` is applied exactly at the end, so the GEMM's error is
fp32 accumulation (plus the 2^-22 split) instead of the 2^-11 of an fp16 activation. The Hadamard-128 of a row
uses the same split against the +-1 matrix (exact products) and one fp32 scaling by 1/sqrt(128).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cpu_tier.exl3 import LOP3_AND, LOP3_XOR, MUL1_BIAS, MUL1_SCALE

__all__ = [
    "decode_kernel",
    "grouped_gemm_kernel",
    "post_swiglu_kernel",
    "row_hadamard_kernel",
    "row_sumsq_kernel",
    "tile_element",
    "window_words",
]

# The format's constants (cpu_tier.exl3) as compile-time constants of the kernels.
_MUL1_SCALE = tl.constexpr(MUL1_SCALE)  # half(0x1EEE)
_MUL1_BIAS = tl.constexpr(MUL1_BIAS)  # half(0xC931)
# With f = float bits 0x4B000000 + bs = 2^23 + bs, one fma f * MUL1_SCALE + (MUL1_BIAS + (1024 - 2^23) * MUL1_SCALE)
# gives (1024 + bs) * MUL1_SCALE + MUL1_BIAS exactly (the folded addend, -56771.453125, is exact in fp32).
_MUL1_BIAS_2P23 = tl.constexpr(MUL1_BIAS + (1024 - 2**23) * MUL1_SCALE)
_LOP3_AND_I32 = tl.constexpr(LOP3_AND - (1 << 32))  # as the signed int32 the kernel's product is
_LOP3_XOR = tl.constexpr(LOP3_XOR)


@triton.jit
def _window16(a, b, sh, ASM: tl.constexpr):
    """Bits ``[sh, sh + 16)`` (MSB first) of the 64-bit word pair ``a:b``: the top half of ``(a:b) << sh``."""
    if ASM:  # one funnel shift (PTX shf.l: d = high word of ({hi=a, lo=b} << sh))
        w = tl.inline_asm_elementwise(
            "shf.l.clamp.b32 $0, $2, $1, $3;", "=r,r,r,r", [a, b, sh], dtype=tl.uint32, is_pure=True, pack=1
        )
    else:  # b >> 32 avoided: (b >> 1) >> (31 - sh)
        w = (a << sh) | ((b >> 1) >> (31 - sh))
    return w >> 16


@triton.jit
def _bytesum(p, ASM: tl.constexpr):
    """Sum of the four bytes of a uint32."""
    if ASM:  # one dp4a against 0x01010101
        return tl.inline_asm_elementwise(
            "{ .reg .u32 o, z; mov.u32 o, 16843009; mov.u32 z, 0; dp4a.u32.u32 $0, $1, o, z; }",
            "=r,r", [p], dtype=tl.uint32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        q = (p & 0x00FF00FF) + ((p >> 8) & 0x00FF00FF)  # two 16-bit pair sums
        return (q & 0xFFFF) + (q >> 16)


@triton.jit
def tile_element(r, c):
    """Trellis index ``t`` of row-major element ``(r, c)`` of a 16x16 tile: the inverse of the tensor-core
    permutation (``cpu_tier.exl3``'s tile order), elementwise over broadcast ``r`` and ``c``."""
    q = (c % 8) * 4 + (r % 8) // 2
    j = (c // 8) * 4 + (r // 8) * 2 + (r % 2)
    return 8 * q + j


@triton.jit
def window_words(t, K2: tl.constexpr):
    """Where trellis element ``t``'s 16-bit state window sits in its tile's tail-biting stream of ``128 * K2`` bits:
    the uint32 word offsets (from the tile's first word) of the two words holding it, and the window's bit offset
    in the first. The window ends ``S(t)`` bits into the stream, the closed form of ``cpu_tier.exl3``'s window
    ends (K = K2 / 2 bits per weight; half-integer K interleaves)."""
    KA: tl.constexpr = K2 // 2
    HALF: tl.constexpr = K2 % 2
    NBITS: tl.constexpr = 128 * K2
    NWORDS: tl.constexpr = 4 * K2
    i = t & 15
    s_end = (t >> 4) * (16 * KA + 8 * HALF) + (i + 1) * KA + HALF * ((i + 1) // 2)
    start = (s_end - 16 + NBITS) % NBITS
    i0 = start // 32
    return i0, (i0 + 1) % NWORDS, start % 32


def _f16x2(v: float) -> str:
    """The PTX immediate of ``v`` (exact in fp16) in both halves of a 32-bit register."""
    b = int(np.array(v, dtype=np.float16).view(np.uint16))
    assert float(np.array(b, dtype=np.uint16).view(np.float16)) == v, v
    return f"0x{b:04X}{b:04X}"


@triton.jit
def _group_offsets(BK: tl.constexpr, BN: tl.constexpr, TN, K2: tl.constexpr):
    """For each group of 8 consecutive trellis elements ``t = 8q .. 8q + 7`` of the tiles of a [BK, BN] block (the
    groups ordered tile column, tile row, q): the uint32 word offsets of the three words holding the group's
    windows and the bit offset of its first window in the first word (integer K <= 4 only: a group's windows
    span ``7K + 16 <= 44`` bits, so three words, and element j's window starts ``K * j`` bits after the first)."""
    KA: tl.constexpr = K2 // 2
    NWORDS: tl.constexpr = 4 * K2
    NBITS: tl.constexpr = 128 * K2
    TNB: tl.constexpr = BN // 16
    KT: tl.constexpr = BK // 16
    g = tl.arange(0, KT * TNB * 32)  # (nt, kt, q): a thread's groups (strided by the CTA) share their rows
    q = g % 32
    tile = (((g // 32) % KT) * TN + g // (KT * 32)) * NWORDS
    start = (8 * KA * q + KA - 16 + NBITS) % NBITS
    i0 = start // 32
    return tile + i0, tile + (i0 + 1) % NWORDS, tile + (i0 + 2) % NWORDS, start % 32


def _group_asm(ka: int) -> str:
    """PTX decoding one group of 8 MUL1 weights (``_decode_groups``): the 64-bit window ``hi:lo`` from three words
    (two funnel shifts), then per element the 16-bit state (a funnel shift by the constant ``ka * j`` and a shift),
    the hash (one multiply), the byte sum (one ``dp4a``), and per pair one ``fma.rn.f16x2`` (exllamav3's hfma)
    whose halves are the outputs. Operands: $0..$7 the fp16 weights, $8..$10 the words, $11 the bit offset, $12
    the multiplier."""
    lines = [
        "{ .reg .b32 hi, lo, o, z, m, c, s0, s1, s2, s3, s4, s5, s6, s7, u;",
        "shf.l.clamp.b32 hi, $9, $8, $11;",
        "shf.l.clamp.b32 lo, $10, $9, $11;",
        "mov.u32 o, 16843009; mov.u32 z, 0;",
        f"mov.b32 m, {_f16x2(MUL1_SCALE)}; mov.b32 c, {_f16x2(MUL1_BIAS)};",
        "shr.b32 s0, hi, 16;",
    ]
    for j in range(1, 8):
        lines.append(f"shf.l.clamp.b32 s{j}, lo, hi, {ka * j}; shr.b32 s{j}, s{j}, 16;")
    for j in range(8):
        lines.append(f"mul.lo.u32 s{j}, s{j}, $12; dp4a.u32.u32 s{j}, s{j}, o, z;")
    for pair in range(4):
        a, b = 2 * pair, 2 * pair + 1
        lines.append(f"prmt.b32 u, s{a}, s{b}, 0x5410; or.b32 u, u, 0x64006400; fma.rn.f16x2 u, u, m, c;")
        lines.append(f"mov.b32 {{${a}, ${b}}}, u;")
    lines.append("}")
    return " ".join(lines)


_GROUP_ASM = {ka: tl.constexpr(_group_asm(ka)) for ka in (1, 2, 3, 4)}
_GROUP_ASM_1 = _GROUP_ASM[1]
_GROUP_ASM_2 = _GROUP_ASM[2]
_GROUP_ASM_3 = _GROUP_ASM[3]
_GROUP_ASM_4 = _GROUP_ASM[4]


@triton.jit
def _funnel32(a, b, sh):
    """The high word of ``(a:b) << sh`` for ``0 <= sh < 32`` (uint32; plain integer ops)."""
    return (a << sh) | ((b >> 1) >> (31 - sh))


@triton.jit
def _decode_groups(base, g0, g1, g2, gsh, MULT, BK: tl.constexpr, BN: tl.constexpr, K2: tl.constexpr,
                   ASM: tl.constexpr):  # fmt: skip
    """fp16 ``W_inner`` values of a [BK, BN] MUL1 block (bit-exact), decoded per group of 8 consecutive trellis
    elements from three words (``_group_offsets``) instead of two words per element, then put in place by a fixed
    permutation: element ``t = 8q + j`` of a tile is row ``8 * (j//2 % 2) + 2 * (q % 4) + j % 2``, column
    ``8 * (j // 4) + q // 4`` (``tile_element``'s inverse)."""
    KA: tl.constexpr = K2 // 2
    a = tl.load(base + g0)
    b = tl.load(base + g1)
    c = tl.load(base + g2)
    if ASM:
        m = tl.full(a.shape, MULT, tl.int32)
        if KA == 1:
            v0, v1, v2, v3, v4, v5, v6, v7 = _group_call(a, b, c, gsh, m, _GROUP_ASM_1)
        elif KA == 2:
            v0, v1, v2, v3, v4, v5, v6, v7 = _group_call(a, b, c, gsh, m, _GROUP_ASM_2)
        elif KA == 3:
            v0, v1, v2, v3, v4, v5, v6, v7 = _group_call(a, b, c, gsh, m, _GROUP_ASM_3)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _group_call(a, b, c, gsh, m, _GROUP_ASM_4)
    else:
        ua = a.to(tl.uint32, bitcast=True)
        ub = b.to(tl.uint32, bitcast=True)
        uc = c.to(tl.uint32, bitcast=True)
        hi = _funnel32(ua, ub, gsh)
        lo = _funnel32(ub, uc, gsh)
        v0 = _mul1_scalar(hi >> 16, MULT)
        v1 = _mul1_scalar(_funnel32(hi, lo, KA * 1) >> 16, MULT)
        v2 = _mul1_scalar(_funnel32(hi, lo, KA * 2) >> 16, MULT)
        v3 = _mul1_scalar(_funnel32(hi, lo, KA * 3) >> 16, MULT)
        v4 = _mul1_scalar(_funnel32(hi, lo, KA * 4) >> 16, MULT)
        v5 = _mul1_scalar(_funnel32(hi, lo, KA * 5) >> 16, MULT)
        v6 = _mul1_scalar(_funnel32(hi, lo, KA * 6) >> 16, MULT)
        v7 = _mul1_scalar(_funnel32(hi, lo, KA * 7) >> 16, MULT)
    # [G, j0, j1, j2] with j = 4 j2 + 2 j1 + j0 (tl.join appends the new axis last), as
    # [nt, kt, q_hi, q_lo, j0, j1, j2]: G = (nt, kt, q_hi, q_lo); rows (kt, j1, q_lo, j0), columns (nt, j2, q_hi)
    w = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    return tl.reshape(w, (BN // 16, BK // 16, 8, 4, 2, 2, 2))


@triton.jit
def _trellis_to_block(w, BK: tl.constexpr, BN: tl.constexpr):
    """A [nt, kt, q_hi, q_lo, j0, j1, j2] block (``_decode_groups``) as the row-major [BK, BN] block."""
    return tl.reshape(tl.permute(w, (1, 5, 3, 4, 0, 6, 2)), (BK, BN))


@triton.jit
def _trellis_rows(BK: tl.constexpr):
    """Row index ``16 kt + 8 j1 + 2 q_lo + j0`` of each element of a [nt, kt, q_hi, q_lo, j0, j1, j2] block, with
    the column axes (nt, q_hi, j2) of size 1 (broadcast)."""
    kt = tl.arange(0, BK // 16)[None, :, None, None, None, None, None]
    q_lo = tl.arange(0, 4)[None, None, None, :, None, None, None]
    j0 = tl.arange(0, 2)[None, None, None, None, :, None, None]
    j1 = tl.arange(0, 2)[None, None, None, None, None, :, None]
    return kt * 16 + j1 * 8 + q_lo * 2 + j0


@triton.jit
def _group_call(a, b, c, gsh, m, ASM_TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM_TEXT, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [a, b, c, gsh, m], dtype=(tl.float16,) * 8, is_pure=True,
        pack=1,
    )  # fmt: skip


@triton.jit
def _mul1_scalar(state, MULT):
    """The MUL1 value of 16-bit states, plain integer ops (the interpreter): hash, byte sum, one fp16 rounding."""
    p = state.to(tl.int32, bitcast=True) * MULT  # wraps modulo 2^32
    return _mul1_value(_bytesum(p.to(tl.uint32, bitcast=True), False))


@triton.jit
def _mul1_value(bs):
    """fp16 ``(1024 + bs) * MUL1_SCALE + MUL1_BIAS`` of byte sums, plain ops (the interpreter): the value is exact
    in fp32, so one rounding to fp16, as exllamav3's hfma (an fma in the interpreter would round twice)."""
    return ((bs + 1024).to(tl.float32) * _MUL1_SCALE + _MUL1_BIAS).to(tl.float16)


@triton.jit
def decode_kernel(
    SRC,  # int32*: trellis words (uint32 bit patterns)
    src_expert_stride,  # int32 units between consecutive experts' records
    src_offset,  # int32 units from a record's start to this projection's trellis
    COUNTS,  # int64*: rows routed to each expert (experts with 0 rows are skipped)
    OUT,  # fp16*: [experts, k, n]
    out_expert_stride,  # elements
    TN,  # n / 16
    MULT,  # codebook multiplier as a signed int32 (the product wraps modulo 2^32 like the uint32 one)
    ADD,  # codebook addend (3INST), signed int32
    K2: tl.constexpr,  # 2 * bits per weight (odd: half-integer K); constant, so the index math folds
    MUL1: tl.constexpr,  # MUL1 byte-sum codebook, else LOP3 + half-sum (3INST/MCG)
    BLOCK_TN: tl.constexpr,
    ASM: tl.constexpr,  # PTX funnel shift + dp4a (GPU); False: plain integer ops (interpreter)
    GROUPS: tl.constexpr = False,  # per group of 8 elements from 3 words (MUL1, integer K <= 4, TN % BLOCK_TN == 0)
):
    """One 16-row band of ``BLOCK_TN`` tiles of one expert: ``OUT[e, 16*tk + r, 16*tn + c]``.

    The integer ALU bounds this kernel, so per element it does only: two word loads, one funnel shift, the
    codebook (multiply, dp4a for MUL1) and the fp16 value; the bit position of every tile element is index math
    on a [1, 16, 16] block (K2 is a compile-time constant), broadcast over the band's tiles."""
    e = tl.program_id(0)
    tk = tl.program_id(1)
    tnb = tl.program_id(2)
    count = tl.load(COUNTS + e)
    if GROUPS and count > 0:
        # the band's tiles decoded per group of 8 consecutive elements (``_decode_groups``), put in row-major
        # order by the fixed permutation, then stored as full rows of the band
        NW: tl.constexpr = 4 * K2
        base = SRC + e.to(tl.int64) * src_expert_stride + src_offset + (tk * TN + tnb * BLOCK_TN) * NW
        g0, g1, g2, gsh = _group_offsets(16, BLOCK_TN * 16, TN, K2)
        v = _trellis_to_block(_decode_groups(base, g0, g1, g2, gsh.to(tl.uint32), MULT, 16, BLOCK_TN * 16, K2, ASM),
                              16, BLOCK_TN * 16)  # fmt: skip
        rr = tl.arange(0, 16)[:, None]
        cc = tnb * (BLOCK_TN * 16) + tl.arange(0, BLOCK_TN * 16)[None, :]
        tl.store(OUT + e.to(tl.int64) * out_expert_stride + (tk * 16 + rr) * (TN * 16) + cc, v)
    elif count > 0:
        # [tile, r, c] blocks with the tile slowest: the 256 elements of one tile sit in one warp, so a word
        # load touches one tile's 32K bytes (one or two cache lines) instead of one line per tile of the band
        tn3 = (tnb * BLOCK_TN + tl.arange(0, BLOCK_TN))[:, None, None]
        r3 = tl.arange(0, 16)[None, :, None]  # row inside the tile (k offset)
        c3 = tl.arange(0, 16)[None, None, :]  # column inside the tile (n offset)
        NWORDS: tl.constexpr = 4 * K2
        i0, i1, sh = window_words(tile_element(r3, c3), K2)
        sh = sh.to(tl.uint32)
        # 32-bit offsets inside one expert's projection (< 2^31 words); the expert base is 64-bit
        base = SRC + e.to(tl.int64) * src_expert_stride + src_offset
        tile_w = (tk * TN + tn3) * NWORDS
        m = (tn3 < TN) & (r3 >= 0) & (c3 >= 0)
        a = tl.load(base + (tile_w + i0), mask=m, other=0).to(tl.uint32, bitcast=True)
        b = tl.load(base + (tile_w + i1), mask=m, other=0).to(tl.uint32, bitcast=True)
        state = _window16(a, b, sh, ASM)
        p = state.to(tl.int32, bitcast=True) * MULT + ADD  # wraps modulo 2^32
        if MUL1:
            bs = _bytesum(p.to(tl.uint32, bitcast=True), ASM)
            # (1024 + bs) * MUL1_SCALE + MUL1_BIAS, exact in fp32, then one rounding to fp16 (the hfma).
            # bits(2^23 + bs) is 0x4B000000 + bs (no int-to-float conversion); one fma with the folded addend.
            if ASM:
                f = (bs + 0x4B000000).to(tl.float32, bitcast=True)
                v = tl.fma(f, _MUL1_SCALE, _MUL1_BIAS_2P23).to(tl.float16)
            else:  # the interpreter's fma rounds twice; this form is exact without one
                v = _mul1_value(bs)
        else:
            x = (p & _LOP3_AND_I32) ^ _LOP3_XOR  # LOP3
            lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = ((x >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            v = (lo + hi).to(tl.float16)  # both halves in [0.125, 2): exact fp32 sum, one rounding
        obase = OUT + e.to(tl.int64) * out_expert_stride + tk * 16 * (TN * 16)
        tl.store(obase + (r3 * (TN * 16) + tn3 * 16 + c3), v, mask=m)


@triton.jit(do_not_specialize=["R", "grp_base"])
def row_sumsq_kernel(
    X,  # input rows (fp16/bf16/fp32)
    stride_x,
    SRC,  # int64*: input row of each row (HAS_SRC)
    GRP,  # int64*: group of each row; local group = GRP[r] - grp_base
    grp_base,
    VEC,  # fp16*: per-group vectors (a staging slot viewed as fp16)
    vec_stride,
    pre_off0,  # elements: first multiplier vector inside a record (HAS_PRE)
    pre_off1,  # elements: second multiplier vector (TWO)
    SS,  # fp32* [1 or 2, R]: sum of squares of (X[src] * pre) per row
    R,
    N,
    HAS_SRC: tl.constexpr,
    HAS_PRE: tl.constexpr,
    TWO: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    if HAS_SRC:
        src = tl.load(SRC + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    grp = (tl.load(GRP + rows, mask=rmask, other=grp_base) - grp_base).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m2 = rmask[:, None]
    ss0 = tl.zeros([BLOCK_R], dtype=tl.float32)
    ss1 = tl.zeros([BLOCK_R], dtype=tl.float32)
    for kb in range(0, N, BLOCK_N):
        v = tl.load(X + src[:, None] * stride_x + kb + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_PRE:
            vrow = VEC + grp[:, None] * vec_stride + kb + cols[None, :]
            v0 = v * tl.load(vrow + pre_off0, mask=m2, other=0.0).to(tl.float32)
            ss0 += tl.sum(v0 * v0, axis=1)
            if TWO:
                v1 = v * tl.load(vrow + pre_off1, mask=m2, other=0.0).to(tl.float32)
                ss1 += tl.sum(v1 * v1, axis=1)
        else:
            ss0 += tl.sum(v * v, axis=1)
    tl.store(SS + rows, ss0, mask=rmask)
    if TWO:
        tl.store(SS + R + rows, ss1, mask=rmask)


@triton.jit
def _row_scale(ss):
    """Power-of-two scale s (and 1/s) per row with ``sqrt(ss) * s < 2^14``, from the fp32 bits of ``ss``."""
    e_ss = ((ss.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # ss in [2^e, 2^(e+1))
    m_exp = (e_ss + 258) // 2 - 128  # ceil((e+1)/2): norm < 2^m
    es = tl.minimum(tl.maximum(14 - m_exp, -100), 100)
    scale = ((es + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - es) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _fwht128(v):
    """Unnormalised Sylvester Hadamard-128 of each row of a [rows, 128] fp32 block: seven butterfly stages of
    fp32 adds and subtracts (every output is a 7-level tree sum, rounded to nearest at each add)."""
    R: tl.constexpr = v.shape[0]
    for s in tl.static_range(7):
        w = tl.permute(tl.reshape(v, [R, 64 >> s, 2, 1 << s]), [0, 1, 3, 2])
        a, b = tl.split(w)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, 128])
    return v


@triton.jit
def _hadamard_scaled(v, scale, hpm, FWHT: tl.constexpr = False):
    """``s * H128(v)`` per row of a [rows, 128] fp32 block: split ``v*s`` into fp16 hi + lo, exact +-1 products,
    two fp32 sums joined by one round-to-nearest add, one scaling by 1/sqrt(128). ``FWHT``: fp32 butterflies
    on CUDA cores instead of the tensor cores (which do not round to nearest while they accumulate)."""
    if FWHT:
        return _fwht128(v * scale[:, None]) * 0.08838834764831845
    y = v * scale[:, None]
    y_hi = y.to(tl.float16)
    y_lo = (y - y_hi.to(tl.float32)).to(tl.float16)
    h = tl.dot(y_hi, hpm, out_dtype=tl.float32) + tl.dot(y_lo, hpm, out_dtype=tl.float32)
    return h * 0.08838834764831845


@triton.jit(do_not_specialize=["R", "grp_base"])
def row_hadamard_kernel(
    X,  # input rows (fp16/bf16/fp32)
    stride_x,
    SRC,  # int64*: input row of each output row (HAS_SRC)
    GRP,  # int64*: group (expert id) of each row; local group = GRP[r] - grp_base
    grp_base,
    VEC,  # fp16*: per-group vectors (a staging slot viewed as fp16)
    vec_stride,  # elements between consecutive groups' records
    pre_off,  # elements: the pre-multiplier (suh) inside a record
    post_off,  # elements: the post-multiplier (svh) inside a record
    SS,  # fp32* [R]: sum of squares of each row of X[src] * pre (row_sumsq_kernel)
    HPM,  # fp16* [128, 128] +-1 Hadamard
    O_HI,  # fp16* [R, N] (MODE 0)
    O_LO,  # fp16* [R, N] (MODE 0 and SPLIT)
    O_INV,  # fp32* [R] (MODE 0): 1/s of each row
    stride_oa,
    OUT,  # fp32* (MODE 1: [R, N]; MODE 2: [T, N] accumulated at DST rows)
    stride_o,
    W,  # fp32* [R] (MODE 2): routing weight
    DST,  # int64* [R] (MODE 2): token of each row
    R,
    N,
    HAS_SRC: tl.constexpr,
    HAS_PRE: tl.constexpr,
    HAS_POST: tl.constexpr,
    MODE: tl.constexpr,  # 0: split fp16 hi/lo for a GEMM; 1: store fp32; 2: weighted atomic add into OUT[DST]
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CPB: tl.constexpr,  # 128-column blocks per program (the Hadamard matrix is loaded once for all)
    FWHT: tl.constexpr = False,  # fp32 butterflies instead of the split tensor-core product
):
    """Rows x CPB 128-column blocks: ``v = X[src] * pre[grp]``; ``h = H128(v)``; then MODE 0: ``h*s`` split to
    fp16 hi/lo plus ``1/s``; MODE 1: ``h * post[grp]``; MODE 2: ``OUT[dst] += h * post[grp] * w``.

    ``s = 2^e`` with ``sqrt(SS[r]) * s < 2^14``: the row's 2-norm bounds every Hadamard output (orthonormal),
    so ``h*s`` and its hi part are inside fp16 range and the lo part keeps ~11 more bits."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    if HAS_SRC:
        src = tl.load(SRC + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    grp = (tl.load(GRP + rows, mask=rmask, other=grp_base) - grp_base).to(tl.int64)
    scale, inv = _row_scale(tl.load(SS + rows, mask=rmask, other=0.0))
    hpm = tl.load(HPM + tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :])
    if MODE == 0:
        if tl.program_id(1) == 0:
            tl.store(O_INV + rows, inv, mask=rmask)
    if MODE == 2:
        w = tl.load(W + rows, mask=rmask, other=0.0)
        dst = tl.load(DST + rows, mask=rmask, other=0).to(tl.int64)
    for cb in tl.static_range(CPB):
        cols = (tl.program_id(1) * CPB + cb) * 128 + tl.arange(0, 128)
        m2 = rmask[:, None] & (cols < N)[None, :]
        vrow = VEC + grp[:, None] * vec_stride + cols[None, :]
        v = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_PRE:
            v = v * tl.load(vrow + pre_off, mask=m2, other=0.0).to(tl.float32)
        h = _hadamard_scaled(v, scale, hpm, FWHT)  # s * H128(v)
        if MODE == 0:
            a_hi = h.to(tl.float16)
            tl.store(O_HI + rows[:, None].to(tl.int64) * stride_oa + cols[None, :], a_hi, mask=m2)
            if SPLIT:
                a_lo = (h - a_hi.to(tl.float32)).to(tl.float16)
                tl.store(O_LO + rows[:, None].to(tl.int64) * stride_oa + cols[None, :], a_lo, mask=m2)
        else:
            o = h * inv[:, None]
            if HAS_POST:
                o = o * tl.load(vrow + post_off, mask=m2, other=0.0).to(tl.float32)
            if MODE == 1:
                tl.store(OUT + rows[:, None].to(tl.int64) * stride_o + cols[None, :], o, mask=m2)
            else:
                # relaxed: no fence per element (kernel boundaries order the batches); lowers to red.global.add
                tl.atomic_add(OUT + dst[:, None] * stride_o + cols[None, :], o * w[:, None], mask=m2, sem="relaxed")


@triton.jit(do_not_specialize=["R", "grp_base"])
def post_swiglu_kernel(
    TG,  # fp32* [R, N]: gate GEMM output (Hadamard basis)
    TU,  # fp32* [R, N]: up GEMM output
    stride_t,
    SS,  # fp32* [2, R]: row sums of squares of TG and TU
    GRP,
    grp_base,
    VEC,  # fp16*: slot records
    vec_stride,
    svh_g,  # elements: gate svh inside a record
    svh_u,  # elements: up svh inside a record
    HPM,
    ACT,  # fp32* [R, N]: silu(min(g, L)) * clamp(u, -L, L)
    stride_a,
    limit,
    R,
    N,
    HAS_LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CPB: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # accurate exp (GPU); False in the interpreter
    FWHT: tl.constexpr = False,
):
    """``g = H128(TG) * svh_g``, ``u = H128(TU) * svh_u``, ``ACT = silu(min(g, L)) * clamp(u, -L, L)``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    grp = (tl.load(GRP + rows, mask=rmask, other=grp_base) - grp_base).to(tl.int64)
    sg, ig = _row_scale(tl.load(SS + rows, mask=rmask, other=0.0))
    su, iu = _row_scale(tl.load(SS + R + rows, mask=rmask, other=0.0))
    hpm = tl.load(HPM + tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :])
    for cb in tl.static_range(CPB):
        cols = (tl.program_id(1) * CPB + cb) * 128 + tl.arange(0, 128)
        m2 = rmask[:, None] & (cols < N)[None, :]
        off = rows[:, None].to(tl.int64) * stride_t + cols[None, :]
        vrow = VEC + grp[:, None] * vec_stride + cols[None, :]
        g = _hadamard_scaled(tl.load(TG + off, mask=m2, other=0.0), sg, hpm, FWHT) * ig[:, None]
        g = g * tl.load(vrow + svh_g, mask=m2, other=0.0).to(tl.float32)
        u = _hadamard_scaled(tl.load(TU + off, mask=m2, other=0.0), su, hpm, FWHT) * iu[:, None]
        u = u * tl.load(vrow + svh_u, mask=m2, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        # libdevice exp (~1 ulp) and a round-to-nearest division: tl.exp is ex2.approx after a rounded
        # multiply by log2(e), whose error grows with |g| (~1e-6 relative at |g| = 10)
        if LIBDEVICE:
            a = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
        else:  # the interpreter has no libdevice
            a = g / (1.0 + tl.exp(-g)) * u
        tl.store(ACT + rows[:, None].to(tl.int64) * stride_a + cols[None, :], a, mask=m2)


@triton.jit
def grouped_gemm_kernel(
    A_HI,  # fp16* [R, K]
    A_LO,  # fp16* [R, K] (SPLIT)
    A_INV,  # fp32* [R]
    stride_a,
    W,  # fp16* [experts, K, N]
    stride_we,
    OUT,  # fp32* [R, N]
    stride_o,
    TILES,  # int32* [tiles, 3]: (local expert, first row, end row)
    SS,  # fp32* [R] (HAS_SS): zeroed by the caller; gets each output row's sum of squares (atomically per N tile)
    K,
    N,
    HAS_SS: tl.constexpr,
    SPLIT: tl.constexpr,
    PROMOTE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    LO_ACC: tl.constexpr = False,  # accumulate the lo products apart (not on top of the hi partial sums)
):
    """``OUT[rows] = (A_HI[rows] + A_LO[rows]) @ W[e] * A_INV[rows]`` for each tile of one expert's rows.

    With PROMOTE each BK-deep tensor-core partial sum starts from zero and is added to the fp32 accumulator
    with a round-to-nearest add: the tensor cores' own accumulation (which does not round to nearest) then
    only ever spans BK products."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(TILES + pid_m * 3).to(tl.int64)
    r0 = tl.load(TILES + pid_m * 3 + 1)
    r1 = tl.load(TILES + pid_m * 3 + 2)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    ks = tl.arange(0, BK)
    a_off = rows[:, None].to(tl.int64) * stride_a + ks[None, :]
    w_ptr = W + e * stride_we + ks[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_lo = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + k0 * N, mask=cmask[None, :], other=0.0)
        a = tl.load(A_HI + a_off + k0, mask=rmask[:, None], other=0.0)
        if PROMOTE:
            part = tl.dot(a, w, out_dtype=tl.float32)
        else:
            part = tl.dot(a, w, acc, out_dtype=tl.float32)
        if SPLIT:
            a2 = tl.load(A_LO + a_off + k0, mask=rmask[:, None], other=0.0)
            if LO_ACC:
                acc_lo = tl.dot(a2, w, acc_lo, out_dtype=tl.float32)
            else:
                part = tl.dot(a2, w, part, out_dtype=tl.float32)
        if PROMOTE:
            acc += part
        else:
            acc = part
    if LO_ACC:
        acc += acc_lo
    inv = tl.load(A_INV + rows, mask=rmask, other=1.0)
    out = acc * inv[:, None]
    tl.store(OUT + rows[:, None].to(tl.int64) * stride_o + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])
    if HAS_SS:  # columns past N are exact zeros (their weights loaded as 0)
        tl.atomic_add(SS + rows, tl.sum(out * out, axis=1), mask=rmask, sem="relaxed")
