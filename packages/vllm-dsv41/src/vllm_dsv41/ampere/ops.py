"""The indexer's selection and the index bookkeeping, composed from ``kernels`` (no vLLM import).

``index_topk`` is what replaces upstream's ``SparseAttnIndexer`` (DeepGEMM logits + CUDA top-k): scores of every
token against its request's keys, V4.1's two-level candidate filter, top-k. ``global_slots`` turns the
request-local selection into cache slots for ``kernels.sparse_mqa_attention``. Both run on CUDA tensors in the
served model and on CPU tensors under Triton's interpreter in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import kernels

__all__ = ["DEFAULT_LOGITS_BYTES", "global_slots", "index_topk"]

#: Largest fp32 score matrix ``index_topk`` materializes at once (rows are chunked to fit; upstream's default
#: ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` is the same order).
DEFAULT_LOGITS_BYTES = 256 << 20


def _candidates(logits: torch.Tensor, lens: torch.Tensor, cand: torch.Tensor, block: int, write: bool) -> None:
    if logits.is_cuda:  # upstream's arch-neutral Triton kernels (vllm/model_executor/kernels/attention/dsa)
        from vllm.model_executor.kernels.attention.dsa.candidate_blocks import (
            apply_candidate_mask,
            select_candidate_blocks,
        )

        if write:
            select_candidate_blocks(logits, None, lens, cand.shape[1], block, cand)
        else:
            apply_candidate_mask(logits, None, lens, cand, block)
        return
    from . import reference  # CPU (tests): the same semantics in torch

    if write:
        reference.select_candidate_blocks(logits, lens, cand.shape[1], block, cand)
    else:
        reference.apply_candidate_mask(logits, lens, cand, block)


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    query_start_loc: Sequence[int] | torch.Tensor,
    num_tokens: int,
    width: int,
    topk: int,
    out: torch.Tensor,
    *,
    candidates: torch.Tensor | None = None,
    candidate_write: bool = False,
    candidate_block_size: int = 0,
    max_logits_bytes: int = DEFAULT_LOGITS_BYTES,
    block_tokens: int = 4,
) -> None:
    """``out[t, :topk]``: the request-local compressed entries token ``t`` attends to (increasing, then -1).

    ``q`` [T, NH, D] roped bf16 index queries, ``weights`` [T, NH] fp32 (already scaled), ``k_cache`` the paged
    bf16 index keys, ``block_table`` its per-request blocks, ``token_to_req`` / ``positions`` per token,
    ``query_start_loc`` the requests' token offsets on the host, ``width`` at least the largest number of entries a
    token sees (``max_seq_len // ratio``). With ``candidates`` (V4.1's two-level filter, [T, blocks]) the candidate
    source writes its top blocks there (``candidate_write``) and the later indexers keep only those blocks' scores.
    Rows are processed in chunks whose fp32 scores fit ``max_logits_bytes``.
    """
    if num_tokens == 0 or topk == 0:
        return
    if width <= 0:
        out[:num_tokens, :topk].fill_(-1)
        return
    dev = q.device
    lens_all = torch.div(positions[:num_tokens] + 1, ratio, rounding_mode="floor").to(torch.int32)
    rows_per_chunk = max(1, max_logits_bytes // (4 * width))
    for r0 in range(0, num_tokens, rows_per_chunk):
        r1 = min(num_tokens, r0 + rows_per_chunk)
        starts, counts = kernels.token_blocks(query_start_loc, r0, r1, block_tokens)
        # from pinned memory (the caching host allocator keeps it until the copy ran): a pageable source would make
        # the driver stage it and the host wait, per indexer layer and step
        pinned = dev.type == "cuda"
        blk = torch.tensor([starts, counts], dtype=torch.int32, pin_memory=pinned).to(dev, non_blocking=True)
        logits = torch.empty((r1 - r0, width), dtype=torch.float32, device=dev)
        kernels.indexer_logits(
            q,
            weights,
            k_cache,
            block_table,
            token_to_req,
            positions,
            ratio,
            blk[0],
            blk[1],
            logits,
            row0=r0,
            block_tokens=block_tokens,
        )
        lens = lens_all[r0:r1]
        if candidates is not None:
            _candidates(logits, lens, candidates[r0:r1], candidate_block_size, candidate_write)
        kernels.topk_rows(logits, lens, topk, out[r0:r1])


def global_slots(
    local: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    rows_per_block: int,
    is_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache slots int32 [T, K], counts int32 [T]) of request-local entries ``local`` [T, K] (-1 stays -1).

    The counts are the number of selected entries (``local`` lists are compact: valid entries first); tokens
    with ``is_valid`` false (CUDA-graph padding) get 0.
    """
    loc = local.to(torch.int64)
    valid = loc >= 0
    req = token_to_req[: loc.shape[0]].to(torch.int64)[:, None]
    blk = block_table.to(torch.int64)[req, torch.div(loc.clamp(min=0), rows_per_block, rounding_mode="floor")]
    slots = torch.where(valid, blk * rows_per_block + loc.remainder(rows_per_block), -1).to(torch.int32)
    counts = valid.sum(1, dtype=torch.int32)
    if is_valid is not None:
        counts = counts * is_valid[: loc.shape[0]].to(torch.int32)
    return slots, counts
