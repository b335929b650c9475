"""Policy benchmark (CPU): hit rate of every policy, and its ratio to Belady's MIN, on traces at several slot counts.

Traces are synthetic (``expert_cache.trace.generate``: DeepSeek-V4.1-Flash geometry, 40 layers x 384 experts,
top-6), unless ``--trace`` gives recorded ones. Synthetic routing is a model, not a measurement: read the numbers
as a comparison of policies under stated assumptions, not as a prediction for the real model.

    python benches/bench_policies.py [--quick] [--json out.json] [--trace T.npz ...]

Rows: scenario, slots, config, hit rate, hit rate / Belady (bypass MIN on the same decode access stream),
admissions per decode step, GB copied per decode step (13.27 MB per admission), wall seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cpu_tier.geometry import V41_FLASH  # noqa: E402
from expert_cache import (  # noqa: E402
    ArcConfig,
    DecayedConfig,
    ExpertCacheConfig,
    HybridConfig,
    LfuConfig,
    LruConfig,
    SyntheticTraceConfig,
    Trace,
    belady_hit_rate,
    generate,
    load_trace,
    simulate,
    static_oracle_hit_rate,
)

EXPERT = V41_FLASH.expert_trellis_bytes  # bytes of one V4.1-Flash expert (13,271,040)

#: (label, config overrides). The reference runs elastic (released before > 512-token steps, re-warmed after 4
#: decode steps); every config here does too, so all see the same prefill steps.
CONFIGS: list[tuple[str, dict[str, object]]] = [
    ("decayed (reference)", dict(policy=DecayedConfig())),
    ("lru", dict(policy=LruConfig())),
    ("lfu", dict(policy=LfuConfig())),
    ("arc", dict(policy=ArcConfig())),
    ("hybrid @16/48", dict(policy=HybridConfig(), hysteresis=1.2)),
    ("decayed @1/4", dict(policy=DecayedConfig(decay=0.9 ** (1 / 16)), replan_every=1, admit_limit=4)),
    ("hybrid @1/4", dict(policy=HybridConfig(), replan_every=1, admit_limit=4, hysteresis=1.2)),
    (
        "hybrid @1/4 +prefill",
        dict(
            policy=HybridConfig(), replan_every=1, admit_limit=4, hysteresis=1.2, observe_prefill=True, rewarm_set="top"
        ),
    ),
]


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small traces and fewer slot counts (a smoke run)")
    ap.add_argument("--trace", nargs="*", default=[], help="recorded traces to use instead of the synthetic scenarios")
    ap.add_argument("--slots", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=3000, help="decode steps per synthetic trace")
    ap.add_argument("--drift-sweep", action="store_true", help="also C1 at drift 0 and 20 (392 slots)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    steps = 300 if a.quick else a.steps
    slots = a.slots or ([392] if a.quick else [100, 200, 392, 800, 1600])

    scenarios: list[tuple[str, Trace, list[int]]] = []
    t0 = time.perf_counter()
    if a.trace:
        scenarios = [(Path(p).name, load_trace(p), slots) for p in a.trace]
    else:
        base = SyntheticTraceConfig(decode_steps=steps, drift=5.0, seed=7)
        scenarios.append(("C1 drift5", generate(base), slots))
        scenarios.append(("C4 drift5", generate(dataclasses.replace(base, streams=4, seed=8)), slots))
        if a.drift_sweep:
            for d in (0.0, 20.0):
                scenarios.append((f"C1 drift{d:g}", generate(dataclasses.replace(base, drift=d, seed=9)), [392]))
    gen_s = time.perf_counter() - t0

    print(
        f"# expert-cache bench_policies | git {git_rev()} | {platform.processor() or platform.machine()} | "
        f"numpy {np.__version__} | traces generated in {gen_s:.0f} s"
    )
    print(
        f"{'scenario':12s} {'slots':>5s} {'config':24s} {'hit_rate':>8s} {'/belady':>7s} {'adm/step':>8s} "
        f"{'GB/step':>7s} {'sec':>5s}"
    )
    rows: list[dict[str, object]] = []
    for name, tr, ns in scenarios:
        for n in ns:
            t = time.perf_counter()
            bel = belady_hit_rate(tr, n)
            static = static_oracle_hit_rate(tr, n)
            bt = time.perf_counter() - t
            print(f"{name:12s} {n:5d} {'belady MIN (bypass)':24s} {bel:8.4f} {1.0:7.3f} {'':8s} {'':7s} {bt:5.0f}")
            print(f"{name:12s} {n:5d} {'static oracle':24s} {static:8.4f} {static / bel:7.3f}")
            rows.append({"scenario": name, "slots": n, "config": "belady", "hit_rate": bel})
            rows.append({"scenario": name, "slots": n, "config": "static_oracle", "hit_rate": static})
            for label, kw in CONFIGS:
                cfg = ExpertCacheConfig(
                    num_layers=tr.num_layers,
                    num_experts=tr.num_experts,
                    slot_bytes=EXPERT,
                    num_slots=n,
                    elastic=True,
                    **kw,  # type: ignore[arg-type]
                )
                t = time.perf_counter()
                st = simulate(tr, cfg)
                dt = time.perf_counter() - t
                adm = st.admits / max(1, st.decode_steps)
                print(
                    f"{name:12s} {n:5d} {label:24s} {st.hit_rate:8.4f} {st.hit_rate / bel:7.3f} {adm:8.2f} "
                    f"{adm * EXPERT / 1e9:7.3f} {dt:5.0f}",
                    flush=True,
                )
                rows.append(
                    {
                        "scenario": name,
                        "slots": n,
                        "config": label,
                        "ratio_to_belady": st.hit_rate / bel,
                        **st.as_dict(),
                    }
                )
    if a.json:
        meta = {name: tr.meta for name, tr, _ in scenarios}
        Path(a.json).write_text(json.dumps({"git": git_rev(), "traces": meta, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
