"""Triton kernels of the Ampere attention path (sm_80 / sm_86 and newer), with their launch wrappers.

Every kernel uses only what Ampere has (``mma.sync`` through ``tl.dot`` on bf16, plain global loads and stores,
shared-memory histograms and scans): no fp8 conversion, no TMA, no ``wgmma``, no programmatic dependent launch.
The store kernels' ``fp8`` mode (``vllm_dsv41.ampere.fp8``: upstream's FP8 rounding of the stored values, kept in
bf16) rounds onto the e4m3 grid with integer and fp32 arithmetic (``_e4m3_round``), not with a conversion.
``vllm_dsv41.ampere.aot`` compiles each of them for sm_80 and sm_86 and checks the generated code.

Conventions (those of upstream vLLM's V4.1 code):

* a KV row is 512 values, the last 64 carrying GPT-J interleaved RoPE: pair ``i`` is dims ``(448 + 2i, 449 + 2i)``
  rotated by ``cos_sin[pos, i]`` and ``cos_sin[pos, 32 + i]`` (the ``cos_sin_cache`` layout: cos half, sin half);
* a paged cache is ``[blocks, rows_per_block, width]`` with any block stride (vLLM packs several layers' pages
  in one block); slot ``s`` is row ``s % rows_per_block`` of block ``s // rows_per_block``; a negative slot or
  index means "none";
* the indexer works in request-local compressed positions: the compressed entry ``j`` of a request covers tokens
  ``[j * ratio, (j + 1) * ratio)`` and a token at position ``p`` sees entries ``j < (p + 1) // ratio``.

All wrappers take the output buffers from the caller (they run inside vLLM's eager CUDA-graph breaks, which need
stable addresses) and launch on the current stream; none synchronizes with the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "compressed_kv_insert",
    "e4m3_round_blocks",
    "indexer_k_store",
    "indexer_logits",
    "indexer_q_rope",
    "inv_rope_grouped",
    "rope_q_kv_insert",
    "sparse_mqa_attention",
    "topk_rows",
]

LOG2E = 1.4426950408889634
#: Values per UE8M0 scale of the main KV rows' NoPE dims in upstream's sm_90 ``fp8_ds_mla`` record (``fp8.py``).
FP8_BLOCK = 64


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _paged(cache: torch.Tensor, name: str, width: int) -> tuple[int, int, int]:
    """(block stride, row stride, rows per block) of a paged cache ``[blocks, rows, width]``, unit-stride rows."""
    _check(cache.dim() == 3, f"{name}: expected [blocks, rows, {width}], got shape {tuple(cache.shape)}")
    _check(cache.shape[2] == width and cache.stride(2) == 1, f"{name}: rows must be {width} contiguous values")
    return cache.stride(0), cache.stride(1), cache.shape[1]


# ------------------------------------------------------------------------------- FP8 rounding, kept in bf16


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 ``e`` in [-126, 127] (the exponent field alone)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_exponent(amax):
    """int32 ``e`` of upstream's power-of-two scale ``2^e = 2^ceil(log2(max(amax, 1e-4) / 448))`` (``fp8.py``).

    Exact: the fp32 ratio's biased exponent, plus one when its mantissa is not zero (the bit trick of upstream's
    CuTe query kernel; its Triton kernels' ``ceil(log2(.))`` gives the same on the bf16 amaxes they see).
    """
    y = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    return ((y.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23) - 127


@triton.jit
def _e4m3_round(x, e):
    """``x`` (fp32) as upstream stores it: ``x * 2^-e`` cast to e4m3 (nearest, ties to even, saturating at 448),
    times ``2^e``. Exact in fp32 (and in bf16: at most 4 significant bits times a power of two).

    Normal e4m3 values keep 3 mantissa bits (an integer round-to-nearest-even on the fp32 bits; a carry moves to
    the exponent); below 2^-6 the grid is e4m3's subnormal step 2^-9, which adding and subtracting 2^14 rounds to
    (fp32's ulp at 2^14 is 2^-9). The sign is copied from the bits, so -0.0 and values rounding to zero keep it.
    """
    y = x * _pow2(-e)
    a = tl.minimum(tl.abs(y), 448.0)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, sub, normal).to(tl.int32, bitcast=True)
    sign = y.to(tl.int32, bitcast=True) & ~0x7FFFFFFF
    return (r | sign).to(tl.float32, bitcast=True) * _pow2(e)


@triton.jit
def _e4m3_round_rows(x, ROWS: tl.constexpr, QB: tl.constexpr):
    """``x`` [ROWS * QB] rounded per block of ``QB`` consecutive values, each block with its own UE8M0 scale."""
    blk = tl.reshape(x, (ROWS, QB))
    e = _ue8m0_exponent(tl.max(tl.abs(blk), 1))
    return tl.reshape(_e4m3_round(blk, e[:, None]), (ROWS * QB,))


@triton.jit
def _e4m3_round_kernel(x, x_s, out, o_s, exps, B: tl.constexpr, GIVEN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, B)
    v = tl.load(x + r * x_s + i).to(tl.float32)
    if GIVEN:
        e = tl.load(exps + r)
    else:
        e = _ue8m0_exponent(tl.max(tl.abs(v), 0))
    tl.store(out + r * o_s + i, _e4m3_round(v, e).to(out.dtype.element_ty))


def e4m3_round_blocks(x: torch.Tensor, out: torch.Tensor, exponents: torch.Tensor | None = None) -> None:
    """Each row of ``x`` [R, B] rounded as upstream's FP8 store rounds a block into ``out`` [R, B]: with the UE8M0
    scale of the row's amax (``exponents`` None) or with scale ``2^exponents[r]`` (int32 [R]). The rounding the
    store kernels' ``fp8`` mode applies, on its own (tests, and the reference of ``vllm_dsv41.ampere.fp8``)."""
    _check(x.dim() == 2 and x.stride(1) == 1 and out.shape == x.shape and out.stride(1) == 1, "x/out: [rows, B]")
    b = x.shape[1]
    _check(b & (b - 1) == 0, f"x: block {b} must be a power of two")
    if exponents is not None:
        _check(exponents.dtype == torch.int32 and exponents.numel() >= x.shape[0], "exponents: int32 [rows]")
    if x.shape[0] == 0:
        return
    _e4m3_round_kernel[(x.shape[0],)](
        x, x.stride(0), out, out.stride(0), exponents if exponents is not None else x, B=b, GIVEN=exponents is not None
    )


def _check_fp8(fp8: bool, nope: int, what: str) -> None:
    _check(not fp8 or nope % FP8_BLOCK == 0, f"{what}: fp8 rounding needs NoPE dims ({nope}) in blocks of {FP8_BLOCK}")


# ----------------------------------------------------------------------------------------------- RoPE + insert


@triton.jit
def _rope_q_kv_insert_kernel(
    q,
    q_s_t,
    q_s_h,
    n_heads,
    kv,
    kv_s_t,
    positions,
    cos_sin,
    cs_s,
    cache,
    c_s_blk,
    c_s_row,
    c_rows,
    slots,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = ROPE // 2
    NOPE: tl.constexpr = D - ROPE
    i = tl.arange(0, HALF)
    pos = tl.load(positions + t).to(tl.int64)
    c = tl.load(cos_sin + pos * cs_s + i).to(tl.float32)
    s = tl.load(cos_sin + pos * cs_s + HALF + i).to(tl.float32)
    if h < n_heads:  # one query head: rotate its RoPE dims in place
        base = q + t * q_s_t + h * q_s_h + NOPE
        e = tl.load(base + 2 * i).to(tl.float32)
        o = tl.load(base + 2 * i + 1).to(tl.float32)
        tl.store(base + 2 * i, (e * c - o * s).to(q.dtype.element_ty))
        tl.store(base + 2 * i + 1, (o * c + e * s).to(q.dtype.element_ty))
    else:  # the token's KV row: rotated, then written to its cache slot
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            dst = cache + (slot // c_rows) * c_s_blk + (slot % c_rows) * c_s_row
            d = tl.arange(0, D)
            src = kv + t * kv_s_t
            x = tl.load(src + d)
            if FP8:  # the NoPE dims on upstream's grid (the RoPE block's scale is computed, not used)
                x = _e4m3_round_rows(x.to(tl.float32), D // 64, 64)
            tl.store(dst + d, x.to(cache.dtype.element_ty), mask=d < NOPE)
            e = tl.load(src + NOPE + 2 * i).to(tl.float32)
            o = tl.load(src + NOPE + 2 * i + 1).to(tl.float32)
            tl.store(dst + NOPE + 2 * i, (e * c - o * s).to(cache.dtype.element_ty))
            tl.store(dst + NOPE + 2 * i + 1, (o * c + e * s).to(cache.dtype.element_ty))


def rope_q_kv_insert(
    q: torch.Tensor | None,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
    fp8: bool = False,
) -> None:
    """RoPE on ``q`` [T, H, D] in place (when given) and on ``kv`` [T, D], whose rows go to ``cache`` at the slots.

    With ``fp8`` the row's NoPE dims are rounded as upstream's FP8 record stores them (blocks of 64, UE8M0 scales;
    ``vllm_dsv41.ampere.fp8``); the RoPE dims stay bf16, as there. Replaces upstream's
    ``_C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert`` (no query norm: V4.1 norms the query's
    low-rank input instead), ``_C.fused_deepseek_v4_kv_rope_insert`` (``q=None``) and, with ``fp8``, their
    ``..._quant_insert`` counterparts.
    """
    d = kv.shape[-1]
    rope = cos_sin.shape[-1]
    t = kv.shape[0] if num_tokens is None else num_tokens
    _check(kv.dim() == 2 and kv.stride(1) == 1, f"kv: expected [tokens, {d}] with unit-stride rows")
    _check(rope % 2 == 0 and 0 < rope <= d, f"cos_sin: width {rope} does not fit head_dim {d}")
    _check(slot_mapping.numel() >= t and positions.numel() >= t, "slot_mapping/positions: fewer than num_tokens")
    _check_fp8(fp8, d - rope, "kv")
    c_blk, c_row, c_rows = _paged(cache, "cache", d)
    if t == 0:
        return
    heads = 0
    q_s_t = q_s_h = 0
    if q is not None:
        _check(q.dim() == 3 and q.shape[2] == d and q.stride(2) == 1, f"q: expected [tokens, heads, {d}]")
        heads, q_s_t, q_s_h = q.shape[1], q.stride(0), q.stride(1)
    _rope_q_kv_insert_kernel[(t, heads + 1)](
        q if q is not None else kv,
        q_s_t,
        q_s_h,
        heads,
        kv,
        kv.stride(0),
        positions,
        cos_sin,
        cos_sin.stride(0),
        cache,
        c_blk,
        c_row,
        c_rows,
        slot_mapping,
        D=d,
        ROPE=rope,
        FP8=fp8,
        num_warps=4,
    )


@triton.jit
def _rope_tail(x, cos_sin, row_pos, cs_s, sign, D: tl.constexpr, ROPE: tl.constexpr):
    """fp32 ``x`` [D] with its last ``ROPE`` dims rotated in interleaved pairs by position ``row_pos``'s angles
    (``sign`` 1.0: by +angle, -1.0: by -angle, the inverse); the first ``D - ROPE`` dims pass through."""
    HALF: tl.constexpr = ROPE // 2
    NOPE: tl.constexpr = D - ROPE
    even, odd = tl.split(tl.reshape(x, (D // 2, 2)))
    pair = tl.arange(0, D // 2) - NOPE // 2
    is_rope = pair >= 0
    cs = cos_sin + row_pos * cs_s + tl.maximum(pair, 0)
    c = tl.load(cs, mask=is_rope, other=1.0).to(tl.float32)
    s = tl.load(cs + HALF, mask=is_rope, other=0.0).to(tl.float32) * sign
    return tl.interleave(even * c - odd * s, odd * c + even * s)


@triton.jit
def _compressed_kv_insert_kernel(
    latent,
    l_s_t,
    positions,
    cos_sin,
    cs_s,
    cache,
    c_s_blk,
    c_s_row,
    c_rows,
    slots,
    ratio,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    if (slot >= 0) & ((pos + 1) % ratio == 0):  # the last token of a group publishes the group's row
        NOPE: tl.constexpr = D - ROPE
        d = tl.arange(0, D)
        x = tl.load(latent + t * l_s_t + d).to(tl.float32)
        row = _rope_tail(x, cos_sin, pos // ratio * ratio, cs_s, 1.0, D, ROPE)
        if FP8:  # NoPE dims from the latent itself (upstream quantizes the unrotated values), RoPE dims bf16
            row = tl.where(d < NOPE, _e4m3_round_rows(x, D // 64, 64), row)
        dst = cache + (slot // c_rows) * c_s_blk + (slot % c_rows) * c_s_row
        tl.store(dst + d, row.to(cache.dtype.element_ty))


def compressed_kv_insert(
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ratio: int,
    fp8: bool = False,
    num_tokens: int | None = None,
) -> None:
    """The compressed KV rows of the closed groups: the compressor's normed latent [T, D] with RoPE at the group's
    first position, at ``slot_mapping[t]`` when token ``t`` ends a group (``(pos + 1) % ratio == 0``).

    Upstream's ``rope_quant_insert``: bf16 rows as its plain-row kernel writes them, or with ``fp8`` the NoPE dims
    rounded as its 584-byte ``fp8_ds_mla`` record stores them (``vllm_dsv41.ampere.fp8``).
    """
    d = latent.shape[1]
    rope = cos_sin.shape[-1]
    t = slot_mapping.numel() if num_tokens is None else num_tokens
    _check(latent.dim() == 2 and latent.stride(1) == 1 and latent.shape[0] >= t, "latent: expected [tokens, D]")
    _check(positions.numel() >= t and ratio >= 1, "positions: fewer than the tokens, or ratio < 1")
    _check_fp8(fp8, d - rope, "latent")
    c_blk, c_row, c_rows = _paged(cache, "compressed cache", d)
    if t == 0:
        return
    _compressed_kv_insert_kernel[(t,)](
        latent,
        latent.stride(0),
        positions,
        cos_sin,
        cos_sin.stride(0),
        cache,
        c_blk,
        c_row,
        c_rows,
        slot_mapping,
        ratio,
        D=d,
        ROPE=rope,
        FP8=fp8,
        num_warps=4,
    )


# -------------------------------------------------------------------------------------- sparse MQA attention


@triton.jit
def _attend_list(
    qt,
    m_i,
    l_i,
    acc,
    t,
    kv,
    s_blk,
    s_row,
    rows,
    idx,
    idx_s,
    lens,
    width,
    scale_log2,
    D: tl.constexpr,
    BN: tl.constexpr,
):
    """Online-softmax accumulation of ``qt`` [BH, D] over the KV rows one index list names for token ``t``."""
    n = tl.minimum(tl.load(lens + t), width)
    d = tl.arange(0, D)
    for start in range(0, n, BN):
        j = start + tl.arange(0, BN)
        slot = tl.load(idx + t * idx_s + j, mask=j < n, other=-1).to(tl.int64)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        row = kv + (slot // rows) * s_blk + (slot % rows) * s_row
        k = tl.load(row[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [BN, D]
        s = tl.dot(qt, tl.trans(k)) * scale_log2  # [BH, BN], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sparse_mqa_kernel(
    q,
    q_s_t,
    q_s_h,
    out,
    o_s_t,
    o_s_h,
    n_heads,
    kv_a,
    a_s_blk,
    a_s_row,
    a_rows,
    idx_a,
    idx_a_s,
    len_a,
    width_a,
    kv_b,
    b_s_blk,
    b_s_row,
    b_rows,
    idx_b,
    idx_b_s,
    len_b,
    width_b,
    sink,
    scale_log2,
    D: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < n_heads
    d = tl.arange(0, D)
    qt = tl.load(q + t * q_s_t + h[:, None] * q_s_h + d[None, :], mask=hm[:, None], other=0.0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    m_i, l_i, acc = _attend_list(
        qt, m_i, l_i, acc, t, kv_a, a_s_blk, a_s_row, a_rows, idx_a, idx_a_s, len_a, width_a, scale_log2, D, BN
    )
    if HAS_B:
        m_i, l_i, acc = _attend_list(
            qt, m_i, l_i, acc, t, kv_b, b_s_blk, b_s_row, b_rows, idx_b, idx_b_s, len_b, width_b, scale_log2, D, BN
        )
    if HAS_SINK:  # the sink adds exp(sink) to the denominator only
        sk = tl.load(sink + h, mask=hm, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_ref = tl.where(m_i == float("-inf"), sk, m_i)
        m_ref = tl.where(m_ref == float("-inf"), 0.0, m_ref)
        scale = tl.exp2(m_i - m_ref)
        l_i = l_i * scale + tl.exp2(sk - m_ref)
        acc = acc * scale[:, None]
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out + t * o_s_t + h[:, None] * o_s_h + d[None, :], o.to(out.dtype.element_ty), mask=hm[:, None])


def _index_list(
    cache: torch.Tensor | None, idx: torch.Tensor | None, lens: torch.Tensor | None, name: str, d: int, t: int
) -> tuple:
    if cache is None:
        return (None, 0, 0, 1, None, 0, None, 0)
    _check(idx is not None and lens is not None, f"{name}: a cache needs its index list and lengths")
    assert idx is not None and lens is not None
    s_blk, s_row, rows = _paged(cache, f"{name} cache", d)
    idx2 = idx.reshape(idx.shape[0], -1)
    _check(idx2.shape[0] >= t and lens.numel() >= t, f"{name}: index list or lengths shorter than the tokens")
    _check(idx2.stride(1) == 1, f"{name}: index rows must be contiguous")
    return (cache, s_blk, s_row, rows, idx2, idx2.stride(0), lens, idx2.shape[1])


def sparse_mqa_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    num_tokens: int | None = None,
    block_heads: int = 16,
    block_n: int = 32,
) -> None:
    """Sparse multi-query attention of ``q`` [T, H, D] over KV rows named by index lists, into ``out`` [T, H', D].

    Token ``t`` attends to ``swa_cache`` at ``swa_indices[t, :swa_lens[t]]`` and, when given, to ``extra_cache`` at
    ``extra_indices[t, :extra_lens[t]]`` (global slots; negative ones are skipped); keys are values (MQA, one KV
    head). The softmax denominator also holds ``exp(sink[h])``; a head without any key and sink writes zeros.
    Only the first ``H`` heads of ``out`` are written. Replaces FlashMLA's ``flash_mla_with_kvcache`` (decode) and
    ``flash_mla_sparse_fwd`` (prefill) on upstream's plain-row layout.
    """
    t = q.shape[0] if num_tokens is None else num_tokens
    _check(q.dim() == 3 and q.stride(2) == 1, "q: expected [tokens, heads, head_dim]")
    _check(
        out.dim() == 3 and out.shape[0] >= t and out.shape[1] >= q.shape[1] and out.shape[2] == q.shape[2],
        f"out: shape {tuple(out.shape)} does not hold q {tuple(q.shape)}",
    )
    d, heads = q.shape[2], q.shape[1]
    _check(d & (d - 1) == 0, f"q: head_dim {d} must be a power of two")
    if sink is not None:
        _check(sink.numel() >= heads, "sink: fewer entries than heads")
    a = _index_list(swa_cache, swa_indices, swa_lens, "swa", d, t)
    b = _index_list(extra_cache, extra_indices, extra_lens, "extra", d, t)
    if t == 0:
        return
    grid = (t, triton.cdiv(heads, block_heads))
    _sparse_mqa_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        heads,
        *a,
        *(b if extra_cache is not None else a),
        sink if sink is not None else q,
        scale * LOG2E,
        D=d,
        BH=block_heads,
        BN=block_n,
        HAS_B=extra_cache is not None,
        HAS_SINK=sink is not None,
        num_warps=4 if block_heads <= 16 else 8,
    )


# ---------------------------------------------------------------------------------------- lightning indexer


@triton.jit
def _indexer_k_store_kernel(
    k_pre,
    k_s_t,
    positions,
    cos_sin,
    cs_s,
    weight,
    eps,
    cache,
    c_s_blk,
    c_s_row,
    c_rows,
    slots,
    ratio,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    if (slot >= 0) & ((pos + 1) % ratio == 0):  # the last token of a group publishes the group's key
        d = tl.arange(0, D)
        k = tl.load(k_pre + t * k_s_t + d).to(tl.float32)
        w = tl.load(weight + d).to(tl.float32)
        k = (k * tl.rsqrt(tl.sum(k * k, 0) / D + eps) * w).to(tl.bfloat16).to(tl.float32)
        row = _rope_tail(k, cos_sin, pos // ratio * ratio, cs_s, 1.0, D, ROPE)
        if FP8:  # the bf16 key on upstream's grid: one UE8M0 scale for the whole key
            row = row.to(tl.bfloat16).to(tl.float32)
            row = _e4m3_round(row, _ue8m0_exponent(tl.max(tl.abs(row), 0)))
        dst = cache + (slot // c_rows) * c_s_blk + (slot % c_rows) * c_s_row
        tl.store(dst + d, row.to(cache.dtype.element_ty))


def indexer_k_store(
    k_pre: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ratio: int,
    num_tokens: int | None = None,
    fp8: bool = False,
) -> None:
    """Index keys of the closed groups: ``k_norm`` (RMSNorm with weight), RoPE at the group's first position, bf16 rows.

    Row ``t`` of ``k_pre`` [T, 128] (``wk`` of the compressor latent) is stored at ``slot_mapping[t]`` when token
    ``t`` ends a group (``(pos + 1) % ratio == 0``). With ``fp8`` the key is rounded as upstream's FP8 index cache
    stores it (one UE8M0 scale per key, ``vllm_dsv41.ampere.fp8``). Replaces upstream's
    ``indexer_k_norm_rope_store``, which writes FP8 (or MXFP4) rows with Triton's ``float8e4nv`` (sm_89+).
    """
    d = k_pre.shape[1]
    rope = cos_sin.shape[-1]
    t = slot_mapping.numel() if num_tokens is None else num_tokens
    _check(k_pre.dim() == 2 and k_pre.stride(1) == 1 and k_pre.shape[0] >= t, "k_pre: expected [tokens, head_dim]")
    _check(ratio >= 1, f"ratio: expected >= 1, got {ratio}")
    c_blk, c_row, c_rows = _paged(cache, "index cache", d)
    if t == 0:
        return
    _indexer_k_store_kernel[(t,)](
        k_pre,
        k_pre.stride(0),
        positions,
        cos_sin,
        cos_sin.stride(0),
        norm_weight,
        eps,
        cache,
        c_blk,
        c_row,
        c_rows,
        slot_mapping,
        ratio,
        D=d,
        ROPE=rope,
        FP8=fp8,
        num_warps=1,
    )


@triton.jit
def _indexer_q_rope_kernel(
    q,
    q_s_t,
    q_s_h,
    positions,
    cos_sin,
    cs_s,
    w,
    w_s_t,
    w_out,
    wo_s_t,
    w_scale,
    n_heads,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    NH: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    NOPE: tl.constexpr = D - ROPE
    h = tl.arange(0, NH)
    hm = h < n_heads
    i = tl.arange(0, HALF)
    pos = tl.load(positions + t).to(tl.int64)
    c = tl.load(cos_sin + pos * cs_s + i).to(tl.float32)[None, :]
    s = tl.load(cos_sin + pos * cs_s + HALF + i).to(tl.float32)[None, :]
    head = q + t * q_s_t + h[:, None] * q_s_h
    base = head + NOPE + 2 * i[None, :]
    e = tl.load(base, mask=hm[:, None]).to(tl.float32)
    o = tl.load(base + 1, mask=hm[:, None]).to(tl.float32)
    re = (e * c - o * s).to(q.dtype.element_ty)
    ro = (o * c + e * s).to(q.dtype.element_ty)
    if FP8:  # the whole head on upstream's grid, one UE8M0 scale per (token, head) over the bf16 values
        n = tl.arange(0, NOPE)
        xn = tl.load(head + n[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
        re32, ro32 = re.to(tl.float32), ro.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xn), 1), tl.maximum(tl.max(tl.abs(re32), 1), tl.max(tl.abs(ro32), 1)))
        ex = _ue8m0_exponent(amax)[:, None]
        tl.store(head + n[None, :], _e4m3_round(xn, ex).to(q.dtype.element_ty), mask=hm[:, None])
        re = _e4m3_round(re32, ex).to(q.dtype.element_ty)
        ro = _e4m3_round(ro32, ex).to(q.dtype.element_ty)
    tl.store(base, re, mask=hm[:, None])
    tl.store(base + 1, ro, mask=hm[:, None])
    wt = tl.load(w + t * w_s_t + h, mask=hm).to(tl.float32)
    tl.store(w_out + t * wo_s_t + h, wt * w_scale, mask=hm)


def indexer_q_rope(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    weights_out: torch.Tensor,
    weight_scale: float,
    num_tokens: int | None = None,
    fp8: bool = False,
) -> None:
    """Indexer queries: RoPE on ``q`` [T, NH, 128] in place (bf16 stays bf16); ``weights_out = weights * scale``.

    ``weight_scale`` is ``head_dim ** -0.5 * n_heads ** -0.5`` (upstream's softmax and head scales). Replaces
    upstream's ``fused_indexer_q_rope_quant``, which also quantizes ``q`` to FP8 (sm_89+) and folds that scale in;
    with ``fp8`` each head is rounded as that FP8 query is (``vllm_dsv41.ampere.fp8``), its scale kept in the
    values (exact in bf16) instead of the weights: the same scores up to fp32 summation order.
    """
    t = q.shape[0] if num_tokens is None else num_tokens
    _check(q.dim() == 3 and q.stride(2) == 1, "q: expected [tokens, heads, head_dim]")
    _check(weights.shape[-1] >= q.shape[1] and weights_out.dtype == torch.float32, "weights: [tokens, heads] fp32")
    nope = q.shape[2] - cos_sin.shape[-1]
    _check(not fp8 or nope > 0 and nope & (nope - 1) == 0, f"q: fp8 rounding needs a power-of-two NoPE width ({nope})")
    if t == 0:
        return
    heads = q.shape[1]
    _indexer_q_rope_kernel[(t,)](
        q,
        q.stride(0),
        q.stride(1),
        positions,
        cos_sin,
        cos_sin.stride(0),
        weights,
        weights.stride(0),
        weights_out,
        weights_out.stride(0),
        weight_scale,
        heads,
        D=q.shape[2],
        ROPE=cos_sin.shape[-1],
        NH=triton.next_power_of_2(heads),
        FP8=fp8,
        num_warps=4,
    )


@triton.jit
def _indexer_logits_kernel(
    q,
    q_s_t,
    q_s_h,
    w,
    w_s_t,
    n_heads,
    cache,
    c_s_blk,
    c_s_row,
    c_rows,
    block_table,
    bt_s,
    tok_req,
    positions,
    blk_start,
    blk_count,
    ratio,
    out,
    o_s_t,
    row0,
    width,
    D: tl.constexpr,
    NH: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    t0 = tl.load(blk_start + b).to(tl.int64)
    cnt = tl.load(blk_count + b)
    tt = tl.arange(0, BT)
    tm = tt < cnt
    pos = tl.load(positions + t0 + tt, mask=tm, other=-1).to(tl.int64)
    n_vis = (pos + 1) // ratio  # [BT] entries each token sees (0 for padding rows)
    n_max = tl.max(n_vis, 0)
    out_rows = out + (t0 + tt - row0)[:, None] * o_s_t + cols[None, :]
    out_mask = tm[:, None] & (cols < width)[None, :]
    if tl.program_id(1) * BN >= n_max:  # a tile past every token's keys: only the -inf fill
        tl.store(out_rows, tl.full([BT, BN], float("-inf"), tl.float32), mask=out_mask)
    else:
        req = tl.load(tok_req + t0).to(tl.int64)
        d = tl.arange(0, D)
        r = tl.arange(0, BT * NH)
        rt = r // NH
        rh = r % NH
        rm = (rt < cnt) & (rh < n_heads)
        qt = tl.load(q + (t0 + rt)[:, None] * q_s_t + rh[:, None] * q_s_h + d[None, :], mask=rm[:, None], other=0.0)
        wr = tl.load(w + (t0 + rt) * w_s_t + rh, mask=rm, other=0.0).to(tl.float32)
        cm = cols < n_max
        blk = tl.load(block_table + req * bt_s + cols // c_rows, mask=cm, other=0).to(tl.int64)
        row = cache + blk * c_s_blk + (cols % c_rows) * c_s_row
        k = tl.load(row[:, None] + d[None, :], mask=cm[:, None], other=0.0)  # [BN, D]
        s = tl.dot(qt, tl.trans(k))  # [BT*NH, BN]
        s = tl.maximum(s, 0.0) * wr[:, None]
        logit = tl.sum(tl.reshape(s, (BT, NH, BN)), 1)  # [BT, BN]
        logit = tl.where(cols[None, :] < n_vis[:, None], logit, float("-inf"))
        tl.store(out_rows, logit, mask=out_mask)


def token_blocks(
    query_start_loc: Sequence[int] | torch.Tensor, start: int, end: int, block_tokens: int
) -> tuple[list[int], list[int]]:
    """Blocks of at most ``block_tokens`` consecutive tokens of ``[start, end)``, none straddling two requests."""
    qsl = [int(x) for x in (query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else query_start_loc)]
    starts: list[int] = []
    counts: list[int] = []
    for lo, hi in zip(qsl[:-1], qsl[1:], strict=False):
        lo, hi = max(lo, start), min(hi, end)
        for s in range(lo, hi, block_tokens):
            starts.append(s)
            counts.append(min(block_tokens, hi - s))
    return starts, counts


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    blk_start: torch.Tensor,
    blk_count: torch.Tensor,
    out: torch.Tensor,
    row0: int = 0,
    block_tokens: int = 4,
    block_n: int = 64,
) -> None:
    """Lightning-indexer scores ``out[t - row0, j] = sum_h weights[t, h] * relu(q[t, h] . k_req(t)[j])``.

    ``k_req[j]`` is entry ``j`` of the token's request in the paged index cache (``block_table`` row of
    ``token_to_req[t]``); columns a token does not see (``j >= (pos + 1) // ratio``) and columns past the keys are
    ``-inf``. Tokens come in blocks (``blk_start``, ``blk_count``: at most ``block_tokens`` consecutive tokens of
    one request, see ``token_blocks``) that share each key tile. Replaces DeepGEMM's ``fp8_fp4_mqa_logits`` and
    ``fp8_fp4_paged_mqa_logits`` (Hopper/Blackwell only).
    """
    _check(q.dim() == 3 and q.stride(2) == 1, "q: expected [tokens, heads, head_dim]")
    d, heads = q.shape[2], q.shape[1]
    c_blk, c_row, c_rows = _paged(cache, "index cache", d)
    _check(out.dim() == 2 and out.stride(1) == 1 and out.dtype == torch.float32, "out: expected fp32 [rows, width]")
    _check(blk_start.numel() == blk_count.numel(), "blk_start/blk_count: different lengths")
    _check(
        block_tokens > 0 and block_tokens & (block_tokens - 1) == 0,
        f"block_tokens: {block_tokens} is not a power of two",
    )
    nb = blk_start.numel()
    if nb == 0 or out.shape[1] == 0:
        return
    grid = (nb, triton.cdiv(out.shape[1], block_n))
    _indexer_logits_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        weights,
        weights.stride(0),
        heads,
        cache,
        c_blk,
        c_row,
        c_rows,
        block_table,
        block_table.stride(0),
        token_to_req,
        positions,
        blk_start,
        blk_count,
        ratio,
        out,
        out.stride(0),
        row0,
        out.shape[1],
        D=d,
        NH=triton.next_power_of_2(heads),
        BT=block_tokens,
        BN=block_n,
        num_warps=4 if block_tokens * heads <= 64 else 8,
    )


# ---------------------------------------------------------------------------------------------------- top-k


@triton.jit
def _ordered_key(x, valid):
    """fp32 -> uint32 whose order is the floats' (larger float, larger key); invalid entries get key 0.

    Every finite or +inf float maps above 0x007FFFFF, so key 0 is below every selectable entry.
    """
    b = tl.where(x == 0.0, 0, x.to(tl.uint32, bitcast=True))  # -0.0 and +0.0 are one value
    neg = (b >> 31) != 0
    key = tl.where(neg, b ^ 0xFFFFFFFF, b | 0x80000000)
    return tl.where(valid, key, 0)


@triton.jit
def _topk_kernel(logits, l_s, lens, out, o_s, width, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(lens + row), width)
    base = logits + row * l_s
    cnt = 0
    for st in range(0, n, BLOCK):
        c = st + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < n, other=float("-inf"))
        cnt += tl.sum(((x > float("-inf")) & (x == x)).to(tl.int32), 0)
    # radix select of the K-th largest key, 8 bits a pass from the top
    prefix = tl.zeros([], tl.uint32)
    remaining = tl.minimum(K, cnt)
    digits = tl.arange(0, 256)
    for p in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for st in range(0, n, BLOCK):
            c = st + tl.arange(0, BLOCK)
            x = tl.load(base + c, mask=c < n, other=float("-inf"))
            key = _ordered_key(x, (x > float("-inf")) & (x == x))
            match = key > 0
            if p > 0:
                match = match & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
            hist += tl.histogram(((key >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=match)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        dsel = tl.maximum(tl.max(tl.where(at_or_above >= remaining, digits, -1), 0), 0)
        remaining -= tl.sum(tl.where(digits > dsel, hist, 0), 0)
        prefix = prefix | (dsel.to(tl.uint32) << (24 - 8 * p))
    take_all = cnt <= K  # every valid entry is selected
    thr = tl.where(take_all, tl.zeros([], tl.uint32), prefix)
    n_eq = tl.where(take_all, 0, remaining)  # how many entries equal to the threshold key are taken
    written = 0
    eq_seen = 0
    for st in range(0, n, BLOCK):
        c = st + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < n, other=float("-inf"))
        key = _ordered_key(x, (x > float("-inf")) & (x == x))
        gt = (key > thr).to(tl.int32)
        eq = ((key == thr) & (key > 0)).to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(eq, 0) - eq
        take = gt | (eq & (eq_rank < n_eq).to(tl.int32))
        slot = written + tl.cumsum(take, 0) - take
        tl.store(out + row * o_s + slot, c, mask=take != 0)
        written += tl.sum(take, 0)
        eq_seen += tl.sum(eq, 0)
    for st in range(written, K, BLOCK):
        c = st + tl.arange(0, BLOCK)
        tl.store(out + row * o_s + c, tl.full([BLOCK], -1, tl.int32), mask=c < K)


def topk_rows(logits: torch.Tensor, lens: torch.Tensor, k: int, out: torch.Tensor, block: int = 1024) -> None:
    """Per row, the columns of the ``k`` largest entries among ``logits[r, :lens[r]]`` into ``out[r, :k]`` (int32).

    ``-inf`` and NaN entries are never selected. The selected columns are written in increasing order (ties at
    the threshold go to the lower columns), then ``-1`` up to ``k``. A radix select (four 8-bit histogram passes
    over the row) finds the k-th largest value exactly. Replaces upstream's ``top_k_per_row_prefill`` and the
    decode top-k dispatchers.
    """
    _check(logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32, "logits: fp32 [rows, n]")
    _check(
        out.dim() == 2 and out.shape[1] >= k and out.stride(1) == 1 and out.dtype == torch.int32,
        f"out: expected int32 [rows, >= {k}]",
    )
    rows = logits.shape[0]
    _check(out.shape[0] >= rows and lens.numel() >= rows, "out/lens: fewer rows than logits")
    if rows == 0 or k == 0:
        return
    _topk_kernel[(rows,)](
        logits, logits.stride(0), lens, out, out.stride(0), logits.shape[1], k, BLOCK=block, num_warps=8
    )


# -------------------------------------------------------------------------------------------- output RoPE


@triton.jit
def _inv_rope_grouped_kernel(
    o,
    o_s_t,
    o_s_h,
    positions,
    cos_sin,
    cs_s,
    out,
    out_s_g,
    out_s_t,
    heads_per_group,
    D: tl.constexpr,
    ROPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    x = tl.load(o + t * o_s_t + h * o_s_h + d).to(tl.float32)
    pos = tl.load(positions + t).to(tl.int64)
    y = _rope_tail(x, cos_sin, pos, cs_s, -1.0, D, ROPE)  # rotation by -angle
    g = h // heads_per_group
    dst = out + g * out_s_g + t * out_s_t + (h % heads_per_group) * D
    tl.store(dst + d, y.to(out.dtype.element_ty))


def inv_rope_grouped(
    o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, n_groups: int, out: torch.Tensor
) -> None:
    """Undo the RoPE of the attention output and lay it out by ``wo_a`` group: ``out[g, t] = heads of group g``.

    ``o`` [T, H, D] (any head stride), ``out`` [G, T, (H / G) * D] with unit-stride rows. Replaces upstream's
    ``fused_inv_rope_fp8_quant`` (whose launch may use programmatic dependent launch, sm_90+) on the bf16 path.
    """
    t, heads, d = o.shape
    _check(heads % n_groups == 0, f"heads {heads} not divisible by o_groups {n_groups}")
    hpg = heads // n_groups
    _check(
        out.dim() == 3 and tuple(out.shape) == (n_groups, t, hpg * d) and out.stride(2) == 1,
        f"out: expected [{n_groups}, {t}, {hpg * d}] with unit-stride rows, got {tuple(out.shape)}",
    )
    _check(o.stride(2) == 1, "o: rows must be contiguous")
    if t == 0:
        return
    _inv_rope_grouped_kernel[(t, heads)](
        o,
        o.stride(0),
        o.stride(1),
        positions,
        cos_sin,
        cos_sin.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        hpg,
        D=d,
        ROPE=cos_sin.shape[-1],
        num_warps=4,
    )
