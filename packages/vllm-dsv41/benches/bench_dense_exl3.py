"""Dense EXL3 linears on the GPU: exllamav3's kernels against ours (Triton decode + GEMM), per V4.1-Flash shape.

    python packages/vllm-dsv41/benches/bench_dense_exl3.py [--rows 1,8,512] [--json out.json] [--quick]

For every dense V4.1-Flash matrix (attention, shared expert, indexer, Engram ``wkv``, head; bits as in the pack)
and every row count M, both backends run on the same random EXL3 tensor (inside a CUDA graph, so launch
overhead is not timed). Printed per row: time per call, ours / exllamav3 speed, the trellis read rate as a
fraction of the HBM copy rate measured in the same run (read + write bytes of a 2 GiB device copy), and each
backend's error against an exact float64 evaluation of the same EXL3 tensor (dma-prefill's bit-exact torch
decode + float64 Hadamards, the math of ``cpu_tier.exl3.linear``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

#: (name, k, n, bits): DeepSeek-V4.1-Flash's dense EXL3 matrices (reference-system.md section 10; the pack's
#: dense bits are 4, the head's 6).
SHAPES: list[tuple[str, int, int, float]] = [
    ("attn.wq_a", 5120, 1280, 4),
    ("attn.wkv", 5120, 512, 4),
    ("attn.wq_b", 1280, 32768, 4),
    ("attn.wo_b", 8192, 5120, 4),
    ("shared.w1|w3", 5120, 2304, 4),
    ("shared.w2", 2304, 5120, 4),
    ("indexer.wq_b", 1280, 4096, 4),
    ("engram.wkv", 6144, 25600, 4),
    ("head", 5120, 129280, 6),
]


def _tensor(k: int, n: int, bits: float, rng: np.random.Generator) -> Any:
    from cpu_tier.exl3 import Exl3Tensor

    words = int(16 * bits)
    trellis = rng.integers(-(1 << 15), 1 << 15, size=(k // 16, n // 16, words), dtype=np.int16)
    suh = (rng.choice([-1.0, 1.0], size=k) * rng.uniform(0.5, 1.5, size=k)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], size=n) * rng.uniform(0.002, 0.01, size=n)).astype(np.float16)
    return Exl3Tensor.from_arrays(trellis, suh, svh, "mul1")


def _exact(t: Any, x: torch.Tensor) -> torch.Tensor:
    """float64 ``H(H(x * suh) @ W_inner) * svh`` on the GPU (bit-exact decode), column chunks for big shapes."""
    from dma_prefill.ops_torch import decode_torch, hadamard_128_torch

    dev = x.device
    trellis = torch.from_numpy(t.trellis).to(dev)
    xh = hadamard_128_torch(x.double() * torch.from_numpy(t.suh).to(dev).double())
    cols = []
    step = max(16, (1 << 27) // t.k // 16 * 16)  # <= 128M weights decoded at a time
    for c0 in range(0, t.n, step):
        w = decode_torch(trellis[:, c0 // 16 : (c0 + step) // 16].contiguous(), "mul1").double()
        cols.append(xh @ w)
        del w
    y = hadamard_128_torch(torch.cat(cols, dim=1))
    return y * torch.from_numpy(t.svh).to(dev).double()


def _time(fn: Any, iters: int) -> float:
    """Seconds per call: median of 5 CUDA-graph replays of ``iters`` calls (eager if capture fails)."""
    fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    except Exception:  # noqa: BLE001 - fall back to eager launches
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(iters):
                fn()

    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(times)


def hbm_rate() -> float:
    """Device copy rate, bytes read + written per second (2 GiB copy)."""
    bufs = [torch.empty(1 << 31, dtype=torch.uint8, device="cuda") for _ in range(2)]
    t = _time(lambda: bufs[1].copy_(bufs[0]), 5)
    bufs.clear()
    return 2 * (1 << 31) / t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,512")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the first three shapes only")
    a = ap.parse_args(argv)
    from vllm_dsv41.dense import Exllamav3Kernel, TritonKernel, exllamav3_available

    if not exllamav3_available():
        print("exllamav3's CUDA extension does not import here: nothing to compare against", file=sys.stderr)
        return 2
    rows = [int(r) for r in a.rows.split(",")]
    dev = torch.device("cuda")
    hbm = hbm_rate()
    print(f"# {torch.cuda.get_device_name()}: HBM copy {hbm / 1e12:.2f} TB/s (read + write)", flush=True)
    out: list[dict[str, Any]] = []
    hdr = (f"{'matrix':<14}{'k x n @bits':>20}{'M':>5}{'exl3 us':>10}{'ours us':>10}{'ours/exl3':>10}"
           f"{'exl3 HBM':>10}{'ours HBM':>10}{'err exl3':>10}{'err ours':>10}")  # fmt: skip
    print(hdr, flush=True)
    rng = np.random.default_rng(0)
    for name, k, n, bits in SHAPES[:3] if a.quick else SHAPES:
        t0 = time.perf_counter()
        t = _tensor(k, n, bits, rng)
        kernels = {"exl3": Exllamav3Kernel(t, dev, name), "ours": TritonKernel(t, dev, name)}
        tb = t.trellis.nbytes
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = _exact(t, x.float())
            row: dict[str, Any] = {"matrix": name, "k": k, "n": n, "bits": bits, "rows": m, "trellis_bytes": tb}
            for key, kern in kernels.items():
                sec = _time(lambda kern=kern, x=x: kern(x), 20 if m <= 8 else 5)
                y = kern(x).double()
                err = float(torch.linalg.norm(y - ref) / torch.linalg.norm(ref))
                row[f"{key}_us"] = sec * 1e6
                row[f"{key}_hbm_frac"] = tb / sec / hbm
                row[f"{key}_err"] = err
            row["ours_over_exl3_speed"] = row["exl3_us"] / row["ours_us"]
            out.append(row)
            print(f"{name:<14}{f'{k}x{n} @{bits:g}':>20}{m:>5}{row['exl3_us']:>10.1f}{row['ours_us']:>10.1f}"
                  f"{row['ours_over_exl3_speed']:>10.2f}{row['exl3_hbm_frac']:>10.3f}{row['ours_hbm_frac']:>10.3f}"
                  f"{row['exl3_err']:>10.2e}{row['ours_err']:>10.2e}", flush=True)  # fmt: skip
            del ref
        del kernels
        torch.cuda.empty_cache()
        print(f"#   ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hbm_bytes_per_s": hbm, "device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
