"""Residency policies: each ranks every (layer, expert) key; the planner (:mod:`expert_cache.planner`) turns the
ranking into admissions and evictions under the admission limit and hysteresis.

A key is ``layer * num_experts + expert``. The planner calls, in this order, once per replan:

1. :meth:`Policy.update` with the decode steps since the last replan: ``step_keys[i]`` is the sorted array of
   distinct keys routed in step ``first_step + i`` and ``picks`` the routed-pick count of every key over those steps
   (a key picked by 3 tokens of one step counts 3);
2. :meth:`Policy.update_prefill` with the (weighted) pick counts of big steps, when the cache observes prefill;
3. :meth:`Policy.priorities`: a float64 array over all keys. The planner wants the top ``num_slots`` keys of
   positive priority resident, admits the best non-residents first and evicts the worst residents first.

Policies
--------
``decayed``  the reference system's ``ec_step``: ``score = score * decay + picks`` once per replan.
``lru``      priority = step of the last access (recency only).
``lfu``      count of steps a key was accessed in, halved every ``lfu_halve_every`` steps (LFU with aging).
``arc``      ARC (Megiddo and Modha, FAST 2003) run on the per-step access stream with capacity ``num_slots``;
             its logical cache T1+T2 is what the planner wants resident.
``hybrid``   frequency + recency on several time scales: per-step exponentially decayed pick rates for a set
             of half-lives, the one whose shadow cache hits best is used (self-tuning to drift), plus a slow
             rate, an optional saved routing-frequency profile as a prior, and an optional bonus for keys routed
             in the last step. Meant to be replanned every step with a small admission limit.
"""

from __future__ import annotations

import abc
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .config import ArcConfig, DecayedConfig, ExpertCacheConfig, HybridConfig, LfuConfig, LruConfig

__all__ = [
    "ARCPolicy",
    "DecayedCountsPolicy",
    "HybridPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "Policy",
    "load_profile",
    "make_policy",
    "save_profile",
]


