"""Staged-DMA prefill of one Flash-shaped MoE layer on a GPU, against the transfer ceiling measured in the same run.

Builds a synthetic DeepSeek-V4.1-Flash layer pair (384 experts, H=5120, I=2304, MUL1 K=3; random trellis
written straight into registered host memory), caps usable VRAM at --vram-gb, measures the pinned
host-to-device rate, then runs the prefill pipeline at each chunk size over --steps layer steps (alternating
the two layers, with cross-layer prefetch) and reports the copy rate while computing, the copy and compute busy
fractions and tokens/s per layer against the transfer ceiling (layer bytes / H2D rate).

    python packages/dma-prefill/scripts/bench_prefill.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch

from dma_prefill import V41_FLASH, DmaPrefill, HostExpertStore, PrefillConfig, PrefillPlan, StoreConfig
from dma_prefill.config import PROJECTIONS


def fill_layer(store: HostExpertStore, layer: int, seed: int) -> None:
    """Random trellis bits for every expert (generated on the GPU, copied into the registered host memory),
    then realistic suh/svh (random signs x magnitudes giving W entries of RMS ~1/sqrt(k))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    words = store.buffer(layer)[: store.nbytes(layer)].view(torch.int16)
    chunk = 128 << 20
    for s in range(0, words.numel(), chunk):
        n = min(chunk, words.numel() - s)
        r = torch.randint(-32768, 32768, (n,), dtype=torch.int16, device="cuda", generator=g)
        words[s : s + n].copy_(r)
    rec = store.records(layer)
    lay = store.layout(layer)
    E = store.spec(layer).num_experts
    for p in PROJECTIONS:
        ps = store.spec(layer).proj(p)
        for name, length in (("suh", ps.k), ("svh", ps.n)):
            sign = torch.randint(0, 2, (E, length), device="cuda", generator=g) * 2 - 1
            mag = torch.rand(E, length, device="cuda", generator=g) + 0.5
            v = sign * mag / (1.000312 * math.sqrt(ps.k)) if name == "suh" else sign * mag
            off = lay.offsets[(p, name)]
            rec[:, off : off + 2 * length].view(torch.float16).copy_(v.half())


