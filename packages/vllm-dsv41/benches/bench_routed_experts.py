"""What the plugin adds on top of cpu-tier: the ``dsv41::routed_experts_out`` op against ``ExpertTier.forward``.

The op is what vLLM calls per MoE layer: torch tensors in, an output buffer written (conversions, ``Picks``, the
runtime lookup). ``ExpertTier.forward`` on ready numpy inputs is the ceiling. One synthetic MoE layer of
random EXL3 experts (3 bpw MUL1 by default).

    uv run python packages/vllm-dsv41/benches/bench_routed_experts.py [--experts 64 --hidden 2048 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _times(fns: list, warmup: int, iters: int) -> list[np.ndarray]:  # noqa: ANN001
    """Microseconds per call of each function, interleaved call by call so that drift hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    out = np.empty((len(fns), iters))
    for i in range(iters):
        for j, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[j, i] = time.perf_counter() - t0
    return list(out * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--bits", type=float, default=3.0)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from cpu_tier import CpuTierConfig, Picks, selected_isa
    from cpu_tier.exl3 import random_tensor
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.experts import CpuExpertRuntime, register_runtime, unregister_runtime
    from vllm_dsv41.home import LayerExperts

    rng = np.random.default_rng(0)
    h, i, e = a.hidden, a.intermediate, a.experts
    gate = [random_tensor(h, i, a.bits, a.codebook, rng) for _ in range(e)]
    up = [random_tensor(h, i, a.bits, a.codebook, rng) for _ in range(e)]
    down = [random_tensor(i, h, a.bits, a.codebook, rng) for _ in range(e)]
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=a.threads))
    runtime = CpuExpertRuntime(cfg)
    runtime.add_layer(LayerExperts(0, tuple(gate), tuple(up), tuple(down)), swiglu_limit=10.0)
    handle = register_runtime(runtime)
    tier = runtime._tier  # the ceiling: the tier itself, on ready numpy inputs

    print(
        f"# vllm-dsv41 bench_routed_experts | git {_git()} | {platform.processor() or platform.machine()} | "
        f"isa {selected_isa()} | threads {cfg.effective_threads} | "
        f"E={e} k={a.top_k} H={h} I={i} {a.bits:g} bpw {a.codebook} | warmup={a.warmup} iters={a.iters}"
    )
    print(f"{'case':<12}{'median_us':>12}{'p10_us':>10}{'p90_us':>10}{'tier_us':>10}{'overhead':>10}")
    rows = []
    for t in a.tokens:
        x = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32))
        ids = torch.from_numpy(np.stack([rng.choice(e, a.top_k, replace=False) for _ in range(t)]).astype(np.int32))
        w = torch.from_numpy(rng.uniform(0.1, 1, (t, a.top_k)).astype(np.float32))
        xn, out, buf = x.numpy(), np.empty((t, h), np.float32), torch.empty(t, h)
        picks = Picks.from_topk(ids.numpy(), w.numpy())
        op, ceil = _times(
            [
                lambda: torch.ops.dsv41.routed_experts_out(x, ids, w, buf, handle, 0),  # noqa: B023
                lambda: tier.forward(0, xn, picks, out=out),  # noqa: B023
            ],
            a.warmup,
            a.iters,
        )
        med, med_c = float(np.median(op)), float(np.median(ceil))
        p10, p90 = float(np.percentile(op, 10)), float(np.percentile(op, 90))
        row = {"tokens": t, "median_us": med, "p10_us": p10, "p90_us": p90, "tier_median_us": med_c,
               "overhead": med / med_c - 1}  # fmt: skip
        rows.append(row)
        print(f"{'T=' + str(t):<12}{med:>12.1f}{row['p10_us']:>10.1f}{row['p90_us']:>10.1f}{med_c:>10.1f}"
              f"{row['overhead']:>+10.1%}")  # fmt: skip
    unregister_runtime(handle)
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
