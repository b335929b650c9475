"""The device path's staged read: a decode call's misses copied into transient VRAM slots by the GPU itself.

The device path (``vllm_dsv41.tiered``) computes a decode call's every pick in one hit-kernel call through a pointer
table, with no host sync: hits from their VRAM cache slots, misses read in place from the GPU-mapped host home. A
checkpoint's safetensors files place tensors on 8-byte boundaries only, and exllamav3's kernel (the fast one) loads
16 bytes at a time, so on such a home the misses cannot be read in place; the split path then stages them through
transient VRAM slots with the copy engine, which needs the host to know the misses (a device-to-host copy and a
sync per layer). This module stages them from the device instead, so the device path works on any home whose
tensors are 4-byte aligned:

1. ``plan`` (one launch): from the call's ids and hit mask, each distinct missed expert gets a rank (in order of its
   first pick); a copy of the layer's pointer table whose missed experts point to transient slot ``rank % per``
   (``per`` slots); per round ``r`` the picks it computes (the hits in round 0, the misses of ranks
   ``[r * per, (r + 1) * per)``; -1 elsewhere); and rank -> expert.
2. Per round, ``copy`` (one launch): the round's experts' tensors read from the mapped home (4-byte loads: PCIe
   requests of a warp's 128 bytes) into their slots; then the hit kernel over that round's picks.

A call of ``n`` picks has ``ceil(n / per)`` rounds whatever its misses (a round with nothing to copy exits at
once), so the launches depend on the shapes only. ``plan_reference`` / ``copy_reference`` are the definition as
torch ops and ``ctypes.memmove`` (a CPU device, tests); the Triton kernels run on CUDA and, in tests, in Triton's
interpreter, equal to the definition bit for bit (integer work and byte copies).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MAX_PICKS", "DeviceStaging", "copy_reference", "plan_reference"]

#: The most picks one call may have (the device path's calls: ``HIT_CHUNK_TOKENS`` x top-k <= 16 x 8).
MAX_PICKS = 128
#: Experts' table entries one program of the plan kernel writes.
_BLOCK_E = 128
#: Bytes one program of the copy kernel copies.
CHUNK_BYTES = 16384


def plan_reference(ids: torch.Tensor, hit: torch.Tensor, table: torch.Tensor, slot_addr: torch.Tensor,
                   table_d: torch.Tensor, ids_r: torch.Tensor, rank_expert: torch.Tensor) -> None:  # fmt: skip
    """The definition. ``ids`` (int32, ``n`` picks; < 0: no pick), ``hit`` (bool, resident), ``table`` (int64
    ``[P, E]``: the layer's pointer table), ``slot_addr`` (int64 ``[P, per]``: projection ``p`` of transient slot
    ``s``). Writes ``table_d`` (``table`` with each missed expert's column pointing to slot ``rank % per``),
    ``ids_r`` (int32 ``[R, n]``: round ``r``'s picks, -1 elsewhere) and ``rank_expert`` (int32 ``[>= n]``: the
    expert of each rank, -1 past the last)."""
    per = slot_addr.shape[1]
    e = ids.reshape(-1).to(torch.int64)
    n = e.numel()
    h = hit.reshape(-1)
    idx = torch.arange(n, device=e.device)
    valid = e >= 0
    miss = valid & ~h
    same = e[:, None] == e[None, :]
    first = valid & ~(same & (idx[:, None] < idx[None, :]) & valid[:, None]).any(0)
    fm = first & miss
    crank = torch.cumsum(fm.to(torch.int64), 0) - 1
    rank_of = ((same & (idx[:, None] <= idx[None, :]) & fm[:, None]).to(torch.int64) * crank[:, None]).sum(0)
    rank_expert.fill_(-1)
    rank_expert[crank[fm]] = e[fm].to(rank_expert.dtype)
    table_d.copy_(table)
    table_d[:, e[fm]] = slot_addr[:, crank[fm] % per]
    rounds = ids_r.shape[0]
    for r in range(rounds):
        keep = (h & (r == 0)) | (miss & (torch.div(rank_of, per, rounding_mode="floor") == r))
        ids_r[r].copy_(torch.where(keep, e, -1).to(ids_r.dtype))


def copy_reference(table: torch.Tensor, slot_addr: torch.Tensor, nbytes: Sequence[int], rank_expert: torch.Tensor,
                   round_: int) -> int:  # fmt: skip
    """The definition of round ``round_``'s copies on the host: each expert of ranks ``[round_ * per, (round_ + 1) *
    per)`` copied, projection by projection (``nbytes[p]`` bytes from ``table[p, expert]``), to its slot. Only
    where both addresses are the host's (a CPU device). Returns the bytes copied."""
    per = slot_addr.shape[1]
    experts = rank_expert[round_ * per : (round_ + 1) * per].tolist()
    tab, slots = table.tolist(), slot_addr.tolist()
    done = 0
    for s, ex in enumerate(experts):
        if ex < 0:
            break
        for p, nb in enumerate(nbytes):
            ctypes.memmove(slots[p][s], tab[p][ex], nb)
            done += nb
    return done


