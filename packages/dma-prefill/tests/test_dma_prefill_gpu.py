"""GPU checks (run on the device machine through scripts/run_gpu.sh): Triton decode bit-exactness, GEMM error
bounds, KL on a synthetic stack, the ring on real CUDA streams, and the registered + mapped host store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_tier import exl3
from dma_prefill import DmaPrefill, HostExpertStore, LayerSpec, PrefillConfig, PrefillPlan, StoreConfig
from dma_prefill.reference import (
    SyntheticStack,
    fill_random,
    kl_divergence,
    per_expert_errors,
    reference_moe,
    run_stack,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [(cb, k) for cb in exl3.CODEBOOKS for k in exl3.SUPPORTED_BITS[cb]]


def _report(name: str, value: object) -> None:
    print(f"\nREPORT {name} = {value}")


@pytest.mark.parametrize(("codebook", "bits"), CASES)
def test_triton_decode_bit_exact(codebook: str, bits: float) -> None:
    from dma_prefill.triton_ops import decode_triton

    t = exl3.random_tensor(256, 640, bits, codebook, seed=int(bits * 10) + len(codebook))
    got = decode_triton(torch.from_numpy(t.trellis).cuda(), codebook).cpu().numpy()
    ref = exl3.decode(t.trellis, codebook)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "block_tn"), [(2304, 16), (512, 16), (384, 8)])
def test_triton_group_decode_bit_exact(bits: int, n: int, block_tn: int) -> None:
    """The group decode's inline PTX (MUL1 at integer K, whole bands; n = 640 above takes the per-element one)."""
    from dma_prefill.triton_ops import decode_into, group_decode_fits

    assert group_decode_fits(bits, "mul1") and (n // 16) % block_tn == 0
    t = exl3.random_tensor(256, n, bits, "mul1", seed=bits * 1000 + n)
    src = torch.from_numpy(t.trellis).cuda().contiguous().view(-1).view(torch.int32)
    out = torch.full((1, 256, n), 7.0, dtype=torch.float16, device="cuda")
    counts = torch.ones(1, dtype=torch.int64, device="cuda")
    decode_into(src, 0, 0, counts, out, 256, n, bits, "mul1", block_tn=block_tn)
    np.testing.assert_array_equal(out[0].cpu().numpy().view(np.uint16), exl3.decode(t.trellis, "mul1").view(np.uint16))


def test_registered_store_and_zero_copy_decode() -> None:
    from dma_prefill.triton_ops import decode_into

    spec = LayerSpec(6, 256, 384, bits=(3, 2, 4), codebooks=("mul1", "mcg", "3inst"))
    with HostExpertStore({7: spec}, StoreConfig(progress=False)) as store:
        assert store.is_registered(7)
        fill_random(store, seed=4)
        dv = store.device_view(7)
        assert dv.is_cuda and dv.numel() == store.allocated_bytes(7)
        assert torch.equal(dv.cpu(), store.buffer(7))  # the mapped view reads the host bytes
        table = store.address_table(7, device=True)
        assert table[0, 0, 0] == dv.data_ptr()
        lay = store.layout(7)
        src32 = dv[: store.nbytes(7)].view(torch.int32)
        for p in ("gate", "up", "down"):
            ps = spec.proj(p)
            out = torch.empty((6, ps.k, ps.n), dtype=torch.float16, device="cuda")
            counts = torch.ones(6, dtype=torch.int64, device="cuda")
            decode_into(
                src32, lay.stride // 4, lay.elem_offset(p, "trellis", 4), counts, out, ps.k, ps.n, ps.bits, ps.codebook
            )
            for e in range(6):
                ref = exl3.decode(store.numpy(7, e, p, "trellis"), ps.codebook)
                np.testing.assert_array_equal(out[e].cpu().numpy().view(np.uint16), ref.view(np.uint16))


@pytest.fixture(scope="module")
def gpu_stack() -> SyntheticStack:
    spec = LayerSpec(num_experts=16, hidden=512, intermediate=256)
    return SyntheticStack.build(num_layers=3, spec=spec, top_k=4, seed=21, use_cuda=True)


def _pf(stack: SyntheticStack, exact: bool, **kw) -> DmaPrefill:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, exact=exact, backend="triton")
    return DmaPrefill(stack.store, cfg, **kw)


