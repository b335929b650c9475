"""Hit rates of the VRAM expert caches of two 24 GB cards, split three ways, on a synthetic V4.1-Flash trace (CPU).

    uv run python packages/vllm-dsv41/scripts/pp_cache_sim.py [--steps 1500] [--streams 1] [--slots 1075]
        [--pp-slots 1316,1378]

expert-cache's simulator (``expert_cache.sim``: the policy replayed, Belady's MIN, the best fixed set) on one
synthetic trace (``expert_cache.generate``: 40 layers x 384 experts, top-6; a model of routing, not a measurement):

* ``1 GPU``: one cache of ``--slots`` (one card: what the dense weights, KV cache and runtime leave);
* ``shared 2C``: one cache of twice that over every layer (two cards' caches pooled perfectly: the bound);
* ``EP split``: expert parallel over the caches: card ``r`` caches only experts with ``e % 2 == r``, ``--slots``
  each (the policy cannot be replayed on a half, whose rows have a varying number of picks: Belady and the best
  fixed set only, computed on each half's own access stream);
* ``PP split``: pipeline parallel: card ``r`` caches only its stage's layers (vLLM's partition of 40 layers: 20 +
  20), ``--pp-slots`` (each card holds half the dense layers, so it has more room than one card alone).

Rates are of the decode access stream (distinct (layer, expert) keys per step), summed over both cards.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _hits_fixed(keys: np.ndarray, slots: int) -> int:
    """Hits of the best fixed set of ``slots`` keys (known in advance) on ``keys``."""
    _, counts = np.unique(keys, return_counts=True)
    return int(np.sort(counts)[::-1][:slots].sum())


def main() -> int:
    from cpu_tier.geometry import V41_FLASH
    from expert_cache import ExpertCacheConfig, SyntheticTraceConfig, generate, policy_config
    from expert_cache.sim import access_stream, belady_hits, simulate
    from expert_cache.trace import Trace

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="decode steps of the synthetic trace")
    ap.add_argument("--streams", type=int, default=1, help="concurrent decode streams")
    ap.add_argument("--slots", type=int, default=1075, help="one card's cache slots")
    ap.add_argument("--pp-slots", default="1316,1378", help="each pipeline stage's card's slots")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.perf_counter()
    trace = generate(SyntheticTraceConfig(decode_steps=a.steps, streams=a.streams, seed=a.seed))
    L, E = trace.num_layers, trace.num_experts
    keys = access_stream(trace)
    pp = [int(x) for x in a.pp_slots.split(",")]
    from vllm.distributed.utils import get_pp_indices  # the stages' layers: vLLM's partition

    stages = [range(*get_pp_indices(L, r, 2)) for r in range(2)]
    print(f"trace: {trace.num_steps} steps ({a.steps} decode, {a.streams} streams), {keys.size} decode accesses, "
          f"{L} layers x {E} experts; stages {[(s.start, s.stop) for s in stages]} ({time.perf_counter() - t0:.0f} s)",
          flush=True)  # fmt: skip

    def policy_hits(tr: Trace, slots: int) -> int:
        cfg = ExpertCacheConfig(num_layers=tr.num_layers, num_experts=tr.num_experts, num_slots=slots,
                                slot_bytes=V41_FLASH.expert_trellis_bytes, policy=policy_config(a.policy))  # fmt: skip
        return int(simulate(tr, cfg).hits)

    rows: list[tuple[str, str, float | None, float, float]] = []
    n = keys.size
    c = a.slots
    rows.append(("1 GPU", f"{c}", policy_hits(trace, c) / n, belady_hits(keys, c) / n, _hits_fixed(keys, c) / n))
    rows.append(("shared 2C", f"{2 * c}", policy_hits(trace, 2 * c) / n, belady_hits(keys, 2 * c) / n,
                 _hits_fixed(keys, 2 * c) / n))  # fmt: skip
    halves = [keys[(keys % E) % 2 == r] for r in range(2)]
    rows.append(("EP split", f"{c} + {c}", None, sum(belady_hits(h, c) for h in halves) / n,
                 sum(_hits_fixed(h, c) for h in halves) / n))  # fmt: skip
    pol = bel = fix = 0
    for s, slots in zip(stages, pp, strict=True):
        sub = Trace.create(trace.ids[:, s.start : s.stop], trace.rows_per_step, trace.tokens_per_step, E)
        sk = access_stream(sub)
        pol += policy_hits(sub, slots)
        bel += belady_hits(sk, slots)
        fix += _hits_fixed(sk, slots)
    rows.append(("PP split", f"{pp[0]} + {pp[1]}", pol / n, bel / n, fix / n))
    print(f"{'case':<10} {'slots':>12} {a.policy + ' hit':>11} {'Belady MIN':>11} {'best fixed':>11}")
    for name, slots_s, p, b, f in rows:
        ps = f"{p:11.4f}" if p is not None else f"{'-':>11}"
        print(f"{name:<10} {slots_s:>12} {ps} {b:11.4f} {f:11.4f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