class Policy(abc.ABC):
    """Interface of a residency policy over ``num_keys`` keys (see the module docstring for the call order)."""

    name: str = "?"

    def __init__(self, num_keys: int) -> None:
        self.num_keys = int(num_keys)
        self.steps_seen = 0

    @abc.abstractmethod
    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        """Digest decode steps.

        Parameters
        ----------
        step_keys
            One sorted int64 array of distinct keys per decode step since the last call, oldest first.
        picks
            float64 ``[num_keys]``: routed picks per key over those steps.
        """

    def update_prefill(self, picks: np.ndarray, rows: int, weight: float) -> None:  # noqa: B027 - optional hook
        """Digest the routing of big (prefill) steps.

        Parameters
        ----------
        picks
            float64 ``[num_keys]``: routed picks per key over ``rows`` recorded prompt tokens.
        rows
            Number of token rows the picks came from (> 0).
        weight
            ``config.prefill_weight``.

        The default ignores prefill routing (``lru``, ``lfu``, ``arc``: a prompt touches most experts).
        """

    @abc.abstractmethod
    def priorities(self) -> np.ndarray:
        """float64 ``[num_keys]``; higher means more deserving of a slot; ``<= 0`` is never admitted."""

    def tick_replan(self) -> None:  # noqa: B027 - optional hook
        """Called at the start of every replan, after the last :meth:`update` (the reference decays here)."""

    def notify(self, admitted: np.ndarray, evicted: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Told which keys the planner admitted and evicted (most policies ignore it)."""


class DecayedCountsPolicy(Policy):
    """The reference system's score: ``score = score * decay + picks`` at every replan (decode picks only).

    Picks seen since the last replan wait in ``pending`` (the reference keeps them in its GPU counters); between
    replans (at a release or re-warm) the priority is ``score + pending``.
    """

    name = "decayed"

    def __init__(self, num_keys: int, decay: float = 0.9) -> None:
        super().__init__(num_keys)
        self.decay = float(decay)
        self.score = np.zeros(num_keys, np.float64)
        self.pending = np.zeros(num_keys, np.float64)

    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        self.steps_seen += len(step_keys)
        self.pending += picks

    def update_prefill(self, picks: np.ndarray, rows: int, weight: float) -> None:
        self.pending += weight * picks

    def tick_replan(self) -> None:
        self.score *= self.decay
        self.score += self.pending
        self.pending[:] = 0.0

    def priorities(self) -> np.ndarray:
        return self.score + self.pending


class LRUPolicy(Policy):
    """Least recently used: priority = 1 + index of the last decode step that routed the key (0 = never)."""

    name = "lru"

    def __init__(self, num_keys: int) -> None:
        super().__init__(num_keys)
        self.last = np.zeros(num_keys, np.float64)

    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        for keys in step_keys:
            self.steps_seen += 1
            self.last[keys] = self.steps_seen

    def priorities(self) -> np.ndarray:
        return self.last


class LFUPolicy(Policy):
    """LFU with aging: +1 for every decode step that routes the key; all counts halve every ``halve_every`` steps."""

    name = "lfu"

    def __init__(self, num_keys: int, halve_every: int = 256) -> None:
        super().__init__(num_keys)
        self.halve_every = int(halve_every)
        self.count = np.zeros(num_keys, np.float64)

    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        for keys in step_keys:
            self.count[keys] += 1.0
            self.steps_seen += 1
            if self.steps_seen % self.halve_every == 0:
                self.count *= 0.5

    def priorities(self) -> np.ndarray:
        return self.count


class ARCPolicy(Policy):
    """Adaptive Replacement Cache on the decode access stream (per step, keys in ascending order).

    T1 (seen once recently) and T2 (seen at least twice) form the logical cache of ``capacity`` keys; B1 and B2
    are their ghost lists; the target size ``p`` of T1 adapts on ghost hits. The planner is asked to keep T1+T2
    resident: their priority is ``1 + recency`` (in (1, 2]); every other key gets ``recency`` in [0, 1), so a
    physical resident that left T1+T2 is evicted first, least recent first.
    """

    name = "arc"

    def __init__(self, num_keys: int, capacity: int) -> None:
        super().__init__(num_keys)
        if capacity < 1:
            raise ValueError(f"num_slots: ARC needs a capacity >= 1, got {capacity}")
        self.c = int(capacity)
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.last = np.zeros(num_keys, np.float64)

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None
        elif self.t2:
            k, _ = self.t2.popitem(last=False)
            self.b2[k] = None
        else:  # pragma: no cover - unreachable with |T1|+|T2| = c >= 1
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None

    def access(self, x: int) -> None:
        """One access of key ``x`` (the ARC(c) algorithm, cases I-IV of the paper)."""
        t1, t2, b1, b2, c = self.t1, self.t2, self.b1, self.b2, self.c
        if x in t1:
            del t1[x]
            t2[x] = None
            return
        if x in t2:
            t2.move_to_end(x)
            return
        if x in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            self._replace(False)
            del b1[x]
            t2[x] = None
            return
        if x in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            self._replace(True)
            del b2[x]
            t2[x] = None
            return
        l1 = len(t1) + len(b1)
        if l1 == c:
            if len(t1) < c:
                b1.popitem(last=False)
                self._replace(False)
            else:
                t1.popitem(last=False)
        elif l1 < c:
            total = l1 + len(t2) + len(b2)
            if total >= c:
                if total == 2 * c:
                    b2.popitem(last=False)
                self._replace(False)
        t1[x] = None

    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        for keys in step_keys:
            self.steps_seen += 1
            for x in keys.tolist():
                self.access(x)
            self.last[keys] = self.steps_seen

    def priorities(self) -> np.ndarray:
        rec = self.last / (self.steps_seen + 1.0)
        prio = rec.copy()
        logical = np.fromiter((*self.t1.keys(), *self.t2.keys()), np.int64, len(self.t1) + len(self.t2))
        prio[logical] += 1.0
        return prio


class HybridPolicy(Policy):
    """Frequency + recency on several time scales, choosing the time scale online, with an optional prior.

    For each half-life ``h`` in ``halflives`` the policy keeps ``r_h``, the per-step pick rate averaged with an
    exponential half-life of ``h`` decode steps. Candidate ``j``'s priority is

        ``r_h[j] + slow_weight * r_slow + profile_weight * profile + recency_bonus * [routed in the last step]``

    Every candidate's top ``num_slots`` keys form a shadow cache; at each decode step the shadow caches are
    scored on the keys the step routed (hits, exponentially forgotten with ``score_halflife`` steps) and the
    planner is given the best-scoring candidate's priorities. A short half-life wins when routing drifts, a long
    one when it is stationary. Keys never routed and absent from the profile have priority 0.
    """

    name = "hybrid"

    def __init__(
        self,
        num_keys: int,
        num_slots: int,
        halflives: Sequence[float] = (8.0, 16.0, 32.0, 64.0, 128.0),
        slow_halflife: float = 2048.0,
        slow_weight: float = 0.1,
        recency_bonus: float = 0.0,
        profile: np.ndarray | None = None,
        profile_weight: float = 1.0,
        score_halflife: float = 256.0,
    ) -> None:
        super().__init__(num_keys)
        hl = np.asarray(halflives, np.float64)
        if hl.ndim != 1 or hl.size == 0 or np.any(hl <= 0):
            raise ValueError(f"hybrid_halflives: must be a non-empty tuple of positive numbers, got {halflives!r}")
        self.num_slots = int(num_slots)
        self.halflives = hl
        self.d = 0.5 ** (1.0 / hl)  # [J]
        self.ds = 0.5 ** (1.0 / slow_halflife)
        self.dscore = 0.5 ** (1.0 / score_halflife)
        self.slow_weight = float(slow_weight)
        self.recency_bonus = float(recency_bonus)
        self.fast = np.zeros((hl.size, num_keys), np.float64)
        self.slow = np.zeros(num_keys, np.float64)
        self.recent = np.zeros(num_keys, np.float64)
        # Shadow-cache scores; the middle half-life leads until the evidence says otherwise.
        self.score = np.zeros(hl.size, np.float64)
        self.score[hl.size // 2] = 1e-9
        self.leader = hl.size // 2
        self._top: np.ndarray | None = None  # bool [J, num_keys]: each candidate's top num_slots at the last call
        if profile is not None:
            profile = np.asarray(profile, np.float64).reshape(-1)
            if profile.shape[0] != num_keys:
                raise ValueError(f"profile_path: profile has {profile.shape[0]} keys, the cache has {num_keys}")
        self.prior = None if profile is None else float(profile_weight) * profile

    def update(self, step_keys: Sequence[np.ndarray], picks: np.ndarray) -> None:
        n = len(step_keys)
        if n == 0:
            return
        if self._top is not None and self.halflives.size > 1:
            for keys in step_keys:
                self.score *= self.dscore
                self.score += self._top[:, keys].sum(axis=1)
        self.steps_seen += n
        # Exact for n == 1; for a batch the picks are credited at the batch's last step.
        self.fast *= (self.d**n)[:, None]
        self.fast += (1.0 - self.d)[:, None] * picks[None, :]
        self.slow *= self.ds**n
        self.slow += (1.0 - self.ds) * picks
        if self.recency_bonus:
            self.recent[:] = 0.0
            self.recent[step_keys[-1]] = self.recency_bonus

    def update_prefill(self, picks: np.ndarray, rows: int, weight: float) -> None:
        # A prompt's routing samples the new request's routing: picks / rows is its per-token pick rate, the
        # quantity the fast averages estimate for a decode stream. Add it (weighted) on top of what is there.
        if rows > 0:
            self.fast += weight * (picks / rows)[None, :]

    def _base(self) -> np.ndarray:
        base = self.slow_weight * self.slow
        if self.recency_bonus:
            base = base + self.recent
        if self.prior is not None:
            base = base + self.prior
        return base

    def priorities(self) -> np.ndarray:
        base = self._base()
        J, n = self.halflives.size, self.num_slots
        if J > 1 and 0 < n < self.num_keys:
            allp = self.fast + base[None, :]
            thr = np.partition(allp, self.num_keys - n, axis=1)[:, self.num_keys - n]
            self._top = (allp >= thr[:, None]) & (allp > 0)
            self.leader = int(np.argmax(self.score))
            return allp[self.leader]
        return self.fast[self.leader] + base

    @property
    def leader_halflife(self) -> float:
        """The half-life whose shadow cache scores best now."""
        return float(self.halflives[self.leader])

    def rates(self) -> np.ndarray:
        """The slow per-step pick rate of every key: what :func:`save_profile` stores."""
        return self.slow.copy()


def save_profile(path: str | os.PathLike[str], rates: np.ndarray, num_layers: int, num_experts: int) -> None:
    """Save a routing-frequency profile: ``rates`` float ``[num_layers, num_experts]`` picks per decode step.

    The file is an ``.npz`` with ``rates`` (float32 ``[L, E]``) and ``version`` (int, 1).
    """
    r = np.asarray(rates, np.float64).reshape(num_layers, num_experts)
    if not np.all(np.isfinite(r)) or np.any(r < 0):
        raise ValueError("rates: must be finite and >= 0")
    np.savez(path, rates=r.astype(np.float32), version=np.int64(1))


def load_profile(path: str | os.PathLike[str], num_layers: int, num_experts: int) -> np.ndarray:
    """Load a profile written by :func:`save_profile`; returns float64 ``[num_layers * num_experts]``."""
    with np.load(path) as z:
        if "rates" not in z.files:
            raise ValueError(f"{os.fspath(path)}: not a profile (no 'rates' array)")
        r = np.asarray(z["rates"], np.float64)
    if r.shape != (num_layers, num_experts):
        raise ValueError(f"{os.fspath(path)}: rates has shape {r.shape}, the cache has ({num_layers}, {num_experts})")
    if not np.all(np.isfinite(r)) or np.any(r < 0):
        raise ValueError(f"{os.fspath(path)}: rates must be finite and >= 0")
    return r.reshape(-1)


def make_policy(config: ExpertCacheConfig, num_slots: int) -> Policy:
    """Build the policy ``config.policy`` configures, for a cache of ``num_slots`` slots."""
    n = config.num_keys
    p = config.policy
    if isinstance(p, DecayedConfig):
        return DecayedCountsPolicy(n, p.decay)
    if isinstance(p, LruConfig):
        return LRUPolicy(n)
    if isinstance(p, LfuConfig):
        return LFUPolicy(n, p.halve_every)
    if isinstance(p, ArcConfig):
        return ARCPolicy(n, max(1, num_slots))
    if isinstance(p, HybridConfig):
        prof = None
        if p.profile_path is not None:
            prof = load_profile(p.profile_path, config.num_layers, config.num_experts)
        return HybridPolicy(
            n,
            num_slots,
            p.halflives,
            p.slow_halflife,
            p.slow_weight,
            p.recency_bonus,
            prof,
            p.profile_weight,
            p.score_halflife,
        )
    raise TypeError(f"policy: unknown policy config {p!r}")  # pragma: no cover - config validates
