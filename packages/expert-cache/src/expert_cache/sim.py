"""Trace-driven simulation of the cache, and Belady's offline optimum.

``simulate(trace, config)`` replays a trace through the same :class:`~expert_cache.planner.CacheController` that
:class:`~expert_cache.ExpertCache` uses, with the same step protocol (begin step, route, end step, replan when
due) and the same elastic lifecycle; only the memory is missing. Newcomers count as resident from the step after
their replan (on a GPU with ``async_fill`` they become visible when their copy finishes, typically within a step).

``belady_hits`` is Belady's MIN on the decode access stream: the distinct (layer, expert) keys of every decode
step, in step order and ascending key order within a step. With ``bypass=True`` (default) a miss may be left
out of the cache (the home copy serves it), which is the optimum for a cache that serves misses from host memory
and admits only on demand; ``bypass=False`` is the classic demand-paging MIN. Neither models admission limits,
replan periods or elastic releases, so both bound the online policies from above, except that a policy which
admits a key some steps after its miss acts like a (one-key) prefetch and can in principle edge past the
demand-fetch optimum.

CLI::

    python -m expert_cache.sim --trace T.npz --slots 392 --policy decayed --json
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import sys
from collections.abc import Sequence

import numpy as np

from cpu_tier.geometry import V41_FLASH

from .config import POLICIES, ExpertCacheConfig, policy_config
from .planner import CacheController, CacheStats
from .policies import Policy
from .trace import Trace, load_trace

__all__ = ["access_stream", "belady_hits", "belady_hit_rate", "main", "simulate", "static_oracle_hit_rate"]


def _check_geometry(trace: Trace, config: ExpertCacheConfig) -> None:
    if config.num_layers != trace.num_layers:
        raise ValueError(f"num_layers: config has {config.num_layers}, the trace has {trace.num_layers}")
    if config.num_experts != trace.num_experts:
        raise ValueError(f"num_experts: config has {config.num_experts}, the trace has {trace.num_experts}")


def _step_keys(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys of one step's rows ``[rows, L, K]`` and their pick counts."""
    L = ids.shape[1]
    flat = (ids.astype(np.int64) + (np.arange(L, dtype=np.int64) * num_experts)[None, :, None]).reshape(-1)
    return np.unique(flat, return_counts=True)


def simulate(trace: Trace, config: ExpertCacheConfig, policy: Policy | None = None) -> CacheStats:
    """Replay ``trace`` through a cache of ``config.resolve_num_slots()`` slots.

    Parameters
    ----------
    trace
        The routing trace.
    config
        Cache configuration; its geometry must match the trace and it must give ``num_slots`` (or a
        ``vram_budget_bytes``).
    policy
        Overrides the policy built from ``config``.

    Returns
    -------
    CacheStats
        Hits and accesses over decode steps, admissions, evictions, releases, bytes copied.
    """
    _check_geometry(trace, config)
    n = config.resolve_num_slots()
    ctl = CacheController(config, n, policy)
    E, K = config.num_experts, config.num_keys
    resident = np.zeros(K, bool)
    acc_steps: list[np.ndarray] = []
    acc_picks = np.zeros(K, np.float64)
    pre_picks = np.zeros(K, np.float64)
    pre_rows = 0
    hits = accesses = picks = pick_hits = 0
    off = 0

    def flush(complete: bool = False) -> None:
        nonlocal pre_rows
        obs = (list(acc_steps), acc_picks.copy(), pre_picks.copy(), pre_rows)
        ctl.submit(lambda: obs, complete)
        acc_steps.clear()
        acc_picks[:] = 0.0
        pre_picks[:] = 0.0
        pre_rows = 0

    def sync_resident() -> None:
        resident[:] = ctl.slot_of >= 0

    for s in range(trace.num_steps):
        r = int(trace.rows_per_step[s])
        ids = trace.ids[off : off + r]
        off += r
        kind, action = ctl.begin_step(int(trace.tokens_per_step[s]))
        if action == "release":
            flush(complete=True)
            ctl.release()
            sync_resident()
        elif action == "rewarm":
            flush(complete=True)
            ctl.rewarm()
            sync_resident()
        if r:
            keys, cnt = _step_keys(ids, E)
            if kind == "decode":
                hm = resident[keys]
                accesses += keys.size
                hits += int(hm.sum())
                picks += int(cnt.sum())
                pick_hits += int(cnt[hm].sum())
                acc_steps.append(keys)
                acc_picks[keys] += cnt
            elif config.observe_prefill:
                pre_picks[keys] += cnt
                pre_rows += r
        if ctl.end_step(kind):
            flush()
            if ctl.plan():
                sync_resident()
    c = ctl.counters()
    return CacheStats(
        **c,  # the controller's lifecycle counters
        accesses=accesses,
        hits=hits,
        picks=picks,
        pick_hits=pick_hits,
        bytes_copied=c["admits"] * config.expert_bytes,
        num_slots=n,
    )


