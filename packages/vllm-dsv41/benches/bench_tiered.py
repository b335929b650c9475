"""Decode through the tiered runtime at real DeepSeek-V4.1-Flash layer sizes, against its roofline (GPU machine).

    python packages/vllm-dsv41/benches/bench_tiered.py --layers 6 --streams 1,2,4 --splits cpu,auto,pcie

What it does
------------
1. Writes ``--layers`` real-size Flash MoE layers (``pack-tools synth --preset flash-layer``: 384 experts,
   H 5120, I 2304, 3 bpw; 5.1 GB each) once under ``--root``, and opens them as one host home (mapped, CUDA-
   registered), as the served model's loader does.
2. Routing: ``expert_cache``'s synthetic trace model (per-request expert preferences, locality; a model, not a
   measurement) for ``--layers`` layers; decode steps of S tokens (S = streams).
3. Measures the rates the roofline needs, in this run: the CPU tier's streaming rate at one token per expert
   (``cpu``), the hit kernel reading the GPU-mapped host home (``pcie``) and reading VRAM slots (``hbm``).
4. Per (streams, split): a ``TieredRuntime`` whose cache holds the share of a 24 GB card's cache one layer gets
   (``--cache-gib-full`` over the full model's 40 MoE layers, times ``--layers``), ``--warmup`` steps to fill
   it, then ``--steps`` timed steps (wall clock of every layer's call, CUDA synchronized at the step's end).
   Roofline per step: hit bytes / hbm + miss bytes / (cpu + pcie) (auto; cpu: / cpu; pcie: / pcie), with the
   miss and hit bytes of the same steps (distinct experts per layer). Prints one row per case with the ratio
   roofline / measured (goal >= 0.85), the hit rate and Belady's MIN on the same trace at the same capacity,
   and the MoE time per token scaled to the model's 40 layers.

Only the routed experts are timed (the non-expert part of a decode step is the model's, measured by the served
benchmark). Results also go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

GiB = 1 << 30
FULL_LAYERS = 40  # DeepSeek-V4.1-Flash's MoE layers


def combined_home_dir(root: Path, layers: int, shape: dict[str, int]) -> Path:
    """``layers`` flash-layer packs (written once) linked into one directory with one index."""
    from pack_tools import synth
    from pack_tools.presets.flash_layer import FlashLayer

    weight_map: dict[str, str] = {}
    tag = "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    out = root / f"combined{layers}{'-' + tag if tag else ''}"
    out.mkdir(parents=True, exist_ok=True)
    for layer in range(layers):
        d = root / f"layer{layer}{'-' + tag if tag else ''}"
        if not (d / "model.safetensors.index.json").exists():
            t = time.time()
            synth("flash-layer", d, seed=layer, layer=FlashLayer(layer=layer, **shape))
            print(f"synth flash-layer {layer}: {time.time() - t:.0f} s", flush=True)
        index = json.loads((d / "model.safetensors.index.json").read_text())
        for name, rel in index["weight_map"].items():
            link = out / f"l{layer}-{rel}"
            if not link.exists():
                link.symlink_to(d / rel)
            weight_map[name] = link.name
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def decode_steps(layers: int, experts: int, streams: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` decode steps of ``streams`` tokens: ids ``[streams, layers, top_k]`` each."""
    from expert_cache import SyntheticTraceConfig, generate

    trace = generate(SyntheticTraceConfig(num_layers=layers, num_experts=experts, streams=streams,
                                          decode_steps=steps * 3, seed=seed, mean_prompt_tokens=64.0,
                                          full_rows_below=0))  # fmt: skip
    out, row = [], 0
    for rows, toks in zip(trace.rows_per_step.tolist(), trace.tokens_per_step.tolist(), strict=True):
        ids = trace.ids[row : row + rows]
        row += rows
        if toks == streams and rows == streams:
            out.append(ids.astype(np.int64))
        if len(out) == steps:
            break
    if len(out) < steps:
        raise RuntimeError(f"the synthetic trace gave {len(out)} decode steps of {streams} tokens, {steps} needed")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rates(runtime: Any, lx: Any, device: torch.device, reps: int = 5) -> dict[str, float]:
    """cpu / pcie / hbm bytes per second of expert weights, measured now (the runtime's cache must exist, empty).

    cpu and pcie: the runtime's own measurement (the CPU tier at one token per expert; the hit kernel through the
    table of experts not resident, i.e. the GPU-mapped host home; the runtime does not measure pcie on a CPU
    device, so the dry run times that here); hbm: the hit kernel over the same experts copied to device memory."""
    from vllm_dsv41.home import EXPERT_COLUMNS
    from vllm_dsv41.tiered import _expert_bytes, hit_seconds

    eb = _expert_bytes(lx)
    cache = runtime.cache
    li = runtime._index[lx.layer]
    n = min(32, lx.num_experts)
    if (cache.slot_of[li][:n].cpu().numpy() >= 0).any():
        raise RuntimeError("measure_rates: run it before the cache admits experts (some of 0..n-1 are resident)")
    r = runtime._measure_rates()
    kernel = runtime._hits[lx.layer]
    pcie = r.pcie_bps or n * eb / hit_seconds(kernel, cache.layer_pointers(li), n, lx.hidden, device, reps)
    # hbm: the first n experts copied into device memory (one tensor per column), their pointers in a table copy
    ptrs = cache.layer_pointers(li).clone()
    keep = []
    for e in range(n):
        tensors = [getattr(getattr(lx, role)[e], part) for role, part in EXPERT_COLUMNS]
        for c, arr in enumerate(tensors):
            t = torch.from_numpy(np.array(arr)).to(device)
            keep.append(t)
            ptrs[c, e] = t.data_ptr()
    hbm = n * eb / hit_seconds(kernel, ptrs, n, lx.hidden, device, reps)
    h2d, d2d = hardware_ceilings(lx, n, device, reps)
    return {"cpu": r.cpu_bps, "pcie": pcie, "hbm": hbm, "cpu_fixed_s": r.cpu_fixed_s, "pcie_fixed_s": r.pcie_fixed_s,
            "cpu_tokens": [[m, v] for m, v in r.cpu_tokens], "h2d": h2d, "d2d": d2d}  # fmt: skip


