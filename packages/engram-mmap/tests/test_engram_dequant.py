"""dequantize against ml_dtypes (every byte x every scale) and a table of known values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engram_mmap import dequantize


def _all_pairs() -> tuple[np.ndarray, np.ndarray]:
    # rows[i, j] = byte j, scales[i] = scale byte i for all 32 columns of a block: 256 x 256 pairs.
    rows = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    return rows, scales


def _ml_reference(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    v = rows.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    sc = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (v.reshape(*v.shape[:-1], sc.shape[-1], -1) * sc[..., None]).reshape(v.shape)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    np.testing.assert_array_equal(nan_a, nan_b)
    np.testing.assert_array_equal(a[~nan_a].view(np.uint16 if a.itemsize == 2 else np.uint32),
                                  b[~nan_b].view(np.uint16 if b.itemsize == 2 else np.uint32))  # fmt: skip


def test_float32_every_byte_and_scale_bit_exact() -> None:
    rows, scales = _all_pairs()
    got = dequantize(rows, scales)
    assert got.dtype == np.float32 and got.shape == (256, 256)
    _same(got, _ml_reference(rows, scales))


def test_bfloat16_every_byte_and_scale_bit_exact() -> None:
    rows, scales = _all_pairs()
    got = dequantize(rows, scales, dtype="bfloat16")
    assert got.dtype == ml_dtypes.bfloat16
    ref = _ml_reference(rows, scales).astype(ml_dtypes.bfloat16)  # ml_dtypes rounds to nearest even
    _same(got, ref)
    # Products below the bf16 subnormal range really occur (e4m3 2^-9 x e8m0 2^-127) and round.
    assert float(dequantize(np.full((1, 32), 0x01, np.uint8), np.zeros((1, 1), np.uint8), "bfloat16")[0, 0]) == 0.0


KNOWN = [
    # (e4m3 byte, e8m0 byte, value)
    (0x00, 127, 0.0),
    (0x80, 127, -0.0),
    (0x38, 127, 1.0),  # exponent 7 = bias
    (0xB8, 127, -1.0),
    (0x7E, 127, 448.0),  # largest finite
    (0xFE, 127, -448.0),
    (0x01, 127, 2.0**-9),  # smallest subnormal
    (0x07, 127, 7 * 2.0**-9),  # largest subnormal
    (0x08, 127, 2.0**-6),  # smallest normal
    (0x7F, 127, float("nan")),
    (0xFF, 127, float("nan")),
    (0x38, 0, 2.0**-127),  # the smallest scale, a float32 subnormal
    (0x38, 254, 2.0**127),
    (0x38, 255, float("nan")),  # e8m0 0xFF is NaN
    (0x00, 255, float("nan")),
    (0x7E, 254, float("inf")),  # 448 * 2^127 overflows float32
    (0x3C, 130, 12.0),  # 1.5 * 2^3
    (0x01, 0, 2.0**-136),
]


@pytest.mark.parametrize(("byte", "scale", "value"), KNOWN)
def test_known_values(byte: int, scale: int, value: float) -> None:
    rows = np.full((1, 32), byte, np.uint8)
    got = float(dequantize(rows, np.array([[scale]], np.uint8))[0, 0])
    if np.isnan(value):
        assert np.isnan(got)
    else:
        assert got == value and np.signbit(got) == np.signbit(value)


def test_blocks_and_batch_dims() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (3, 24, 256), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 24, 8), dtype=np.uint8)
    got = dequantize(rows, scales)
    _same(got, _ml_reference(rows, scales))
    # Column j uses scale j // 32.
    j = 200
    scale = np.ldexp(1.0, scales[..., j // 32].astype(np.int64) - 127)
    expect = rows[..., j].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    _same(got[..., j], expect.astype(np.float32))
    # 1-byte dtypes other than uint8 are taken as raw bytes.
    _same(dequantize(rows.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu)), got)


def test_out_and_errors() -> None:
    rows, scales = _all_pairs()
    out = np.empty((256, 256), np.float32)
    assert dequantize(rows, scales, out=out) is out
    _same(out, _ml_reference(rows, scales))
    bits = np.empty((256, 256), np.uint16)
    dequantize(rows, scales, "bfloat16", out=bits)
    _same(bits.view(ml_dtypes.bfloat16), dequantize(rows, scales, "bfloat16"))
    with pytest.raises(ValueError, match="out must be float32"):
        dequantize(rows, scales, out=np.empty((256, 255), np.float32))
    with pytest.raises(ValueError, match="must agree"):
        dequantize(rows, scales[:5])
    with pytest.raises(ValueError, match="not a multiple"):
        dequantize(rows[:, :250], scales)
    with pytest.raises(TypeError, match="1-byte"):
        dequantize(rows.astype(np.int32), scales)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dequantize(rows, scales, np.float16)
