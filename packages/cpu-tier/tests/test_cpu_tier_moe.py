"""ExpertTier (MoE layers on the native kernels) against float64 references: every ISA variant the host runs,
1 and 2 threads, both precisions, SwiGLU clamps, asynchronous jobs, the timeout/cancel report, bad input, and no
read past the end (or before the start) of an expert's data."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from cpu_tier import CpuTierConfig, ExpertTier, Picks, exl3, runnable_isas
from cpu_tier.testing import make_experts, ref_moe, rel_max, rel_rms

ISAS = runnable_isas()


def _picks(rng: np.random.Generator, t: int, e: int, k: int) -> Picks:
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
    w = rng.uniform(0.05, 1.0, size=(t, k)).astype(np.float32)
    return Picks.from_topk(ids, w)


def _check(out: np.ndarray, ref: np.ndarray, precision: str) -> None:
    if precision == "exact":
        assert rel_max(out, ref) <= 1e-5, rel_max(out, ref)
    else:
        assert rel_rms(out, ref) <= 5e-3, rel_rms(out, ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_forward_matches_reference(small_experts, isa: str, threads: int, precision: str) -> None:
    rng = np.random.default_rng(threads * 10 + len(isa))
    t = 9
    x = (rng.standard_normal((t, 256)) * 4).astype(np.float32)
    picks = _picks(rng, t, 6, 3)
    # row 4 has no pick; row 0 picks expert 1 twice
    keep = picks.tokens != 4
    picks = Picks(picks.tokens[keep], picks.experts[keep], picks.weights[keep])
    picks.experts[0] = picks.experts[1] = 1
    cfg = CpuTierConfig(threads=threads, isa=isa, precision=precision)  # type: ignore[arg-type]
    with ExpertTier(cfg) as tier:
        for layer, limit in ((0, 10.0), (1, 0.25), (2, None)):
            tier.add_layer(layer, *small_experts, swiglu_limit="config" if layer == 0 else limit)
            out = np.full((t, 256), np.nan, np.float32)
            res = tier.forward(layer, x, picks, out)
            assert res is out
            assert np.all(out[4] == 0.0)
            _check(out, ref_moe(x, picks, small_experts, limit), precision)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("slab_blocks", [1, 2])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_row_slab_split_matches_reference(small_experts, isa: str, slab_blocks: int, precision: str) -> None:
    # H = 256 (2 blocks), I = 384 (3 blocks): 2 and 3 slabs of one block, or 1 and 2 slabs (the last one partial)
    rng = np.random.default_rng(slab_blocks * 7 + len(isa))
    t = 11
    x = (rng.standard_normal((t, 256)) * 4).astype(np.float32)
    picks = _picks(rng, t, 6, 3)
    picks.experts[:t] = 2  # expert 2 gets more than 8 tokens: two chunks
    cfg = CpuTierConfig(threads=2, isa=isa, precision=precision, slab_blocks=slab_blocks)  # type: ignore[arg-type]
    with ExpertTier(cfg) as tier:
        tier.add_layer(0, *small_experts)
        tier.add_layer(1, *small_experts, swiglu_limit=None)
        for layer, limit in ((0, 10.0), (1, None)):
            out = np.full((t, 256), np.nan, np.float32)
            tier.forward(layer, x, picks, out)
            _check(out, ref_moe(x, picks, small_experts, limit), precision)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_prefetch_distance_does_not_change_results(small_experts, isa: str, precision: str) -> None:
    # The software prefetch distance is a tuning knob: every distance gives the same bits, in both work splits
    # (the row-slab split also prefetches the next band's rows at the end of a call).
    rng = np.random.default_rng(len(isa) + len(precision))
    t = 10
    x = (rng.standard_normal((t, 256)) * 4).astype(np.float32)
    picks = _picks(rng, t, 6, 3)
    picks.experts[:t] = 2  # a chunk of 8 tokens and one of 2
    ref = ref_moe(x, picks, small_experts, 10.0)
    for slab_blocks in (0, 1):
        outs = []
        for pfb in (1, 0, 2, 3, 4):
            cfg = CpuTierConfig(
                threads=2,
                isa=isa,
                precision=precision,
                slab_blocks=slab_blocks,  # type: ignore[arg-type]
                prefetch_blocks=pfb,
            )
            with ExpertTier(cfg) as tier:
                tier.add_layer(0, *small_experts)
                outs.append(tier.forward(0, x, picks))
        _check(outs[0], ref, precision)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def test_clamp_follows_deepseek(small_experts) -> None:
    # Large activations: the clamp changes the result, and the gate is clamped before the silu.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 256)) * 50).astype(np.float32)
    picks = Picks(np.array([0, 1], np.int32), np.array([2, 3], np.int32), np.ones(2, np.float32))
    with ExpertTier(CpuTierConfig(threads=1, swiglu_limit=1.0)) as tier:
        tier.add_layer(0, *small_experts)
        tier.add_layer(1, *small_experts, swiglu_limit=None)
        clamped, free = tier.forward(0, x, picks), tier.forward(1, x, picks)
    assert rel_max(clamped, ref_moe(x, picks, small_experts, 1.0)) <= 1e-5
    assert rel_max(free, ref_moe(x, picks, small_experts, None)) <= 1e-5
    assert rel_rms(clamped, free.astype(np.float64)) > 0.1


@pytest.mark.parametrize("isa", ISAS)
def test_1_to_16_tokens_per_expert(small_experts, isa: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    with ExpertTier(CpuTierConfig(threads=2, isa=isa, precision="fast")) as tier:  # type: ignore[arg-type]
        tier.add_layer(0, *small_experts)
        for m in (1, 2, 5, 8, 9, 16):
            picks = Picks(
                np.arange(m, dtype=np.int32), np.full(m, 4, np.int32), rng.uniform(0.5, 1, m).astype(np.float32)
            )
            out = tier.forward(0, x[:m], picks)
            assert rel_rms(out, ref_moe(x[:m], picks, small_experts, 10.0)) <= 5e-3, m


def test_other_codebooks_and_mixed_k() -> None:
    gate, up, down = make_experts(2, 128, 256, 2, "mcg", seed=4)
    down[1] = exl3.random_tensor(256, 128, 4, "3inst", seed=5)  # per-expert K and codebook may differ
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    picks = _picks(rng, 3, 2, 2)
    for precision in ("exact", "fast"):
        with ExpertTier(CpuTierConfig(threads=2, precision=precision)) as tier:  # type: ignore[arg-type]
            tier.add_layer(5, gate, up, down)
            _check(tier.forward(5, x, picks), ref_moe(x, picks, (gate, up, down), 10.0), precision)


def test_auto_precision_follows_the_activation_dtype(small_experts) -> None:
    """The default precision ("auto") runs exact for float32 activations and fast for bf16/fp16 ones: the same
    bytes as the explicit choice."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    picks = _picks(rng, 3, 4, 2)
    outs = {}
    for name, cfg, dtype in (("exact", CpuTierConfig(threads=2, precision="exact"), "float32"),
                             ("fast", CpuTierConfig(threads=2, precision="fast"), "float32"),
                             ("auto-f32", CpuTierConfig(threads=2), "float32"),
                             ("auto-bf16", CpuTierConfig(threads=2), "bfloat16")):  # fmt: skip
        with ExpertTier(cfg, activation_dtype=dtype) as tier:
            tier.add_layer(0, *small_experts)
            outs[name] = (tier.precision, tier.forward(0, x, picks))
    assert outs["auto-f32"][0] == "exact" and outs["auto-bf16"][0] == "fast"
    assert not np.array_equal(outs["exact"][1], outs["fast"][1])  # the two arithmetics differ on this data
    assert np.array_equal(outs["auto-f32"][1], outs["exact"][1])
    assert np.array_equal(outs["auto-bf16"][1], outs["fast"][1])


