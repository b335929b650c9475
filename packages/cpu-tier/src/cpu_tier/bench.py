"""Benchmark of the native expert kernels: ``python -m cpu_tier.bench [--json FILE]``.

In one run: the host's streaming read bandwidth (its own probe: every worker sums its part of a large buffer),
then DeepSeek-V4.1 experts (H=5120, I=2304, MUL1 K=3: 13,271,040 bytes of trellis per expert) through
``ExpertTier`` with 1, 2, 4 and 8 tokens per expert, per ISA, on one core and on all cores. Each job runs every
expert of a pool larger than the last-level cache, so weights come from DRAM. Reported: ms per expert, weights/s,
trellis GB/s, per core, the ratio of trellis GB/s to the probe's GB/s for the same thread count, and core cycles per
weight (clock from a dependent imul chain run on every worker at once).

Probes besides the streaming read: ``probe/band-read`` reads memory in the band kernels' pattern with no compute
(768 bytes of every 13,824: the gate/up bands), ``probe/vector-ports`` the two vector ports' throughput with every
worker busy at once, in cores' worth of the fastest core (below the thread count where cores share their ports).

Compute ceilings (same job, weights that stay in cache, so the kernel alone sets the rate): ``llc`` = the V4.1
expert, the pool being one expert's memory referenced n times (13.27 MB: in the last-level cache); ``l2`` = a reduced
expert with the same gate/up band loop (H=5120, I=256: 1.47 MB, one expert referenced n times).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import CpuTierConfig, ExpertTier, Picks, cpu_features, exl3, runnable_isas
from .config import usable_cpus

H, I, K = 5120, 2304, 3


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _git() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _page_aligned_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` at a page-aligned address, like the server's pinned expert buffers (numpy's own large
    allocations sit 16 bytes past a page boundary, which costs the kernels ~15% from split cache lines)."""
    buf = np.empty(a.nbytes + 4096, dtype=np.uint8)
    off = (-buf.ctypes.data) % 4096
    v = buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    v[...] = a
    return v


def _anon_huge_mib() -> float:
    """This process's anonymous memory in transparent huge pages (MiB; nan where /proc does not say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def _thp_mode() -> str:
    """The transparent huge page setting ("always", "madvise", "never" or "unknown")."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def _hugepage_copies(experts: tuple[list, list, list]) -> tuple[list, list, list]:
    """The same experts, their trellis copied into one anonymous mapping advised for transparent huge pages
    (2 MiB pages where the kernel grants them: THP "always" or "madvise"), page-aligned each."""
    sizes = [(t.trellis.nbytes + 4095) & ~4095 for proj in experts for t in proj]
    mm = mmap.mmap(-1, sum(sizes) + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mm, dtype=np.uint8)
    off = (-buf.ctypes.data) % (2 << 20)  # the first expert at a 2 MiB boundary
    out: tuple[list, list, list] = ([], [], [])
    for proj, dst in zip(experts, out, strict=True):
        for t in proj:
            v = buf[off : off + t.trellis.nbytes].view(t.trellis.dtype).reshape(t.trellis.shape)
            v[...] = t.trellis
            dst.append(exl3.Exl3Tensor.from_arrays(v, t.suh, t.svh, t.codebook))
            off += (t.trellis.nbytes + 4095) & ~4095
    return out


def _experts(n: int, hidden: int, inter: int, codebook: str, seed: int) -> tuple[list, list, list]:
    """n distinct experts (separate, page-aligned memory); the trellis content repeats from 3 random templates."""
    rng = np.random.default_rng(seed)
    tmpl = [
        (
            exl3.random_tensor(hidden, inter, K, codebook, seed=rng),
            exl3.random_tensor(hidden, inter, K, codebook, seed=rng),
            exl3.random_tensor(inter, hidden, K, codebook, seed=rng),
        )
        for _ in range(3)
    ]
    gate, up, down = [], [], []
    for e in range(n):
        g, u, d = tmpl[e % 3]
        for src, dst in ((g, gate), (u, up), (d, down)):
            dst.append(exl3.Exl3Tensor.from_arrays(_page_aligned_copy(src.trellis), src.suh, src.svh, codebook))
    return gate, up, down