def _exact_errors_with(stack: SyntheticStack, **compute_attrs: object) -> dict[str, np.ndarray]:
    """``per_expert_errors`` of the exact path (layer 0, the error-bound test's rows) with ``TritonCompute``'s
    class attributes temporarily set to ``compute_attrs``."""
    from dma_prefill.triton_compute import TritonCompute

    saved = {k: getattr(TritonCompute, k) for k in compute_attrs}
    for k, v in compute_attrs.items():
        setattr(TritonCompute, k, v)
    try:
        x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(2)).cuda()
        return per_expert_errors(stack.store, 0, _pf(stack, True), x, seed=3)
    finally:
        for k, v in saved.items():
            setattr(TritonCompute, k, v)


def test_gemm_error_bounds_per_expert(gpu_stack: SyntheticStack) -> None:
    x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(2)).cuda()
    exact = _exact_errors_with(gpu_stack)
    fp16 = per_expert_errors(gpu_stack.store, 0, _pf(gpu_stack, False), x, seed=3)
    _report("per-expert max rel err, exact path (max over experts)", f"{exact['ours'].max():.3e}")
    _report("per-expert max rel err, plain fp32 evaluation, BLAS order (yardstick)", f"{exact['fp32'].max():.3e}")
    _report("per-expert max rel err, plain fp32 evaluation, sequential k order", f"{exact['fp32_seq'].max():.3e}")
    _report("per-expert max rel err, fp16-activation path", f"{fp16['ours'].max():.3e}")
    assert exact["ours"].max() < 4 * exact["fp32"].max() + 1e-7
    assert exact["ours"].max() < 5e-6
    # the default path (fp32-butterfly Hadamards) sits inside the spread of fp32 evaluation orders
    assert exact["ours"].max() <= 1.25 * max(exact["fp32"].max(), exact["fp32_seq"].max())
    assert fp16["ours"].max() > 10 * exact["ours"].max()


@pytest.mark.parametrize("bk", [16, 32, 64])
def test_gemm_promotion_granularity(gpu_stack: SyntheticStack, bk: int) -> None:
    """Error of the exact path against how often the tensor-core partial sums are promoted (every BK)."""
    from dma_prefill.triton_compute import TritonCompute

    configs = {bm: (c[0], bk, c[2], c[3]) for bm, c in TritonCompute.gemm_configs.items()}
    err = _exact_errors_with(gpu_stack, gemm_configs=configs)
    _report(f"per-expert max rel err, exact path, promotion every {bk}", f"{err['ours'].max():.3e}")
    assert err["ours"].max() < 5e-6


def test_fwht_per_expert_error(gpu_stack: SyntheticStack) -> None:
    """The exact path with the other Hadamard than the default (fp32 butterflies vs tensor cores)."""
    from dma_prefill.triton_compute import TritonCompute

    err = _exact_errors_with(gpu_stack, fwht=not TritonCompute.fwht)
    _report(f"per-expert max rel err, exact path, fwht={not TritonCompute.fwht}", f"{err['ours'].max():.3e}")
    _report("per-expert max rel err, fp32 BLAS / sequential", f"{err['fp32'].max():.3e} / {err['fp32_seq'].max():.3e}")
    assert err["ours"].max() < 5e-6


