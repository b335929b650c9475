"""The staged prefill inside the tiered runtime at V4.1-Flash layer sizes, VRAM capped, against the transfer
ceiling measured in the same run.

    python packages/vllm-dsv41/benches/bench_prefill.py --layers 6 --prompts 8192,16384,32768 --json out.json

1. ``--layers`` real-size Flash MoE layers (``pack-tools synth --preset flash-layer``, linked into one home as
   ``bench_tiered.py`` does), mapped and CUDA-registered: the one host copy.
2. VRAM capped at ``--vram-gib`` (``torch.cuda.set_per_process_memory_fraction``); the tiered runtime's cache takes
   what is left minus its margin; the staged prefill borrows its ring and scratch from the cache.
3. The ceiling: pinned H2D of one layer's expert bytes from the home (the copy engine, same run): a prompt of T
   tokens chunked at ``--chunk`` cannot stream faster than ``layers * chunks * layer_bytes / H2D``.
4. Per prompt size (uniform top-6 routing, fresh per layer and chunk): the MoE calls of every chunk through
   ``TieredRuntime.forward_into`` (the served op's entry), wall time with a device sync per chunk; tok/s and the
   ratio ceiling / measured (the MoE share; attention and dense layers are not in this pack: the end-to-end figure
   needs the full model, see gpu_prefill.sh's served step). Runs ``--runs`` times: min / median / max.
5. Short prompts: ``--short`` tokens through every layer (the decode path must take them: TTFT share of the MoE).
6. Hit rate of the first ``--decode-steps`` decode steps (synthetic trace, 1 stream) after a long prefill vs
   the same steps before it (the cache's refill after giving the ring back), and the peak VRAM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiered import combined_home_dir, decode_steps  # noqa: E402

GiB = 1 << 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--root", type=Path, default=Path("/tmp/dsv41/flash"))
    ap.add_argument("--prompts", default="8192,16384,32768")
    ap.add_argument("--chunk", type=int, default=8192, help="vLLM's max_num_batched_tokens (default 8192)")
    ap.add_argument("--short", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--vram-gib", type=float, default=24.0)
    ap.add_argument("--cache-margin-gib", type=float, default=2.0)
    ap.add_argument("--cache-mib", type=float, default=0.0, help="cache size (dry runs; default: auto)")
    ap.add_argument("--min-tokens", type=int, default=0, help="prefill_min_tokens (0: the calibrated rule)")
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run at small shapes)")
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from cpu_tier import CpuTierConfig
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.config import TieredConfig
    from vllm_dsv41.home import ExpertHome
    from vllm_dsv41.tiered import TieredRuntime

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.vram_gib * GiB / total), device)
    shape = {k: v for k, v in (("experts", a.experts), ("hidden", a.hidden), ("intermediate", a.intermediate)) if v}
    home = ExpertHome(combined_home_dir(a.root, a.layers, shape), register=cuda)
    print(f"home: {home.describe()}", flush=True)
    layers = list(home.layers())
    lids = [lx.layer for lx in layers]
    E, H = layers[0].num_experts, layers[0].hidden
    K = min(6, E)
    tcfg = TieredConfig(cache_margin_gib=a.cache_margin_gib, deadline_factor=0.0, stats_every=0,
                        prefill_min_tokens=a.min_tokens, hit_kernel="auto" if cuda else "reference")  # fmt: skip
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=a.cpu_threads), runtime="tiered", tiered=tcfg)
    # the cache sizes itself from the 24 GiB card mimicked here, not from the H200's free memory
    rt = TieredRuntime(cfg, home, device, cache_bytes=int(a.cache_mib * (1 << 20)) or None,
                       device_budget_bytes=int(a.vram_gib * GiB) if cuda else None)  # fmt: skip
    for lx in layers:
        rt.add_layer(lx, swiglu_limit=None)
    rt.allow_cache()
    rng = np.random.default_rng(0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def moe_pass(tokens: int) -> float:
        """Every MoE layer once for a call of ``tokens`` tokens (uniform routing); seconds."""
        out = torch.empty((tokens, H), dtype=torch.bfloat16, device=device)
        x = torch.randn((tokens, H), dtype=torch.bfloat16, device=device)
        ids = torch.from_numpy(np.argsort(rng.random((tokens, E)), axis=1)[:, :K].astype(np.int64)).to(device)
        w = torch.full((tokens, K), 1.0 / K, device=device)
        sync()
        t0 = time.perf_counter()
        for lid in lids:
            rt.forward_into(lid, x, ids, w, out)
        sync()
        return time.perf_counter() - t0

    def decode(steps: list[np.ndarray]) -> float:
        s0 = rt.cache.stats()
        for ids in steps:
            x = torch.randn((1, H), dtype=torch.bfloat16, device=device)
            out = torch.empty((1, H), dtype=torch.bfloat16, device=device)
            w = torch.full((1, K), 1.0 / K, device=device)
            for li, lid in enumerate(lids):
                rt.forward_into(lid, x, torch.from_numpy(ids[:, li].astype(np.int64)).to(device), w, out)
        s1 = rt.cache.stats()
        return (s1.hits - s0.hits) / max(s1.accesses - s0.accesses, 1)

    moe_pass(1)  # creates the cache, measures the rates, calibrates the staged prefill
    pf = rt.prefill
    print(f"prefill: {pf.describe()}; MoE calls of >= {pf.thresholds(K)[0]} tokens stream", flush=True)
    layer_bytes = E * pf.store.layout(lids[0]).stride
    # the ceiling, same run: the home's bytes of one layer over the copy engine
    segs = pf.store.copy_segments(lids[0], 0, E)
    dst = torch.empty(layer_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for src, off in segs:
            dst[off : off + src.numel()].copy_(src, non_blocking=cuda)
        sync()
        best = min(best, time.perf_counter() - t0)
    del dst
    h2d = sum(s.numel() for s, _ in segs) / best
    print(f"ceiling: {layer_bytes / 1e9:.3f} GB per layer, H2D from the home {h2d / 1e9:.2f} GB/s "
          f"({len(segs)} DMAs per layer)", flush=True)  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps = decode_steps(len(lids), E, 1, 2 * a.decode_steps, seed=1)
    before = decode(steps[: a.decode_steps])
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"rows": rows, "h2d_bps": h2d, "layer_bytes": layer_bytes, "hit_before": before,
                           "layers": len(lids)}  # fmt: skip

    def save() -> None:  # after every row: a run cut by a time limit keeps what it measured
        if a.json:
            a.json.write_text(json.dumps(doc, indent=1))

    for prompt in (int(p) for p in a.prompts.split(",")):
        times = []
        for _ in range(a.runs):
            t = 0.0
            for c0 in range(0, prompt, a.chunk):
                t += moe_pass(min(a.chunk, prompt - c0))
            times.append(t)
        chunks = -(-prompt // a.chunk)
        ceiling = len(lids) * chunks * layer_bytes / h2d
        med = statistics.median(times)
        row = {"case": f"prefill {prompt}", "tokens": prompt, "s_min": min(times), "s_med": med, "s_max": max(times),
               "tok_s_med": prompt / med, "ceiling_s": ceiling, "vs_ceiling_med": ceiling / med,
               "vs_ceiling_max": ceiling / min(times)}  # fmt: skip
        rows.append(row)
        print(f"{row['case']:>15}: {1e3 * min(times):9.1f} / {1e3 * med:9.1f} / {1e3 * max(times):9.1f} ms "
              f"(min/med/max) for {len(lids)} layers, {prompt / med:9.0f} tok/s, ceiling {1e3 * ceiling:9.1f} ms, "
              f"MoE share of the ceiling {ceiling / med:.3f} (best {ceiling / min(times):.3f})",
              flush=True)  # fmt: skip
        save()
    after = decode(steps[a.decode_steps :])
    short = [moe_pass(a.short) for _ in range(a.runs)]
    rows.append({"case": f"short {a.short}", "s_min": min(short), "s_med": statistics.median(short),
                 "s_max": max(short), "streamed": pf.wants(a.short, K)})  # fmt: skip
    print(
        f"short {a.short}-token call through {len(lids)} layers: {1e3 * min(short):.2f} / "
        f"{1e3 * statistics.median(short):.2f} / {1e3 * max(short):.2f} ms, streamed: {pf.wants(a.short, K)}"
    )
    peak = torch.cuda.max_memory_reserved(device) if cuda else 0
    print(
        f"decode hit rate, first {a.decode_steps} steps: before the prefills {before:.3f}, after {after:.3f}; "
        f"peak VRAM reserved {peak / GiB:.2f} GiB (cap {a.vram_gib} GiB); {pf.stats.describe()}",
        flush=True,
    )
    rt.close()
    doc.update(hit_after=after, peak_vram=peak)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
