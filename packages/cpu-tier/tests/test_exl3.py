"""Tests of the numpy EXL3 reference (cpu_tier.exl3) against independent bit-level constructions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from cpu_tier import exl3

ALL_BITS = [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5]


def _stream_bits(tile: np.ndarray) -> np.ndarray:
    """Independent, slow bit unpacking of one tile: the stream as a list of 0/1, position p = bit 31-(p%32)
    of little-endian uint32 word p//32, built word by word from the raw bytes."""
    raw = tile.astype("<i2").tobytes()
    out = []
    for w in range(len(raw) // 4):
        word = int.from_bytes(raw[4 * w : 4 * w + 4], "little")
        out.extend((word >> (31 - b)) & 1 for b in range(32))
    return np.array(out, dtype=np.int64)


def _pack_codes(codes: list[int], lengths: list[int]) -> np.ndarray:
    """Write variable-length codes MSB-first into the stream, return the tile as int16 words."""
    bits: list[int] = []
    for c, n in zip(codes, lengths, strict=True):
        bits.extend((c >> (n - 1 - i)) & 1 for i in range(n))
    assert len(bits) % 32 == 0
    words = []
    for w in range(len(bits) // 32):
        v = 0
        for b in bits[32 * w : 32 * w + 32]:
            v = (v << 1) | b
        words.append(v)
    u32 = np.array(words, dtype="<u4")
    return u32.view("<i2").astype(np.int16)


@pytest.mark.parametrize(("codebook", "rms"), [("3inst", 1.243711), ("mcg", 1.244112), ("mul1", 1.000312)])
def test_codebook_rms_over_all_states(codebook: str, rms: float) -> None:
    v = exl3.codebook_values(np.arange(65536), codebook).astype(np.float64)  # type: ignore[arg-type]
    assert v.dtype == np.float64
    assert abs(np.sqrt(np.mean(v * v)) - rms) < 5e-7


def test_codebook_known_values() -> None:
    # Hand-computed: state 0 -> 3INST: x = 64248484 = 0x03D45BA4 -> LOP3 -> 0x38B460C4 ^ ... checked via the
    # formula below in pure Python integers, independent of numpy's vector path.
    def ref_sumh(x: int) -> float:
        lo = np.array(x & 0xFFFF, dtype=np.uint16).view(np.float16)
        hi = np.array(x >> 16, dtype=np.uint16).view(np.float16)
        return float(np.float16(float(lo) + float(hi)))

    def ref(s: int, cb: str) -> float:
        if cb == "mul1":
            p = (s * 0x83DCD12D) & 0xFFFFFFFF
            bs = sum((p >> (8 * i)) & 0xFF for i in range(4))
            return float(np.float16((1024 + bs) * 0.00676727294921875 - 10.3828125))
        x = (s * 89226354 + 64248484) & 0xFFFFFFFF if cb == "3inst" else (s * 0xCBAC1FED) & 0xFFFFFFFF
        return ref_sumh((x & 0x8FFF8FFF) ^ 0x3B603B60)

    rng = np.random.default_rng(1)
    states = np.concatenate([[0, 1, 0xFFFF, 0x8000], rng.integers(0, 65536, 200)])
    for cb in exl3.CODEBOOKS:
        got = exl3.codebook_values(states, cb)
        assert got.dtype == np.float16
        want = np.array([ref(int(s), cb) for s in states], dtype=np.float16)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), cb


def test_mul1_is_one_fp16_rounding_of_the_fma() -> None:
    # The MUL1 value differs from the CPU formula (bs - 510) * k_inv by the rounding of the GPU hfma only.
    s = np.arange(65536)
    v = exl3.codebook_values(s, "mul1").astype(np.float64)
    p = (s.astype(np.uint64) * 0x83DCD12D) & 0xFFFFFFFF
    bs = sum((p >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)).astype(np.float64)
    exact = (1024 + bs) * 0.00676727294921875 - 10.3828125
    assert np.max(np.abs(v - exact)) <= np.max(np.abs(exact)) * 2.0**-11  # half an fp16 ulp at most
    assert np.all(np.abs(v - exact) <= np.spacing(exact.astype(np.float16)).astype(np.float64) / 2 + 1e-12)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_states_are_the_sliding_16_bit_window(bits: float) -> None:
    rng = np.random.default_rng(int(bits * 10))
    tile = rng.integers(-32768, 32768, size=(int(16 * bits),), dtype=np.int16)
    states = exl3.trellis_states(tile[None, :])[0].astype(np.int64)
    stream = _stream_bits(tile)
    nbits = len(stream)
    assert nbits == int(256 * bits)
    lengths = exl3.code_lengths(bits)
    assert lengths.sum() == nbits
    ends = np.cumsum(lengths)
    for t in range(256):
        window = [stream[(ends[t] - 16 + j) % nbits] for j in range(16)]
        assert states[t] == int("".join(map(str, window)), 2), t


@pytest.mark.parametrize("bits", ALL_BITS)
def test_shift_recurrence_and_tail_biting(bits: float) -> None:
    rng = np.random.default_rng(7)
    lengths = exl3.code_lengths(bits)
    codes = [int(rng.integers(0, 1 << int(n))) for n in lengths]
    tile = _pack_codes(codes, [int(n) for n in lengths])
    assert tile.shape == (int(16 * bits),)
    states = exl3.trellis_states(tile[None, :])[0].astype(np.int64)
    for t in range(256):
        prev = states[t - 1]  # t = 0 wraps to element 255: tail-biting
        assert states[t] == ((prev << int(lengths[t])) | codes[t]) & 0xFFFF, t
        assert states[t] & ((1 << int(lengths[t])) - 1) == codes[t]


def test_half_integer_code_lengths() -> None:
    for bits in exl3.HALF_BITS:
        d = exl3.code_lengths(bits)
        ka = int(bits - 0.5)
        assert np.array_equal(d[0:16:2], [ka] * 8) and np.array_equal(d[1:16:2], [ka + 1] * 8)
        assert d.sum() == 256 * bits


def test_permutation_is_a_bijection_with_the_documented_structure() -> None:
    perm = exl3.tensor_core_perm()
    assert sorted(perm.tolist()) == list(range(256))
    rows, cols = perm // 16, perm % 16
    # Within a half-row the trellis index steps by 32 per column.
    for r in range(16):
        for half in (0, 8):
            idx = sorted(np.nonzero((rows == r) & (cols >= half) & (cols < half + 8))[0])
            assert np.all(np.diff(idx) == 32)
            assert [cols[i] for i in idx] == list(range(half, half + 8))


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_decode_places_tiles_and_elements(codebook: str) -> None:
    t = exl3.random_tensor(256, 384, 2, codebook, seed=3)  # type: ignore[arg-type]
    w = exl3.decode(t.trellis, t.codebook)
    assert w.dtype == np.float16 and w.shape == (256, 384)
    perm = exl3.tensor_core_perm()
    for tk, tn in [(0, 0), (5, 17), (15, 23)]:
        states = exl3.trellis_states(t.trellis[tk, tn][None])[0]
        vals = exl3.codebook_values(states, t.codebook)
        tile = w[16 * tk : 16 * tk + 16, 16 * tn : 16 * tn + 16]
        for e in (0, 1, 77, 255):
            r, c = divmod(int(perm[e]), 16)
            assert tile[r, c].view(np.uint16) == vals[e].view(np.uint16)


def test_hadamard_is_orthonormal_blockwise_sylvester() -> None:
    eye = np.eye(256)
    h = exl3.hadamard_128(eye)
    assert np.allclose(h @ h.T, eye, atol=1e-12)
    assert np.allclose(h[:128, 128:], 0) and np.allclose(h[128:, :128], 0)
    i, j = 37, 101
    assert np.isclose(h[i, j], (-1) ** bin(i & j).count("1") / np.sqrt(128))
    with pytest.raises(ValueError, match="multiple of 128"):
        exl3.hadamard_128(np.ones(100))


@pytest.mark.parametrize(
    ("codebook", "bits"),
    [(cb, b) for cb in exl3.CODEBOOKS for b in (1, 3, 4, 8, 2.5) if b in exl3.SUPPORTED_BITS[cb]],
)
def test_linear_equals_x_at_reconstruct(codebook: str, bits: float) -> None:
    rng = np.random.default_rng(11)
    t = exl3.random_tensor(384, 256, bits, codebook, seed=rng, bias=True)  # type: ignore[arg-type]
    w = exl3.reconstruct(t.trellis, t.suh, t.svh, t.codebook)
    assert w.dtype == np.float32 and w.shape == (384, 256)
    x = rng.standard_normal((5, 384)).astype(np.float32)
    y = exl3.linear(x, t.trellis, t.suh, t.svh, t.codebook, t.bias)
    assert y.dtype == np.float32 and y.shape == (5, 256)
    ref = x.astype(np.float64) @ w.astype(np.float64) + t.bias.astype(np.float64)  # type: ignore[union-attr]
    assert np.max(np.abs(y - ref)) <= 2e-6 * np.max(np.abs(ref))
    # And reconstruct is diag(suh) H W_inner H diag(svh), built here with explicit matrices.
    hk = exl3.hadamard_128(np.eye(384))
    hn = exl3.hadamard_128(np.eye(256))
    w_ref = (
        np.diag(t.suh.astype(np.float64))
        @ hk
        @ exl3.decode(t.trellis, t.codebook)
        @ hn
        @ np.diag(t.svh.astype(np.float64))
    )
    assert np.allclose(w, w_ref, rtol=1e-6, atol=1e-7 * np.max(np.abs(w_ref)))


def test_random_tensor_has_realistic_scale_and_is_deterministic() -> None:
    a = exl3.random_tensor(512, 256, 3, "mul1", seed=5)
    b = exl3.random_tensor(512, 256, 3, "mul1", seed=5)
    assert np.array_equal(a.trellis, b.trellis) and np.array_equal(a.suh, b.suh)
    x = np.random.default_rng(0).standard_normal((64, 512))
    y = a.linear(x)
    assert 0.3 < float(np.std(y)) < 3.0
    assert a.k == 512 and a.n == 256 and a.bits == 3 and a.codebook == "mul1"
    assert a.trellis.shape == (32, 16, 48)


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_safetensors_round_trip(tmp_path, codebook: str) -> None:
    t = exl3.random_tensor(256, 128, 4, codebook, seed=2, bias=True)  # type: ignore[arg-type]
    tensors = t.to_tensors("layers.3.ffn.experts.9.w2")
    marker_names = {k.rsplit(".", 1)[1] for k in tensors} & {"mcg", "mul1"}
    assert marker_names == ({codebook} if codebook != "3inst" else set())
    for m in marker_names:
        assert tensors[f"layers.3.ffn.experts.9.w2.{m}"].shape == ()
        assert tensors[f"layers.3.ffn.experts.9.w2.{m}"].dtype == np.int32
    path = tmp_path / "x.safetensors"
    save_file({**tensors, "other.weight": np.zeros(3, np.float16)}, str(path))
    with safe_open(str(path), framework="numpy") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        back = exl3.Exl3Tensor.from_safetensors(f, "layers.3.ffn.experts.9.w2")
    assert dtypes["layers.3.ffn.experts.9.w2.trellis"] == "I16"
    assert dtypes["layers.3.ffn.experts.9.w2.suh"] == "F16"
    assert back.codebook == codebook and back.bits == 4 and (back.k, back.n) == (256, 128)
    for name in ("trellis", "suh", "svh", "bias"):
        assert np.array_equal(getattr(back, name), getattr(t, name))


def test_legacy_sign_vectors() -> None:
    t = exl3.random_tensor(128, 128, 2, "mcg", seed=4)
    signs = np.random.default_rng(0).integers(0, 2, 128)
    packed = np.zeros(8, dtype=np.uint16)
    for i, s in enumerate(signs):
        packed[i // 16] |= np.uint16(s << (i % 16))
    d = {k: v for k, v in t.to_tensors("p").items() if not k.endswith(("suh", "svh"))}
    d["p.su"] = packed.view(np.int16)
    d["p.sv"] = packed.view(np.int16)
    back = exl3.Exl3Tensor.from_safetensors(d, "p")
    assert np.array_equal(back.suh, np.where(signs == 1, -1.0, 1.0).astype(np.float16))


# --------------------------------------------------------------------------------------------- bad input


def _good() -> dict[str, np.ndarray]:
    return exl3.random_tensor(128, 256, 3, "mul1", seed=0).to_tensors("w")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update({"w.trellis": d["w.trellis"].astype(np.int32)}), r"w\.trellis.*int16"),
        (lambda d: d.update({"w.trellis": d["w.trellis"][0]}), r"w\.trellis.*3-D"),
        (lambda d: d.update({"w.trellis": d["w.trellis"][:4]}), r"w\.trellis.*multiples of 128"),
        (lambda d: d.update({"w.trellis": d["w.trellis"][:, :, :44]}), r"w\.trellis.*16\*K"),
        (
            lambda d: d.update(
                {
                    "w.trellis": d["w.trellis"][:, :, :24].copy(),
                    "w.mcg": d.pop("w.mul1") * 0 + np.int32(exl3.MARKERS["mcg"]),
                }
            ),
            r"w\.trellis.*K=1\.5.*mcg",
        ),
        (lambda d: d.update({"w.suh": d["w.suh"].astype(np.float32)}), r"w\.suh.*float16"),
        (lambda d: d.update({"w.svh": d["w.svh"][:100]}), r"w\.svh.*shape"),
        (lambda d: d.pop("w.suh"), r"w\.suh: missing"),
        (lambda d: d.pop("w.trellis"), r"w\.trellis: missing"),
        (lambda d: d.update({"w.mul1": np.array(5, np.int32)}), r"w\.mul1.*unknown codebook marker value"),
        (lambda d: d.update({"w.mul1": np.array([exl3.MARKERS["mul1"]], np.int32)}), r"w\.mul1.*0-dim int32"),
        (lambda d: d.update({"w.mcg": np.array(exl3.MARKERS["mcg"], np.int32)}), r"conflicting codebook markers"),
        (lambda d: d.update({"w.foo": np.array(1, np.int32)}), r"w\.foo: unknown EXL3 tensor or codebook marker"),
        (lambda d: d.update({"w.bias": np.zeros(7, np.float16)}), r"w\.bias.*shape"),
        (lambda d: d.update({"w.bias": np.zeros(256, np.int8)}), r"w\.bias.*dtype"),
    ],
)
def test_bad_input_names_the_tensor(mutate, match: str) -> None:
    d = _good()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        exl3.Exl3Tensor.from_safetensors(d, "w")


