"""The avx512 variant's kernel code, run with its AVX-512 intrinsics emulated in scalar C++ (csrc/emu512.h), so
hosts without AVX-512 (this project's CI) check its logic; on AVX-512 hosts the real variant runs every test of
test_cpu_tier_kernels.py and test_cpu_tier_moe.py as well."""

from __future__ import annotations

import numpy as np
import pytest

from cpu_tier import Picks, exl3
from cpu_tier._loader import load_emulated
from cpu_tier.testing import make_experts, ref_moe, rel_max, rel_rms

EMU = load_emulated()
pytestmark = pytest.mark.skipif(EMU is None, reason="_native_avx512emu not built (or no AVX2 on this host)")
CB_ID = {"3inst": 0, "mcg": 1, "mul1": 2}


@pytest.fixture(scope="module")
def rt():
    r = EMU.Runtime(2, [], 50)
    yield r
    r.close()


def _matmul(rt, x: np.ndarray, t: exl3.Exl3Tensor, fast: bool) -> np.ndarray:
    out = np.full((x.shape[0], t.n), np.nan, np.float32)
    bias = None if t.bias is None else t.bias.view(np.uint16)
    rt.matmul(x, t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), bias, CB_ID[t.codebook], fast, out)
    return out


def test_is_the_emulated_avx512_code() -> None:
    assert EMU.isa() == "avx512emu"


@pytest.mark.parametrize(("codebook", "bits"), [(cb, b) for cb in exl3.CODEBOOKS for b in exl3.SUPPORTED_BITS[cb]])
def test_matmul(rt, codebook: str, bits: float) -> None:
    rng = np.random.default_rng(int(bits * 100) + len(codebook))
    t = exl3.random_tensor(384, 384, bits, codebook, seed=rng, bias=bits == 2)  # type: ignore[arg-type]
    w = t.reconstruct().astype(np.float64)
    for m in (1, 3):
        x = rng.standard_normal((m, 384)).astype(np.float32)
        ref = x.astype(np.float64) @ w + (0 if t.bias is None else t.bias.astype(np.float64))
        assert rel_max(_matmul(rt, x, t, False), ref) <= 1e-5
        assert rel_rms(_matmul(rt, x, t, True), ref) <= 5e-3


def test_tokens_1_to_9(rt) -> None:
    rng = np.random.default_rng(1)
    for bits in (3, 1.5, 4, 5):
        t = exl3.random_tensor(256, 384, bits, "mul1", seed=rng)
        w = t.reconstruct().astype(np.float64)
        x = rng.standard_normal((9, 256)).astype(np.float32)
        for m in range(1, 10):
            ref = x[:m].astype(np.float64) @ w
            assert rel_rms(_matmul(rt, x[:m], t, True), ref) <= 5e-3, (bits, m)
            assert rel_max(_matmul(rt, x[:m], t, False), ref) <= 1e-5, (bits, m)


def test_moe(rt) -> None:
    experts = make_experts(3, 128, 256, 3, "mul1", seed=2)
    layer = EMU.Layer(128, 256, 10.0)
    for g, u, d in zip(*experts, strict=True):
        layer.add_expert(
            *(a for t in (g, u, d) for a in (t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, 2))
        )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    picks = Picks.from_topk(rng.integers(0, 3, (6, 2)), rng.random((6, 2)).astype(np.float32))
    ref = ref_moe(x, picks, experts, 10.0)
    for fast, slab_blocks in ((False, 0), (True, 0), (False, 1), (True, 1)):
        out = np.full((6, 128), np.nan, np.float32)
        job = rt.submit_moe(layer, x, picks.tokens, picks.experts, picks.weights, out, fast, 64, slab_blocks)
        assert job.wait(60.0) and not job.error()
        assert np.all(job.computed() == 1)
        if fast:
            assert rel_rms(out, ref) <= 5e-3
        else:
            assert rel_max(out, ref) <= 1e-5


