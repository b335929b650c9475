"""A decode call's routing prepared for the tiered runtime in one GPU launch instead of ~13.

Per MoE layer call the tiered runtime needs, from the router's ``topk_ids`` / ``topk_weights`` and the cache's
``slot_of`` row of the layer: the ids as int32 and the weights as fp32 in its persistent buffers, which picks
are hits (resident, and a real pick: vLLM pads a CUDA graph's batch with id -1), the hits' ids with every other
pick -1 (what the split path's hit kernel computes), the cache's step counts (+1 at each real pick's expert:
``ExpertCache.observe``) and, on the device path, its running hit / pick counts. As torch ops that is ~13
launches (copies, clamp, compares, an index, ``index_add_``, sums, a stack); ``prepare_routing`` runs them as one
Triton kernel on a GPU and as the torch ops (``prepare_routing_reference``, the definition) elsewhere. The two
are equal bit for bit (integer work; the counts are whole numbers in fp32, so the atomics' order cannot show).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["prepare_routing", "prepare_routing_reference", "share_misses", "share_misses_reference"]

#: Picks one program of the kernel handles (a decode call has at most 16 x top-k; a larger call has a grid).
BLOCK = 128


def prepare_routing_reference(topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_row: torch.Tensor,
                              counts: torch.Tensor | None, dev_counts: torch.Tensor | None, ids: torch.Tensor,
                              w: torch.Tensor, hit: torch.Tensor, gpu_ids: torch.Tensor | None) -> None:  # fmt: skip
    """The definition, as torch ops. Writes ``ids`` (int32 ``[t, k]``) and ``w`` (fp32) from the router's outputs,
    ``hit`` (bool: a real pick whose expert has a slot, ``slot_row[id] >= 0``), ``gpu_ids`` (the id where ``hit``,
    else -1; skipped when None); adds 1.0 to ``counts[id]`` per real pick (skipped when None) and ``(hits, real
    picks)`` to ``dev_counts`` (int64 ``[2]``; skipped when None)."""
    ids.copy_(topk_ids)
    w.copy_(topk_weights)
    valid = ids >= 0
    clamped = ids.clamp(min=0)
    if counts is not None:
        counts.index_add_(0, clamped.reshape(-1), valid.reshape(-1).to(torch.float32))
    torch.ge(slot_row[clamped.long()], 0, out=hit)
    hit &= valid
    if gpu_ids is not None:
        torch.where(hit, ids, torch.full((), -1, dtype=ids.dtype, device=ids.device), out=gpu_ids)
    if dev_counts is not None:
        dev_counts.add_(torch.stack((hit.sum(), valid.sum())))


def prepare_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_row: torch.Tensor,
                    counts: torch.Tensor | None, dev_counts: torch.Tensor | None, ids: torch.Tensor, w: torch.Tensor,
                    hit: torch.Tensor, gpu_ids: torch.Tensor | None,
                    use_triton: bool | None = None) -> None:  # fmt: skip
    """``prepare_routing_reference``'s effect: one Triton launch on a CUDA device (``use_triton`` None), the torch
    ops elsewhere; ``use_triton=True`` forces the kernel (Triton's interpreter on the CPU, tests)."""
    if use_triton is None:
        use_triton = topk_ids.device.type == "cuda"
    if not use_triton:
        prepare_routing_reference(topk_ids, topk_weights, slot_row, counts, dev_counts, ids, w, hit, gpu_ids)
        return
    if topk_ids.shape != ids.shape or topk_weights.shape != ids.shape:  # (broadcasting: the general path)
        prepare_routing_reference(topk_ids, topk_weights, slot_row, counts, dev_counts, ids, w, hit, gpu_ids)
        return
    n = ids.numel()
    if n == 0:
        return
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()  # (a router's outputs already are)
    for name, tns in (("ids", ids), ("w", w), ("hit", hit), ("gpu_ids", gpu_ids), ("slot_row", slot_row)):
        if tns is not None and not tns.is_contiguous():
            raise ValueError(f"prepare_routing: {name} must be contiguous")
    kernel = _kernel()
    dummy = ids  # a pointer for the disabled outputs (never written: the constexpr flags drop their code)
    kernel[(-(-n // BLOCK),)](
        topk_ids, topk_weights, slot_row, counts if counts is not None else dummy,
        dev_counts if dev_counts is not None else dummy, ids, w, hit.view(torch.uint8),
        gpu_ids if gpu_ids is not None else dummy, n,
        COUNT=counts is not None, DEV_COUNTS=dev_counts is not None, GPU_IDS_OUT=gpu_ids is not None, BLOCK=BLOCK,
    )  # fmt: skip


def share_misses_reference(ids: torch.Tensor, hit: torch.Tensor, gpu_ids: torch.Tensor, quota: torch.Tensor,
                           count: torch.Tensor) -> None:  # fmt: skip
    """The stream-driven split's PCIe share of a call, as torch ops (the definition). Of the call's distinct missed
    experts (real picks, ``ids >= 0``, not ``hit``), ``quota[n]`` go to the GPU, which reads them from the host home
    (``n``: how many there are; ``n`` past the table's end reads its last entry): the most-picked first (a read
    over PCIe costs the same for any number of tokens, the CPU tier's time grows with them), then the lowest ids.
    Their picks become ``hit`` (so the CPU tier skips them) and their ids are written to ``gpu_ids`` (so the hit
    kernel computes them); their pick count is added to ``count`` (int64 ``[1]``). No host sync: the quota is
    looked up on the device. ``ids`` int32 ``[t, k]``, ``hit`` bool, ``gpu_ids`` int32, ``quota`` int32
    ``[>= 1]`` (``split.share_quota_table``'s row for the call's token count)."""
    e = ids.reshape(-1).to(torch.int64)
    n = e.numel()
    miss = (e >= 0) & ~hit.reshape(-1)
    idx = torch.arange(n, device=ids.device)
    same = (e[:, None] == e[None, :]) & miss[:, None] & miss[None, :]
    first = miss & ~(same & (idx[None, :] < idx[:, None])).any(dim=1)  # each distinct missed expert once
    picks = same.sum(dim=1)  # the picks of each pick's expert
    ahead = (picks[None, :] > picks[:, None]) | ((picks[None, :] == picks[:, None]) & (e[None, :] < e[:, None]))
    rank = (ahead & first[None, :]).sum(dim=1)  # distinct missed experts before this pick's
    q = quota[first.sum().clamp(max=quota.numel() - 1)]
    pcie = (miss & (rank < q)).view_as(hit)
    hit |= pcie
    torch.where(pcie, ids, gpu_ids, out=gpu_ids)
    count.add_(pcie.sum())


def share_misses(ids: torch.Tensor, hit: torch.Tensor, gpu_ids: torch.Tensor, quota: torch.Tensor,
                 count: torch.Tensor, use_triton: bool | None = None) -> None:  # fmt: skip
    """``share_misses_reference``'s effect: one Triton program on a CUDA device (``use_triton`` None; the call's
    picks in one block, pairwise), the torch ops elsewhere; ``use_triton=True`` forces the kernel (Triton's
    interpreter on the CPU, tests)."""
    if use_triton is None:
        use_triton = ids.device.type == "cuda"
    if not use_triton:
        share_misses_reference(ids, hit, gpu_ids, quota, count)
        return
    n = ids.numel()
    if n == 0:
        return
    for name, tns in (("ids", ids), ("hit", hit), ("gpu_ids", gpu_ids), ("quota", quota)):
        if not tns.is_contiguous():
            raise ValueError(f"share_misses: {name} must be contiguous")
    if _share is None:
        raise RuntimeError("share_misses: the kernel needs Triton, which is not installed")
    block = max(BLOCK, 1 << (n - 1).bit_length())  # one size for every decode call (16 x top-k <= 128): one compile
    _share[(1,)](ids, hit.view(torch.uint8), gpu_ids, quota, count, n, quota.numel() - 1, BLOCK=block)


def _kernel() -> Any:
    if _route_prep is None:
        raise RuntimeError("prepare_routing: the fused kernel needs Triton, which is not installed")
    return _route_prep


try:
    import triton
    import triton.language as tl
except ImportError:  # (torch without CUDA may come without Triton: the torch ops serve there)
    _route_prep = None
    _share = None
else:

    @triton.jit
    def _share(IDS, HIT, GPU_IDS, QUOTA, COUNT, N, QMAX, BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.arange(0, BLOCK)
        m = offs < N
        e = tl.load(IDS + offs, mask=m, other=-1).to(tl.int32)
        h = tl.load(HIT + offs, mask=m, other=1)
        miss = m & (e >= 0) & (h == 0)
        same = (e[:, None] == e[None, :]) & miss[:, None] & miss[None, :]
        first = miss & (tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1) == 0)
        picks = tl.sum(same.to(tl.int32), axis=1)
        ahead = (picks[None, :] > picks[:, None]) | ((picks[None, :] == picks[:, None]) & (e[None, :] < e[:, None]))
        rank = tl.sum((ahead & first[None, :]).to(tl.int32), axis=1)
        q = tl.load(QUOTA + tl.minimum(tl.sum(first.to(tl.int32), axis=0), QMAX))
        pcie = miss & (rank < q)
        tl.store(HIT + offs, ((h != 0) | pcie).to(tl.uint8), mask=m)
        g = tl.load(GPU_IDS + offs, mask=m, other=-1)
        tl.store(GPU_IDS + offs, tl.where(pcie, e, g), mask=m)
        tl.atomic_add(COUNT, tl.sum(pcie.to(tl.int64), axis=0))

    @triton.jit
    def _route_prep(TOPK_IDS, TOPK_W, SLOT_ROW, COUNTS, DEV, IDS, W, HIT, GPU_IDS, N,
                    COUNT: tl.constexpr, DEV_COUNTS: tl.constexpr, GPU_IDS_OUT: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        e = tl.load(TOPK_IDS + offs, mask=m, other=-1).to(tl.int32)
        wt = tl.load(TOPK_W + offs, mask=m, other=0.0).to(tl.float32)
        valid = m & (e >= 0)
        ec = tl.where(valid, e, 0)
        slot = tl.load(SLOT_ROW + ec, mask=valid, other=-1)
        h = valid & (slot >= 0)
        tl.store(IDS + offs, e, mask=m)
        tl.store(W + offs, wt, mask=m)
        tl.store(HIT + offs, h.to(tl.uint8), mask=m)
        if GPU_IDS_OUT:
            tl.store(GPU_IDS + offs, tl.where(h, e, -1), mask=m)
        if COUNT:
            tl.atomic_add(COUNTS + ec, tl.full((BLOCK,), 1.0, tl.float32), mask=valid)
        if DEV_COUNTS:
            tl.atomic_add(DEV, tl.sum(h.to(tl.int64), axis=0))
            tl.atomic_add(DEV + 1, tl.sum(valid.to(tl.int64), axis=0))