def test_bad_function_arguments() -> None:
    t = exl3.random_tensor(128, 128, 3, "mcg", seed=0)
    with pytest.raises(ValueError, match="unknown codebook"):
        exl3.decode(t.trellis, "nf4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="K=2.5.*3inst"):
        exl3.decode(np.zeros((8, 8, 40), np.int16), "3inst")
    with pytest.raises(ValueError, match=r"x must have shape \(m, 128\)"):
        exl3.linear(np.zeros((2, 64), np.float32), t.trellis, t.suh, t.svh, "mcg")
    with pytest.raises(ValueError, match="x must be a floating-point"):
        exl3.linear(np.zeros((2, 128), np.int32), t.trellis, t.suh, t.svh, "mcg")
    with pytest.raises(ValueError, match="suh.*shape"):
        exl3.reconstruct(t.trellis, t.svh[:64], t.svh, "mcg")
    with pytest.raises(ValueError, match="multiples of 128"):
        exl3.random_tensor(100, 128, 3, "mcg")
    with pytest.raises(ValueError, match="unsupported bits"):
        exl3.random_tensor(128, 128, 9, "mcg")
    with pytest.raises(ValueError, match="states must be an integer"):
        exl3.codebook_values(np.zeros(3), "mcg")


def test_cpu_features_probe() -> None:
    import cpu_tier

    f = cpu_tier.cpu_features()
    assert set(f) >= {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512vbmi"}
    # AVX-512 implies the OS saves the zmm state, which implies AVX state.
    if f["avx512f"]:
        assert f["os_avx512"] and f["os_avx"]
    flags = Path("/proc/cpuinfo").read_text().split()
    assert f["avx2"] == ("avx2" in flags)
    assert f["avx512f"] <= ("avx512f" in flags)


def test_cli_selfcheck(capsys) -> None:
    from cpu_tier.__main__ import main

    assert main(["selfcheck", "--k", "256", "--n", "128"]) == 0
    out = capsys.readouterr().out
    assert "selfcheck passed" in out and "mul1  rms 1.000312" in out
