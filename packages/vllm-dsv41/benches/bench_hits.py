"""Hits through a pointer table (``vllm_dsv41.hits``): microseconds per layer and the trellis read rate, against the
ceilings measured in the same run.

One MoE layer of fresh random EXL3 experts (DeepSeek-V4.1-Flash's shape by default: 384 experts, H 5120, I 2304,
3 bpw MUL1, top-6), in a VRAM pool (the cache's slots) and in GPU-mapped host memory (the registered home, read over
PCIe). Per backend, memory and T: fresh routings (top-k of all experts, uniform) per run, L2 flushed before each
run, each run timed with CUDA events around one replay of a CUDA graph of ``forward`` (the served path; ``--eager``
times eager calls as well). Bytes = every distinct expert of the run's routing, all nine tensors (what the kernel
must read). Ceilings, same bytes, same flush: VRAM, a device-to-device copy (read + write traffic / time: the HBM
rate); mapped, a pinned host-to-device copy (the PCIe rate). Each row: min / median / max us over the runs, GB/s at
the median, ratio to the ceiling's median rate, and the error against the float64 reference on the first routing.

    python packages/vllm-dsv41/benches/bench_hits.py [--json out.json]            # GPU: every backend
    python packages/vllm-dsv41/benches/bench_hits.py --device cpu --experts 8 --hidden 256 --intermediate 128 \\
        --tokens 1 2 --runs 3                                                      # CPU dry run (reference only)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


class Timer:
    """Times one call per run: CUDA events (L2 flushed first) on CUDA, the wall clock on the CPU."""

    def __init__(self, device: torch.device, flush_mib: int = 256) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def runs(self, fn: Callable[[int], None], prepare: Callable[[int], None], runs: int, warmup: int) -> list[float]:
        """Microseconds of ``fn(r)`` for r in range(runs), after ``prepare(r)`` (untimed) and an L2 flush."""
        out = []
        for r in range(-warmup, runs):
            prepare(r % runs)
            if self.cuda:
                assert self.flush is not None
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(r % runs)
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3
            else:
                t0 = time.perf_counter()
                fn(r % runs)
                us = (time.perf_counter() - t0) * 1e6
            if r >= 0:
                out.append(us)
        return out


def _stats(us: list[float]) -> tuple[float, float, float]:
    return min(us), statistics.median(us), max(us)


def main() -> None:  # noqa: PLR0915 - one linear script
    from cpu_tier.geometry import V41_FLASH

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=V41_FLASH.num_experts)
    ap.add_argument("--top-k", type=int, default=V41_FLASH.top_k)
    ap.add_argument("--hidden", type=int, default=V41_FLASH.hidden)
    ap.add_argument("--intermediate", type=int, default=V41_FLASH.intermediate)
    ap.add_argument("--bits", type=float, default=V41_FLASH.bits)
    ap.add_argument("--codebook", default=V41_FLASH.codebook)
    ap.add_argument("--swiglu-limit", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--memory", nargs="+", default=None,
                    help="device mapped (default, CUDA) / host (CPU); MEMORY@N puts every tensor N bytes past a "
                         "256-byte boundary (mapped@4: a Flash pack's home, on 4-byte boundaries)")  # fmt: skip
    ap.add_argument("--backends", nargs="+", default=None, help="default: exllamav3 triton on CUDA, reference on CPU")
    ap.add_argument(
        "--triton",
        nargs="*",
        default=["", "prefetch=0", "block_n=256", "decode=elements"],
        help="TritonHits option sets to compare, e.g. 'block_k=64,prefetch=4,decode=elements' ('' or 'defaults': "
        "the defaults)",
    )
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="also time eager calls (launch overhead included)")
    ap.add_argument("--no-check", action="store_true", help="skip the error against the float64 reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from cpu_tier.exl3 import random_tensor
    from vllm_dsv41.dense import exllamav3_available
    from vllm_dsv41.hits import ExpertPool, HitGeometry, ReferenceHits, make_hits
    from vllm_dsv41.home import LayerExperts

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    memories = a.memory or (["device", "mapped"] if cuda else ["host"])
    if any((m.split("@")[0] == "host") == cuda for m in memories):
        raise SystemExit(f"bench_hits: memory {memories} on {dev}: 'device'/'mapped' on CUDA, 'host' on the CPU")
    backends = a.backends or (["exllamav3", "triton"] if cuda else ["reference"])
    if "exllamav3" in backends and not (cuda and exllamav3_available()):
        raise SystemExit("bench_hits: backend exllamav3 asked for, but its CUDA extension does not import here")
    h, i, e, k = a.hidden, a.intermediate, a.experts, a.top_k
    rng = np.random.default_rng(a.seed)
    t0 = time.time()
    lx = LayerExperts(
        0,
        *(
            tuple(random_tensor(kk, nn, a.bits, a.codebook, rng) for _ in range(e))
            for kk, nn in ((h, i), (h, i), (i, h))
        ),
    )
    geo = HitGeometry.from_layer(lx, a.swiglu_limit)
    print(f"# {e} experts synthesized in {time.time() - t0:.1f} s ({e * geo.expert_bytes / 2**30:.2f} GiB)", flush=True)
    pools = {}
    for m in memories:
        t0 = time.time()
        kind, _, off = m.partition("@")
        pools[m] = ExpertPool(lx, dev, kind, offset=int(off or 0))  # type: ignore[arg-type]
        print(f"# {m} pool ready in {time.time() - t0:.1f} s", flush=True)

    name = torch.cuda.get_device_name(dev) if cuda else (platform.processor() or platform.machine())
    print(
        f"# vllm-dsv41 bench_hits | git {_git()} | {name} | torch {torch.__version__} | E={e} top-{k} H={h} I={i} "
        f"{a.bits:g} bpw {a.codebook} | {geo.expert_bytes / 1e6:.2f} MB per expert | runs={a.runs} "
        f"warmup={a.warmup} | {'L2 flushed before every run' if cuda else 'wall clock'} | "
        "GB/s = distinct experts' bytes / median time | "
        f"ceiling: device = D2D copy (read + write) of the same bytes, mapped = pinned H2D copy of the same bytes"
    )
    timer = Timer(dev)
    rows: list[dict[str, Any]] = []
    git = _git()

    def save() -> None:  # after every row: a run cut by a time limit keeps what it measured
        if a.json:
            a.json.write_text(json.dumps(dict(git=git, device=name, args=vars(a) | {"json": str(a.json)}, rows=rows),
                                         indent=1))  # fmt: skip

    # per T: the routings of every run (fresh each run), their distinct-expert bytes, the ceiling of that many bytes
    routes: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]] = {}
    for t in a.tokens:
        lst = []
        for _ in range(a.runs):
            ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
            w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
            x = rng.standard_normal((t, h)).astype(np.float32)
            nbytes = len(np.unique(ids)) * geo.expert_bytes
            lst.append(
                (torch.from_numpy(ids).to(dev), torch.from_numpy(w).to(dev), torch.from_numpy(x).to(dev), nbytes)
            )
        routes[t] = lst

    ceilings: dict[tuple[str, int], float] = {}  # (memory, T) -> GB/s at the median
    for m in memories:
        for t in a.tokens:
            nb = int(statistics.median(r[3] for r in routes[t]))
            dst = torch.empty(nb, dtype=torch.uint8, device=dev)
            if m.startswith("device"):
                src = torch.empty(nb, dtype=torch.uint8, device=dev)
                src.fill_(1)
                traffic = 2 * nb  # read + write
            else:
                src = torch.ones(nb, dtype=torch.uint8, pin_memory=cuda)
                traffic = nb
            us = timer.runs(lambda r, dst=dst, src=src: dst.copy_(src, non_blocking=True), lambda r: None, a.runs,
                            a.warmup)  # fmt: skip
            lo, med, hi = _stats(us)
            ceilings[(m, t)] = traffic / med / 1e3
            what = {"device": "D2D copy", "mapped": "H2D copy", "host": "memcpy"}[m.split("@")[0]]
            rows.append(dict(case="ceiling", backend=what, memory=m, tokens=t, bytes=nb, us_min=lo, us_med=med,
                             us_max=hi, gbps=ceilings[(m, t)]))  # fmt: skip
            del src, dst
    print(f"{'backend':<34} {'memory':<7} {'T':>3} {'mode':<6} {'picks':>5} {'experts':>7} {'MB':>8} "
          f"{'us min':>9} {'us med':>9} {'us max':>9} {'GB/s':>8} {'ceil':>8} {'ratio':>6} {'err':>8}")  # fmt: skip
    for row in rows:
        print(f"{'ceiling: ' + row['backend']:<34} {row['memory']:<7} {row['tokens']:>3} {'':<6} {'':>5} {'':>7} "
              f"{row['bytes'] / 1e6:>8.1f} {row['us_min']:>9.1f} {row['us_med']:>9.1f} {row['us_max']:>9.1f} "
              f"{row['gbps']:>8.1f}", flush=True)  # fmt: skip

    variants: list[tuple[str, str, dict[str, Any]]] = []
    for b in backends:
        if b == "triton":
            for spec in a.triton:
                pairs = (kv.split("=", 1) for kv in spec.split(",") if kv and kv != "defaults")
                opts = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}
                variants.append((b, f"triton {spec or 'defaults'}", opts))
        else:
            variants.append((b, b, {}))
    ref = ReferenceHits(geo)
    for m in memories:
        ptrs = pools[m].ptrs
        for t in a.tokens:
            want = None
            ids0, w0, x0, _ = routes[t][0]
            if not a.no_check:
                want = torch.empty((t, k, h), dtype=torch.float32, device=dev)
                ref.forward(ptrs, x0, ids0, w0, want)
            for backend, label, opts in variants:
                kern: Any = make_hits(lx, dev, backend, swiglu_limit=a.swiglu_limit, max_tokens=t, top_k=k, **opts)  # type: ignore[arg-type]
                if int(m.partition("@")[2] or 0) % getattr(kern, "alignment", 1):
                    print(f"# {label}: skipped on {m} (its loads need {kern.alignment}-byte aligned tensors)")
                    continue
                sx, sids, sw = x0.clone(), ids0.clone(), w0.clone()
                out = torch.empty((t, k, h), dtype=torch.float32, device=dev)
                kern.forward(ptrs, sx, sids, sw, out)  # compiles / autotunes this size
                err = float("nan")
                if want is not None:
                    live = sids >= 0
                    d = (out.double() - want.double()).abs().amax(-1)[live]
                    err = float((d / want.double().abs().amax(-1)[live]).max())

                def prepare(r: int, t: int = t, sx: Any = sx, sids: Any = sids, sw: Any = sw) -> None:
                    ids_r, w_r, x_r, _ = routes[t][r]
                    sids.copy_(ids_r)
                    sw.copy_(w_r)
                    sx.copy_(x_r)

                modes: list[tuple[str, Callable[[int], None]]] = []
                eager = lambda r, k=kern, p=ptrs, x=sx, i=sids, w=sw, o=out: k.forward(p, x, i, w, o)  # noqa: E731
                if cuda and getattr(kern, "graph_safe", False):
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.graph(graph):
                            kern.forward(ptrs, sx, sids, sw, out)
                        modes.append(("graph", lambda r, graph=graph: graph.replay()))
                    except RuntimeError as exc:  # timed eagerly instead, and said so
                        print(f"# {label} T={t}: CUDA graph capture failed ({exc}); eager only", flush=True)
                        modes.append(("eager", eager))
                    if a.eager and modes[0][0] == "graph":
                        modes.append(("eager", eager))
                else:
                    modes.append(("eager", eager))
                picks = sum(int((r[0] >= 0).sum()) for r in routes[t]) / a.runs
                nb = statistics.median(r[3] for r in routes[t])
                for mode, fn in modes:
                    us = timer.runs(fn, prepare, a.runs, a.warmup)
                    lo, med, hi = _stats(us)
                    gbps = nb / med / 1e3
                    ratio = gbps / ceilings[(m, t)]
                    rows.append(dict(case="hits", backend=label, memory=m, tokens=t, mode=mode, picks=picks,
                                     experts=nb / geo.expert_bytes, bytes=nb, us_min=lo, us_med=med, us_max=hi,
                                     gbps=gbps, ceiling_gbps=ceilings[(m, t)], ratio=ratio, err=err))  # fmt: skip
                    print(f"{label:<34} {m:<7} {t:>3} {mode:<6} {picks:>5.0f} {nb / geo.expert_bytes:>7.1f} "
                          f"{nb / 1e6:>8.1f} {lo:>9.1f} {med:>9.1f} {hi:>9.1f} {gbps:>8.1f} {ceilings[(m, t)]:>8.1f} "
                          f"{ratio:>6.2f} {err:>8.1e}", flush=True)  # fmt: skip
                    save()
                del kern
    for p in pools.values():
        p.close()
    save()
    if a.json:
        print(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
