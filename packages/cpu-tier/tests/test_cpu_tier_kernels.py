"""exl3_matmul (the native kernels) against cpu_tier.exl3 on fresh random tensors, for every ISA variant the host
runs: every codebook and supported K, m = 1..16, shapes whose k and n are multiples of 128 but not of 256."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from cpu_tier.testing import rel_max, rel_rms

from cpu_tier import CpuTierConfig, exl3, exl3_matmul, runnable_isas, selected_isa
from cpu_tier._loader import REQUIRED, missing_features

ISAS = runnable_isas()
CASES = [(cb, b) for cb in exl3.CODEBOOKS for b in exl3.SUPPORTED_BITS[cb]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("codebook", "bits"), CASES)
def test_every_codebook_and_k(isa: str, codebook: str, bits: float) -> None:
    rng = np.random.default_rng(abs(hash((isa, codebook, bits))) % 2**32)
    t = exl3.random_tensor(384, 640, bits, codebook, seed=rng, bias=bits == 3)  # type: ignore[arg-type]
    for m in (1, 3):
        x = (rng.standard_normal((m, 384)) * rng.uniform(0.1, 10)).astype(np.float32)
        ref = x.astype(np.float64) @ t.reconstruct().astype(np.float64)
        if t.bias is not None:
            ref = ref + t.bias.astype(np.float64)
        cfg = CpuTierConfig(threads=1, isa=isa)  # type: ignore[arg-type]
        exact = exl3_matmul(x, t, precision="exact", config=cfg)
        assert exact.dtype == np.float32 and exact.shape == (m, 640)
        assert rel_max(exact, ref) <= 1e-5, (m, rel_max(exact, ref))
        fast = exl3_matmul(x, t, precision="fast", config=cfg)
        assert rel_rms(fast, ref) <= 5e-3, (m, rel_rms(fast, ref))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("codebook", "bits"), [("mul1", 3), ("mul1", 2.5), ("mcg", 3), ("3inst", 2), ("mul1", 5)])
def test_tokens_1_to_16(isa: str, codebook: str, bits: float) -> None:
    rng = np.random.default_rng(5)
    t = exl3.random_tensor(640, 384, bits, codebook, seed=rng)  # type: ignore[arg-type]
    w = t.reconstruct().astype(np.float64)
    x = rng.standard_normal((16, 640)).astype(np.float32)
    x[3] *= 100.0  # rows of very different scales in one chunk
    x[5] *= 1e-3
    cfg = CpuTierConfig(threads=2, isa=isa)  # type: ignore[arg-type]
    for m in range(1, 17):
        ref = x[:m].astype(np.float64) @ w
        exact = exl3_matmul(x[:m], t, config=cfg)
        fast = exl3_matmul(x[:m], t, precision="fast", config=cfg)
        for i in range(m):  # each row on its own scale
            assert rel_max(exact[i : i + 1], ref[i : i + 1]) <= 1e-5, (m, i)
            assert rel_rms(fast[i : i + 1], ref[i : i + 1]) <= 5e-3, (m, i)


def test_variants_agree_bit_for_bit_where_exact_arithmetic_allows() -> None:
    # The integer path sums exactly; all variants quantise identically, so their "fast" MUL1 results differ
    # only by fp32 summation order. Exact mode likewise.
    if len(ISAS) < 2:
        pytest.skip("one ISA variant on this host")
    rng = np.random.default_rng(9)
    t = exl3.random_tensor(512, 256, 3, "mul1", seed=rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    outs = [exl3_matmul(x, t, precision="fast", config=CpuTierConfig(threads=1, isa=i)) for i in ISAS]  # type: ignore[arg-type]
    for o in outs[1:]:
        assert rel_max(o, outs[0].astype(np.float64)) <= 2e-6


def test_exact_kernels_of_avx2_and_avx512_are_one_arithmetic() -> None:
    """Both families' exact MUL1 kernels at K = 3 (band_exact_mul1) round by the same offset split and sum in the same
    order (per lane, slot and tile row; the offset out per row) up to 3 tokens: their outputs are equal bit for bit.
    The AVX-512 side is the hardware variant where the host runs it, and the emulated module (its kernel code with
    scalar intrinsics) where that is built, so AVX2-only machines check it too."""
    from cpu_tier._loader import load_emulated

    if "avx2" not in ISAS:
        pytest.skip("needs the avx2 variant")
    emu = load_emulated()
    if "avx512" not in ISAS and emu is None:
        pytest.skip("neither the avx512 variant nor the emulated module")
    rng = np.random.default_rng(23)
    t = exl3.random_tensor(1024, 768, 3, "mul1", seed=rng)
    rt = emu.Runtime(1, [], 50) if emu is not None else None
    try:
        for m in (1, 2, 3):
            x = rng.standard_normal((m, 1024)).astype(np.float32)
            a = exl3_matmul(x, t, precision="exact", config=CpuTierConfig(threads=1, isa="avx2"))
            if "avx512" in ISAS:
                b = exl3_matmul(x, t, precision="exact", config=CpuTierConfig(threads=1, isa="avx512"))
                assert np.array_equal(a, b), (m, float(np.abs(a - b).max()))
            if rt is not None:
                e = np.empty((m, 768), np.float32)
                rt.matmul(x, t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, 2, False, e)
                assert np.array_equal(a, e), (m, float(np.abs(a - e).max()))
    finally:
        if rt is not None:
            rt.close()


def test_isa_selection() -> None:
    runnable = runnable_isas()
    assert runnable[-1] == "scalar"
    assert selected_isa() == runnable[0] == selected_isa(CpuTierConfig(isa="auto"))
    for isa in REQUIRED:
        missing = missing_features(isa)
        if missing:
            with pytest.raises(ValueError, match=f"cannot run the '{isa}' kernels.*{missing[0]}"):
                selected_isa(CpuTierConfig(isa=isa))  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=missing[0]):
                exl3_matmul(
                    np.zeros((1, 128), np.float32),
                    exl3.random_tensor(128, 128, 2, "mul1"),
                    config=CpuTierConfig(isa=isa),
                )  # type: ignore[arg-type]
            assert f"cpu_tier._native_{isa}" not in sys.modules  # never loaded
        else:
            assert selected_isa(CpuTierConfig(isa=isa)) == isa  # type: ignore[arg-type]


def test_amx_needs_a_build_with_amx_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AMX host, "amx" is runnable only if the avx512 module was built with its AMX kernels."""
    import types

    import cpu_tier
    from cpu_tier import _loader

    every = {f: True for feats in REQUIRED.values() for f in feats}
    monkeypatch.setattr(cpu_tier, "cpu_features", lambda: every)
    for built in (False, True):
        fake = types.SimpleNamespace(has_amx_kernels=lambda built=built: built)
        monkeypatch.setattr(_loader, "load", lambda isa="auto", fake=fake: fake)
        missing = _loader.missing_features("amx")
        assert (missing == []) if built else (missing and "amx kernels" in missing[0]), (built, missing)
        assert ("amx" in _loader.runnable_isas()) == built


