"""Benchmark of the Engram gather: ``python -m engram_mmap.bench [--json out.json]``.

Two synthetic V4.1-layout tables (layers 1 and 14, 24 row ids per token each, so 48 rows per token)
are written once to real files under ``--dir`` and reused. Row ids come from the real Engram hash
(V4.1 multipliers, bucket primes scaled to the file) of uniform random tokens. Cases:

* cold: the table file is evicted from the page cache before every step (``MADV_DONTNEED`` +
  ``POSIX_FADV_DONTNEED``; the resident fraction measured by mincore is reported), which is what a
  table far larger than the page cache looks like to a step. Ceiling: O_DIRECT 4 KiB random reads of
  the same file from many threads, measured in the same run.
* cold-rs: the same with ``TableConfig.resident_scales`` (scale tensors copied to RAM at open), so a
  row costs one page read instead of two.
* cached: a smaller file read into the page cache first. Ceiling: buffered 4 KiB random preads of it.

Each case reports median / p10 / p90 step latency, rows/s (48 x tokens / median) and the ratio of
rows/s to the ceiling's reads/s. A cold row needs up to two page reads (its 256 fp8 bytes and its 8
scale bytes live in different tensors), so a ratio near 0.5-1 is at the device's limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from . import _native
from .config import EngramConfig
from .hashing import EngramHasher
from .synthetic import write_v41_engram_shard
from .table import EngramTable, TableConfig

LAYERS = (1, 14)
COLS = 24  # 3 orders x 8 heads


def _engram_config(total_bytes: int) -> EngramConfig:
    """V4.1 hash geometry with bucket primes scaled so that two tables fill ~total_bytes."""
    rows_per_table = max(COLS * 8, total_bytes // 2 // 264)
    return EngramConfig(
        layer_ids=LAYERS,
        max_ngram_size=4,
        n_heads=8,
        vocab_sizes=(rows_per_table // COLS,) * 3,
        compressed_vocab_size=99092,
        pad_token_id=2,
    )


def _ensure_file(path: str, cfg: EngramConfig, log: Any) -> float:
    """Write the shard unless a file with the same tensors exists; returns seconds spent writing."""
    want = {layer: cfg.table_rows(layer) for layer in LAYERS}
    if os.path.exists(path):
        try:
            one = TableConfig(num_threads=1)
            rows = []
            for layer in LAYERS:
                with EngramTable.open(path, f"layers.{layer}.engram.embed", config=one) as t:
                    rows.append(t.rows)
            if rows == [want[layer] for layer in LAYERS]:
                return 0.0
        except (ValueError, OSError):
            pass
    log(f"# writing {path} ({sum(want.values()) * 264 / 2**30:.2f} GiB of random bytes, fsync) ...")
    t0 = time.perf_counter()
    write_v41_engram_shard(path, want, fill="random", seed=1)
    return time.perf_counter() - t0


def _env(path: str) -> dict[str, Any]:
    def git() -> str:
        try:
            return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or "unknown"  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    fs = "unknown"
    try:
        best = ""
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, kind = line.split()[:3]
                if real.startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                    best, fs = mnt, f"{kind} on {dev}"
    except OSError:
        pass
    return {"git": git(), "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1),
            "kernel": platform.release(), "python": platform.python_version(), "fs": fs,
            "loadavg": os.getloadavg()[0]}  # fmt: skip


def random_read_ceiling(path: str, reads: int, threads: int, seed: int = 0, block: int = 4096) -> tuple[float, str]:
    """The disk's random-read ceiling for a file: ``block``-byte reads per second at random block offsets of
    ``path`` from ``threads`` threads (one read in flight per thread).

    Reads bypass the page cache (O_DIRECT). On a filesystem without O_DIRECT (older tmpfs) the file is
    evicted from the page cache (POSIX_FADV_DONTNEED) and read buffered instead. Returns
    ``(reads per second, mode)`` with mode ``"O_DIRECT"`` or ``"buffered after eviction"``.
    """
    size = os.path.getsize(path)
    try:
        return reads / _native.random_read(path, 0, size, reads, threads, block, True, seed), "O_DIRECT"
    except RuntimeError as e:
        if "Invalid argument" not in str(e):
            raise
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return reads / _native.random_read(path, 0, size, reads, threads, block, False, seed), "buffered after eviction"


def _stats(seconds: list[float]) -> tuple[float, float, float]:
    return (statistics.median(seconds), float(np.percentile(seconds, 10)), float(np.percentile(seconds, 90)))


def _run_steps(
    tables: list[EngramTable], row_ids: list[np.ndarray], cold: bool
) -> tuple[list[float], list[float], list[float]]:
    """One gather of both tables per step (async, as a server overlaps them); returns the step wall
    times, the step CPU times of the process (all threads: what the step costs on a busy machine)
    and, for cold steps, the weight-tensor resident fraction measured just before each."""
    times, cpu, resident = [], [], []
    for ids in row_ids:
        if cold:
            for t in tables:
                t.evict()
            resident.append(max(t.resident_fraction()[0] for t in tables))
        c0, t0 = time.process_time(), time.perf_counter()
        handles = [t.gather_async(ids[i]) for i, t in enumerate(tables)]
        for h in handles:
            h.wait()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu, resident


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m engram_mmap.bench", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/engram_mmap_bench", help="where the table files live (kept)")
    p.add_argument("--cold-mib", type=int, default=4096, help="size of the cold table file (two tables)")
    p.add_argument("--cached-mib", type=int, default=512, help="size of the cached table file")
    p.add_argument("--tokens", default="1,8192", help="tokens per step, comma separated")
    p.add_argument("--threads", type=int, default=TableConfig().num_threads, help="TableConfig.num_threads")
    p.add_argument("--ceiling-threads", type=int, default=0, help="threads of the 4 KiB reads (0: 2 x --threads)")
    p.add_argument("--steps", type=int, default=40, help="timed steps of at most 64 tokens")
    p.add_argument("--steps-large", type=int, default=3, help="timed steps above 64 tokens")
    p.add_argument("--ceiling-reads", type=int, default=40000, help="reads per ceiling measurement")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    tokens = [int(v) for v in args.tokens.split(",")]
    ceiling_threads = args.ceiling_threads or 2 * args.threads
    os.makedirs(args.dir, exist_ok=True)
    files = {"cold": os.path.join(args.dir, "cold.safetensors"), "cached": os.path.join(args.dir, "cached.safetensors")}
    configs = {"cold": _engram_config(args.cold_mib << 20), "cached": _engram_config(args.cached_mib << 20)}
    written = {k: _ensure_file(files[k], configs[k], log) for k in files}
    env = _env(files["cold"])
    table_cfg = TableConfig(num_threads=args.threads)
    log(f"# engram-mmap bench | git {env['git']} | {env['cpu']} x{env['cores']} | {env['mem_gib']} GiB RAM | "
        f"Linux {env['kernel']} | {env['fs']} | load {env['loadavg']:.1f}")  # fmt: skip
    log(f"# {table_cfg} | 48 rows (2 tables x 24) per token, rows from the V4.1 hash of uniform random tokens")
    rng = np.random.default_rng(args.seed)
    results: dict[str, Any] = {"env": env, "table_config": repr(table_cfg), "files": {}, "ceilings": {}, "cases": []}
    log(
        f"{'case':<40}{'median_ms':>11}{'p10_ms':>10}{'p90_ms':>10}{'rows/s':>12}{'ceiling/s':>12}{'ratio':>7}"
        f"{'cpu_ms':>10}"
    )
    # "cold-rs": the cold file again, with the scale tensors copied to RAM (TableConfig.resident_scales).
    for kind in ("cold", "cold-rs", "cached"):
        base = "cached" if kind == "cached" else "cold"
        path, cfg = files[base], configs[base]
        size = os.path.getsize(path)
        hasher = EngramHasher(cfg)
        cfg_kind = dataclasses.replace(table_cfg, resident_scales=kind == "cold-rs")
        tables = [EngramTable.open_layer(path, cfg, layer, config=cfg_kind) for layer in LAYERS]
        cold = base == "cold"
        try:
            if kind == "cached":
                with open(path, "rb") as f:  # read the file once so it sits in the page cache
                    while f.read(64 << 20):
                        pass
            how = "O_DIRECT" if cold else "buffered, cached"
            if cold:
                ceiling, how = random_read_ceiling(path, args.ceiling_reads, ceiling_threads, args.seed + 1)
                best_threads = ceiling_threads
            else:
                # Cached reads are CPU bound: more threads than cores only add switching, so take the
                # best of a few thread counts, with more reads (each takes about a microsecond).
                ceiling, best_threads = 0.0, 0
                for threads in sorted({1, os.cpu_count() or 1, ceiling_threads}):
                    n = 5 * args.ceiling_reads
                    rate = n / _native.random_read(path, 0, size, n, threads, 4096, False, args.seed + 1)
                    if rate > ceiling:
                        ceiling, best_threads = rate, threads
            qd1 = None
            if how == "O_DIRECT":
                n = 2000
                qd1 = _native.random_read(path, 0, size, n, 1, 4096, True, args.seed + 2) / n
            results["files"][base] = {"path": path, "bytes": size, "rows_per_table": [t.rows for t in tables],
                                      "write_seconds": round(written[base], 1),
                                      "resident_after_warm": tables[0].resident_fraction()[0]}  # fmt: skip
            results["ceilings"][kind] = {"reads_per_s": ceiling, "threads": best_threads, "mode": how,
                                         "qd1_latency_us": None if qd1 is None else qd1 * 1e6}  # fmt: skip
            log(f"# {kind}: {size / 2**30:.2f} GiB file, {tables[0].rows} rows per table; ceiling {how} 4 KiB "
                f"random reads x{best_threads} threads: {ceiling:,.0f}/s"
                + (f", QD1 latency {qd1 * 1e6:.0f} us" if qd1 else ""))  # fmt: skip
            for t_tokens in tokens:
                steps = args.steps if t_tokens <= 64 else args.steps_large
                batches = []
                for _ in range(steps + (0 if cold else 2)):
                    tok = rng.integers(0, cfg.compressed_vocab_size, size=t_tokens)
                    batches.append(hasher.row_ids_all(tok))
                if kind == "cached":
                    _run_steps(tables, batches[:2], cold=False)  # warm-up (PTEs, pool threads)
                    batches = batches[2:]
                times, cpu, resident = _run_steps(tables, batches, cold=cold)
                cpu_ms = statistics.median(cpu) * 1e3
                med, p10, p90 = _stats(times)
                rows_s = 48 * t_tokens / med
                case = {"case": f"{kind}/{t_tokens}tok", "kind": kind, "tokens": t_tokens, "rows": 48 * t_tokens,
                        "steps": len(times), "median_ms": med * 1e3, "p10_ms": p10 * 1e3, "p90_ms": p90 * 1e3,
                        "rows_per_s": rows_s, "ceiling_reads_per_s": ceiling, "ratio": rows_s / ceiling,
                        "cpu_ms": cpu_ms,
                        "resident_before_step_max": max(resident) if resident else None}  # fmt: skip
                results["cases"].append(case)
                log(f"{kind + ' gather ' + str(t_tokens) + ' tok (' + str(48 * t_tokens) + ' rows)':<40}"
                    f"{med * 1e3:>11.3f}{p10 * 1e3:>10.3f}{p90 * 1e3:>10.3f}{rows_s:>12,.0f}{ceiling:>12,.0f}"
                    f"{rows_s / ceiling:>7.2f}{cpu_ms:>10.3f}")  # fmt: skip
        finally:
            for t in tables:
                t.close()
    # Hashing cost (numpy), for the record: both layers' row ids of one step.
    cfg = configs["cached"]
    hasher = EngramHasher(cfg)
    for t_tokens in tokens:
        tok = rng.integers(0, cfg.compressed_vocab_size, size=t_tokens)
        reps = 50 if t_tokens <= 64 else 5
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            hasher.row_ids_all(tok, lookback=tok[:3])
            times.append(time.perf_counter() - t0)
        med, p10, p90 = _stats(times)
        results["cases"].append({"case": f"hash/{t_tokens}tok", "kind": "hash", "tokens": t_tokens,
                                 "median_ms": med * 1e3, "p10_ms": p10 * 1e3, "p90_ms": p90 * 1e3})  # fmt: skip
        label = f"row_ids_all {t_tokens} tok (numpy)"
        log(f"{label:<40}{med * 1e3:>11.3f}{p10 * 1e3:>10.3f}{p90 * 1e3:>10.3f}")
    cold_res = [c.get("resident_before_step_max") for c in results["cases"]]
    cold_res = [r for r in cold_res if r is not None]
    if cold_res:
        log(f"# cold steps: at most {max(cold_res):.4%} of a weight tensor was resident before a step (mincore)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
