"""``cpu-tier`` command line: check and decode EXL3 tensors with the reference decoder.

cpu-tier selfcheck [--k 512 --n 384 --bits 3 --codebook mul1]
cpu-tier decode FILE.safetensors PREFIX [--out W.npy]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _selfcheck(args: argparse.Namespace) -> int:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from . import cpu_features, exl3

    feats = cpu_features()
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512vbmi") if feats[f]]
    print(f"host ISA: {' '.join(isa) or 'none of avx2/avx512'}")
    print("codebook RMS over all 65536 states (expected 3inst 1.243711, mcg 1.244112, mul1 1.000312):")
    states = np.arange(65536)
    for cb in exl3.CODEBOOKS:
        v = exl3.codebook_values(states, cb).astype(np.float64)
        print(f"  {cb:5s} rms {np.sqrt(np.mean(v * v)):.6f}  range [{v.min():+.4f}, {v.max():+.4f}]")
    failures = 0
    for cb in exl3.CODEBOOKS:
        t = exl3.random_tensor(args.k, args.n, args.bits if cb == "mul1" else round(args.bits), cb, seed=args.seed)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "t.safetensors"
            save_file(t.to_tensors("layers.0.ffn.experts.0.w1"), str(path))
            with safe_open(str(path), framework="numpy") as f:
                back = exl3.Exl3Tensor.from_safetensors(f, "layers.0.ffn.experts.0.w1")
        x = np.random.default_rng(args.seed).standard_normal((4, args.k)).astype(np.float32)
        t0 = time.perf_counter()
        y = back.linear(x)
        dt = time.perf_counter() - t0
        ref = x.astype(np.float64) @ back.reconstruct().astype(np.float64)
        err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
        ok = err < 1e-5 and np.array_equal(back.trellis, t.trellis)
        failures += not ok
        print(
            f"  {cb:5s} K={back.bits} {back.k}x{back.n}: safetensors round trip, linear vs x@W "
            f"max rel err {err:.2e} ({dt * 1e3:.1f} ms) {'OK' if ok else 'FAIL'}"
        )
    print("selfcheck", "passed" if failures == 0 else f"FAILED ({failures})")
    return 1 if failures else 0


def _decode(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from .exl3 import Exl3Tensor

    path = Path(args.file)
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    try:
        with safe_open(str(path), framework="numpy") as f:
            t = Exl3Tensor.from_safetensors(f, args.prefix)
    except ValueError as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    w = t.reconstruct()
    print(
        f"{args.prefix}: {t.codebook} K={t.bits} k={t.k} n={t.n} bias={'yes' if t.bias is not None else 'no'} "
        f"W rms {float(np.sqrt(np.mean(w.astype(np.float64) ** 2))):.4g}"
    )
    if args.out:
        np.save(args.out, w)
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="cpu-tier", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("selfcheck", help="decode random tensors of every codebook and check them")
    s.add_argument("--k", type=int, default=512)
    s.add_argument("--n", type=int, default=384)
    s.add_argument("--bits", type=float, default=3)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_selfcheck)
    d = sub.add_parser("decode", help="decode one EXL3 linear from a safetensors file")
    d.add_argument("file")
    d.add_argument("prefix", help="tensor name prefix, e.g. layers.0.ffn.experts.3.w1")
    d.add_argument("--out", help="save the original-basis W (float32, k x n) as .npy")
    d.set_defaults(fn=_decode)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