def test_matmul_bad_input() -> None:
    t = exl3.random_tensor(256, 128, 3, "mul1", seed=1)
    x = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match="x: dtype must be float32, got float64"):
        exl3_matmul(x.astype(np.float64), t)
    with pytest.raises(ValueError, match=r"x: shape must be \(T, 256\), got \(2, 128\)"):
        exl3_matmul(x[:, :128].copy(), t)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        exl3_matmul(np.ones((256, 2), np.float32).T, t)
    with pytest.raises(ValueError, match="precision"):
        exl3_matmul(x, t, precision="medium")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor: expected an Exl3Tensor"):
        exl3_matmul(x, t.trellis)  # type: ignore[arg-type]
    assert exl3_matmul(np.zeros((0, 256), np.float32), t).shape == (0, 128)


def test_matmul_accepts_torch() -> None:
    torch = pytest.importorskip("torch")
    t = exl3.random_tensor(256, 128, 4, "mcg", seed=2)
    x = torch.randn(3, 256)
    y = exl3_matmul(x, t)
    assert rel_max(y, x.numpy().astype(np.float64) @ t.reconstruct().astype(np.float64)) <= 1e-5
    with pytest.raises(ValueError, match="x: dtype must be float32"):
        exl3_matmul(x.double(), t)
    with pytest.raises(ValueError, match="x: cannot view"):
        exl3_matmul(x.bfloat16(), t)


def test_native_state_extraction_matches_reference() -> None:
    # The kernels' scalar state extraction (tables.h) against the numpy bit-level reference, every K.
    from cpu_tier import _loader

    mod = _loader.load("scalar")
    rng = np.random.default_rng(3)
    for bits in exl3.SUPPORTED_BITS["mul1"]:
        tile = rng.integers(-32768, 32768, size=(int(16 * bits),), dtype=np.int16)
        want = exl3.trellis_states(tile[None, :])[0]
        got = mod.tile_states(tile.view(np.uint8), int(2 * bits))
        assert np.array_equal(got, want), bits


