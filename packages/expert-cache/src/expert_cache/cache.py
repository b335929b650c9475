"""The expert cache on a device: slot pool, per-layer ``slot_of`` maps, pointer tables, stream-ordered swaps.

Memory model
------------
Every expert keeps its *home* copy in host memory (pinned or CUDA-registered, so a GPU kernel can read it in
place): stacked host tensors or an address-based :class:`expert_cache.home.ExpertRows`. The pool holds
``num_slots`` slots of ``config.slot_stride`` bytes on the device, its base and every column inside a slot aligned
to ``config.slot_alignment`` (>= 128 bytes). For every (layer, projection, expert) the int64 pointer table
``[num_layers, num_projections, num_experts]`` holds the address a kernel must read: the slot's bytes when the
expert is resident, the home row's kernel address otherwise; ``layer_pointers(layer)[p]`` is one contiguous
``[num_experts]`` array per projection, the form pointer-table MoE kernels take. ``slot_of[layer, expert]`` (int32)
is the slot or -1.

Ordering (CUDA)
---------------
All table writes happen on the *compute stream* (the stream the MoE kernels run on), between steps. A swap of
victim ``v`` (in slot ``s``) for newcomer ``n``:

1. compute stream: ``v``'s pointers go back home, ``slot_of[v] = -1``; record event A;
2. side stream: wait A, copy ``n``'s home rows into slot ``s``; record event B;
3. compute stream: wait B (or, with ``async_fill``, at the first step boundary where B has completed), then
   ``n``'s pointers move to slot ``s`` and ``slot_of[n] = s``.

Kernels enqueued before step 1 read ``v`` from ``s``, and the fill cannot start before they finish (A); kernels
after step 1 read ``v`` from home; no kernel reads ``n`` from ``s`` before its bytes are there (B). A pointer
that is stale (still home) is slower, never wrong. On a CPU device every copy is synchronous.

Hot path
--------
:meth:`observe` is one ``index_add_`` into the step's pick counts (a fixed buffer); :meth:`after_step` folds the
step into the interval counters with a handful of element-wise ops over ``num_layers * num_experts`` values.
Neither reads a device value on the host. The counters are copied to the host once per replan; the
replan waits for that copy (one sync, like the reference) unless ``async_observe`` lets it use the previous one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .config import ExpertCacheConfig
from .home import ExpertRows
from .planner import CacheController, CacheStats, Swap
from .policies import HybridPolicy, save_profile

__all__ = ["ExpertCache", "Loan", "slot_pool"]


def slot_pool(config: ExpertCacheConfig, num_slots: int, device: torch.device | str) -> torch.Tensor:
    """A ``[num_slots, slot_stride]`` uint8 pool on ``device`` (uninitialised) whose base is on a
    ``config.slot_alignment`` boundary, so every projection column of every slot is (the layout the cache's pointer
    tables and the hit kernels assume). The one allocator of slots: the cache's pool and any transient slots."""
    n, align = num_slots * config.slot_stride, config.slot_alignment
    raw = torch.empty(n + align, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % align  # CPU tensors are only 64-aligned
    return raw[skip : skip + n].view(num_slots, config.slot_stride)


@dataclasses.dataclass(frozen=True, eq=False)
class Loan:
    """Pool memory lent out by :meth:`ExpertCache.lend`.

    ``buffer`` is the uint8 view of slots ``[first_slot, first_slot + num_slots)`` (contiguous, ``num_slots *
    slot_stride`` bytes, ``slot_alignment``-aligned). The borrower's first write must wait for ``ready`` (a CUDA
    event on the cache's side stream, after every copy that reads or writes those slots; None on a CPU device).
    """

    buffer: torch.Tensor
    first_slot: int
    num_slots: int
    evicted: int
    moved: int
    ready: Any = None


class ExpertCache:
    """An elastic cache of expert weights in device slots, read by kernels through pointer tables.

    Parameters
    ----------
    config
        The configuration (geometry, size, policy, lifecycle).
    home
        Where the experts live on the host (the cache never writes there), in one of two forms:
        ``home[layer][p]``, the host tensor of projection ``p`` for all experts of ``layer``, shape
        ``[num_experts, *projections[p].shape]``, dtype ``projections[p].dtype``, contiguous, pinned when the
        device is CUDA; or an :class:`~expert_cache.home.ExpertRows` (rows at any addresses inside pinned or
        CUDA-registered host buffers, with the address a kernel reads per buffer). Both behave identically.
    device
        Where the pool and the tables live (``"cpu"`` works, for tests).
    compute_stream
        CUDA only: the stream whose kernels read the tables (default: the current stream at construction).
    free_bytes
        The device memory the pool may take before ``config.margin_bytes`` is subtracted, used only when
        ``config.num_slots`` and ``config.vram_budget_bytes`` are 0 (:meth:`ExpertCacheConfig.resolve_num_slots`).
        Default: the device's free memory now (CUDA; ``torch.cuda.mem_get_info``). A server that builds the cache
        before its KV cache is allocated passes what will be left after it.

    Step protocol
    -------------
    ``before_step(num_tokens)``; the model runs and calls ``observe(layer, ids)`` per MoE layer;
    ``after_step()`` (which replans every ``replan_every`` decode steps). ``replan``, ``release`` and ``rewarm``
    can also be called directly between steps.
    """

    def __init__(
        self,
        config: ExpertCacheConfig,
        home: Sequence[Sequence[torch.Tensor]] | ExpertRows,
        device: torch.device | str = "cpu",
        compute_stream: Any = None,
        free_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        L, E = config.num_layers, config.num_experts
        P = len(config.projection_specs)
        self._offs = config.projection_offsets
        self._stride = config.slot_stride
        rows = home if isinstance(home, ExpertRows) else ExpertRows.from_stacked(home, config)
        rows.check(config, self._cuda)
        self._rows = rows
        home_ptr = rows.kernel_addresses()  # [L, P, E]
        #: int64 ``[L * E, P]``: the home pointers by key (host side, for repointing victims).
        self._home_ptr = np.ascontiguousarray(home_ptr.transpose(0, 2, 1)).reshape(L * E, P)
        # Flat table index of (key, p): (layer * P + p) * E + expert.
        keys = np.arange(L * E, dtype=np.int64)
        self._flat = ((keys // E * P)[:, None] + np.arange(P, dtype=np.int64)[None, :]) * E + (keys % E)[:, None]
        dev = self.device
        # torch.cuda.Stream on a CUDA device, None on a CPU one (every use is on the CUDA path)
        self._compute: Any
        self._side: Any
        if self._cuda:
            self._compute = compute_stream if compute_stream is not None else torch.cuda.current_stream(dev)
            self._side = torch.cuda.Stream(dev)
        else:
            if compute_stream is not None:
                raise ValueError("compute_stream: only meaningful on a CUDA device")
            self._compute = self._side = None
        with self._on_compute():
            #: int64 ``[L, P, E]``: address of each expert's projection (slot or home). Kernels read this.
            self.pointer_table = torch.from_numpy(np.ascontiguousarray(home_ptr)).to(dev)
            #: int32 ``[L, E]``: slot of each expert, -1 when it is read from home.
            self.slot_of = torch.full((L, E), -1, dtype=torch.int32, device=dev)
            R = config.replan_every
            # Routing of the open step (picks per key), folded into the interval buffers by after_step().
            self._step_counts = torch.zeros(L * E, dtype=torch.float32, device=dev)
            self._touched = torch.zeros((R, L * E), dtype=torch.bool, device=dev)  # distinct keys per decode step
            self._counts = torch.zeros(L * E, dtype=torch.float32, device=dev)  # picks since the last drain
            self._prefill_counts = torch.zeros(L * E, dtype=torch.float32, device=dev)
            self._base = torch.arange(L, dtype=torch.int64, device=dev) * E
            self._dev_counters = torch.zeros(4, dtype=torch.int64, device=dev)  # accesses, hits, pick_hits, picks
        if free_bytes is None and self._cuda and not (config.num_slots or config.vram_budget_bytes):
            free_bytes = torch.cuda.mem_get_info(dev)[0]
        self.num_slots = config.resolve_num_slots(free_bytes)
        self._ctl = CacheController(config, self.num_slots)
        self._pool: torch.Tensor | None = None
        self._pending: list[tuple[Any, np.ndarray, np.ndarray]] = []  # (event B, keys, slots) awaiting activation
        self._kind: str | None = None
        self._row = 0  # touched row of the current decode step (= decode steps since the last drain)
        self._prefill_rows = 0
        self._step_rows = 0
        self._fills = 0
        self._moves = 0
        self._loan: Loan | None = None
        self._allocate()

    # ---- validation and helpers ------------------------------------------------------------------------------

    def _on_compute(self) -> Any:
        if self._cuda:
            return torch.cuda.stream(self._compute)
        return torch.no_grad()

    def _h2d(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if not self._cuda:
            return t
        # Pinned staging (torch's caching host allocator keeps the block until the copy is done): the copy is
        # queued on the current (compute) stream and the host never waits for the device.
        return t.pin_memory().to(self.device, non_blocking=True)

    def _write_tables(self, keys: np.ndarray, ptrs: np.ndarray, slots: np.ndarray) -> None:
        """On the compute stream: the pointers of ``keys`` = ``ptrs`` ``[n, P]``, slot_of[keys] = slots."""
        if keys.size == 0:
            return
        with self._on_compute():
            idx = self._h2d(self._flat[keys].reshape(-1))
            self.pointer_table.view(-1).index_copy_(0, idx, self._h2d(ptrs.astype(np.int64).reshape(-1)))
            self.slot_of.view(-1).index_copy_(0, self._h2d(keys.astype(np.int64)), self._h2d(slots.astype(np.int32)))

    def _slot_ptrs(self, slots: np.ndarray) -> np.ndarray:
        assert self._pool is not None
        base = self._pool.data_ptr() + slots.astype(np.int64)[:, None] * self._stride
        return base + np.asarray(self._offs, np.int64)[None, :]

    def _allocate(self) -> None:
        if self._pool is not None or self.num_slots == 0:
            return
        with self._on_compute():
            self._pool = slot_pool(self.config, self.num_slots, self.device)
            if self._cuda:
                # The side stream writes the pool: the allocator must not hand its memory out again before
                # those copies are done, whenever the pool is dropped.
                self._pool.record_stream(self._side)

    # ---- swaps -----------------------------------------------------------------------------------------------

    def _execute(self, swaps: list[Swap]) -> None:
        if not swaps:
            return
        old = np.array([s.old_key for s in swaps if s.old_key >= 0], np.int64)
        new = np.array([s.new_key for s in swaps], np.int64)
        slots = np.array([s.slot for s in swaps], np.int64)
        # 1. victims back home (compute stream), and never activate them later.
        self._write_tables(old, self._home_ptr[old], np.full(old.size, -1))
        # 2. fills on the side stream after the repoint.
        E = self.config.num_experts
        assert self._pool is not None
        if self._cuda:
            ev_a = torch.cuda.Event()
            ev_a.record(self._compute)
            self._side.wait_event(ev_a)
            ctx: Any = torch.cuda.stream(self._side)
        else:
            ctx = torch.no_grad()
        with ctx:
            for key, slot in zip(new.tolist(), slots.tolist(), strict=True):
                layer, e = divmod(key, E)
                self._rows.copy_expert(self._pool[slot], layer, e, self.config, non_blocking=self._cuda)
        self._fills += new.size
        # 3. activation.
        if not self._cuda:
            self._activate(new, slots)
            return
        ev_b = torch.cuda.Event()
        ev_b.record(self._side)
        if self.config.async_fill:
            self._pending.append((ev_b, new, slots))
        else:
            self._compute.wait_event(ev_b)
            self._activate(new, slots)

    def _activate(self, keys: np.ndarray, slots: np.ndarray) -> None:
        live = self._ctl.slot_of[keys] == slots  # skip keys evicted (or moved) since their fill was queued
        keys, slots = keys[live], slots[live]
        self._write_tables(keys, self._slot_ptrs(slots), slots)

    def _poll(self, wait: bool = False) -> None:
        """Activate newcomers whose fill finished (all of them with ``wait``; the compute stream then waits)."""
        while self._pending:
            ev, keys, slots = self._pending[0]
            if not wait and not ev.query():
                break
            self._compute.wait_event(ev)
            self._pending.pop(0)
            self._activate(keys, slots)

    # ---- observation -----------------------------------------------------------------------------------------

    def before_step(self, num_tokens: int) -> None:
        """Start a step of ``num_tokens`` scheduled tokens (may release or re-warm the pool first)."""
        if self._kind is not None:
            raise RuntimeError("before_step: the previous step was not closed with after_step()")
        kind, action = self._ctl.begin_step(int(num_tokens))
        if action == "release":
            self._release_now()
        elif action == "rewarm":
            self._rewarm_now()
        self._kind = kind
        self._step_rows = 0

    def observe(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Record the routing of one MoE layer in the current step.

        Parameters
        ----------
        layer
            MoE layer index in ``[0, num_layers)``.
        expert_ids
            Integer tensor ``[tokens, top_k]`` on the cache's device, the router's top-k ids, each in
            ``[0, num_experts)`` (not checked on the device: that would need a sync), or negative for no pick (vLLM
            marks the rows a CUDA graph pads a batch with by -1: they are not counted). int32/int64 are used as
            they are; other integer types cost one conversion kernel.

        Notes
        -----
        One device op (an ``index_add_`` into the step's pick counts), no host sync, fixed buffers: a decode step's
        calls can be captured in a CUDA graph (``expert_ids`` of at most 64 elements, or after one eager call of
        the captured size). Prefill steps add to the prefill counts when ``observe_prefill`` is on and do nothing
        otherwise. Call it on the compute stream.
        """
        ids = self._index(expert_ids)
        target = self.observe_counts(layer, expert_ids.shape[0] if expert_ids.dim() > 1 else 1)
        if target is None or ids.numel() == 0:
            return
        target.index_add_(0, ids.clamp(min=0), (ids >= 0).to(torch.float32))

    def observe_counts(self, layer: int, rows: int) -> torch.Tensor | None:
        """What ``observe`` adds to, for a caller that counts in its own fused kernel: the float32 ``[num_experts]``
        counts of ``layer`` in the current step (add 1.0 at each pick's expert id; a negative id adds nothing), or
        None when this step does not observe (a prefill step without ``observe_prefill``). ``rows``: the tokens of
        the routing that will be counted (the step's rows, as ``observe`` records them)."""
        kind = self._kind
        if kind is None:
            raise RuntimeError("observe: call before_step(num_tokens) first")
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer: must be in [0, {self.config.num_layers}), got {layer}")
        if kind == "prefill" and not self.config.observe_prefill:
            return None
        if rows:
            self._step_rows = max(self._step_rows, rows)
        E = self.config.num_experts
        target = self._step_counts if kind == "decode" else self._prefill_counts
        return target[layer * E : (layer + 1) * E]

    def observe_all(self, expert_ids: torch.Tensor) -> None:
        """Record the routing of every MoE layer at once: ``expert_ids`` ``[num_layers, tokens, top_k]``.

        Equivalent to ``observe(layer, expert_ids[layer])`` for each layer, in one pass of device ops.
        """
        kind = self._kind
        if kind is None:
            raise RuntimeError("observe_all: call before_step(num_tokens) first")
        L = self.config.num_layers
        if expert_ids.dim() != 3 or expert_ids.shape[0] != L:
            raise ValueError(f"expert_ids: must be [num_layers={L}, tokens, top_k], got {tuple(expert_ids.shape)}")
        if kind == "prefill" and not self.config.observe_prefill:
            return
        ids = self._index(expert_ids).view(L, -1)
        n = ids.numel()
        if n == 0:
            return
        self._step_rows = max(self._step_rows, expert_ids.shape[1])
        flat = (ids.clamp(min=0) + self._base[:, None]).view(-1)
        target = self._step_counts if kind == "decode" else self._prefill_counts
        target.index_add_(0, flat, (ids >= 0).view(-1).to(torch.float32))  # negative ids (padding) count 0

    def _index(self, expert_ids: torch.Tensor) -> torch.Tensor:
        if expert_ids.device != self.device:
            raise ValueError(f"expert_ids: must be on {self.device}, got {expert_ids.device}")
        if expert_ids.dtype not in (torch.int32, torch.int64):
            if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
                raise TypeError(f"expert_ids: must be an integer tensor, got {expert_ids.dtype}")
            expert_ids = expert_ids.to(torch.int64)
        return expert_ids.reshape(-1)

    def after_step(self) -> None:
        """Close the step: fold its routing into the counters, activate finished fills, replan when due."""
        kind = self._kind
        if kind is None:
            raise RuntimeError("after_step: no step is open (call before_step first)")
        self._kind = None
        if kind == "decode":
            with self._on_compute():
                sc = self._step_counts
                row = self._touched[self._row]
                torch.gt(sc, 0, out=row)
                res = (self.slot_of.view(-1) >= 0).to(torch.float32)
                acc = torch.stack([row.sum(dtype=torch.float32), (row * res).sum(), (sc * res).sum(), sc.sum()])
                self._dev_counters.add_(acc.to(torch.int64))
                self._counts.add_(sc)
                sc.zero_()
            self._row += 1
        elif self._step_rows:
            self._prefill_rows += self._step_rows
        if self._cuda:
            self._poll()
        if self._ctl.refill_keys.size and self._loan is None and self._pool is not None:
            self._execute(self._ctl.refill(self.config.rewarm_limit or self.config.admit_limit))
        if self._ctl.end_step(kind):  # type: ignore[arg-type]
            self.replan()

    def _drain(self, complete: bool = False) -> None:
        """Snapshot the device-side observations (D2H copies on the compute stream), clear them, and hand the
        snapshot to the controller (which reads it now, or at the next replan with ``async_observe``)."""
        n = self._row
        rows = self._prefill_rows
        with self._on_compute():
            touched = self._touched[:n].to("cpu", non_blocking=self._cuda, copy=True)
            picks = self._counts.to("cpu", non_blocking=self._cuda, copy=True)
            pre = self._prefill_counts.to("cpu", non_blocking=self._cuda, copy=True) if rows else None
            ev = None
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record(self._compute)
            self._counts.zero_()
            if pre is not None:
                self._prefill_counts.zero_()
        self._row = 0
        self._prefill_rows = 0

        def fetch() -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None, int]:
            if ev is not None:
                ev.synchronize()
            t = touched.numpy()
            return (
                [np.flatnonzero(r) for r in t],
                picks.numpy().astype(np.float64),
                None if pre is None else pre.numpy().astype(np.float64),
                rows,
            )

        self._ctl.submit(fetch, complete)

    # ---- public lifecycle ------------------------------------------------------------------------------------

    def replan(self) -> list[Swap]:
        """Feed the observations to the policy and execute its admissions/evictions (between steps).

        Returns
        -------
        list[Swap]
            The swaps executed (slot, evicted key or -1, admitted key); key = ``layer * num_experts + expert``.
        """
        if self._kind is not None:
            raise RuntimeError("replan: not allowed inside a step (between before_step and after_step)")
        if self._cuda:
            self._poll()
        self._drain()
        swaps = self._ctl.plan()
        self._execute(swaps)
        return swaps

    def slots_for(self, nbytes: int) -> int:
        """Slots that hold ``nbytes`` contiguous bytes (what :meth:`lend` takes for them)."""
        return -(-int(nbytes) // self._stride)

    def lend(self, nbytes: int) -> Loan:
        """Lend ``nbytes`` of the pool (rounded up to whole slots, the last ones) to another user of the device,
        e.g. a prefill step's staging ring; the coldest residents make room.

        The hottest residents that fit in the remaining slots stay resident; those sitting in the lent region move
        to slots freed by the evictions (a device-to-device copy on the side stream; until it is done they are read
        from home). Every evicted or moving expert's pointers go home on the compute stream first, so no kernel
        enqueued after this call reads the lent slots; the borrower waits for ``Loan.ready``, recorded on the side
        stream after the moves, which themselves wait for everything the compute stream had enqueued (kernels
        still reading the region). The planner leaves the lent slots alone until :meth:`give_back`.
        """
        if self._loan is not None:
            raise RuntimeError("lend: the pool is already lent out (give it back first)")
        if self._pool is None:
            raise RuntimeError("lend: no pool (released, or a cache of 0 slots)")
        if nbytes <= 0:
            raise ValueError(f"lend: nbytes must be > 0, got {nbytes}")
        n = self.slots_for(nbytes)
        if n > self.num_slots:
            raise ValueError(
                f"lend: {nbytes} bytes need {n} slots of {self._stride} bytes, the pool has {self.num_slots}"
            )
        evicted, moves = self._ctl.lend(n)
        mk = np.array([m[0] for m in moves], np.int64)
        fr = np.array([m[1] for m in moves], np.int64)
        to = np.array([m[2] for m in moves], np.int64)
        home = np.concatenate([evicted, mk])
        self._write_tables(home, self._home_ptr[home], np.full(home.size, -1))
        ready = None
        if self._cuda:
            ev_a = torch.cuda.Event()
            ev_a.record(self._compute)
            self._side.wait_event(ev_a)
            ctx: Any = torch.cuda.stream(self._side)
        else:
            ctx = torch.no_grad()
        with ctx:
            for a, b in zip(fr.tolist(), to.tolist(), strict=True):
                self._pool[b].copy_(self._pool[a], non_blocking=self._cuda)
        self._moves += mk.size
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(self._side)
            if self.config.async_fill:
                self._pending.append((ready, mk, to))
            else:
                self._compute.wait_event(ready)
                self._activate(mk, to)
        else:
            self._activate(mk, to)
        first = self.num_slots - n
        self._loan = Loan(self._pool[first:].view(-1), first, n, int(evicted.size), int(mk.size), ready)
        return self._loan

    def give_back(self, loan: Loan, after: Any = None) -> None:
        """End a :meth:`lend`. ``after``: a CUDA event recorded after the borrower's last use of the memory (the
        compute stream waits for it before any fill is queued); without it the borrower's work must already be
        ordered before the compute stream's next work. The evicted experts are re-admitted over the following
        steps, at most ``rewarm_limit`` (``admit_limit`` when 0) per :meth:`after_step`, fills on the side stream."""
        if loan is not self._loan:
            raise RuntimeError("give_back: not the current loan")
        if self._cuda and after is not None:
            self._compute.wait_event(after)
        self._ctl.give_back()
        self._loan = None

    @property
    def loan(self) -> Loan | None:
        """The current loan, or None."""
        return self._loan

    def release(self) -> None:
        """Give the whole pool back (every pointer goes home); the residents are remembered for :meth:`rewarm`."""
        if self._kind is not None:
            raise RuntimeError("release: not allowed inside a step")
        if self._ctl.released:
            return
        if self._loan is not None:
            raise RuntimeError("release: part of the pool is lent (give it back first)")
        self._release_now()

    def _release_now(self) -> None:
        self._drain(complete=True)
        residents = self._ctl.release()
        if self._cuda:
            self._compute.wait_stream(self._side)  # every fill done before the pool can go
        pend = [k for _, k, _ in self._pending]
        self._pending.clear()
        keys = np.unique(np.concatenate([residents, *pend])) if pend else residents
        self._write_tables(keys, self._home_ptr[keys], np.full(keys.size, -1))
        self._pool = None
        if self._cuda:
            torch.cuda.empty_cache()

    def rewarm(self) -> None:
        """Re-allocate the pool and refill it (``rewarm_set``), if it was released."""
        if self._kind is not None:
            raise RuntimeError("rewarm: not allowed inside a step")
        if not self._ctl.released:
            return
        self._rewarm_now()

    def _rewarm_now(self) -> None:
        self._drain(complete=True)
        self._allocate()
        self._execute(self._ctl.rewarm())

    def synchronize(self) -> None:
        """Wait for every queued fill and activate it (tests and benchmarks; not needed in serving)."""
        if self._cuda:
            self._poll(wait=True)
            torch.cuda.synchronize(self.device)

    # ---- inspection ------------------------------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """True while the pool is given back."""
        return self._ctl.released

    @property
    def pool(self) -> torch.Tensor | None:
        """uint8 ``[num_slots, slot_stride]`` device tensor, or None while released."""
        return self._pool

    def layer_pointers(self, layer: int) -> torch.Tensor:
        """int64 ``[num_projections, num_experts]`` contiguous view of one layer's pointer table (what a kernel is
        given): row ``p`` is the ``[num_experts]`` address array of projection ``p``."""
        return self.pointer_table[layer]

    @property
    def home(self) -> ExpertRows:
        """The home as rows (a stacked home is converted at construction)."""
        return self._rows

    @property
    def home_alignment(self) -> int:
        """The largest power of two (at most 4096) dividing every home pointer a kernel may be given: the widest
        load a kernel may issue on a non-resident expert (slot pointers are ``slot_alignment``-aligned)."""
        acc = int(np.bitwise_or.reduce(self._home_ptr.reshape(-1))) | 4096
        return acc & -acc

    def resident(self) -> dict[int, int]:
        """``{key: slot}`` of the planned residents (a newcomer may still be filling; see :meth:`synchronize`)."""
        keys = self._ctl.resident_keys()
        return {int(k): int(self._ctl.slot_of[k]) for k in keys}

    def home_pointer(self, layer: int, expert: int, projection: int) -> int:
        """The home address of one expert projection (the kernel address: what the table holds when not resident)."""
        return int(self._home_ptr[layer * self.config.num_experts + expert, projection])

    @property
    def fills_issued(self) -> int:
        """Experts copied into slots since construction (queued fills included; host-side, no sync)."""
        return self._fills

    def stats(self) -> CacheStats:
        """Counters since construction (reads the device counters: one sync)."""
        acc, hits, pick_hits, picks = (int(v) for v in self._dev_counters.cpu().tolist())
        c = self._ctl.counters()
        return CacheStats(
            **c,  # the controller's lifecycle counters
            accesses=acc,
            hits=hits,
            picks=picks,
            pick_hits=pick_hits,
            bytes_copied=self._fills * self.config.expert_bytes,
            num_slots=self.num_slots,
        )

    def save_profile(self, path: str) -> None:
        """Save the hybrid policy's slow pick rates as a routing-frequency profile (hybrid policy only)."""
        pol = self._ctl.policy
        if not isinstance(pol, HybridPolicy):
            raise ValueError(
                f"policy: save_profile needs the 'hybrid' policy, the cache uses {self.config.policy.name!r}"
            )
        save_profile(path, pol.rates(), self.config.num_layers, self.config.num_experts)
