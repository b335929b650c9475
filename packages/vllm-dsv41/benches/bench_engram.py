"""Engram rows for the served model: gather latency per decode step against the time the model gives it, and
prefill rows/s against the disk's random-read ceiling, both measured in the same run (GPU machine).

    python packages/vllm-dsv41/benches/bench_engram.py [--table-gib 16] [--decode 1,4,16,64] [--prefill 2048,8192]

``--device cpu --no-budget`` runs the same path on host buffers (a dry run of the script, not a measurement of
the served path).

What it does
------------
1. Tables: two V4.1-layout Engram tables (layers 1 and 14, 24 row ids per token each, rows of 256 fp8 E4M3 bytes
   + 8 E8M0 scale bytes) in one dense file of ``--table-gib`` random bytes on the local disk (written once, kept
   under ``--dir``), bucket primes scaled to the file (engram-mmap's bench geometry); row ids from the real V4.1
   hash of uniform random tokens.
2. Ceiling: the disk's 4 KiB random reads/s on that file (O_DIRECT, ``--ceiling-threads`` threads), this run.
3. Cases: ``cold`` (the file evicted from the page cache before every step; the largest resident fraction seen
   before a step is printed) and ``warm`` (the file read into the page cache once first). A step is what the
   served model does for its two Engram layers (``vllm_dsv41.engram.EngramRowGather``, the class the model's
   hooks drive): the row ids, on the GPU, copied to pinned memory on a side stream; a worker thread per table
   gathers the rows from the mapped file into pinned staging and copies them to the GPU; then ``finish``: join,
   the stream waits, upstream's lookup kernel dequantizes into bf16. Latency = start -> rows on the GPU
   (synchronized), min / median / max over ``--steps`` steps.
4. Budget (decode): the time the model gives the gather, the layers before the first Engram layer (layer 1). In
   the served configuration that is layer 0 (plus the embedding and the hash); its routed experts run on the CPU
   tier and dominate it. Measured here as the CPU tier's time for one Flash-size MoE layer
   (pack-tools' ``flash-layer`` preset: 384 experts, H 5120, I 2304, 3 bpw; 5.1 GB written once under
   ``--flash-root``) at the case's decode tokens, top-6 random routing, through the served runtime
   (``CpuExpertRuntime.forward_into`` on GPU tensors: staging copies included). Layer 0's attention, shared expert
   and the hash are not counted: the budget is a lower bound, so the ratio is conservative.

Rows: decode ``ratio`` = gather median / budget median (below 1: the gather hides behind layer 0; the model waits
``max(0, gather - budget)``); prefill ``ratio`` = rows/s / ceiling reads/s (a cold row is one or two 4 KiB reads:
its fp8 bytes and its scale bytes live in different tensors; ``--resident-scales`` makes it one). ``--json``
writes everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

GiB = 1 << 30


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min_ms": 1e3 * min(xs), "median_ms": 1e3 * statistics.median(xs), "max_ms": 1e3 * max(xs)}


def flash_budget(root: Path, device: torch.device, tokens: list[int], steps: int, threads: int,
                 seed: int) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per decode size: the CPU tier's time for one Flash-size MoE layer (the served runtime, from the host home)."""
    from cpu_tier import CpuTierConfig
    from cpu_tier.geometry import V41_FLASH
    from pack_tools import synth
    from pack_tools.presets.flash_layer import FlashLayer
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.experts import CpuExpertRuntime
    from vllm_dsv41.home import ExpertHome

    d = root / "layer0"
    if not (d / "model.safetensors.index.json").exists():
        t = time.time()
        synth("flash-layer", d, seed=0, layer=FlashLayer(layer=0))
        print(f"# synth flash-layer 0 under {d}: {time.time() - t:.0f} s", flush=True)
    home = ExpertHome(d, register=device.type == "cuda")
    rt = CpuExpertRuntime(Dsv41PluginConfig(cpu=CpuTierConfig(threads=threads)), max_tokens=max(tokens))
    lx = next(iter(home.layers()))
    rt.add_layer(lx, swiglu_limit=None)
    rng = np.random.default_rng(seed)
    out: dict[int, dict[str, float]] = {}
    try:
        for t in tokens:
            x = torch.randn((t, lx.hidden), dtype=torch.bfloat16, device=device)
            y = torch.empty_like(x)
            w = torch.full((t, V41_FLASH.top_k), 1.0 / V41_FLASH.top_k, device=device)
            times = []
            for i in range(steps + 2):
                ids = np.stack([rng.choice(V41_FLASH.num_experts, V41_FLASH.top_k, replace=False) for _ in range(t)])
                dev_ids = torch.from_numpy(ids).to(device=device, dtype=torch.int32)
                _sync(device)
                t0 = time.perf_counter()
                rt.forward_into(lx.layer, x, dev_ids, w, y)
                _sync(device)
                if i >= 2:  # two warm-up steps (the tier's pool, page tables)
                    times.append(time.perf_counter() - t0)
            out[t] = _stats(times)
            print(f"# budget: Flash MoE layer 0 on the CPU tier, {t} tok: median {out[t]['median_ms']:.3f} ms "
                  f"(min {out[t]['min_ms']:.3f}, max {out[t]['max_ms']:.3f})", flush=True)  # fmt: skip
    finally:
        rt.close()
        home.close()
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv41/engram-bench"), help="the table file (kept)")
    ap.add_argument("--table-gib", type=float, default=16.0, help="size of the dense table file (two tables)")
    ap.add_argument("--decode", default="1,4,16,64", help="decode tokens per step, comma separated")
    ap.add_argument("--prefill", default="2048,8192", help="prefill tokens per step, comma separated")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    ap.add_argument("--steps-prefill", type=int, default=3, help="timed prefill steps per case")
    ap.add_argument("--threads", type=int, default=64, help="engram-mmap TableConfig.num_threads (per table)")
    ap.add_argument("--resident-scales", action="store_true", help="TableConfig.resident_scales")
    ap.add_argument("--ceiling-threads", type=int, default=128)
    ap.add_argument("--ceiling-reads", type=int, default=100_000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-budget", action="store_true", help="skip the Flash-layer budget (a dry run)")
    ap.add_argument("--flash-root", type=Path, default=Path("/tmp/dsv41/flash"))
    ap.add_argument("--cpu-threads", type=int, default=0, help="the CPU tier's threads for the budget (0: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from engram_mmap import EngramHasher, EngramTable, TableConfig
    from engram_mmap.bench import LAYERS, _engram_config, _ensure_file, _env, random_read_ceiling
    from vllm_dsv41.engram import EngramRowGather

    device = torch.device(a.device)
    decode = [int(v) for v in a.decode.split(",") if v]
    prefill = [int(v) for v in a.prefill.split(",") if v]
    a.dir.mkdir(parents=True, exist_ok=True)
    path = str(a.dir / "tables.safetensors")
    cfg = _engram_config(int(a.table_gib * GiB))
    wrote = _ensure_file(path, cfg, lambda m: print(m, flush=True))
    env = _env(path)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    print(f"# bench_engram | git {env['git']} | {env['cpu']} x{env['cores']} | {env['mem_gib']} GiB RAM | {env['fs']} "
          f"| GPU {gpu} | load {env['loadavg']:.1f}", flush=True)  # fmt: skip
    size = os.path.getsize(path)
    ceiling, how = random_read_ceiling(path, a.ceiling_reads, a.ceiling_threads, a.seed + 1)
    print(f"# tables: {size / GiB:.2f} GiB file ({'written ' + format(wrote, '.0f') + ' s' if wrote else 'reused'}), "
          f"{cfg.table_rows(LAYERS[0]):,} rows per table; ceiling {how} 4 KiB random reads x{a.ceiling_threads}: "
          f"{ceiling:,.0f}/s", flush=True)  # fmt: skip
    budget = {} if a.no_budget else flash_budget(a.flash_root, device, decode, a.steps, a.cpu_threads, a.seed)
    table_cfg = TableConfig(num_threads=a.threads, resident_scales=a.resident_scales)
    print(f"# {table_cfg}; a step = both tables (48 rows per token)", flush=True)
    hasher = EngramHasher(cfg)
    rng = np.random.default_rng(a.seed)
    tables = [EngramTable.open_layer(path, cfg, layer, config=table_cfg) for layer in LAYERS]
    max_t = max(decode + prefill)
    gathers = [EngramRowGather(t, max_t, cfg.n_cols, device, name=f"layer {layer}")
               for t, layer in zip(tables, LAYERS, strict=True)]  # fmt: skip
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    outs = [torch.empty((max_t, cfg.n_cols, cfg.head_dim), dtype=torch.bfloat16, device=device) for _ in LAYERS]
    rows: list[dict[str, Any]] = []
    print(f"{'case':<28}{'min_ms':>10}{'median_ms':>11}{'max_ms':>10}{'rows/s':>13}{'vs':>22}{'ratio':>8}"
          f"{'resident':>10}", flush=True)  # fmt: skip
    try:
        for kind in ("cold", "warm"):
            if kind == "warm":
                with open(path, "rb") as f:  # the whole file into the page cache
                    while f.read(64 << 20):
                        pass
            for t, is_decode in [(t, True) for t in decode] + [(t, False) for t in prefill]:
                steps = a.steps if is_decode else a.steps_prefill
                times, resident = [], []
                for i in range(steps + 1):
                    tok = rng.integers(0, cfg.compressed_vocab_size, size=t)
                    ids = torch.from_numpy(hasher.row_ids_batch(tok, [0, t]).astype(np.int32)).to(device)
                    if kind == "cold":
                        for tb in tables:
                            tb.evict()
                        resident.append(max(tb.resident_fraction()[0] for tb in tables))
                    _sync(device)
                    t0 = time.perf_counter()
                    for j, g in enumerate(gathers):
                        if side is not None:
                            side.wait_stream(torch.cuda.current_stream(device))
                        g.start(ids[:, j], outs[j], side)
                    for g in gathers:
                        g.finish()
                    _sync(device)
                    if i >= 1:  # the first step of a case is not timed (pool threads, page tables, kernels)
                        times.append(time.perf_counter() - t0)
                st = _stats(times)
                rate = 2 * cfg.n_cols * t / (st["median_ms"] / 1e3)
                row: dict[str, Any] = {"case": f"{kind}/{t}tok", "kind": kind, "tokens": t, "steps": steps, **st,
                                       "rows_per_s": rate, "resident_max": max(resident, default=None)}  # fmt: skip
                if is_decode:
                    b = budget.get(t)
                    row["budget_median_ms"] = None if b is None else b["median_ms"]
                    row["ratio"] = None if b is None else st["median_ms"] / b["median_ms"]
                    vs = "no budget" if b is None else f"budget {b['median_ms']:.3f} ms"
                elif kind == "cold":
                    row["ceiling_reads_per_s"] = ceiling
                    row["ratio"] = rate / ceiling
                    vs = f"ceiling {ceiling:,.0f}/s"
                else:  # from the page cache: the disk's ceiling does not bound it
                    row["ratio"], vs = None, "page cache"
                rows.append(row)
                ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
                res = "" if row["resident_max"] is None else f"{row['resident_max']:.2%}"
                print(f"{row['case'] + (' (decode)' if is_decode else ' (prefill)'):<28}{st['min_ms']:>10.3f}"
                      f"{st['median_ms']:>11.3f}{st['max_ms']:>10.3f}{rate:>13,.0f}{vs:>22}{ratio:>8}{res:>10}",
                      flush=True)  # fmt: skip
    finally:
        for g in gathers:
            g.close()
        for tb in tables:
            tb.close()
    if a.json:
        doc = {"env": env, "gpu": gpu, "table_config": dataclasses.asdict(table_cfg), "file_bytes": size,
               "ceiling_reads_per_s": ceiling, "ceiling_mode": how, "budget": budget, "rows": rows}  # fmt: skip
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