def _constant_state_tensor(k: int, n: int, seed: int) -> exl3.Exl3Tensor:
    """A K = 3 MUL1 tensor whose every state is 0xB6DB, byte sum 724 (the largest among the constant streams): the
    stream repeats 011 (a 3-bit period, so every 16-bit window, which starts at a bit = 2 mod 3, reads 1011011...)."""
    bits = np.tile(np.array([0, 1, 1], np.uint32), 256)  # 768 stream bits of one tile
    words = (bits.reshape(24, 32) << np.arange(31, -1, -1, dtype=np.uint32)).sum(1).astype(np.uint32)
    trellis = np.broadcast_to(words.view(np.int16), (k // 16, n // 16, 48)).copy()
    rnd = exl3.random_tensor(k, n, 3, "mul1", seed=seed)
    return exl3.Exl3Tensor.from_arrays(trellis, rnd.suh, rnd.svh, "mul1")


@pytest.mark.parametrize("isa", [*ISAS, "avx512emu"])
def test_fast_path_int32_sums_do_not_overflow(isa: str) -> None:
    """The integer path's worst case: every prepared activation of a block equal to +XQ_MAX (x * suh is one spike at
    the block's first input: the Hadamard spreads it evenly) times weights whose byte sums are all 724. A block's
    128 rows sum to 128 * 724 * 32639 = 3.0e9 > 2^31 in one column: a kernel must split each column's rows over
    several int32 lanes (each kernel's lanes hold at most 64 rows: <= 64 * 1005 * 32639 < 2^31)."""
    from cpu_tier._loader import load_emulated

    t = _constant_state_tensor(256, 256, seed=1)
    states = exl3.trellis_states(t.trellis)
    assert (states == 0xB6DB).all()
    x = np.zeros((2, 256), np.float32)
    x[0, 0], x[0, 128] = 1.0 / float(t.suh[0]), 1.0 / float(t.suh[128])  # block-wise spikes: equal activations
    x[1, 0], x[1, 128] = -2.0 / float(t.suh[0]), 0.5 / float(t.suh[128])  # negative ones too
    ref = x.astype(np.float64) @ t.reconstruct().astype(np.float64)
    if isa == "avx512emu":
        mod = load_emulated()
        if mod is None:
            pytest.skip("the emulated AVX-512 module is not built")
        rt = mod.Runtime(1, [], 50)
        try:
            out = np.empty((2, 256), np.float32)
            rt.matmul(x, t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), None, 2, True, out)
        finally:
            rt.close()
    else:
        out = exl3_matmul(x, t, precision="fast", config=CpuTierConfig(threads=1, isa=isa))  # type: ignore[arg-type]
    for i in range(2):
        assert rel_rms(out[i : i + 1], ref[i : i + 1]) <= 5e-3, (isa, i)


@pytest.mark.parametrize("isa", ISAS + ["avx512emu"])
def test_exact_codebook_values_bit_for_bit(isa: str) -> None:
    # Each variant's float path rounds its decoded values to fp16 its own way (AVX2: Veltkamp's split, AVX-512: the
    # F16C conversion in the generic loop, scalar: integer rounding): every one of the 65,536 states, every codebook,
    # bit for bit.
    from cpu_tier import _loader

    mod = _loader.load_emulated() if isa == "avx512emu" else _loader.load(isa)
    if mod is None:
        pytest.skip("_native_avx512emu not built (or no AVX2 on this host)")
    # Index 3: MUL1 through the exact kernels' own arithmetic (AVX2 and AVX-512: the offset split of
    # band_exact_mul1, round11(N) + 905216 from float(1774 bs)); scalar: the same as MUL1.
    states = np.arange(65536, dtype=np.uint16)
    for index, cb in [*enumerate(exl3.CODEBOOKS), (3, "mul1")]:
        want = exl3.codebook_values(states, cb).astype(np.float32)
        got = mod.decode_exact(states, index)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (index, cb, [(int(s), float(got[s]), float(want[s])) for s in bad[:5]])
    with pytest.raises(ValueError, match="codebook"):
        mod.decode_exact(states[:16], 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        mod.decode_exact(states[:15], 0)
