"""GPU benchmark: slot-fill copy rate against the pinned host-to-device rate measured in the same run, the cost
of a replan (host time, policy + planner + enqueueing), and the per-step cost of observe/after_step.

Geometry is DeepSeek-V4.1-Flash EXL3 3 bpw (40 MoE layers x 384 experts, 13,271,040 B per expert). To keep the
pinned host memory at one layer's worth (5.1 GB instead of 204 GB), every layer's home points at the same pinned
``[384, ...]`` tensors; the copies are real pinned-to-device copies of 12.66 MiB experts.

The served model's form is measured too (``--no-mapped`` skips it): one layer's experts as the nine EXL3 columns
the served model uses (gate/up/down x trellis/suh/svh, 13.32 MB per expert) laid out expert after expert in a file,
the file mapped read-only and registered with CUDA (read-only, mapped) like vllm-dsv41's ``ExpertHome``, and the
cache given an address-based home (``ExpertRows``) over it; its ceiling is a 1 GiB copy out of the same mapping.

    python benches/bench_gpu.py [--vram-gb 24] [--steps 1500] [--no-mapped] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cpu_tier.geometry import V41_FLASH  # noqa: E402
from expert_cache import (  # noqa: E402
    DSV41_FLASH_EXL3_3BPW,
    ExpertCache,
    ExpertCacheConfig,
    ExpertRows,
    ProjectionSpec,
    SyntheticTraceConfig,
    generate,
    policy_config,
)

EXPERT = V41_FLASH.expert_trellis_bytes  # bytes of one V4.1-Flash expert (13,271,040)
H, I = V41_FLASH.hidden, V41_FLASH.intermediate
#: The served model's columns (vllm-dsv41's EXPERT_COLUMNS): per role, the trellis and the two sign vectors.
SERVED_COLUMNS = tuple(
    spec
    for role, (k, n) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))
    for spec in (
        ProjectionSpec(f"{role}.trellis", V41_FLASH.trellis_shape(role), "int16"),  # type: ignore[arg-type]
        ProjectionSpec(f"{role}.suh", (k,), "float16"),
        ProjectionSpec(f"{role}.svh", (n,), "float16"),
    )
)


class MappedHome:
    """``num_experts`` experts of ``SERVED_COLUMNS`` written expert after expert (8-byte aligned, as safetensors
    aligns) to a file, mapped read-only, optionally registered with CUDA; ``rows(num_layers)`` addresses it for
    every layer."""

    def __init__(self, path: Path, num_experts: int, register: bool) -> None:
        self.num_experts = num_experts
        self.col_off, pos = [], 0
        for spec in SERVED_COLUMNS:
            self.col_off.append(pos)
            pos += spec.nbytes + -spec.nbytes % 8
        self.stride = pos
        self.length = num_experts * self.stride + -(num_experts * self.stride) % mmap.PAGESIZE
        blob = np.random.default_rng(0).integers(0, 256, self.stride, dtype=np.uint8)
        with open(path, "wb") as f:
            for e in range(num_experts):
                blob[:8] = np.frombuffer(np.int64(e).tobytes(), np.uint8)
                f.write(blob.tobytes())
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc = libc
        fd = os.open(path, os.O_RDONLY)
        try:
            base = libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"{path}: mmap failed")
        self.base: int = base
        self.device_base = base
        self.registered = False
        if register:
            from dma_prefill import _cudart

            self._cudart = _cudart
            flags = _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED | 8  # 8: cudaHostRegisterReadOnly
            _cudart.host_register(base, self.length, flags)
            self.registered = True
            self.device_base, _ = _cudart.device_pointer(base)
        self.buffer = torch.frombuffer((ctypes.c_uint8 * self.length).from_address(base), dtype=torch.uint8)

    def rows(self, num_layers: int) -> ExpertRows:
        E, P = self.num_experts, len(SERVED_COLUMNS)
        off = np.arange(E, dtype=np.int64)[None, :] * self.stride + np.array(self.col_off, np.int64)[:, None]
        off = np.ascontiguousarray(np.broadcast_to(off, (num_layers, P, E)))
        return ExpertRows((self.buffer,), np.zeros((num_layers, P, E), np.int32), off, (self.device_base,), self)

    def close(self) -> None:
        if self.registered:
            self._cudart.host_unregister(self.base)
            self.registered = False
        if self.base:
            self._libc.munmap(self.base, self.length)
            self.base = 0


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return "?"


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def time_copies(
    dst: torch.Tensor, src: torch.Tensor, chunk: int, n: int, stream: torch.cuda.Stream, reps: int
) -> list[float]:
    """GB/s of ``n`` copies of ``chunk`` bytes (src row i -> dst row i) on ``stream``, per repetition."""
    rates = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            for i in range(n):
                dst[i % dst.shape[0], :chunk].copy_(src[i % src.shape[0], :chunk], non_blocking=True)
            b.record()
        b.synchronize()
        rates.append(n * chunk / (a.elapsed_time(b) * 1e-3) / 1e9)
    return rates[1:]  # first is warm-up


def rewarm_rates(cache: ExpertCache, reps: int, expert_bytes: int = EXPERT) -> tuple[list[float], int, float]:
    """GB/s of full re-warms of the pool (release, then rewarm: call to the side stream's last byte), per
    repetition after one warm-up; the number of experts; the host time of the last rewarm call."""
    rates = []
    n, t_host = 0, 0.0
    for _ in range(reps + 1):
        cache.release()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(cache._side)
        t0 = time.perf_counter()
        cache.rewarm()
        t_host = time.perf_counter() - t0
        e1.record(cache._side)
        e1.synchronize()
        n = len(cache.resident())
        rates.append(n * expert_bytes / (e0.elapsed_time(e1) * 1e-3) / 1e9)
        cache.synchronize()
    return rates[1:], n, t_host


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vram-gb", type=float, default=24.0, help="cap usable VRAM like a 24 GB card")
    ap.add_argument("--slots", type=int, default=392)
    ap.add_argument(
        "--steps", type=int, default=1500, help="decode steps of the synthetic trace driven through the cache"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-mapped", action="store_true", help="skip the registered-file-mapping home (served form)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    total = props.total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.vram_gb * 2**30 / total), dev)
    env = {
        "git": git_rev(),
        "gpu": props.name,
        "sm": f"{props.major}{props.minor}",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "vram_cap_gb": a.vram_gb,
    }
    print(
        f"# expert-cache bench_gpu | git {env['git']} | {env['gpu']} sm_{env['sm']} | CUDA {env['cuda']} | "
        f"torch {env['torch']} | VRAM cap {a.vram_gb} GB | reps={a.reps}"
    )
    rows: list[dict[str, object]] = []

    def row(case: str, unit: str, xs: list[float], extra: str = "") -> None:
        med, p10, p90 = statistics.median(xs), pct(xs, 10), pct(xs, 90)
        rows.append({"case": case, "unit": unit, "median": med, "p10": p10, "p90": p90, "n": len(xs), "note": extra})
        print(f"{case:44s} {med:10.3f} {p10:10.3f} {p90:10.3f}  {unit:6s} {extra}", flush=True)

    # ---- home: one layer of experts, pinned, non-zero pattern -----------------------------------------------
    t0 = time.perf_counter()
    E = 384
    w13 = torch.empty((E, 2, 320, 144, 48), dtype=torch.int16, pin_memory=True)
    w2 = torch.empty((E, 144, 320, 48), dtype=torch.int16, pin_memory=True)
    pat = torch.randint(-32768, 32767, (1 << 22,), dtype=torch.int16)
    for t in (w13, w2):
        flat = t.view(-1)
        for i in range(0, flat.numel(), pat.numel()):
            n = min(pat.numel(), flat.numel() - i)
            flat[i : i + n].copy_(pat[:n])
    print(f"# pinned home: {2 * (w13.numel() + w2.numel()) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    print(f"{'case':44s} {'median':>10s} {'p10':>10s} {'p90':>10s}  unit")

    # ---- ceilings: pinned host -> device ---------------------------------------------------------------------
    side = torch.cuda.Stream()
    host_rows = w13.view(E, -1).view(torch.uint8)  # [384, 8.8 MB] pinned
    dst = torch.empty((80, host_rows.shape[1]), dtype=torch.uint8, device=dev)
    big_src = w13.view(-1).view(torch.uint8)[: 1 << 30]
    big_dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    r = []
    for _ in range(a.reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            e0.record()
            big_dst.copy_(big_src, non_blocking=True)
            e1.record()
        e1.synchronize()
        r.append((1 << 30) / (e0.elapsed_time(e1) * 1e-3) / 1e9)
    row("ceiling: pinned H2D 1 x 1 GiB", "GB/s", r[1:])
    h2d_chunk = time_copies(dst, host_rows, 8_847_360, 160, side, a.reps)
    row("ceiling: pinned H2D 160 x 8.44 MiB (w13 rows)", "GB/s", h2d_chunk)
    del big_dst, dst
    torch.cuda.empty_cache()

    # ---- the cache -------------------------------------------------------------------------------------------
    def make(policy: str, **kw: object) -> ExpertCache:
        cfg = ExpertCacheConfig(
            num_layers=V41_FLASH.num_layers,
            num_experts=E,
            projections=DSV41_FLASH_EXL3_3BPW,
            num_slots=a.slots,
            policy=policy_config(policy),
            **kw,
        )  # type: ignore[arg-type]
        return ExpertCache(cfg, [[w13, w2] for _ in range(40)], dev)

    tr = generate(SyntheticTraceConfig(decode_steps=a.steps, streams=1, drift=5.0, seed=11))
    dec = [s for s in range(tr.num_steps) if tr.tokens_per_step[s] <= 512 and tr.rows_per_step[s] > 0]
    off = np.concatenate([[0], np.cumsum(tr.rows_per_step)])
    ids_gpu = torch.from_numpy(tr.ids.astype(np.int64)).to(dev)

    results = {}
    hybrid = dict(replan_every=1, admit_limit=4, hysteresis=1.2)
    for name, tag, policy, kw in [
        ("decayed (reference: every 16, admit 48)", "decayed", "decayed", {}),
        ("hybrid (every step, admit 4, hyst 1.2)", "hybrid", "hybrid", hybrid),
        ("hybrid, async_observe (no wait for the GPU)", "hybrid async", "hybrid", dict(hybrid, async_observe=True)),
    ]:
        cache = make(policy, **kw)
        step_us: list[float] = []
        replan_ms: list[float] = []
        obs_us: list[float] = []
        for s in dec:
            ids = ids_gpu[off[s] : off[s + 1]]
            t0 = time.perf_counter()
            cache.before_step(int(tr.tokens_per_step[s]))
            t1 = time.perf_counter()
            for layer in range(40):
                cache.observe(layer, ids[:, layer, :])
            t2 = time.perf_counter()
            due = cache._ctl.steps_since_replan + 1 >= cache.config.replan_every
            cache.after_step()
            t3 = time.perf_counter()
            obs_us.append((t2 - t1) * 1e6)
            (replan_ms.append((t3 - t2) * 1e3) if due else step_us.append((t3 - t2 + t1 - t0) * 1e6))
        cache.synchronize()
        st = cache.stats()
        results[name] = st.as_dict()
        row(f"{tag}: 40 x observe per step (host)", "us", obs_us[10:])
        if step_us:
            row(f"{tag}: before+after_step, no replan (host)", "us", step_us[10:])
        row(
            f"{tag}: after_step with replan (host)",
            "ms",
            replan_ms[2:],
            f"hit_rate {st.hit_rate:.4f} admits/step {st.admits / max(1, st.decode_steps):.2f}",
        )

        rates, n, t_host = rewarm_rates(cache, a.reps)
        row(f"{tag}: rewarm fill {n} experts (side stream)", "GB/s", rates, f"host enqueue {t_host * 1e3:.1f} ms")
        del cache
        torch.cuda.empty_cache()

    # ---- observe_all: all layers in one call ------------------------------------------------------------------
    cache = make("decayed")
    all_us: list[float] = []
    for s in dec[:400]:
        ids = ids_gpu[off[s] : off[s + 1]].permute(1, 0, 2)  # [L, rows, K]
        cache.before_step(int(tr.tokens_per_step[s]))
        t0 = time.perf_counter()
        cache.observe_all(ids)
        all_us.append((time.perf_counter() - t0) * 1e6)
        cache.after_step()
    row("decayed: observe_all (40 layers) per step (host)", "us", all_us[10:])
    del cache
    torch.cuda.empty_cache()

    # ---- the served form: nine columns in a registered read-only file mapping ----------------------------------
    if not a.no_mapped:
        del w13, w2, host_rows, big_src
        torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            home = MappedHome(Path(tmp) / "experts.bin", E, register=True)
            try:
                took = time.perf_counter() - t0
                print(f"# mapped home: {home.length / 1e9:.2f} GB written, mapped, registered in {took:.1f} s; "
                      f"{home.stride} B per expert in {len(SERVED_COLUMNS)} columns")  # fmt: skip
                big_dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
                r = []
                for _ in range(a.reps + 1):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(side):
                        e0.record()
                        big_dst.copy_(home.buffer[: 1 << 30], non_blocking=True)
                        e1.record()
                    e1.synchronize()
                    r.append((1 << 30) / (e0.elapsed_time(e1) * 1e-3) / 1e9)
                row("ceiling: registered mapping H2D 1 x 1 GiB", "GB/s", r[1:])
                del big_dst
                torch.cuda.empty_cache()
                cfg = ExpertCacheConfig(num_layers=V41_FLASH.num_layers, num_experts=E, projections=SERVED_COLUMNS,
                                        num_slots=a.slots)  # fmt: skip
                cache = ExpertCache(cfg, home.rows(V41_FLASH.num_layers), dev)
                for s in dec[:400]:  # fill the pool through replans
                    cache.before_step(int(tr.tokens_per_step[s]))
                    cache.observe_all(ids_gpu[off[s] : off[s + 1]].permute(1, 0, 2))
                    cache.after_step()
                cache.synchronize()
                rates, n, t_host = rewarm_rates(cache, a.reps, cfg.expert_bytes)
                row(f"served form: rewarm fill {n} experts, 9 columns", "GB/s", rates,
                    f"host enqueue {t_host * 1e3:.1f} ms (registered file mapping)")  # fmt: skip
                del cache
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            finally:
                home.close()

    print(f"# peak VRAM {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (cap {a.vram_gb} GB)")
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "rows": rows, "cache_stats": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