class DeviceStaging:
    """The plan and copies of the device path's staged read over ``per`` transient slots (see the module doc).

    Parameters
    ----------
    slot_addr : int64 ``[P, per]`` on the device: the address of projection ``p`` of each transient slot.
    nbytes : bytes of each projection (all multiples of 4; the home's addresses must be 4-byte aligned: the caller
        checks both with :func:`supported`).
    num_experts : experts per layer (the pointer table's columns).
    use_triton : None: the kernels on CUDA, the definition elsewhere; True forces the kernels (the interpreter).
    """

    def __init__(self, slot_addr: torch.Tensor, nbytes: Sequence[int], num_experts: int, *,
                 use_triton: bool | None = None) -> None:  # fmt: skip
        self.slot_addr = slot_addr
        self.device = slot_addr.device
        self.per = int(slot_addr.shape[1])
        self.nbytes = [int(b) for b in nbytes]
        if self.per < 1 or len(self.nbytes) != slot_addr.shape[0]:
            raise ValueError(f"device staging: slot_addr {tuple(slot_addr.shape)} for {len(self.nbytes)} projections")
        self.num_experts = num_experts
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self._nbytes_t = torch.tensor(self.nbytes, dtype=torch.int64, device=self.device)
        self._chunks = -(-max(self.nbytes) // CHUNK_BYTES)
        p = len(self.nbytes)
        self.table_d = torch.empty((p, num_experts), dtype=torch.int64, device=self.device)
        self._ids_r = torch.empty(self.rounds(MAX_PICKS) * MAX_PICKS, dtype=torch.int32, device=self.device)
        self.rank_expert = torch.empty(MAX_PICKS, dtype=torch.int32, device=self.device)
        self.bytes_copied = 0  # by the reference only (the kernels' copies stay on the device)

    @staticmethod
    def supported(alignment: int, nbytes: Sequence[int]) -> bool:
        """Whether a home of this address ``alignment`` with projections of ``nbytes`` can be staged (4-byte words)."""
        return alignment % 4 == 0 and all(b % 4 == 0 for b in nbytes)

    def rounds(self, picks: int) -> int:
        """Rounds of a call of ``picks`` picks (its shape's, whatever its misses)."""
        return max(1, -(-picks // self.per))

    def plan(self, ids: torch.Tensor, hit: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Plan a call (``ids`` / ``hit``: ``[t, k]``, contiguous): returns ``ids_r`` ``[R, t, k]``; ``table_d``
        holds the call's pointer table."""
        n = ids.numel()
        if n > MAX_PICKS:
            raise ValueError(f"device staging: a call of {n} picks (at most {MAX_PICKS})")
        for name, x, dtype in (("ids", ids, torch.int32), ("hit", hit, torch.bool), ("table", table, torch.int64)):
            if x.dtype != dtype or not x.is_contiguous() or x.device != self.device:
                raise ValueError(f"device staging: {name} must be contiguous {dtype} on {self.device}, got "
                                 f"{x.dtype} on {x.device}{'' if x.is_contiguous() else ', strided'}")  # fmt: skip
        if hit.shape != ids.shape:
            raise ValueError(f"device staging: hit {tuple(hit.shape)} for ids {tuple(ids.shape)}")
        if table.shape != self.table_d.shape:
            raise ValueError(
                f"device staging: pointer table {tuple(table.shape)}, expected {tuple(self.table_d.shape)}"
            )
        rounds = self.rounds(n)
        ids_r = self._ids_r[: rounds * n].view(rounds, n)
        if not self.use_triton:
            plan_reference(ids, hit, table, self.slot_addr, self.table_d, ids_r, self.rank_expert)
        elif n:
            # the pick block as small as the call allows (its [B, B] temporaries: 16, 32, 64 or 128 picks)
            block_n = max(16, 1 << (n - 1).bit_length())
            _kernels()[0][(-(-self.num_experts // _BLOCK_E),)](
                ids, hit.view(torch.uint8), table, self.slot_addr, self.table_d, ids_r, self.rank_expert,
                n, self.num_experts, self.per, rounds, self.rank_expert.numel(),
                P=len(self.nbytes), BLOCK_N=block_n, BLOCK_E=_BLOCK_E, num_warps=8,
            )  # fmt: skip
        else:  # nothing to stage (a later copy() finds no expert)
            self.rank_expert.fill_(-1)
        return ids_r.view(rounds, *ids.shape)

    def copy(self, table: torch.Tensor, round_: int) -> None:
        """Round ``round_``'s copies (after ``plan``, on the same stream): its experts' tensors from ``table``'s
        addresses (the home's, for a missed expert) into their slots."""
        if not self.use_triton:
            self.bytes_copied += copy_reference(table, self.slot_addr, self.nbytes, self.rank_expert, round_)
            return
        _kernels()[1][(self.per, len(self.nbytes), self._chunks)](
            table, self.slot_addr, self._nbytes_t, self.rank_expert, round_ * self.per, self.rank_expert.numel(),
            self.num_experts, self.per, CHUNK=CHUNK_BYTES,
        )  # fmt: skip


def _kernels() -> tuple[Any, Any]:
    if _stage_plan is None:
        raise RuntimeError("device staging: the kernels need Triton, which is not installed")
    return _stage_plan, _stage_copy


try:
    import triton
    import triton.language as tl
except ImportError:  # (torch without CUDA may come without Triton: the definition serves there)
    _stage_plan = _stage_copy = None
else:
    # (the integer arguments not specialized on their values: a new batch size does not compile the kernels again)
    @triton.jit(do_not_specialize=["N", "E", "PER", "R", "NRANK"])
    def _stage_plan(IDS, HIT, TABLE, SLOT_ADDR, TABLE_D, IDS_R, RANK_EXPERT, N, E, PER, R, NRANK,
                    P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
        i = tl.arange(0, BLOCK_N)
        m = i < N
        e = tl.load(IDS + i, mask=m, other=-1)
        hv = tl.load(HIT + i, mask=m, other=0)
        valid = e >= 0
        miss = valid & (hv == 0)
        same = e[:, None] == e[None, :]
        earlier = (same & (i[:, None] < i[None, :]) & valid[:, None]).to(tl.int32)
        first = valid & (tl.sum(earlier, axis=0) == 0)
        fm = first & miss
        crank = tl.cumsum(fm.to(tl.int32), axis=0) - 1
        # a miss's rank is its expert's: its first pick's
        own = same & (i[:, None] <= i[None, :]) & fm[:, None]
        rank_of = tl.sum(tl.where(own, crank[:, None], 0), axis=0)
        # this program's experts in the call's table: a missed expert -> its slot, the others as the layer's
        ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        em = ex < E
        match = (ex[:, None] == e[None, :]) & fm[None, :]
        s = tl.sum(tl.where(match, (crank % PER + 1)[None, :], 0), axis=1) - 1
        staged = s >= 0
        sc = tl.where(staged, s, 0)
        for p in tl.static_range(P):
            old = tl.load(TABLE + p * E + ex, mask=em, other=0)
            new = tl.load(SLOT_ADDR + p * PER + sc, mask=em & staged, other=0)
            tl.store(TABLE_D + p * E + ex, tl.where(staged, new, old), mask=em)
        if tl.program_id(0) == 0:
            rnd = rank_of // PER
            for r in range(R):
                keep = ((hv != 0) & valid & (r == 0)) | (miss & (rnd == r))
                tl.store(IDS_R + r * N + i, tl.where(keep, e, -1), mask=m)
            rk = tl.arange(0, BLOCK_N)
            at = (crank[None, :] == rk[:, None]) & fm[None, :]
            tl.store(RANK_EXPERT + rk, tl.sum(tl.where(at, (e + 1)[None, :], 0), axis=1) - 1)
            for r0 in range(BLOCK_N, NRANK, BLOCK_N):  # the ranks past this call's block: none
                tl.store(RANK_EXPERT + r0 + rk, tl.full((BLOCK_N,), -1, tl.int32), mask=r0 + rk < NRANK)

    @triton.jit(do_not_specialize=["R0", "NRANK", "E", "PER"])
    def _stage_copy(TABLE, SLOT_ADDR, NBYTES, RANK_EXPERT, R0, NRANK, E, PER, CHUNK: tl.constexpr):
        s = tl.program_id(0)
        p = tl.program_id(1)
        start = tl.program_id(2) * CHUNK
        rk = R0 + s
        if rk < NRANK:
            ex = tl.load(RANK_EXPERT + rk)
            nb = tl.load(NBYTES + p)
            if (ex >= 0) & (start < nb):
                src = tl.load(TABLE + p * E + ex).to(tl.pointer_type(tl.int32))
                dst = tl.load(SLOT_ADDR + p * PER + s).to(tl.pointer_type(tl.int32))
                w = start // 4 + tl.arange(0, CHUNK // 4)
                wm = w < nb // 4
                tl.store(dst + w, tl.load(src + w, mask=wm), mask=wm)