def test_async_jobs(small_experts) -> None:
    rng = np.random.default_rng(4)
    with ExpertTier(CpuTierConfig(threads=2)) as tier:
        tier.add_layer(0, *small_experts)
        tier.add_layer(1, *small_experts, swiglu_limit=None)
        xs = [rng.standard_normal((5, 256)).astype(np.float32) for _ in range(4)]
        picks = [_picks(rng, 5, 6, 2) for _ in range(4)]
        t0 = time.perf_counter()
        jobs = [tier.submit(i % 2, xs[i], picks[i]) for i in range(4)]
        for i, job in enumerate(jobs):
            assert job.wait(timeout=60.0)
            assert job.done()
            # the pool's own run time of the job: positive, within the wall time since the first submit
            assert 0.0 < job.elapsed_s <= time.perf_counter() - t0
            assert job.missing().size == 0
            _check(job.result(), ref_moe(xs[i], picks[i], small_experts, 10.0 if i % 2 == 0 else None), "exact")


def test_timeout_reports_missing_picks() -> None:
    experts = make_experts(4, 256, 384, 3, "mul1", seed=8)
    rng = np.random.default_rng(5)
    t = 24
    x = rng.standard_normal((t, 256)).astype(np.float32)
    picks = _picks(rng, t, 4, 4)  # 96 picks, 12 chunks of 8
    ref_all = ref_moe(x, picks, experts, 10.0)
    for slab_blocks in (2, 1):  # the row-slab split reports the same way (slabs of 2 blocks: 1 + 2 slabs)
        with ExpertTier(CpuTierConfig(threads=2, slab_blocks=slab_blocks)) as tier:
            tier.add_layer(0, *experts)
            job = tier.submit(0, x, picks, _test_cancel_after_chunks=3)
            assert job.wait(60.0)
            missing = job.missing()
            assert 0 < missing.size < len(picks.tokens)
            done = np.setdiff1d(np.arange(len(picks.tokens)), missing)
            assert rel_max(job.out, ref_moe(x, picks, experts, 10.0, only=done)) <= 1e-5
    with ExpertTier(CpuTierConfig(threads=1, isa="scalar")) as tier:
        tier.add_layer(0, *experts)
        # A deterministic partial run: the job cancels itself once 3 chunks are complete.
        job = tier.submit(0, x, picks, _test_cancel_after_chunks=3)
        assert job.wait(60.0)
        missing = job.missing()
        assert 0 < missing.size < len(picks.tokens)
        done = np.setdiff1d(np.arange(len(picks.tokens)), missing)
        assert rel_max(job.out, ref_moe(x, picks, experts, 10.0, only=done)) <= 1e-5
        with pytest.raises(RuntimeError, match="not computed"):
            job.result()
        # The caller computes the rest elsewhere (here: a second job) and adds it.
        rest = Picks(picks.tokens[missing], picks.experts[missing], picks.weights[missing])
        total = job.out + tier.forward(0, x, rest)
        assert rel_max(total, ref_all) <= 1e-5
        # A real timeout: the scalar variant on one thread cannot finish this in 1 ms.
        job = tier.submit(0, x, picks)
        if not job.wait(timeout=0.001):
            with pytest.raises(RuntimeError, match="not complete"):
                job.result()
        missing = job.missing()  # cancels the unfinished job and waits for it to stop
        assert job.done()
        done = np.setdiff1d(np.arange(len(picks.tokens)), missing)
        if done.size:
            assert rel_max(job.out, ref_moe(x, picks, experts, 10.0, only=done)) <= 1e-5
        else:
            assert np.all(job.out == 0)


