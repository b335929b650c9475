"""Per-kernel timings of one staged batch at the 32k-chunk shape, over tile configurations, on the GPU.

One batch of 8 DeepSeek-V4.1-Flash experts (H=5120, I=2304, MUL1 K=3, random trellis, realistic suh/svh) in a
device staging slot, R rows routed to them (32768 tokens x top-6 / 48 batches = 4096 by default). Each kernel of
``TritonCompute._batch`` is timed alone (``triton.testing.do_bench``, median) for every candidate config, with
the bytes it must move and the HBM rate that implies, and the fastest config is printed (and written with
``--json``) so the defaults in ``TritonCompute`` can be set from measurements.

    python packages/dma-prefill/scripts/kernel_tune.py [--rows 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton.testing

from dma_prefill import V41_FLASH
from dma_prefill.layout import ExpertLayout
from dma_prefill.ops_torch import hadamard_pm1
from dma_prefill.triton_ops import decode_into, grouped_gemm, post_swiglu, row_hadamard, row_sumsq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="routed rows in the batch")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batches-per-layer", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    lay = ExpertLayout.build(V41_FLASH)
    B, R, T, H, I = args.experts, args.rows, args.tokens, V41_FLASH.hidden, V41_FLASH.intermediate
    slot = torch.randint(0, 256, (B * lay.stride + 4096,), dtype=torch.uint8, device=dev, generator=g)
    recs = slot[: B * lay.stride].view(B, lay.stride)
    for p in ("gate", "up", "down"):
        ps = V41_FLASH.proj(p)
        for name, n in (("suh", ps.k), ("svh", ps.n)):
            v = (torch.randint(0, 2, (B, n), device=dev, generator=g) * 2 - 1) * (
                torch.rand(B, n, device=dev, generator=g) + 0.5
            )
            v = v / math.sqrt(ps.k) if name == "suh" else v
            off = lay.offsets[(p, name)]
            recs[:, off : off + 2 * n].view(torch.float16).copy_(v.half())
    slot32, slot16 = slot.view(torch.int32), slot.view(torch.float16)
    s4, s2 = lay.stride // 4, lay.stride // 2
    counts = torch.full((B,), R // B, dtype=torch.int64, device=dev)
    grp = torch.arange(B, device=dev).repeat_interleave(R // B)
    tok = torch.randint(0, T, (R,), device=dev, generator=g)
    wts = torch.rand(R, device=dev, generator=g)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    hpm = hadamard_pm1(torch.float16, dev)
    w = {
        p: torch.empty((B, V41_FLASH.proj(p).k, V41_FLASH.proj(p).n), dtype=torch.float16, device=dev)
        for p in ("gate", "up", "down")
    }
    tiles_l = []
    bm = 128
    for e in range(B):
        for s in range(e * (R // B), (e + 1) * (R // B), bm):
            tiles_l.append((e, s, min(s + bm, (e + 1) * (R // B))))
    tiles = torch.tensor(tiles_l, dtype=torch.int32, device=dev)
    ss_in = torch.empty((2, R), device=dev)
    row_sumsq(x, H, R, grp, 0, ss_in, src=tok, vec=slot16, vec_stride=s2,
              pre_offs=(lay.elem_offset("gate", "suh", 2), lay.elem_offset("up", "suh", 2)))  # fmt: skip
    hi = torch.empty((R, H), dtype=torch.float16, device=dev)
    lo = torch.empty_like(hi)
    inv = torch.empty(R, device=dev)
    tg = torch.randn(R, I, device=dev, generator=g)
    tu = torch.randn(R, I, device=dev, generator=g)
    ss_gu = torch.stack([(tg * tg).sum(1), (tu * tu).sum(1)])
    act = torch.empty(R, I, device=dev)
    t = torch.randn(R, H, device=dev, generator=g)
    ss_t = (t * t).sum(1)
    out = torch.zeros(T, H, device=dev)
    results: dict[str, dict[str, float]] = {}
    nb = args.batches_per_layer

    def run(kernel: str, cfg: object, fn, nbytes: float = 0.0, flops: float = 0.0) -> None:
        """Time ``fn``; print ms per batch and layer with the HBM rate (``nbytes``) or tensor rate (``flops``)."""
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=40)
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            print(f"  {kernel:<22}{str(cfg):<22} failed: {type(exc).__name__}: {str(exc)[:80]}")
            return
        results.setdefault(kernel, {})[str(cfg)] = ms
        rate = f"{flops / ms / 1e9:>8.0f} TFLOP/s" if flops else f"{nbytes / ms / 1e6:>8.0f} GB/s"
        print(f"  {kernel:<22}{str(cfg):<22}{ms * 1e3:>9.1f} us/batch{ms * nb:>8.2f} ms/layer{rate}")

    print(f"# kernel_tune | {torch.cuda.get_device_name()} | R={R} rows, {B} experts, layer = {nb} batches")
    ps = V41_FLASH.proj("gate")
    dec_bytes = B * (ps.trellis_bytes + ps.k * ps.n * 2)
    for btn in (4, 8, 16):
        run("decode gate", btn, lambda btn=btn: decode_into(slot32, s4, lay.elem_offset("gate", "trellis", 4), counts, w["gate"],  # noqa: E501
                                                            ps.k, ps.n, ps.bits, ps.codebook, block_tn=btn), dec_bytes)  # fmt: skip  # noqa: E501
    for p in ("up", "down"):
        q = V41_FLASH.proj(p)
        decode_into(slot32, s4, lay.elem_offset(p, "trellis", 4), counts, w[p], q.k, q.n, q.bits, q.codebook)
    run("row_sumsq in (x2)", "-", lambda: row_sumsq(x, H, R, grp, 0, ss_in, src=tok, vec=slot16, vec_stride=s2,
        pre_offs=(lay.elem_offset("gate", "suh", 2), lay.elem_offset("up", "suh", 2))), R * H * 4)  # fmt: skip
    for c in [(64, 2, 4), (64, 4, 4), (64, 1, 4), (128, 2, 8), (32, 2, 4)]:
        run("transform in (gate)", c, lambda c=c: row_hadamard(
            x, H, R, grp, 0, hpm, ss_in[0], mode=0, src=tok, vec=slot16, vec_stride=s2,
            pre_off=lay.elem_offset("gate", "suh", 2), split=True, o_hi=hi, o_lo=lo, o_inv=inv,
            block_r=c[0], cpb=c[1], num_warps=c[2]), R * H * (2 + 2 + 4))  # fmt: skip
    for c in [(16, 4, 4), (16, 2, 4), (16, 8, 4), (32, 2, 4), (64, 2, 4), (16, 4, 2)]:
        run("post + swiglu", c, lambda c=c: post_swiglu(
            tg, tu, ss_gu, grp, 0, slot16, s2, (lay.elem_offset("gate", "svh", 2), lay.elem_offset("up", "svh", 2)),
            hpm, act, 10.0, block_r=c[0], cpb=c[1], num_warps=c[2]), R * I * 12)  # fmt: skip
    for c in [(64, 2, 4), (64, 4, 4), (32, 2, 4), (16, 4, 4)]:
        run("post + weighted add", c, lambda c=c: row_hadamard(
            t, H, R, grp, 0, hpm, ss_t, mode=2, vec=slot16, vec_stride=s2,
            post_off=lay.elem_offset("down", "svh", 2), out=out, w=wts, dst=tok,
            block_r=c[0], cpb=c[1], num_warps=c[2]), R * H * 8)  # fmt: skip
    tgo = torch.empty(R, I, device=dev)
    ssg = torch.zeros(R, device=dev)
    for c in [(128, 64, 8, 3), (128, 32, 8, 4), (128, 16, 8, 5), (64, 64, 4, 4)]:
        run(
            "gemm gate (split)",
            c,
            lambda c=c: grouped_gemm(
                hi, lo, inv, w["gate"], tiles, tgo, bm=bm, bn=c[0], bk=c[1], num_warps=c[2], num_stages=c[3], ss=ssg
            ),
            flops=2 * 2 * R * H * I,
        )  # fmt: skip  (hi + lo)
    best = {k: min(v, key=v.get) for k, v in results.items()}
    print("best:", best)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": R, "results": results, "best": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