def hardware_ceilings(lx: Any, n: int, device: torch.device, reps: int = 5) -> tuple[float, float]:
    """The machine's own rates, not our kernels': the copy engine's bytes/s from the host home (the first ``n``
    experts' tensors, page-locked, copied to device memory) and device memory's read rate (a device-to-device copy
    of 512 MiB reads and writes it: 2 x bytes / time). Best of ``reps``; (0, 0) off CUDA."""
    from vllm_dsv41.home import EXPERT_COLUMNS

    if device.type != "cuda":
        return 0.0, 0.0
    src = [torch.from_numpy(np.asarray(getattr(getattr(lx, role)[e], part)))
           for e in range(n) for role, part in EXPERT_COLUMNS]  # fmt: skip
    dst = [torch.empty_like(t, device=device) for t in src]
    h2d_bytes = sum(t.numel() * t.element_size() for t in src)
    big = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)

    def best(fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return min(times)

    def h2d_copy() -> None:
        for d, t in zip(dst, src, strict=True):
            d.copy_(t, non_blocking=True)

    h2d = h2d_bytes / best(h2d_copy)
    d2d = 2 * big.numel() / best(lambda: big2.copy_(big))
    big = big2 = torch.empty(0)
    dst.clear()
    torch.cuda.empty_cache()  # (the buffers' 1 GiB back before the cases run)
    return h2d, d2d


def model_rates(rates: dict[str, Any], source: str) -> Any:
    """The cost model's ``Rates`` from ``measure_rates``' numbers (JSON-safe, so a child process can take them)."""
    from vllm_dsv41.split import Rates

    return Rates(
        rates["cpu"], rates["pcie"], rates["hbm"], source,
        cpu_tokens=tuple((int(m), float(v)) for m, v in rates.get("cpu_tokens", ())),
        cpu_fixed_s=float(rates.get("cpu_fixed_s", 0.0)),
        pcie_fixed_s=float(rates.get("pcie_fixed_s", 0.0)),
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--root", type=Path, default=Path("/tmp/dsv41/flash"))
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--splits", default="cpu,auto,pcie")
    ap.add_argument("--cache-gib-full", type=float, default=12.0,
                    help="the full model's expert cache on a 24 GB card (default 12 GiB)")  # fmt: skip
    ap.add_argument("--cache-mib", type=float, default=0.0,
                    help="the cache's size for the --layers given, overriding --cache-gib-full (dry runs)")  # fmt: skip
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--hit-kernel", default="auto")
    ap.add_argument("--pcie-read", default="auto", choices=("auto", "mapped", "staged"),
                    help="how the GPU reads the PCIe share from the home (TieredConfig.pcie_read)")  # fmt: skip
    ap.add_argument("--pcie-stage-slots", type=int, default=8)
    ap.add_argument("--replan-every", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run at small shapes)")
    ap.add_argument("--experts", type=int, default=0, help="experts per layer (0: Flash's 384); dry runs only")
    ap.add_argument("--hidden", type=int, default=0, help="hidden size (0: Flash's); dry runs only")
    ap.add_argument("--intermediate", type=int, default=0, help="expert intermediate size (0: Flash's); dry runs")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from cpu_tier import CpuTierConfig
    from expert_cache import Trace, belady_hit_rate
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.config import TieredConfig
    from vllm_dsv41.home import ExpertHome
    from vllm_dsv41.split import Rates
    from vllm_dsv41.tiered import TieredRuntime, _expert_bytes

    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shape = {k: v for k, v in (("experts", a.experts), ("hidden", a.hidden), ("intermediate", a.intermediate)) if v}
    home = ExpertHome(combined_home_dir(a.root, a.layers, shape), register=device.type == "cuda")
    print(f"home: {home.describe()}", flush=True)
    layers = list(home.layers())
    lx0 = layers[0]
    eb = _expert_bytes(lx0)
    cache_bytes = int(a.cache_mib * (1 << 20)) if a.cache_mib else int(a.cache_gib_full * GiB * a.layers / FULL_LAYERS)
    if a.pcie_read != "mapped":
        # a staged read's transient slots come out of the cache's budget: a few slots of the ~900 of a 24 GB card's
        # cache at 40 layers, but a sixth of this scaled-down one; the bench adds them so the hit rate stays the
        # full model's
        from expert_cache import ExpertCacheConfig

        src = home.cache_home([lx.layer for lx in layers])
        stride = ExpertCacheConfig(num_layers=len(layers), num_experts=lx0.num_experts,
                                   projections=src.projections).slot_stride  # fmt: skip
        cache_bytes += a.pcie_stage_slots * stride + 4096

    def runtime(split: str, rates: Rates | None) -> TieredRuntime:
        tcfg = TieredConfig(
            split=split,
            policy=a.policy,
            hit_kernel=a.hit_kernel,  # type: ignore[arg-type]
            pcie_read=a.pcie_read,
            pcie_stage_slots=a.pcie_stage_slots,
            replan_every=a.replan_every,
            deadline_factor=0.0,
            stats_every=0,
            prefill=False,
        )  # fmt: skip (decode only: no staged-prefill calibration)
        cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=a.cpu_threads), runtime="tiered", tiered=tcfg)
        rt = TieredRuntime(cfg, home, device, cache_bytes=cache_bytes, rates=rates)
        for lx in layers:
            rt.add_layer(lx, swiglu_limit=None)
        rt.allow_cache()
        return rt

    # the rates, once, with an empty cache (no expert resident yet)
    rt = runtime("auto", Rates(1.0, 1.0))
    rt._create_cache()
    rates = measure_rates(rt, lx0, device)
    rt.close()
    model = model_rates(rates, "measured")
    print(f"rates (GB/s of expert weights): {model.describe()}", flush=True)
    rows: list[dict[str, Any]] = []
    for streams in (int(s) for s in a.streams.split(",")):
        steps = decode_steps(a.layers, lx0.num_experts, streams, a.warmup + a.steps, a.seed)
        ids_all = np.concatenate(steps)  # [steps * streams, L, K]
        n_steps = len(steps)
        trace = Trace.create(ids_all, np.full(n_steps, streams), np.full(n_steps, streams), lx0.num_experts)
        for split in a.splits.split(","):
            rt = runtime(split, model)
            g = torch.Generator(device=device).manual_seed(a.seed)
            xs = torch.randn((streams, lx0.hidden), generator=g, device=device, dtype=torch.bfloat16)
            out = torch.empty_like(xs)
            k = int(steps[0].shape[-1])
            w = torch.full((streams, k), 1.0 / k, device=device)
            times: list[float] = []
            hit_bytes = miss_bytes = 0
            before = (0, 0)
            for i, ids in enumerate(steps):
                dev_ids = torch.from_numpy(ids.astype(np.int32)).to(device)
                sync(device)
                t0 = time.perf_counter()
                for j, lx in enumerate(layers):
                    rt.forward_into(lx.layer, xs, dev_ids[:, j], w, out)
                sync(device)
                dt = time.perf_counter() - t0
                if i == a.warmup - 1:
                    before = (rt.stats.hit_picks, rt.stats.picks)
                if i >= a.warmup:
                    times.append(dt)
                    for j, lx in enumerate(layers):  # residency as this step saw it (replans run between steps)
                        li = rt._index[lx.layer]
                        distinct = np.unique(ids[:, j])
                        resident = rt.cache.slot_of[li].cpu().numpy()[distinct] >= 0
                        hit_bytes += int(resident.sum()) * eb
                        miss_bytes += int((~resident).sum()) * eb
            hits = (rt.stats.hit_picks - before[0]) / max(rt.stats.picks - before[1], 1)
            cap = rt.cache.num_slots
            rt.close()
            n = len(times)
            miss_rate = {"cpu": rates["cpu"], "pcie": rates["pcie"], "auto": rates["cpu"] + rates["pcie"]}[split]
            roof = (hit_bytes / rates["hbm"] + miss_bytes / miss_rate) / n
            med = statistics.median(times)
            # Belady's MIN in its own unit (distinct experts per layer and step) over the timed steps only; the
            # runtime's rate in the same unit from the residency each timed step saw
            bel = belady_hit_rate(trace, cap, from_step=a.warmup)
            hits_distinct = hit_bytes / max(hit_bytes + miss_bytes, 1)
            row = {"streams": streams, "split": split, "slots": cap, "median_ms": 1e3 * med, "min_ms": 1e3 * min(times),
                   "max_ms": 1e3 * max(times), "roofline_ms": 1e3 * roof, "ratio": roof / med, "hit_rate": hits,
                   "hit_rate_distinct": hits_distinct, "belady": bel,
                   "moe_ms_per_step_40_layers": 1e3 * med * FULL_LAYERS / a.layers,
                   "tok_s_moe_only_40_layers": a.layers / (med * FULL_LAYERS) * streams}  # fmt: skip
            rows.append(row)
            print(f"S={streams} split={split:5s} slots={cap:5d} step {row['median_ms']:.2f} ms "
                  f"(min {row['min_ms']:.2f}, max {row['max_ms']:.2f}) roofline {row['roofline_ms']:.2f} ms "
                  f"ratio {row['ratio']:.2f}; hit rate {hits:.3f} of picks, {hits_distinct:.3f} of distinct experts "
                  f"(Belady MIN {bel:.3f}, same steps and unit); "
                  f"MoE at 40 layers {row['moe_ms_per_step_40_layers']:.1f} ms/step = "
                  f"{row['tok_s_moe_only_40_layers']:.1f} tok/s (experts only)", flush=True)  # fmt: skip
            if a.json:  # after every row: a run cut by a time limit keeps what it measured
                a.json.write_text(json.dumps({"rates": rates, "rows": rows, "layers": a.layers}, indent=2))
    home.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