@pytest.mark.parametrize("bits", [3, 6])
@pytest.mark.parametrize("codebook", ["mul1", "mcg"])
def test_prefetch_stays_inside_the_matrix(bits: int, codebook: str) -> None:
    """Every software prefetch of the band kernels (block and row kernels, int16 / AMX / 32-bit-lane / float, both
    work splits, every distance) lies inside its matrix's trellis (the emulated build checks and counts each one:
    a prefetch never faults, so nothing else would notice); distance 0 issues none; no distance changes a bit."""
    experts = make_experts(2, 256, 384, bits, codebook, seed=bits)
    layer = EMU.Layer(256, 384, 10.0)
    for g, u, d in zip(*experts, strict=True):
        layer.add_expert(
            *(
                a
                for t in (g, u, d)
                for a in (t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, CB_ID[codebook])
            )
        )
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    # expert 0: 8 tokens (AMX from amx_min_tokens=6), expert 1: 2 tokens
    picks = Picks(
        np.r_[np.arange(8), np.arange(2)].astype(np.int32),
        np.r_[np.zeros(8), np.ones(2)].astype(np.int32),
        rng.random(10).astype(np.float32),
    )
    EMU._emu_prefetch_stats()  # zero the counters
    for fast in (True, False):
        for slab_blocks in (0, 1):
            base = None
            for pfb in (0, 1, 2, 4):
                rt = EMU.Runtime(2, [], 50, amx=True, amx_min_tokens=6, prefetch_blocks=pfb)
                try:
                    out = np.full((9, 256), np.nan, np.float32)
                    job = rt.submit_moe(
                        layer, x, picks.tokens, picks.experts, picks.weights, out, fast, 64, slab_blocks
                    )
                    assert job.wait(60.0) and not job.error()
                finally:
                    rt.close()
                calls, outside = EMU._emu_prefetch_stats()
                assert outside == 0, (fast, slab_blocks, pfb, calls, outside)
                assert (calls == 0) == (pfb == 0), (fast, slab_blocks, pfb, calls)
                if base is None:
                    base = out
                np.testing.assert_array_equal(out, base)


@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4])
def test_int16_kernel_forms_agree(bits: float) -> None:
    """The AVX-512 int16 kernel's benchmark forms (1, 2: vpermt2b on the whole tile, reloaded / hoisted) compute the
    same integer sums as the default form (vpermb on an in-tile window): identical outputs, emulated here and natively
    where the host runs AVX-512."""
    from cpu_tier import runnable_isas
    from cpu_tier._loader import load

    mods = [EMU] + ([load("avx512")] if "avx512" in runnable_isas() else [])
    rng = np.random.default_rng(int(bits * 10))
    t = exl3.random_tensor(256, 256, bits, "mul1", seed=rng)
    w = t.reconstruct().astype(np.float64)
    for mod in mods:
        r = mod.Runtime(1, [], 50)
        try:
            for m in (1, 2, 3):
                x = np.ascontiguousarray(rng.standard_normal((m, 256)).astype(np.float32))
                outs = []
                for variant in (0, 1, 2):
                    out = np.full((m, 256), np.nan, np.float32)
                    r.matmul(x, t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, CB_ID["mul1"], True, out,
                             variant)  # fmt: skip
                    outs.append(out)
                assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2]), (mod.isa(), m)
                assert rel_rms(outs[0], x.astype(np.float64) @ w) <= 5e-3
        finally:
            r.close()


def _amx_modules() -> list:
    """The emulated module, and the real avx512 one where this host runs the "amx" variant."""
    from cpu_tier import runnable_isas
    from cpu_tier._loader import load

    return [EMU] + ([load("amx")] if "amx" in runnable_isas() else [])