def test_stack_kl_on_gpu(gpu_stack: SyntheticStack) -> None:
    h0 = gpu_stack.embed(256, seed=7)
    ref = gpu_stack.reference_logits(h0)
    kl = kl_divergence(ref, run_stack(gpu_stack, _pf(gpu_stack, True), h0, device="cuda").cpu())
    kl16 = kl_divergence(ref, run_stack(gpu_stack, _pf(gpu_stack, False), h0, device="cuda").cpu())
    _report("stack KL exact path (mean, max)", f"{kl.mean():.3e}, {kl.max():.3e}")
    _report("stack KL fp16-activation path (mean, max)", f"{kl16.mean():.3e}, {kl16.max():.3e}")
    assert float(kl.mean()) < 1e-9
    assert float(kl16.mean()) > float(kl.mean())


def test_ring_on_real_streams(gpu_stack: SyntheticStack, make_routing) -> None:
    pf = _pf(gpu_stack, True, timing=True)
    T = 300
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, 512, generator=g).cuda()
    routes, weights = zip(*(make_routing(T, 16, 4, seed=9 + i) for i in range(3)), strict=True)
    torch.cuda.synchronize()
    pf.start_window()
    outs = []
    for i, lid in enumerate([0, 1, 2]):
        plan = PrefillPlan.build(routes[i].cuda(), weights[i].cuda(), 16, 4)
        outs.append(pf.run_layer(lid, x, plan, next_layer=lid + 1 if lid < 2 else None))
    st = pf.stats()
    for lid, out in enumerate(outs):
        ref = reference_moe(gpu_stack.store, lid, x, routes[lid], weights[lid])
        assert float((out.cpu().double() - ref).abs().max() / ref.abs().max()) < 5e-6
    done = pf.compute.computed
    assert len(done) == len(set(done)) == 48  # 16 experts x 3 layers, each once
    assert [s.slot for s in pf.ring.history] == [i % 2 for i in range(12)]
    assert st.batches == 12 and st.layers == 3
    assert st.bytes_copied == 48 * gpu_stack.store.layout(0).stride
    assert 0 < st.copy_fraction <= 1 and 0 < st.compute_fraction <= 1
    _report(
        "small ring copy GB/s, copy fraction, compute fraction",
        f"{st.copy_gbps:.1f}, {st.copy_fraction:.2f}, {st.compute_fraction:.2f}",
    )


def test_swiglu_limit_on_gpu(gpu_stack: SyntheticStack, make_routing) -> None:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="triton", swiglu_limit=0.3)
    pf = DmaPrefill(gpu_stack.store, cfg)
    x = torch.randn(200, 512, generator=torch.Generator().manual_seed(13))
    ids, w = make_routing(200, 16, 4, seed=13)
    out = pf.run_layer(2, x.cuda(), PrefillPlan.build(ids.cuda(), w.cuda(), 16, 4))
    ref = reference_moe(gpu_stack.store, 2, x, ids, w, limit=0.3)
    unclamped = reference_moe(gpu_stack.store, 2, x, ids, w)
    assert float((ref - unclamped).abs().max()) > 1e-2  # the limit really bites
    assert float((out.cpu().double() - ref).abs().max() / ref.abs().max()) < 5e-6