@dataclass(frozen=True)
class _Where:
    """Where a case runs: the ISA, the thread count and pinning, and that setting's probes (bandwidth, clock)."""

    isa: str
    thr: int
    pin: tuple[int, ...]
    bw: float
    ghz: float


def _stats(ts: list[float]) -> tuple[float, float, float]:
    """p50, p10, p90."""
    a = np.sort(np.asarray(ts))
    return float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90))


def _load() -> float:
    """The 1-minute load average (nan where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


ANCHOR_TIER = {"avx2": "avx2", "avx512": "vbmi", "amx": "vbmi"}  # exllamav3's kernel tier for our ISA variant


def _run_anchor(path: str, isa: str, threads: int, experts: int, seconds: float, pin: bool) -> dict[str, Any]:
    """One run of exllamav3's CPU MoE kernel (the exl3-cpu-anchor tool's bench_a: ``time THREADS NEXP SECONDS job``,
    DeepSeek-V4.1 experts at m = 1 from DRAM), capped at the tier that matches our ``isa`` (EXL3_MOE_CPU_MAX_ISA) and
    pinned or not like our workers (EXL3_MOE_CPU_PIN). Returns its RESULT fields (ms_med, ms_min, ms_max per
    expert, tier, passes, ...)."""
    env = dict(os.environ, EXL3_MOE_CPU_MAX_ISA=ANCHOR_TIER.get(isa, isa), EXL3_MOE_CPU_PIN="1" if pin else "0")
    cmd = [path, "time", str(threads), str(experts), str(seconds), "job"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60 + 10 * seconds)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"--anchor {path}: could not run it ({e})") from None
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode or line is None:
        raise RuntimeError(f"--anchor {path}: exit code {res.returncode}, no RESULT line; stderr: {res.stderr[-500:]}")
    out: dict[str, Any] = {}
    for kv in line.split()[1:]:
        k, _, v = kv.partition("=")
        try:
            out[k] = float(v) if "." in v else int(v)
        except ValueError:
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cpu_tier.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", help="also write the rows and the environment to this file")
    p.add_argument("--isa", action="append", help="ISA to run (repeatable); default: every runnable SIMD one")
    p.add_argument("--threads", type=int, default=0, help="'all cores' thread count (default: every usable core)")
    p.add_argument("--thread-counts", default="", help="extra thread counts to run, comma separated (1 and all always)")
    p.add_argument("--experts", type=int, default=0, help="experts per job (default: enough to exceed the LLC)")
    p.add_argument("--tokens", default="1,2,4,8", help="tokens per expert, comma separated")
    p.add_argument("--iters", type=int, default=5, help="timed jobs per case (after one warm-up)")
    p.add_argument("--probe-mib", type=int, default=1024, help="size of the bandwidth probe's buffer")
    p.add_argument(
        "--cases",
        default="fast,exact,mcg,llc,l2,kernel",
        help="comma separated: fast (MUL1 fast at --tokens), exact, mcg, llc, l2, kernel (compute ceilings, m=1)",
    )
    p.add_argument(
        "--slabs",
        default="0",
        help="CpuTierConfig.slab_blocks values (comma separated) for the m=1 fast cases; the first one "
        "for every other case",
    )
    p.add_argument(
        "--prefetch-blocks",
        default="1",
        help="CpuTierConfig.prefetch_blocks values (comma separated) for the m=1 fast, llc and l2 cases; "
        "the first one for every other case (the kernel ceiling keeps the default, 1)",
    )
    p.add_argument(
        "--hugepages",
        action="store_true",
        help="also run the m=1 fast cases with the experts' memory in transparent huge pages (an A/B: "
        "rows named 'huge')",
    )
    p.add_argument(
        "--amx-min-tokens",
        type=int,
        default=6,
        help="CpuTierConfig.amx_min_tokens of the isa 'amx' job cases (its kernel ceiling always runs the AMX kernel)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin the workers to the first usable cores (CpuTierConfig.cpus; the anchor too). Default: not "
        "pinned: on a machine shared with other processes a pinned worker cannot leave a busy core, "
        "and every phase of a job waits for it (see the README)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of the fast and exact cases from DRAM at every --tokens (and of the anchor, when given, "
        "interleaved with m=1 fast); a summary row gives min/median/max over the rounds' medians, and exact's "
        "time over fast's",
    )
    p.add_argument(
        "--anchor",
        metavar="BENCH_A",
        help="exllamav3's CPU kernel timed beside ours: the exl3-cpu-anchor tool's bench_a binary (see "
        "/work/shared/tools/exl3-cpu-anchor); its row follows each round of the m=1 fast case",
    )
    p.add_argument("--anchor-seconds", type=float, default=2.0, help="seconds per anchor run")
    p.add_argument("--quick", action="store_true", help="small shapes, few experts: a smoke test of the CLI")
    args = p.parse_args(argv)

    hidden, inter = (512, 384) if args.quick else (H, I)
    # default: the SIMD variants (the scalar reference is ~100x slower; ask for it with --isa scalar)
    isas = args.isa or [i for i in runnable_isas() if i != "scalar"] or ["scalar"]
    for isa in isas:
        if isa not in runnable_isas():
            p.error(f"--isa {isa}: not runnable here (runnable: {runnable_isas()})")
    all_threads = args.threads or len(usable_cpus())
    thread_counts = sorted({1, all_threads, *(int(v) for v in args.thread_counts.split(",") if v)})
    tokens = [int(t) for t in args.tokens.split(",")]
    want = {c.strip() for c in args.cases.split(",") if c.strip()}
    bad = want - {"fast", "exact", "mcg", "llc", "l2", "kernel"}
    if bad:
        p.error(f"--cases: unknown {sorted(bad)} (known: fast, exact, mcg, llc, l2, kernel)")
    slabs = [int(v) for v in args.slabs.split(",")]
    pfbs = [int(v) for v in args.prefetch_blocks.split(",")]
    if any(not 0 <= v <= 4 for v in pfbs):
        p.error("--prefetch-blocks: values must be in 0..4")
    if args.rounds < 1:
        p.error("--rounds: must be >= 1")
    if args.anchor and not Path(args.anchor).is_file():
        p.error(f"--anchor {args.anchor}: no such file")
    expert_bytes = 3 * hidden * inter * K // 8
    n_exp = args.experts or (4 if args.quick else max(16, 4 * all_threads))
    probe_bytes = (4 if args.quick else args.probe_mib) << 20

    feats = [
        f
        for f in ("avx2", "avx512f", "avx512bw", "avx512vnni", "avx512vbmi", "amx_int8", "os_amx")
        if cpu_features().get(f)
    ]
    print(
        f"# cpu-tier bench | git {_git()} | {_cpu_model()} | {len(usable_cpus())} cores | {' '.join(feats)} | "
        f"expert H={hidden} I={inter} MUL1 K={K} ({expert_bytes / 1e6:.2f} MB) x {n_exp} per job | "
        f"warmup=1 iters={args.iters} | amx jobs: AMX kernel from {args.amx_min_tokens} tokens per expert | "
        f"workers {'pinned' if args.pin else 'not pinned'} | load average {_load():.2f}",
        flush=True,
    )
    t0 = time.perf_counter()
    gate, up, down = _experts(n_exp, hidden, inter, "mul1", seed=1)
    huge = None
    if args.hugepages:
        before = _anon_huge_mib()
        huge = _hugepage_copies((gate, up, down))
        print(
            f"# --hugepages: {_anon_huge_mib() - before:.0f} MiB of the experts' copy in transparent huge pages "
            f"(THP: {_thp_mode()})",
            flush=True,
        )
    mcg = _experts(min(n_exp, 8), hidden, inter, "mcg", seed=2) if not args.quick and "mcg" in want else None
    # compute ceilings: one expert's memory referenced n_exp times (cache resident)
    llc = ([gate[0]] * n_exp, [up[0]] * n_exp, [down[0]] * n_exp)
    l2_inter = 256 if not args.quick else 128
    l2e = _experts(1, hidden, l2_inter, "mul1", seed=3)
    l2 = (l2e[0] * n_exp, l2e[1] * n_exp, l2e[2] * n_exp)
    print(f"# built {n_exp} experts in {time.perf_counter() - t0:.1f} s", flush=True)
    hdr = (
        f"{'case':<30}{'isa':>8}{'thr':>5}{'m':>3}{'prec':>7}{'p50 ms':>9}{'p10':>8}{'p90':>8}"
        f"{'Gw/s':>8}{'GB/s':>8}{'GB/s/core':>10}{'probe':>8}{'ratio':>7}{'cyc/w':>7}"
    )
    print(hdr, flush=True)
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for isa in isas:
        port_best = 0.0  # the fastest one core's vector-port rate seen so far (alone, or with others busy)
        for thr in thread_counts:
            pin = usable_cpus()[:thr] if args.pin and thr <= len(usable_cpus()) else ()
            cfg = CpuTierConfig(threads=thr, cpus=pin, isa=isa)  # type: ignore[arg-type]
            with ExpertTier(cfg) as probe_tier:
                probes = probe_tier._mod.bench  # the native module's probes (csrc/bench_probes.cpp)
                bw = probes.read_bandwidth(probe_tier._rt, probe_bytes, 3) / 1e9
                # the gate/up band kernels' memory pattern without their compute: 8 tiles (768 B at K=3) of every
                # tile row, rows (I/16) x 96 B apart
                seg, stride = 8 * 2 * K * 16, inter // 16 * 2 * K * 16
                bw_band = probes.read_bandwidth(probe_tier._rt, probe_bytes, 3, seg, stride, hidden // 16) / 1e9
                ghz = float(np.median(probes.clock_ghz(probe_tier._rt)))
                # three runs: the fastest one alone (one thread), the median one with all busy
                runs = sorted(
                    (np.asarray(probes.port_rates(probe_tier._rt, 0.03)) for _ in range(3)), key=lambda r: r.sum()
                )
                ports = runs[-1] if thr == 1 else runs[1]
            row = {
                "case": "probe/stream-read",
                "isa": isa,
                "threads": thr,
                "GBps": bw,
                "GBps_per_core": bw / thr,
                "bytes": probe_bytes,
                "clock_GHz": ghz,
            }
            rows.append(row)
            print(
                f"{'probe/stream-read':<30}{isa:>8}{thr:>5}{'':>3}{'':>7}{'':>9}{'':>8}{'':>8}{'':>8}"
                f"{bw:8.2f}{bw / thr:10.2f}{bw:8.2f}{'':>7}  (core clock ~{ghz:.2f} GHz with {thr} busy)",
                flush=True,
            )
            rows.append(
                {
                    "case": "probe/band-read",
                    "isa": isa,
                    "threads": thr,
                    "GBps": bw_band,
                    "GBps_per_core": bw_band / thr,
                    "probe_GBps": bw,
                    "ratio_to_probe": bw_band / bw,
                    "segment_bytes": seg,
                    "stride_bytes": stride,
                }
            )
            print(
                f"{'probe/band-read':<30}{isa:>8}{thr:>5}{'':>3}{'':>7}{'':>9}{'':>8}{'':>8}{'':>8}"
                f"{bw_band:8.2f}{bw_band / thr:10.2f}{bw:8.2f}{bw_band / bw:7.2f}  ({seg} B of every {stride} B, "
                f"no compute)",
                flush=True,
            )
            # the vector ports' throughput with every worker busy at once, in cores' worth of the fastest core seen so far:
            # below the thread count where cores share their ports (SMT siblings; in a VM, possibly with another
            # guest's busy vCPU, which also slows a core that runs alone)
            port_best = max(port_best, float(ports.max()))
            eff = float(ports.sum()) / port_best
            rows.append(
                {
                    "case": "probe/vector-ports",
                    "isa": isa,
                    "threads": thr,
                    "steps_per_ns": float(ports.sum()),
                    "per_worker_steps_per_ns": [round(float(v), 3) for v in ports],
                    "effective_cores": eff,
                }
            )
            print(
                f"{'probe/vector-ports':<30}{isa:>8}{thr:>5}  = {eff:.1f} cores' worth of the fastest core "
                f"(per core {ports.min() / port_best:.2f}..{ports.max() / port_best:.2f})",
                flush=True,
            )
            if "kernel" in want:
                # kernel alone, every worker at once on its own L2-resident band (the job's compute ceiling);
                # variants of the AVX-512 int16 kernel (see csrc/arch/avx512/kernels.h), for an A/B against the default
                # (vpermb on an in-tile 64-byte window for the column pairs that do not wrap): 1 = vpermt2b on the
                # whole tile reloaded per column pair, 2 = vpermt2b with the tiles hoisted (the former default);
                # of the AVX2 integer kernel (csrc/arch/avx2/kernels.h): 1 = the former 32-bit-lane forms
                for variant in {"avx512": (0, 1, 2), "amx": (0, 1, 2), "avx2": (0, 1)}.get(isa, (0,)):
                    with ExpertTier(
                        CpuTierConfig(
                            threads=thr,
                            cpus=pin,
                            isa=isa,  # type: ignore[arg-type]
                            amx_min_tokens=1,
                        )
                    ) as kt:
                        g0 = gate[0]
                        kb_iters = 200 if not args.quick else 4  # ~12 ms per worker: sustained clock
                        secs = np.asarray(
                            kt._mod.bench.kernel_band_seconds(
                                kt._rt,
                                g0.trellis,
                                g0.suh.view(np.uint16),
                                g0.svh.view(np.uint16),
                                2,
                                True,
                                1,
                                1,
                                kb_iters,
                                variant,
                            )
                        )
                    band_w = hidden * 128
                    per_worker = band_w / secs / 1e9
                    gw = float(per_worker.sum())  # all workers together
                    gbps = gw * K / 8
                    case = "ceiling/kernel 1 band L2" + (f" v{variant}" if variant else "")
                    rows.append(
                        {
                            "case": case,
                            "pool": "l2-band",
                            "variant": variant,
                            "isa": isa,
                            "threads": thr,
                            "tokens": 1,
                            "precision": "fast",
                            "codebook": "mul1",
                            "Gweights_per_s": gw,
                            "GBps": gbps,
                            "GBps_per_core": gbps / thr,
                            "probe_GBps": bw,
                            "ratio_to_probe": gbps / bw,
                            "clock_GHz": ghz,
                            "cycles_per_weight": ghz * thr / gw,
                            "per_worker_Gw_s": [round(float(v), 3) for v in per_worker],
                        }
                    )
                    print(
                        f"{case:<30}{isa:>8}{thr:>5}{1:>3}{'fast':>7}{'':>9}{'':>8}{'':>8}"
                        f"{gw:8.2f}{gbps:8.2f}{gbps / thr:10.2f}{bw:8.2f}{gbps / bw:7.2f}{ghz * thr / gw:7.3f}",
                        flush=True,
                    )
            # (tokens, precision, codebook, pool name, slab_blocks, prefetch_blocks)
            Case = tuple[int, str, str, str, int, int]
            main_pf = (slabs[0], pfbs[0])
            cases: list[Case] = (
                [
                    (m, "fast", "mul1", pool, sb, pf)
                    for m in tokens
                    for pool in ("dram", "dram-huge")
                    if pool == "dram" or (huge is not None and m == 1)
                    for sb in (slabs if m == 1 else slabs[:1])
                    for pf in (pfbs if m == 1 else pfbs[:1])
                ]
                if "fast" in want
                else []
            )
            if "exact" in want:  # each m's exact case right after that m's fast one
                for m in tokens:
                    at = max((i + 1 for i, c in enumerate(cases) if c[0] == m), default=len(cases))
                    cases.insert(at, (m, "exact", "mul1", "dram", *main_pf))
            if mcg is not None:
                cases.append((1, "fast", "mcg", "dram", *main_pf))
            cases += [(1, "fast", "mul1", c, sb, pf) for c in ("llc", "l2") if c in want for sb in slabs for pf in pfbs]
            if isa == "scalar":  # m = 1 from DRAM at the default split only: fast and exact
                cases = [c for c in cases if c[0] == 1 and c[3] == "dram" and c[4:] == main_pf][:2]

            def is_main(
                c: Case, main_pf: tuple[int, int] = main_pf
            ) -> bool:  # from DRAM, default split: several rounds
                return (c[2], c[3], *c[4:]) == ("mul1", "dram", *main_pf)

            # groups measured round by round together: a main fast case and the exact case at its m (their ratio
            # under the same conditions), the anchor beside m = 1 fast; every other case alone, one round
            groups: list[list[Case]] = []
            for c in cases:
                if c[1] == "exact" and groups and is_main(groups[-1][0]) and groups[-1][0][:2] == (c[0], "fast"):
                    groups[-1].append(c)
                else:
                    groups.append([c])

            def case_name(c: Case, e_inter: int) -> str:
                m, prec, cb, pool, sb, pf = c
                case = f"expert/{cb} K={K} {'fast' if prec == 'fast' else 'exact'}"
                if pool == "dram-huge":
                    case += " huge"
                elif pool != "dram":
                    case = f"ceiling/{pool} I={e_inter}"
                if sb:
                    case += f" rows/{sb}"
                if len(pfbs) > 1:
                    case += f" pf{pf}"
                return case

            def run_ours(c: Case, rnd: int, w: _Where) -> tuple[str, float]:
                """One case's jobs once (a warm-up, then --iters timed): its row; returns (name, ms per expert)."""
                m, prec, cb, pool, sb, pf = c
                experts = {"dram": (gate, up, down) if cb == "mul1" else mcg, "dram-huge": huge, "llc": llc, "l2": l2}[
                    pool
                ]
                if w.isa == "scalar":  # a few experts suffice for a variant this slow
                    experts = tuple(p[:2] for p in experts)  # type: ignore[assignment]
                ne = len(experts[0])
                e_inter = experts[0][0].n
                e_bytes = 3 * hidden * e_inter * K // 8
                e_weights = 3 * hidden * e_inter
                case = case_name(c, e_inter)
                tier = ExpertTier(
                    CpuTierConfig(
                        threads=w.thr,
                        cpus=w.pin,
                        isa=w.isa,  # type: ignore[arg-type]
                        precision=prec,  # type: ignore[arg-type]
                        slab_blocks=sb,
                        amx_min_tokens=args.amx_min_tokens,
                        prefetch_blocks=pf,
                    )
                )
                tier.add_layer(0, *experts)
                x = rng.standard_normal((m, hidden)).astype(np.float32)
                picks = Picks(
                    np.repeat(np.arange(m, dtype=np.int32), ne),
                    np.tile(np.arange(ne, dtype=np.int32), m),
                    np.full(m * ne, 0.5, np.float32),
                )
                out = np.empty((m, hidden), np.float32)
                iters = max(1, args.iters if w.isa != "scalar" else 1)
                times = []
                phases = np.zeros(6)
                for it in range(iters + 1):
                    t1 = time.perf_counter()
                    job = tier.submit(0, x, picks, out)
                    job.wait()
                    job.result()
                    dt = time.perf_counter() - t1
                    if it:
                        times.append(dt / ne)
                        phases += np.asarray(job._native.phase_s()) / ne / iters
                tier.close()
                med, p10, p90 = _stats(times)
                gbps = e_bytes / med / 1e9
                gw = e_weights / med / 1e9
                rows.append(
                    {
                        "case": case,
                        "pool": pool,
                        "slab_blocks": sb,
                        "prefetch_blocks": pf,
                        "expert_bytes": e_bytes,
                        "isa": w.isa,
                        "threads": w.thr,
                        "tokens": m,
                        "precision": prec,
                        "codebook": cb,
                        "round": rnd,
                        "load_average": _load(),
                        "ms_per_expert": med * 1e3,
                        "p10_ms": p10 * 1e3,
                        "p90_ms": p90 * 1e3,
                        "job_ms_per_expert": [round(t * 1e3, 4) for t in times],
                        "Gweights_per_s": gw,
                        "GBps": gbps,
                        "GBps_per_core": gbps / w.thr,
                        "probe_GBps": w.bw,
                        "ratio_to_probe": gbps / w.bw,
                        "clock_GHz": w.ghz,
                        "cycles_per_weight": w.ghz * 1e9 * w.thr / (gw * 1e9),
                        "phase_ms_per_expert": dict(
                            zip(
                                ("zero", "input", "gate_up", "swiglu_down_input", "down", "sum"),
                                (round(float(v) * 1e3, 4) for v in phases),
                            )
                        ),
                    }
                )
                print(
                    f"{case:<30}{w.isa:>8}{w.thr:>5}{m:>3}{prec:>7}{med * 1e3:9.3f}{p10 * 1e3:8.3f}"
                    f"{p90 * 1e3:8.3f}{gw:8.2f}{gbps:8.2f}{gbps / w.thr:10.2f}{w.bw:8.2f}{gbps / w.bw:7.2f}"
                    f"{w.ghz * w.thr / gw:7.3f}",
                    flush=True,
                )
                return case, med * 1e3

            def run_anchor(rnd: int, ours_ms: float | None, w: _Where) -> float:
                a = _run_anchor(args.anchor, w.isa, w.thr, n_exp, args.anchor_seconds, args.pin)
                row = {
                    "case": f"anchor/exllamav3 {a.get('tier', '?')}",
                    "isa": w.isa,
                    "threads": w.thr,
                    "tokens": 1,
                    "round": rnd,
                    "load_average": _load(),
                    "ms_per_expert": a["ms_med"],
                    "min_ms": a["ms_min"],
                    "max_ms": a["ms_max"],
                    "passes": a.get("passes"),
                    "anchor": a,
                    "GBps": a.get("GBps"),
                    "ratio_anchor_over_ours": a["ms_med"] / ours_ms if ours_ms else None,
                }
                rows.append(row)
                print(
                    f"{row['case']:<30}{w.isa:>8}{w.thr:>5}{1:>3}{'int8':>7}{a['ms_med']:9.3f}"
                    f"{a['ms_min']:8.3f}{a['ms_max']:8.3f}{'':>8}{a.get('GBps', 0):8.2f}"
                    f"{a.get('GBps', 0) / w.thr:10.2f}  (min/max, not p10/p90; load {_load():.2f})",
                    flush=True,
                )
                return float(a["ms_med"])

            where = _Where(isa, thr, pin, bw, ghz)
            for group in groups:
                rounds = args.rounds if is_main(group[0]) else 1
                # the headline case (m = 1 fast from DRAM, default split) has the anchor beside it
                with_anchor = (
                    group[0][:2] == (1, "fast") and is_main(group[0]) and bool(args.anchor) and isa != "scalar"
                )
                names = [""] * len(group)
                ours_med: list[list[float]] = [[] for _ in group]
                anchor_med: list[float] = []
                # even rounds: the group's cases in order (the anchor right after the headline case); odd ones the
                # other way round, so neither side always runs first
                order: list[int | None] = [0, *([None] if with_anchor else []), *range(1, len(group))]
                for rnd in range(rounds):
                    for i in order if rnd % 2 == 0 else order[::-1]:
                        if i is None:
                            anchor_med.append(run_anchor(rnd, ours_med[0][-1] if ours_med[0] else None, where))
                        else:
                            names[i], ms = run_ours(group[i], rnd, where)
                            ours_med[i].append(ms)
                for i, c in enumerate(group):
                    m, prec = c[0], c[1]
                    o = np.asarray(ours_med[i])
                    ratio = float(np.median(o)) / float(np.median(ours_med[0])) if i and prec == "exact" else None
                    summary: dict[str, Any] = {
                        "case": "summary/" + names[i],
                        "isa": isa,
                        "threads": thr,
                        "tokens": m,
                        "rounds": rounds,
                        "ours_ms_min_med_max": [float(o.min()), float(np.median(o)), float(o.max())],
                    }
                    text = f"ours {o.min():.3f}/{np.median(o):.3f}/{o.max():.3f}"
                    if i == 0 and anchor_med:
                        a = np.asarray(anchor_med)
                        r = a / o[: len(a)]
                        summary.update(
                            {
                                "anchor_ms_min_med_max": [float(a.min()), float(np.median(a)), float(a.max())],
                                "speedup_over_anchor_per_round": [round(float(v), 3) for v in r],
                                "speedup_over_anchor_of_medians": float(np.median(a) / np.median(o)),
                            }
                        )
                        text += (
                            f" | anchor {a.min():.3f}/{np.median(a):.3f}/{a.max():.3f} | ours faster by "
                            f"{np.median(a) / np.median(o):.2f}x (rounds {r.min():.2f}..{r.max():.2f})"
                        )
                    if ratio is not None:
                        summary["exact_over_fast_of_medians"] = ratio
                        text += f" | exact's time {ratio:.2f}x fast's (rounds interleaved)"
                    if rounds > 1 or anchor_med or ratio is not None:
                        rows.append(summary)
                        print(f"{'summary (ms/expert min/med/max)':<30}{isa:>8}{thr:>5}{m:>3}  {text}", flush=True)
    if args.json:
        env = {
            "cpu": _cpu_model(),
            "cores": len(usable_cpus()),
            "features": cpu_features(),
            "git": _git(),
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "experts_per_job": n_exp,
            "expert_bytes": expert_bytes,
            "hidden": hidden,
            "intermediate": inter,
            "bits": K,
        }
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