@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4])
def test_amx_kernel_matches_int16_kernel(bits: float) -> None:
    """The AMX kernel (tile unit does the byte sums and activation products) sums the same int32 per block as the
    int16 kernel; only the float accumulation of the blocks differs. Every token count 1..9 (9 = two chunks), k a
    multiple of 128 but not 256, non-square."""
    rng = np.random.default_rng(int(bits * 10) + 7)
    t = exl3.random_tensor(384, 256, bits, "mul1", seed=rng)
    w = t.reconstruct().astype(np.float64)
    x = rng.standard_normal((9, 384)).astype(np.float32)
    x[2] *= 1e3  # a token with a very different scale
    for mod in _amx_modules():
        r_int16, r_amx = mod.Runtime(1, [], 50), mod.Runtime(2, [], 50, amx=True)
        assert r_amx.amx and not r_int16.amx
        try:
            for m in range(1, 10):
                xm = np.ascontiguousarray(x[:m])
                a, b = _matmul(r_int16, xm, t, True), _matmul(r_amx, xm, t, True)
                ref = xm.astype(np.float64) @ w
                assert rel_max(b, a) <= 1e-6, (mod.isa(), bits, m)
                assert rel_rms(b, ref) <= 5e-3, (mod.isa(), bits, m)
        finally:
            r_int16.close()
            r_amx.close()


def test_amx_moe_and_untouched_paths() -> None:
    """An MoE layer through the AMX runtime (integer path on AMX; the "exact" float path and K = 5 are unchanged)."""
    rng = np.random.default_rng(11)
    for mod in _amx_modules():
        rt = mod.Runtime(2, [], 50, amx=True)
        try:
            for bits in (3, 5):
                experts = make_experts(3, 128, 256, bits, "mul1", seed=bits)
                layer = mod.Layer(128, 256, 10.0)
                for g, u, d in zip(*experts, strict=True):
                    layer.add_expert(*(a for t in (g, u, d) for a in (t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, 2)))  # fmt: skip
                x = rng.standard_normal((6, 128)).astype(np.float32)
                picks = Picks.from_topk(rng.integers(0, 3, (6, 2)), rng.random((6, 2)).astype(np.float32))
                ref = ref_moe(x, picks, experts, 10.0)
                for fast, slab_blocks in ((True, 0), (True, 1), (False, 0)):
                    out = np.full((6, 128), np.nan, np.float32)
                    job = rt.submit_moe(
                        layer, x, picks.tokens, picks.experts, picks.weights, out, fast, 64, slab_blocks
                    )
                    assert job.wait(60.0) and not job.error()
                    assert (rel_rms(out, ref) <= 5e-3) if fast else (rel_max(out, ref) <= 1e-5), (mod.isa(), bits, fast)
        finally:
            rt.close()


def test_amx_min_tokens_threshold() -> None:
    """Chunks below amx_min_tokens run the int16 kernel, chunks at or above it the AMX kernel (the emulated tile
    product, broken on purpose, shows which one ran)."""
    t = exl3.random_tensor(256, 128, 3, "mul1", seed=8)
    x = np.random.default_rng(9).standard_normal((8, 256)).astype(np.float32)
    rt = EMU.Runtime(1, [], 50, amx=True, amx_min_tokens=4)
    assert rt.amx_min_tokens == 4
    try:
        for m in (1, 3, 4, 8):
            good = _matmul(rt, x[:m], t, True)
            EMU._emu_amx_fault(True)
            try:
                bad = _matmul(rt, x[:m], t, True)
            finally:
                EMU._emu_amx_fault(False)
            assert np.array_equal(good, bad) == (m < 4), m
    finally:
        rt.close()
    for bad_min in (0, 10):
        with pytest.raises(ValueError, match="amx_min_tokens"):
            EMU.Runtime(1, [], 50, amx=True, amx_min_tokens=bad_min)


def test_amx_kernel_really_runs() -> None:
    """A broken emulated tile product must change the result: proof that the runtime's amx flag reaches the kernel."""
    t = exl3.random_tensor(256, 128, 3, "mul1", seed=5)
    x = np.random.default_rng(6).standard_normal((2, 256)).astype(np.float32)
    r_amx = EMU.Runtime(1, [], 50, amx=True)
    try:
        good = _matmul(r_amx, x, t, True)
        EMU._emu_amx_fault(True)  # the emulated TDPBSUD then drops its last K group
        try:
            bad = _matmul(r_amx, x, t, True)
        finally:
            EMU._emu_amx_fault(False)
        assert not np.allclose(good, bad)
        assert np.array_equal(_matmul(r_amx, x, t, True), good)
    finally:
        r_amx.close()