def h2d_rate(nbytes: int, reps: int = 5) -> float:
    """Pinned (cudaHostAlloc) host-to-device GB/s for one copy of ``nbytes``, median of ``reps``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    src.copy_(dst)  # random bytes, never zeros
    rates = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    del dst
    return statistics.median(rates[1:])


def ring_copy_only(store: HostExpertStore, cfg: PrefillConfig, layer: int) -> float:
    """GB/s of streaming a whole layer through the staging ring with no compute (the ring's own copy ceiling)."""
    pf = DmaPrefill(store, cfg, timing=True)
    ring = pf.ring
    nb = -(-store.spec(layer).num_experts // cfg.experts_per_batch)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    pending = []
    for b in range(nb):
        while not ring.can_issue():
            st = pending.pop(0)
            ring.acquire(st.layer, st.batch, stream)
            ring.release(st, stream)
        pending.append(ring.issue(layer, b))
    for st in pending:
        ring.acquire(st.layer, st.batch, stream)
        ring.release(st, stream)
    t1 = torch.cuda.Event(enable_timing=True)
    t1.record()
    torch.cuda.synchronize()
    nbytes = sum(s.nbytes for s in ring.history)
    secs = t0.elapsed_time(t1) / 1e3
    del pf
    return nbytes / secs / 1e9


def routing(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(T, E, device="cuda", generator=g)
    w, ids = scores.topk(k, dim=1)
    return ids, torch.softmax(w, dim=1)


def bench_chunk(store: HostExpertStore, cfg: PrefillConfig, T: int, steps: int, seed: int) -> dict:
    pf = DmaPrefill(store, cfg, timing=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, V41_FLASH.hidden, device="cuda", generator=g).to(torch.bfloat16)
    routes = [routing(T, V41_FLASH.num_experts, 6, seed + 1 + s) for s in range(steps + 1)]
    # warm-up layer (JIT, allocator), no prefetch so the timed window starts cold
    pf.run_layer(1, x, PrefillPlan.build(*routes[0], V41_FLASH.num_experts, cfg.experts_per_batch))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    pf.start_window()
    t_host = time.perf_counter()
    for s in range(steps):
        layer = s % 2
        plan = PrefillPlan.build(*routes[s + 1], V41_FLASH.num_experts, cfg.experts_per_batch)
        pf.run_layer(layer, x, plan, next_layer=(s + 1) % 2 if s + 1 < steps else None)
    st = pf.stats()
    host_s = time.perf_counter() - t_host
    return {
        "tokens": T,
        "steps": steps,
        "wall_s": st.wall_s,
        "host_s": host_s,
        "s_per_layer": st.wall_s / steps,
        "tok_per_s_layer": T * steps / st.wall_s,
        "copy_busy_s": st.copy_busy_s,
        "compute_busy_s": st.compute_busy_s,
        "copy_fraction": st.copy_fraction,
        "compute_fraction": st.compute_fraction,
        "copy_gbps_engine": st.copy_gbps,
        "copy_gbps_effective": st.effective_gbps,
        "bytes": st.bytes_copied,
        "peak_vram_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def profile_layer(store: HostExpertStore, cfg: PrefillConfig, T: int, seed: int, top: int = 14) -> list[dict]:
    """Device time per kernel name for one layer at chunk ``T`` (after a warm-up layer), via torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    pf = DmaPrefill(store, cfg)
    x = torch.randn(T, V41_FLASH.hidden, device="cuda").to(torch.bfloat16)
    r0, r1 = routing(T, V41_FLASH.num_experts, 6, seed), routing(T, V41_FLASH.num_experts, 6, seed + 1)
    pf.run_layer(0, x, PrefillPlan.build(*r0, V41_FLASH.num_experts, cfg.experts_per_batch))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pf.run_layer(1, x, PrefillPlan.build(*r1, V41_FLASH.num_experts, cfg.experts_per_batch))
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us > 0:
            rows.append({"name": ev.key[:60], "ms": us / 1e3, "calls": ev.count})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def stage_profile(store: HostExpertStore, cfg: PrefillConfig, T: int, seed: int) -> dict[str, float]:
    """Compute-stream milliseconds per stage for one layer at chunk ``T`` (after a warm-up layer), from CUDA
    events recorded between the stages of every batch (copies run concurrently on their own stream)."""
    pf = DmaPrefill(store, cfg)
    x = torch.randn(T, V41_FLASH.hidden, device="cuda").to(torch.bfloat16)
    r0, r1 = routing(T, V41_FLASH.num_experts, 6, seed), routing(T, V41_FLASH.num_experts, 6, seed + 1)
    pf.run_layer(0, x, PrefillPlan.build(*r0, V41_FLASH.num_experts, cfg.experts_per_batch))
    torch.cuda.synchronize()
    pf.compute.stage_events = []
    pf.run_layer(1, x, PrefillPlan.build(*r1, V41_FLASH.num_experts, cfg.experts_per_batch))
    times = pf.compute.stage_times()
    pf.compute.stage_events = None
    return times


def tune(store: HostExpertStore, cfg: PrefillConfig, T: int) -> dict:
    """Greedy choice of the decode block, the row-transform block and the GEMM tile by the measured compute
    time per layer (sum of batch compute intervals) at chunk ``T``, two layer steps per candidate."""
    from dma_prefill.triton_compute import TritonCompute as TC

    def measure() -> float:
        r = bench_chunk(store, cfg, T, 2, 11)
        return r["compute_busy_s"] / r["steps"] * 1e3

    log: dict = {}
    for attr, cands in (
        ("decode_block_tn", [8, 4, 16]),
        ("swiglu_config", [(16, 4, 4), (16, 2, 4), (32, 2, 4)]),
        ("transform_config", [(64, 2, 4), (64, 4, 4)]),
        ("out_config", [(64, 2, 4), (64, 4, 4)]),
    ):
        res = {}
        for c in cands:
            setattr(TC, attr, c)
            res[str(c)] = measure()
        best = min(res, key=res.get)
        setattr(TC, attr, next(c for c in cands if str(c) == best))
        log[attr] = res
        print(f"tune {attr}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in res.items()) + f" -> {best}", flush=True)
    res = {}
    base = dict(TC.gemm_configs)
    gemm_cands = [(128, 64, 8, 3), (128, 64, 8, 4)]
    for c in gemm_cands:
        TC.gemm_configs = {**base, 128: c}
        res[str(c)] = measure()
    best = min(res, key=res.get)
    TC.gemm_configs = {**base, 128: next(c for c in gemm_cands if str(c) == best)}
    log["gemm_128"] = res
    print(
        "tune gemm BM=128 (BN, BK, warps, stages): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in res.items())
        + f" -> {best}",
        flush=True,
    )
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="2048,8192,16384,32768")
    ap.add_argument("--steps", type=int, default=4, help="timed layer steps per chunk size")
    ap.add_argument("--vram-gb", type=float, default=24.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fp16-chunks", default="32768", help="chunk sizes to repeat with fp16 activations")
    ap.add_argument("--profile-chunks", default="", help="chunk sizes to break down per kernel (torch.profiler)")
    ap.add_argument("--stage-chunks", default="32768", help="chunk sizes to break down per stage (CUDA events)")
    ap.add_argument("--no-promote-chunks", default="32768", help="chunk sizes to repeat without GEMM promotion")
    ap.add_argument("--bk32-chunks", default="", help="chunk sizes to repeat with GEMM promotion every 32 (BK=32)")
    ap.add_argument("--fwht-chunks", default="", help="chunk sizes to repeat with fp32-butterfly Hadamards")
    ap.add_argument("--tune-chunk", type=int, default=0, help="chunk size for a tile-tuning pass first (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dev = torch.cuda.get_device_properties(0)
    total = dev.total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 2**30 / total))
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        git = "?"
    import triton

    print(
        f"# dma-prefill bench_prefill | git {git or '?'} | {dev.name} sm_{dev.major}{dev.minor} | "
        f"torch {torch.__version__} | triton {triton.__version__} | VRAM cap {args.vram_gb} GiB | "
        f"slots {args.slots} x {args.batch} experts"
    )
    t = time.perf_counter()
    store = HostExpertStore({0: V41_FLASH, 1: V41_FLASH}, StoreConfig(progress=False))
    t_reg = time.perf_counter() - t
    for lid in (0, 1):
        fill_layer(store, lid, seed=100 + lid)
    torch.cuda.synchronize()
    t_fill = time.perf_counter() - t - t_reg
    layer_bytes = store.nbytes(0)
    print(f"store: 2 layers x {layer_bytes / 1e9:.3f} GB, allocate+register {t_reg:.2f} s, fill {t_fill:.2f} s")

    h2d_1g = h2d_rate(1 << 30)
    slot_bytes = args.batch * store.layout(0).stride
    h2d_slot = h2d_rate(slot_bytes)
    cfg = PrefillConfig(num_slots=args.slots, experts_per_batch=args.batch)
    ring_rate = ring_copy_only(store, cfg, 0)
    h2d = max(h2d_1g, h2d_slot)
    ceiling_s = layer_bytes / (h2d * 1e9)
    print(
        f"pinned H2D: 1 GiB copies {h2d_1g:.1f} GB/s, {slot_bytes / 1e6:.0f} MB copies {h2d_slot:.1f} GB/s; "
        f"ring copy-only from the registered store {ring_rate:.1f} GB/s"
    )
    print(f"transfer ceiling: {layer_bytes / 1e9:.3f} GB / {h2d:.1f} GB/s = {ceiling_s * 1e3:.1f} ms per layer")

    from dma_prefill.triton_compute import TritonCompute

    tuning = tune(store, cfg, args.tune_chunk) if args.tune_chunk else {}
    chosen = {
        "decode_block_tn": TritonCompute.decode_block_tn,
        "transform_config": TritonCompute.transform_config,
        "swiglu_config": TritonCompute.swiglu_config,
        "out_config": TritonCompute.out_config,
        "gemm_configs": TritonCompute.gemm_configs,
    }
    print(f"configs used: {chosen}")
    rows = []
    # (chunk, exact, variant): "" = the defaults; "-np" no GEMM promotion; "-bk32" promotion every 32 K;
    # "-fwht-toggled" the other Hadamard (TritonCompute.fwht flipped)
    cases = (
        [(int(c), True, "") for c in args.chunks.split(",") if c]
        + [(int(c), False, "") for c in args.fp16_chunks.split(",") if c]
        + [(int(c), True, "-np") for c in args.no_promote_chunks.split(",") if c]
        + [(int(c), True, "-bk32") for c in args.bk32_chunks.split(",") if c]
        + [(int(c), True, "-fwht-toggled") for c in args.fwht_chunks.split(",") if c]
    )
    for T, exact, variant in cases:
        saved = (TritonCompute.promote, TritonCompute.fwht, dict(TritonCompute.gemm_configs))
        if variant == "-np":
            TritonCompute.promote = False
        elif variant == "-bk32":
            TritonCompute.gemm_configs = {bm: (c[0], 32, c[2], c[3] + 1) for bm, c in saved[2].items()}
        elif variant == "-fwht-toggled":
            TritonCompute.fwht = not saved[1]
        try:
            cfg_t = PrefillConfig(num_slots=args.slots, experts_per_batch=args.batch, exact=exact)
            r = bench_chunk(store, cfg_t, T, args.steps, 7)
        finally:
            TritonCompute.promote, TritonCompute.fwht, TritonCompute.gemm_configs = saved
        r["exact"] = exact
        r["variant"] = variant
        r["ceiling_tok_per_s"] = T / ceiling_s
        r["vs_ceiling"] = r["tok_per_s_layer"] / r["ceiling_tok_per_s"]
        r["copy_vs_h2d"] = r["copy_gbps_effective"] / h2d
        rows.append(r)
        print(f"  done T={T} exact={exact}: {r['tok_per_s_layer']:.0f} tok/s/layer", flush=True)

    print(
        f"{'case':<19}{'ms/layer':>10}{'tok/s/layer':>13}{'ceiling':>10}{'vs ceil':>9}"
        f"{'copy GB/s':>11}{'eff GB/s':>10}{'copy/H2D':>10}{'copy busy':>11}{'comp busy':>11}{'VRAM GiB':>10}"
    )
    for r in rows:
        name = f"{'exact' if r['exact'] else 'fp16'}{r['variant']} T={r['tokens']}"
        print(
            f"{name:<19}{r['s_per_layer'] * 1e3:>10.1f}{r['tok_per_s_layer']:>13.0f}{r['ceiling_tok_per_s']:>10.0f}"
            f"{r['vs_ceiling']:>9.1%}{r['copy_gbps_engine']:>11.1f}{r['copy_gbps_effective']:>10.1f}"
            f"{r['copy_vs_h2d']:>10.1%}{r['copy_fraction']:>11.1%}{r['compute_fraction']:>11.1%}{r['peak_vram_gib']:>10.2f}"
        )
    profiles = {}
    for T in [int(c) for c in args.profile_chunks.split(",") if c]:
        prof = profile_layer(store, cfg, T, 99)
        profiles[T] = prof
        print(f"per-kernel device time, one layer, T={T} (copies run on their own stream, concurrently):")
        for p in prof:
            print(f"  {p['name']:<60}{p['ms']:>9.2f} ms{p['calls']:>7} calls")
    stages = {}
    for T in [int(c) for c in args.stage_chunks.split(",") if c]:
        st = stage_profile(store, cfg, T, 98)
        stages[T] = st
        print(f"per-stage compute-stream time, one layer, T={T}: total {sum(st.values()):.1f} ms")
        for name, ms in sorted(st.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<24}{ms:>9.2f} ms")
    if args.json:
        env = {"git": git, "gpu": dev.name, "torch": torch.__version__, "triton": triton.__version__}
        meta = {
            "layer_bytes": layer_bytes, "h2d_1g_gbps": h2d_1g, "h2d_slot_gbps": h2d_slot, "h2d_gbps": h2d,
            "ring_copy_only_gbps": ring_rate, "ceiling_s_per_layer": ceiling_s, "vram_cap_gib": args.vram_gb,
            "slots": args.slots, "experts_per_batch": args.batch,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(
                {"env": env, "meta": meta, "rows": rows, "profiles": profiles, "stages": stages, "tuning": tuning,
                 "chosen": str(chosen)},
                f, indent=1,
            )  # fmt: skip
    store.close()


if __name__ == "__main__":
    sys.exit(main())