def test_cpu_tier_tail_on_cuda(gpu_stack: SyntheticStack, make_routing) -> None:
    """Hybrid step on real streams: the tail's rows go to pinned host memory on a side stream, the native CPU
    tier computes them from the registered store while the GPU computes the other batches."""
    from cpu_tier import CpuTierConfig, ExpertTier
    from dma_prefill import CpuTierTail

    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, backend="triton", cpu_tail_batches=2)
    pf = DmaPrefill(gpu_stack.store, cfg)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(17))
    ids, w = make_routing(300, 16, 4, seed=17)
    plan = PrefillPlan.build(ids.cuda(), w.cuda(), 16, 4, cpu_tail_batches=2)
    assert plan.cpu_batches == (2, 3)
    with ExpertTier(CpuTierConfig(threads=4, precision="exact", swiglu_limit=None)) as tier:
        tail = CpuTierTail(gpu_stack.store, tier, swiglu_limit=None, layers=(1,))
        out = pf.run_layer(1, x.cuda(), plan, cpu_tail=tail)
        torch.cuda.synchronize()
    ref = reference_moe(gpu_stack.store, 1, x, ids, w)
    assert float((out.cpu().double() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert {e for _, e in pf.compute.computed} == set(range(8))


def test_stage_errors_report(gpu_stack: SyntheticStack) -> None:
    """Where the exact path's error comes from: each stage of one linear (input transform, GEMM, output
    transform) against float64 on the stage's own input, beside a plain fp32 evaluation of the same stage,
    with the variants (fp32 butterflies for the Hadamard; the lo products accumulated apart in the GEMM)."""
    from dma_prefill.ops_torch import hadamard_128_torch, hadamard_pm1
    from dma_prefill.triton_ops import grouped_gemm, row_hadamard, row_sumsq

    store = gpu_stack.store
    suh = store.tensor(0, 0, "gate", "suh").cuda()
    svh = store.tensor(0, 0, "gate", "svh").cuda()
    W = torch.from_numpy(exl3.decode(store.numpy(0, 0, "gate", "trellis"), "mul1")).cuda()
    K, N = W.shape
    R = 256
    x = torch.randn(R, K, generator=torch.Generator().manual_seed(4)).cuda()
    vec = torch.cat([suh, svh]).contiguous()
    grp = torch.zeros(R, dtype=torch.int64, device="cuda")
    hpm = hadamard_pm1(torch.float16, "cuda")

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.double() - ref).abs().max() / ref.abs().max())

    ss = torch.empty(1, R, device="cuda")
    row_sumsq(x, K, R, grp, 0, ss, vec=vec, vec_stride=0, pre_offs=(0,))
    ref_a = hadamard_128_torch(x.double() * suh.double())
    errs: dict[str, float] = {"in fp32": rel(hadamard_128_torch(x * suh.float()), ref_a)}
    split = {}
    for fwht in (False, True):
        hi = torch.empty(R, K, dtype=torch.float16, device="cuda")
        lo = torch.empty_like(hi)
        inv = torch.empty(R, device="cuda")
        row_hadamard(x, K, R, grp, 0, hpm, ss[0], mode=0, vec=vec, vec_stride=0, pre_off=0, o_hi=hi, o_lo=lo,
                     o_inv=inv, fwht=fwht)  # fmt: skip
        errs[f"in ours fwht={fwht}"] = rel((hi.double() + lo.double()) * inv.double()[:, None], ref_a)
        split[fwht] = (hi, lo, inv)
    hi, lo, inv = split[False]
    tiles = torch.tensor([(0, s, min(s + 64, R)) for s in range(0, R, 64)], dtype=torch.int32, device="cuda")
    ref_g = ((hi.double() + lo.double()) @ W.double()) * inv.double()[:, None]
    a32 = (hi.float() + lo.float()) * inv[:, None]
    errs["gemm fp32"] = rel(a32 @ W.float(), ref_g)
    t = None
    for promote, lo_acc in ((True, False), (True, True), (False, False)):
        out = torch.empty(R, N, device="cuda")
        grouped_gemm(hi, lo, inv, W[None].contiguous(), tiles, out, bm=64, promote=promote, lo_acc=lo_acc)
        errs[f"gemm ours promote={promote} lo_acc={lo_acc}"] = rel(out, ref_g)
        t = out if t is None else t
    ref_o = hadamard_128_torch(t.double()) * svh.double()
    errs["out fp32"] = rel(hadamard_128_torch(t) * svh.float(), ref_o)
    sst = (t.double() ** 2).sum(1).float()
    for fwht in (False, True):
        o = torch.empty(R, N, device="cuda")
        row_hadamard(t, N, R, grp, 0, hpm, sst, mode=1, vec=vec, vec_stride=0, post_off=K, out=o, fwht=fwht)
        errs[f"out ours fwht={fwht}"] = rel(o, ref_o)
    for k, v in errs.items():
        _report(f"stage error {k}", f"{v:.3e}")
    assert max(errs.values()) < 1e-5
