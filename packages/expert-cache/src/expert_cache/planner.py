"""The device-free half of the cache: which key sits in which slot, the replan rule, the elastic lifecycle.

:class:`CacheController` is shared by :class:`expert_cache.ExpertCache` (which executes its swaps on real memory)
and :func:`expert_cache.sim.simulate` (which only counts), so the simulator measures the code that runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from .config import ExpertCacheConfig
from .policies import Policy, make_policy

__all__ = ["CacheController", "CacheStats", "Swap"]


@dataclasses.dataclass(frozen=True, slots=True)
class Swap:
    """Put ``new_key`` into ``slot``; ``old_key`` is the evicted key or -1 when the slot was free."""

    slot: int
    old_key: int
    new_key: int


@dataclasses.dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of a cache or a simulation.

    ``accesses``/``hits`` count distinct (layer, expert) pairs routed in a decode step (one weight read each);
    ``picks``/``pick_hits`` count routed (token, layer, slot-of-top-k) picks. Big (prefill) steps are not counted
    in either. ``bytes_copied`` = slot fills x expert bytes.
    """

    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    accesses: int = 0
    hits: int = 0
    picks: int = 0
    pick_hits: int = 0
    admits: int = 0
    evicts: int = 0
    replans: int = 0
    releases: int = 0
    rewarms: int = 0
    lends: int = 0
    bytes_copied: int = 0
    num_slots: int = 0

    @property
    def misses(self) -> int:
        """Distinct decode accesses that read the host home copy."""
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        """``hits / accesses`` (0 when nothing was accessed)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def pick_hit_rate(self) -> float:
        """``pick_hits / picks`` (0 when nothing was picked)."""
        return self.pick_hits / self.picks if self.picks else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """All counters plus ``misses``, ``hit_rate`` and ``pick_hit_rate``."""
        d: dict[str, float | int] = dataclasses.asdict(self)
        d["misses"] = self.misses
        d["hit_rate"] = self.hit_rate
        d["pick_hit_rate"] = self.pick_hit_rate
        return d


StepKind = Literal["decode", "prefill"]
#: ``CacheController.slot_key`` of a lent slot.
LENT = -2
#: What an executor hands the controller at a flush: (step_keys, picks, prefill_picks or None, prefill_rows).
Observation = tuple[Sequence[np.ndarray], np.ndarray, "np.ndarray | None", int]


class CacheController:
    """Slot assignment, replan rule and elastic lifecycle for ``num_slots`` global slots.

    Parameters
    ----------
    config
        The cache configuration.
    num_slots
        Slots in the pool (``config.resolve_num_slots`` on a device).
    policy
        Overrides the policy built from ``config``.

    Attributes
    ----------
    slot_key : np.ndarray
        int64 ``[num_slots]``: the key in each slot, -1 when free.
    slot_of : np.ndarray
        int64 ``[num_keys]``: the slot of each key, -1 when not resident.
    """

    def __init__(self, config: ExpertCacheConfig, num_slots: int, policy: Policy | None = None) -> None:
        if num_slots < 0 or num_slots > config.num_keys:
            raise ValueError(f"num_slots: must be in [0, {config.num_keys}], got {num_slots}")
        self.config = config
        self.num_slots = int(num_slots)
        self.policy = policy if policy is not None else make_policy(config, num_slots)
        self.slot_key = np.full(self.num_slots, -1, np.int64)
        self.slot_of = np.full(config.num_keys, -1, np.int64)
        self.released = False
        self.keep = np.zeros(0, np.int64)
        #: slots at the end of the pool lent out (``lend``); their ``slot_key`` is ``LENT``
        self.lent = 0
        #: keys evicted by the last ``lend``, best first, not yet re-admitted (``refill``)
        self.refill_keys = np.zeros(0, np.int64)
        self.decode_streak = 0
        self.steps_since_replan = 0
        self._held: Callable[[], Observation] | None = None
        self._c = {
            k: 0
            for k in (
                "steps",
                "decode_steps",
                "prefill_steps",
                "admits",
                "evicts",
                "replans",
                "releases",
                "rewarms",
                "lends",
            )
        }

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def begin_step(self, num_tokens: int) -> tuple[StepKind, str | None]:
        """Classify the coming step and say what the elastic lifecycle needs before it runs.

        Parameters
        ----------
        num_tokens
            Tokens scheduled in the step (> ``prefill_tokens`` makes it a prefill step).

        Returns
        -------
        (kind, action)
            ``action`` is ``"release"`` (the caller flushes its observations, calls :meth:`release` and frees the
            pool), ``"rewarm"`` (the caller flushes, re-allocates the pool and executes :meth:`rewarm`'s swaps) or
            None. Rewarm comes before the ``rewarm_after + 1``-th consecutive decode step after a release.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        cfg = self.config
        self._c["steps"] += 1
        if num_tokens > cfg.prefill_tokens:
            self._c["prefill_steps"] += 1
            self.decode_streak = 0
            if cfg.elastic and not self.released:
                return "prefill", "release"
            return "prefill", None
        self._c["decode_steps"] += 1
        action = None
        if self.released and self.decode_streak >= cfg.rewarm_after:
            action = "rewarm"
        self.decode_streak += 1
        return "decode", action

    def end_step(self, kind: StepKind) -> bool:
        """Count a finished step; True when a replan is due (every ``replan_every`` decode steps)."""
        if kind == "decode":
            self.steps_since_replan += 1
        return self.steps_since_replan >= self.config.replan_every

    # ---- lending slots ---------------------------------------------------------------------------------------

    @property
    def usable(self) -> int:
        """Slots the planner may fill: all but the lent ones."""
        return self.num_slots - self.lent

    def lend(self, n: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Free the last ``n`` slots for someone else: the hottest residents that fit in the other slots stay (those
        sitting in the lent region move to slots freed below it), the coldest are evicted.

        Returns
        -------
        (evicted, moves)
            ``evicted``: the evicted keys, best first (remembered in ``refill_keys``); ``moves``: ``(key, from_slot,
            to_slot)`` of the residents that leave the lent region (their bytes must be copied slot to slot).
        """
        if self.lent:
            raise RuntimeError(f"lend: {self.lent} slots are already lent (give them back first)")
        if self.released:
            raise RuntimeError("lend: the pool is released")
        if not 0 < n <= self.num_slots:
            raise ValueError(f"lend: n must be in [1, {self.num_slots}], got {n}")
        keep_n = self.num_slots - n
        res = self.slot_key[self.slot_key >= 0]
        prio = self.policy.priorities()
        ranked = res[np.lexsort((res, -prio[res]))]  # best first
        keep, evicted = ranked[:keep_n], ranked[keep_n:]
        self.slot_key[self.slot_of[evicted]] = -1
        self.slot_of[evicted] = -1
        movers = keep[self.slot_of[keep] >= keep_n]
        free = np.flatnonzero(self.slot_key[:keep_n] == -1)
        moves: list[tuple[int, int, int]] = []
        for k, to in zip(movers.tolist(), free[: movers.size].tolist(), strict=True):
            fr = int(self.slot_of[k])
            self.slot_key[fr] = -1
            self.slot_key[to] = k
            self.slot_of[k] = to
            moves.append((k, fr, to))
        self.slot_key[keep_n:] = LENT
        self.lent = n
        self.refill_keys = evicted.copy()
        self._c["lends"] += 1
        self._c["evicts"] += evicted.size
        self.policy.notify(np.zeros(0, np.int64), evicted)
        return evicted, moves

    def give_back(self) -> None:
        """The lent slots are free again (``refill`` re-admits the evicted keys into them)."""
        if not self.lent:
            raise RuntimeError("give_back: no slots are lent")
        self.slot_key[self.num_slots - self.lent :] = -1
        self.lent = 0

    def refill(self, limit: int) -> list[Swap]:
        """Re-admit up to ``limit`` of the keys the last ``lend`` evicted (best first by the current priorities) into
        free slots; the rest wait for the next call (or the replans)."""
        if self.lent or self.released or not self.refill_keys.size:
            return []
        cand = self.refill_keys[self.slot_of[self.refill_keys] < 0]
        prio = self.policy.priorities()
        cand = cand[np.lexsort((cand, -prio[cand]))]
        free = np.flatnonzero(self.slot_key == -1)
        take = cand[: min(limit, free.size)]
        swaps = [Swap(int(slot), -1, int(k)) for slot, k in zip(free.tolist(), take.tolist(), strict=False)]
        for sw in swaps:
            self.slot_key[sw.slot] = sw.new_key
            self.slot_of[sw.new_key] = sw.slot
        self.refill_keys = cand[take.size :] if free.size > take.size else np.zeros(0, np.int64)
        self._c["admits"] += len(swaps)
        self.policy.notify(take, np.zeros(0, np.int64))
        return swaps

    def release(self) -> np.ndarray:
        """Forget all residents (remembered in ``keep``, best first); returns the evicted keys by slot order."""
        if self.lent:
            raise RuntimeError(f"release: {self.lent} slots are lent (give them back first)")
        residents = self.slot_key[self.slot_key >= 0]
        prio = self.policy.priorities()
        self.keep = residents[np.lexsort((residents, -prio[residents]))]
        self.slot_of[residents] = -1
        self.slot_key[:] = -1
        self.released = True
        self._c["releases"] += 1
        return residents

    def rewarm(self) -> list[Swap]:
        """Refill the empty pool: the kept keys (``rewarm_set="kept"``) or the top keys, best first, at most
        ``rewarm_limit`` of them when that is set (the replans that follow fill the rest)."""
        prio = self.policy.priorities()
        if self.config.rewarm_set == "kept":
            cand = self.keep[np.lexsort((self.keep, -prio[self.keep]))]
        else:
            cand = self._want(prio)
            cand = cand[np.lexsort((cand, -prio[cand]))]
        cand = cand[: min(self.num_slots, self.config.rewarm_limit or self.num_slots)]
        self.released = False
        self.keep = np.zeros(0, np.int64)
        self._c["rewarms"] += 1
        swaps = []
        for slot, key in enumerate(cand.tolist()):
            swaps.append(Swap(slot, -1, key))
            self.slot_key[slot] = key
            self.slot_of[key] = slot
        self._c["admits"] += len(swaps)
        self.policy.notify(cand, np.zeros(0, np.int64))
        return swaps

    # ---- replan ----------------------------------------------------------------------------------------------

    def observe(
        self,
        step_keys: Sequence[np.ndarray],
        picks: np.ndarray,
        prefill_picks: np.ndarray | None = None,
        prefill_rows: int = 0,
    ) -> None:
        """Feed the policy: decode steps (see :meth:`Policy.update`) and optionally prefill routing."""
        self.policy.update(step_keys, picks)
        if prefill_picks is not None and prefill_rows > 0 and self.config.observe_prefill:
            self.policy.update_prefill(prefill_picks, prefill_rows, self.config.prefill_weight)

    def submit(self, fetch: Callable[[], Observation], complete: bool = False) -> None:
        """Hand over the observations since the last flush as a callable that produces them.

        Without ``async_observe`` (or with ``complete``) the policy gets them now. With ``async_observe`` the
        controller keeps ``fetch`` and feeds the one kept at the previous flush, so an executor's snapshot can
        finish on the device meanwhile; ``complete=True`` (releases and re-warms) feeds both.
        """
        if self.config.async_observe:
            held, self._held = self._held, fetch
            if held is not None:
                self.observe(*held())
            if complete:
                self.flush_held()
        else:
            self.observe(*fetch())

    def flush_held(self) -> None:
        """Feed the observation kept by :meth:`submit` (if any) to the policy."""
        held, self._held = self._held, None
        if held is not None:
            self.observe(*held())

    def _want(self, prio: np.ndarray) -> np.ndarray:
        """The top ``num_slots`` keys of positive priority (ties: lower key first), unordered."""
        n = self.usable
        pos = np.flatnonzero(prio > 0)
        if pos.size <= n:
            return pos
        vals = prio[pos]
        thr = np.partition(vals, pos.size - n)[pos.size - n]
        above = pos[vals > thr]
        tied = pos[vals == thr]  # ascending key order
        return np.concatenate([above, tied[: n - above.size]])

    def plan(self) -> list[Swap]:
        """One replan (the reference's ``ec_step`` rule, for any policy).

        ``want`` = top ``num_slots`` keys of positive priority. Non-resident keys of ``want`` are admitted best
        first, at most ``admit_limit``: into a free slot, else over the worst resident outside ``want`` if
        ``priority(new) > hysteresis * priority(victim)``, else the replan stops. The slot maps are updated at once.
        """
        self.steps_since_replan = 0
        self._c["replans"] += 1
        self.policy.tick_replan()
        if self.released or self.usable == 0:
            return []
        prio = self.policy.priorities()
        want = self._want(prio)
        cand = want[self.slot_of[want] < 0]
        if cand.size == 0:
            return []
        cand = cand[np.lexsort((cand, -prio[cand]))][: self.config.admit_limit]
        free = np.flatnonzero(self.slot_key == -1)  # (lent slots are LENT)
        in_want = np.zeros(self.config.num_keys, bool)
        in_want[want] = True
        res = self.slot_key[self.slot_key >= 0]
        vict = res[~in_want[res]]
        vict = vict[np.lexsort((vict, prio[vict]))]
        hyst = self.config.hysteresis
        swaps: list[Swap] = []
        fi = vi = 0
        for k in cand.tolist():
            if fi < free.size:
                slot, old = int(free[fi]), -1
                fi += 1
            elif vi < vict.size:
                v = int(vict[vi])
                if not prio[k] > hyst * prio[v]:
                    break
                slot, old = int(self.slot_of[v]), v
                vi += 1
                self.slot_of[v] = -1
            else:  # pragma: no cover - |want| <= num_slots makes a victim or free slot exist
                break
            self.slot_key[slot] = k
            self.slot_of[k] = slot
            swaps.append(Swap(slot, old, k))
        adm = np.array([s.new_key for s in swaps], np.int64)
        ev = np.array([s.old_key for s in swaps if s.old_key >= 0], np.int64)
        self._c["admits"] += adm.size
        self._c["evicts"] += ev.size
        self.policy.notify(adm, ev)
        return swaps

    # ---- reporting -------------------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Lifecycle counters: steps, decode_steps, prefill_steps, admits, evicts, replans, releases, rewarms."""
        return dict(self._c)

    def resident_keys(self) -> np.ndarray:
        """Sorted int64 keys currently assigned a slot."""
        return np.sort(self.slot_key[self.slot_key >= 0])
