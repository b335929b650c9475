"""Pure torch references (float64 math) of every kernel in ``vllm_dsv41.ampere.kernels``, and of the two-level
candidate filter V4.1's indexers use.

Each reference takes the kernel's inputs and returns what the kernel writes, rounded to the output dtype where
the kernel stores a narrower type (bf16 rows): the kernel is then equal to the reference up to the rounding of
its own fp32 arithmetic. With ``fp8`` the stores also apply upstream's FP8 rounding (``fp8.round_blocks``) to the
bf16 values. They are slow (Python loops over tokens) and meant for tests at tiny sizes.
"""

from __future__ import annotations

import torch

from .fp8 import round_blocks

__all__ = [
    "apply_candidate_mask",
    "compressed_kv_insert",
    "indexer_k_store",
    "indexer_logits",
    "indexer_q_rope",
    "inv_rope_grouped",
    "rope_q_kv_insert",
    "select_candidate_blocks",
    "sparse_mqa_attention",
    "topk_rows",
]

F64 = torch.float64


def _row(cache: torch.Tensor, slot: int) -> torch.Tensor:
    rows = cache.shape[1]
    return cache[slot // rows, slot % rows]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE of the last ``2 * len(c)`` dims of ``x`` (float64), by +angle or -angle."""
    r = 2 * c.numel()
    y = x.clone()
    e, o = x[..., -r::2], x[..., -r + 1 :: 2]
    if inverse:
        y[..., -r::2], y[..., -r + 1 :: 2] = e * c + o * s, o * c - e * s
    else:
        y[..., -r::2], y[..., -r + 1 :: 2] = e * c - o * s, o * c + e * s
    return y


def _cs(cos_sin: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin.shape[-1] // 2
    row = cos_sin[pos].to(F64)
    return row[:half], row[half:]


def rope_q_kv_insert(
    q: torch.Tensor | None,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rotated q, cache after the inserts); inputs are not modified. ``fp8``: NoPE dims in FP8 blocks of 64."""
    q_out = None if q is None else q.clone()
    cache_out = cache.clone()
    for t in range(kv.shape[0]):
        c, s = _cs(cos_sin, int(positions[t]))
        if q is not None and q_out is not None:
            q_out[t] = _rotate(q[t].to(F64), c, s).to(q.dtype)
        slot = int(slot_mapping[t])
        if slot >= 0:
            _row(cache_out, slot)[:] = _kv_row(_rotate(kv[t].to(F64), c, s), kv[t], 2 * c.numel(), fp8, cache.dtype)
    return q_out, cache_out


def _kv_row(rotated: torch.Tensor, raw: torch.Tensor, rope: int, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """A stored KV row: the rotated row in ``dtype``; with ``fp8`` its NoPE dims (``raw``'s) rounded in blocks of 64."""
    row = rotated.to(dtype)
    if fp8:
        nope = raw.shape[-1] - rope
        row[:nope] = round_blocks(raw[:nope].to(dtype).float(), 64).to(dtype)
    return row


def compressed_kv_insert(
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ratio: int,
    fp8: bool = False,
) -> torch.Tensor:
    """The compressed cache after the stores: the latent of each group-ending token, RoPE at the group's first
    position (``fp8``: NoPE dims in FP8 blocks of 64, as upstream's 584-byte record)."""
    out = cache.clone()
    for t in range(slot_mapping.numel()):
        slot, pos = int(slot_mapping[t]), int(positions[t])
        if slot < 0 or (pos + 1) % ratio:
            continue
        c, s = _cs(cos_sin, pos // ratio * ratio)
        _row(out, slot)[:] = _kv_row(_rotate(latent[t].to(F64), c, s), latent[t], 2 * c.numel(), fp8, cache.dtype)
    return out


def sparse_mqa_attention(
    q: torch.Tensor,
    scale: float,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 [T, H, D]: softmax over the named rows (plus ``exp(sink)`` in the denominator) of scores times rows."""
    t_n, heads, d = q.shape
    out = torch.zeros(t_n, heads, d, dtype=F64)
    lists = [(swa_cache, swa_indices.reshape(t_n, -1), swa_lens)]
    if extra_cache is not None:
        assert extra_indices is not None and extra_lens is not None
        lists.append((extra_cache, extra_indices.reshape(t_n, -1), extra_lens))
    for t in range(t_n):
        rows = [_row(cache, int(i)) for cache, idx, lens in lists for i in idx[t, : int(lens[t])] if int(i) >= 0]
        sk = sink[:heads].to(F64) if sink is not None else torch.full((heads,), float("-inf"), dtype=F64)
        if not rows:
            continue
        kv = torch.stack(rows).to(F64)  # [N, D]
        scores = q[t].to(F64) @ kv.T * scale  # [H, N]
        m = torch.maximum(scores.max(1).values, sk)
        p = torch.exp(scores - m[:, None])
        den = p.sum(1) + torch.exp(sk - m)
        out[t] = (p @ kv) / den[:, None]
    return out


def indexer_k_store(
    k_pre: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ratio: int,
    fp8: bool = False,
) -> torch.Tensor:
    """The index cache after the stores (bf16 rounding of the normed key before RoPE, as upstream's kernel; ``fp8``:
    the bf16 key then rounded as one FP8 block)."""
    out = cache.clone()
    w = norm_weight.to(F64)
    for t in range(slot_mapping.numel()):
        slot, pos = int(slot_mapping[t]), int(positions[t])
        if slot < 0 or (pos + 1) % ratio:
            continue
        k = k_pre[t].to(F64)
        k = (k * torch.rsqrt(k.square().mean() + eps) * w).to(torch.bfloat16).to(F64)
        c, s = _cs(cos_sin, pos // ratio * ratio)
        key = _rotate(k, c, s).to(cache.dtype)
        _row(out, slot)[:] = round_blocks(key.float(), key.numel()).to(cache.dtype) if fp8 else key
    return out


def indexer_q_rope(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    weight_scale: float,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q in q's dtype, weights * weight_scale in fp32); ``fp8``: each head then rounded as one FP8 block."""
    out = q.clone()
    for t in range(q.shape[0]):
        c, s = _cs(cos_sin, int(positions[t]))
        out[t] = _rotate(q[t].to(F64), c, s).to(q.dtype)
        if fp8:
            out[t] = round_blocks(out[t].float(), q.shape[-1]).to(q.dtype)
    return out, (weights[:, : q.shape[1]].to(F64) * weight_scale).to(torch.float32)


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    width: int,
) -> torch.Tensor:
    """float64 [T, width]: ``sum_h w[t, h] * relu(q[t, h] . k[j])`` for the entries the token sees, else -inf."""
    t_n = q.shape[0]
    rows = cache.shape[1]
    out = torch.full((t_n, width), float("-inf"), dtype=F64)
    for t in range(t_n):
        n = (int(positions[t]) + 1) // ratio
        if n == 0:
            continue
        req = int(token_to_req[t])
        keys = torch.stack([cache[int(block_table[req, j // rows]), j % rows] for j in range(n)]).to(F64)
        s = torch.relu(q[t].to(F64) @ keys.T)  # [H, n]
        out[t, :n] = (weights[t, : q.shape[1]].to(F64)[:, None] * s).sum(0)
    return out


def topk_rows(logits: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [rows, k]: columns of the k largest finite entries of ``logits[r, :lens[r]]`` (value descending, then
    column ascending), written in increasing column order, then -1."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        n = min(int(lens[r]), logits.shape[1])
        x = logits[r, :n].to(F64)
        cols = [c for c in range(n) if torch.isfinite(x[c]) or x[c] == float("inf")]
        cols.sort(key=lambda c: (-float(x[c]), c))
        chosen = sorted(cols[:k])
        out[r, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def inv_rope_grouped(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[G, T, (H / G) * D] in o's dtype: each head de-rotated (RoPE by -angle), heads laid out by group."""
    t_n, heads, d = o.shape
    hpg = heads // n_groups
    out = torch.empty(n_groups, t_n, hpg * d, dtype=o.dtype)
    for t in range(t_n):
        c, s = _cs(cos_sin, int(positions[t]))
        y = _rotate(o[t].to(F64), c, s, inverse=True).to(o.dtype)  # [H, D]
        out[:, t] = y.reshape(n_groups, hpg * d)
    return out


def select_candidate_blocks(
    logits: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block_size: int, out: torch.Tensor
) -> None:
    """V4.1's candidate source: per row, the ``topk_blocks`` blocks of ``block_size`` columns with the largest max
    score among the row's ``lens[r]`` columns, the newest block always included; ``-1`` pads (blocks whose score is
    -inf are not candidates). Semantics of upstream's ``select_candidate_blocks`` with zero row starts."""
    rows, width = logits.shape
    nblocks = -(-width // block_size)
    out[:rows].fill_(-1)
    for r in range(rows):
        n = min(int(lens[r]), width)
        scores = torch.full((nblocks,), float("-inf"), dtype=F64)
        for b in range(nblocks):
            seg = logits[r, b * block_size : min((b + 1) * block_size, n)]
            if seg.numel():
                scores[b] = seg.to(F64).max()
        if n > 0:
            scores[(n - 1) // block_size] = float("inf")
        top = torch.topk(scores, min(topk_blocks, nblocks))
        ids = torch.where(top.values != float("-inf"), top.indices, -1)
        out[r, : ids.numel()] = ids.to(out.dtype)


def apply_candidate_mask(logits: torch.Tensor, lens: torch.Tensor, candidates: torch.Tensor, block_size: int) -> None:
    """V4.1's candidate consumers: set to -inf every column outside the row's length or outside its candidate
    blocks (in place; upstream's ``apply_candidate_mask`` with zero row starts)."""
    rows, width = logits.shape
    for r in range(rows):
        n = min(int(lens[r]), width)
        keep = torch.zeros(width, dtype=torch.bool)
        for b in candidates[r].tolist():
            if b >= 0:
                if b * block_size >= width:  # a candidate past the scored width keeps the last column
                    keep[width - 1] = True
                else:
                    keep[b * block_size : (b + 1) * block_size] = True
        keep[n:] = False
        logits[r, ~keep] = float("-inf")