def test_torch_tensors(small_experts) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 256)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 2]])
    w = torch.rand(4, 2)
    picks = Picks.from_topk(ids, w)
    assert picks.tokens.dtype == np.int32 and picks.experts.dtype == np.int32 and picks.weights.dtype == np.float32
    out = torch.empty(4, 256)
    with ExpertTier(CpuTierConfig(threads=2)) as tier:
        tier.add_layer(0, *small_experts)
        tier.forward(0, x, picks, out=out)
    assert rel_max(out.numpy(), ref_moe(x.numpy(), picks, small_experts, 10.0)) <= 1e-5


def test_negative_ids_are_no_pick(small_experts) -> None:
    """vLLM marks the rows a CUDA graph pads a batch with by expert id -1: those picks are left out (their output
    rows stay zero) and the others are computed as without them."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    ids = np.array([[0, 1], [-1, -1], [4, -1], [1, 2]])
    w = rng.uniform(0.1, 1.0, (4, 2)).astype(np.float32)
    picks = Picks.from_topk(ids, w)
    assert picks.tokens.tolist() == [0, 0, 2, 3, 3] and picks.experts.tolist() == [0, 1, 4, 1, 2]
    np.testing.assert_array_equal(picks.weights, w.reshape(-1)[[0, 1, 4, 6, 7]])
    out = np.full((4, 256), np.nan, np.float32)
    with ExpertTier(CpuTierConfig(threads=2)) as tier:
        tier.add_layer(0, *small_experts)
        tier.forward(0, x, picks, out=out)
    assert np.all(out[1] == 0)
    assert rel_max(out, ref_moe(x, picks, small_experts, 10.0)) <= 1e-5


def test_bad_input(small_experts) -> None:
    gate, up, down = small_experts
    x = np.zeros((3, 256), np.float32)
    ok = Picks(np.array([0, 1], np.int32), np.array([0, 5], np.int32), np.ones(2, np.float32))
    with ExpertTier(CpuTierConfig(threads=1)) as tier:
        tier.add_layer(0, gate, up, down)
        with pytest.raises(ValueError, match="x: dtype must be float32, got float64"):
            tier.forward(0, x.astype(np.float64), ok)
        with pytest.raises(ValueError, match=r"x: shape must be \(T, 256\)"):
            tier.forward(0, np.zeros((3, 128), np.float32), ok)
        with pytest.raises(ValueError, match="x: must be C-contiguous"):
            tier.forward(0, np.zeros((512, 3), np.float32)[::2].T, ok)
        with pytest.raises(ValueError, match=r"picks.experts\[1\] = 6 is out of range \(layer 0 has 6 experts\)"):
            tier.forward(0, x, Picks(ok.tokens, np.array([0, 6], np.int32), ok.weights))
        with pytest.raises(ValueError, match=r"picks.experts\[0\] = -1 is out of range"):
            tier.forward(0, x, Picks(ok.tokens, np.array([-1, 0], np.int32), ok.weights))
        with pytest.raises(ValueError, match=r"picks.tokens\[1\] = 3 is out of range \(x has 3 rows\)"):
            tier.forward(0, x, Picks(np.array([0, 3], np.int32), ok.experts, ok.weights))
        with pytest.raises(ValueError, match="picks: tokens, experts and weights must have one length"):
            tier.forward(0, x, Picks(ok.tokens, ok.experts, np.ones(3, np.float32)))
        with pytest.raises(ValueError, match="picks.weights: must be floating point"):
            tier.forward(0, x, Picks(ok.tokens, ok.experts, np.ones(2, np.int32)))
        with pytest.raises(ValueError, match="picks.tokens: must be an integer array"):
            tier.forward(0, x, Picks(ok.tokens.astype(np.float32), ok.experts, ok.weights))
        with pytest.raises(ValueError, match="layer 7: not added"):
            tier.forward(7, x, ok)
        with pytest.raises(ValueError, match=r"out: shape must be \(3, 256\)"):
            tier.forward(0, x, ok, out=np.zeros((2, 256), np.float32))
        with pytest.raises(ValueError, match="out: must not overlap x"):
            tier.forward(0, x, ok, out=x)
        with pytest.raises(ValueError, match="layer 0: already added"):
            tier.add_layer(0, gate, up, down)
        with pytest.raises(ValueError, match="layer 1: up has 5 experts, gate has 6"):
            tier.add_layer(1, gate, up[:5], down)
        with pytest.raises(
            ValueError, match=r"layer 1 expert 2 down: shape \(k, n\) = \(256, 384\), expected \(384, 256\)"
        ):
            tier.add_layer(1, gate, up, down[:2] + [gate[2]] + down[3:])
        bad = exl3.Exl3Tensor.from_arrays(up[3].trellis[:, ::1, :][::1], up[3].suh, up[3].svh, "mul1")
        strided = exl3.Exl3Tensor(
            trellis=np.concatenate([bad.trellis, bad.trellis], axis=2)[:, :, ::2],
            suh=bad.suh,
            svh=bad.svh,
            bias=None,
            codebook="mul1",
            bits=3,
            k=256,
            n=384,
        )
        with pytest.raises(ValueError, match="layer 1 expert 3 up.trellis: must be C-contiguous"):
            tier.add_layer(1, gate, up[:3] + [strided] + up[4:], down)
        with pytest.raises(ValueError, match="swiglu_limit"):
            tier.add_layer(1, gate, up, down, swiglu_limit=-1.0)
    with pytest.raises(RuntimeError, match="closed"):
        tier.forward(0, x, ok)


_GUARD_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np
    from cpu_tier import CpuTierConfig, ExpertTier, Picks, exl3, exl3_matmul, runnable_isas
    from cpu_tier.testing import make_experts, ref_moe, rel_max, rel_rms

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    keep = []

    def guarded(a, at_end):
        # a copy of `a` flush against a PROT_NONE page: after its last byte (at_end) or before its first
        raw = a.view(np.uint8).reshape(-1)
        pages = (raw.size + PAGE - 1) // PAGE
        mm = mmap.mmap(-1, (pages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        for p in (0, pages + 1):
            assert libc.mprotect(base + p * PAGE, PAGE, 0) == 0, ctypes.get_errno()
        off = PAGE + (pages * PAGE - raw.size if at_end else 0)
        v = np.frombuffer(mm, dtype=np.uint8, count=raw.size, offset=off)
        v[:] = raw
        keep.append(mm)
        return v.view(a.dtype).reshape(a.shape)

    def guard_tensor(t, at_end):
        return exl3.Exl3Tensor.from_arrays(guarded(t.trellis, at_end), guarded(t.suh, at_end),
                                           guarded(t.svh, at_end), t.codebook)

    rng = np.random.default_rng(0)
    for bits, cb in ((3, "mul1"), (1, "mul1"), (1.5, "mul1"), (2, "mcg"), (8, "3inst"), (5, "mul1")):
        ex = make_experts(2, 128, 256, bits, cb, seed=int(bits * 10))
        g = tuple([guard_tensor(t, at_end=(i == 0)) for i, t in enumerate(p)] for p in ex)
        x = rng.standard_normal((9, 128)).astype(np.float32)
        for isa in runnable_isas():
            for prec in ("exact", "fast"):
                cfg = CpuTierConfig(threads=2, isa=isa, precision=prec)
                for m in (1, 3, 9):
                    y = exl3_matmul(x[:m], g[0][0], precision=prec, config=cfg)
                    ref = x[:m].astype(np.float64) @ ex[0][0].reconstruct().astype(np.float64)
                    assert rel_rms(y, ref) < 5e-3
                with ExpertTier(cfg) as tier:
                    tier.add_layer(0, *g)
                    for m in (1, 3, 9):
                        picks = Picks(np.concatenate([np.arange(m), np.arange(m)]).astype(np.int32),
                                      np.array([0] * m + [1] * m, np.int32), np.ones(2 * m, np.float32))
                        out = tier.forward(0, x[:m], picks)
                        assert rel_rms(out, ref_moe(x[:m], picks, ex, 10.0)) < 5e-3, (bits, isa, prec, m)
    print("guarded OK")
    """
)


def test_no_read_outside_expert_data() -> None:
    # Every expert array sits flush against a PROT_NONE page (after its end, or before its start); a kernel
    # that reads outside an expert's data kills the child process with SIGSEGV.
    r = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "guarded OK" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