def access_stream(trace: Trace, prefill_tokens: int = 512) -> np.ndarray:
    """int64 keys of the decode access stream: per decode step (``tokens <= prefill_tokens``), its distinct keys
    ascending, steps in order."""
    return _access_stream(trace, prefill_tokens)[0]


def _access_stream(trace: Trace, prefill_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The decode access stream and the trace step of each access."""
    E = trace.num_experts
    out: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    off = 0
    for s in range(trace.num_steps):
        r = int(trace.rows_per_step[s])
        if r and int(trace.tokens_per_step[s]) <= prefill_tokens:
            out.append(_step_keys(trace.ids[off : off + r], E)[0])
            steps.append(np.full(out[-1].size, s, np.int64))
        off += r
    if not out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out), np.concatenate(steps)


def _next_use(keys: np.ndarray) -> np.ndarray:
    """``nxt[i]`` = the next index j > i with ``keys[j] == keys[i]``, or ``len(keys)``."""
    m = keys.size
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    nxt = np.full(m, m, np.int64)
    same = sk[1:] == sk[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(keys: Sequence[int] | np.ndarray, num_slots: int, bypass: bool = True) -> int:
    """Hits of Belady's MIN on an access sequence with ``num_slots`` slots (see :func:`belady_hit_mask`)."""
    return int(belady_hit_mask(keys, num_slots, bypass).sum())


def belady_hit_mask(keys: Sequence[int] | np.ndarray, num_slots: int, bypass: bool = True) -> np.ndarray:
    """Which accesses of ``keys`` hit under Belady's MIN with ``num_slots`` slots (bool, one per access).

    Parameters
    ----------
    keys
        The access sequence (any hashable ints).
    num_slots
        Cache capacity (>= 0).
    bypass
        On a miss with a full cache, keep the cache as it is when the missed key is used again later than every
        resident (optimal when misses can be served without admission); False admits on every miss.
    """
    keys = np.asarray(keys, np.int64)
    if num_slots < 0:
        raise ValueError(f"num_slots: must be >= 0, got {num_slots}")
    m = keys.size
    hit = np.zeros(m, bool)
    if m == 0 or num_slots == 0:
        return hit
    nxt = _next_use(keys).tolist()
    ks = keys.tolist()
    cur: dict[int, int] = {}  # resident key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), lazily invalidated
    for i in range(m):
        k, nu = ks[i], nxt[i]
        if k in cur:
            hit[i] = True
            cur[k] = nu
            heapq.heappush(heap, (-nu, k))
            continue
        if bypass and nu == m:
            continue
        if len(cur) < num_slots:
            cur[k] = nu
            heapq.heappush(heap, (-nu, k))
            continue
        while True:
            neg, v = heap[0]
            if cur.get(v) == -neg:
                break
            heapq.heappop(heap)
        if bypass and nu >= -neg:
            continue
        heapq.heappop(heap)
        del cur[v]
        cur[k] = nu
        heapq.heappush(heap, (-nu, k))
    return hit


def belady_hit_rate(trace: Trace, num_slots: int, prefill_tokens: int = 512, bypass: bool = True,
                    from_step: int = 0) -> float:  # fmt: skip
    """Belady's MIN hit rate over the trace's decode access stream (see :func:`belady_hits`), counted over the
    accesses of steps ``>= from_step`` (MIN itself sees the whole stream: a cache measured after a warm-up of
    ``from_step`` steps is compared with MIN over the same steps, not with MIN's cold start)."""
    keys, steps = _access_stream(trace, prefill_tokens)
    counted = steps >= from_step
    n = int(counted.sum())
    return int(belady_hit_mask(keys, num_slots, bypass)[counted].sum()) / n if n else 0.0


def static_oracle_hit_rate(trace: Trace, num_slots: int, prefill_tokens: int = 512) -> float:
    """Hit rate of the best fixed set of ``num_slots`` keys (the most accessed over the whole trace, known in
    advance): what a perfect saved profile with no adaptation would reach."""
    keys = access_stream(trace, prefill_tokens)
    if keys.size == 0:
        return 0.0
    cnt = np.bincount(keys)
    top = np.sort(cnt)[::-1][:num_slots]
    return float(top.sum()) / keys.size


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m expert_cache.sim``: simulate one policy on one trace and print the stats."""
    ap = argparse.ArgumentParser(prog="python -m expert_cache.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="trace .npz (expert_cache.trace format)")
    ap.add_argument("--slots", type=int, required=True, help="VRAM slots (global across layers)")
    ap.add_argument("--policy", choices=POLICIES, default="decayed")
    ap.add_argument("--replan-every", type=int, default=16)
    ap.add_argument("--admit-limit", type=int, default=48)
    ap.add_argument("--hysteresis", type=float, default=1.0)
    ap.add_argument("--elastic", action="store_true", help="release before prefill steps, re-warm after decode steps")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--observe-prefill", action="store_true")
    ap.add_argument("--rewarm-set", choices=("kept", "top"), default="kept")
    ap.add_argument("--rewarm-limit", type=int, default=0, help="at most this many re-warm admissions (0: all)")
    ap.add_argument("--profile", default=None, help="routing-frequency profile .npz (hybrid policy)")
    ap.add_argument(
        "--slot-bytes",
        type=int,
        default=V41_FLASH.expert_trellis_bytes,
        help="bytes per expert (for bytes_copied; default: a V4.1-Flash expert)",
    )
    ap.add_argument("--belady", action="store_true", help="also compute Belady's MIN hit rate (bypass)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    try:
        trace = load_trace(a.trace)
        cfg = ExpertCacheConfig(
            num_layers=trace.num_layers,
            num_experts=trace.num_experts,
            slot_bytes=a.slot_bytes,
            num_slots=a.slots,
            policy=policy_config(a.policy, profile_path=a.profile) if a.profile else policy_config(a.policy),
            replan_every=a.replan_every,
            admit_limit=a.admit_limit,
            hysteresis=a.hysteresis,
            elastic=a.elastic,
            prefill_tokens=a.prefill_tokens,
            observe_prefill=a.observe_prefill,
            rewarm_set=a.rewarm_set,
            rewarm_limit=a.rewarm_limit,
        )
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = simulate(trace, cfg)
    out: dict[str, object] = {
        "trace": a.trace,
        "source": trace.meta.get("source", "?"),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "projections"}
        | {"policy": {"name": cfg.policy.name, **dataclasses.asdict(cfg.policy)}},
        "stats": st.as_dict(),
    }
    if a.belady:
        out["belady_hit_rate"] = belady_hit_rate(trace, a.slots, a.prefill_tokens)
    if a.json:
        print(json.dumps(out, sort_keys=True))
    else:
        s = st
        line = f"policy={a.policy} slots={a.slots} hit_rate={s.hit_rate:.4f} pick_hit_rate={s.pick_hit_rate:.4f} "
        line += f"admits={s.admits} evicts={s.evicts} releases={s.releases} GB_copied={s.bytes_copied / 1e9:.2f}"
        if a.belady:
            line += f" belady={out['belady_hit_rate']:.4f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
