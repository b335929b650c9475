"""Dequantization of gathered Engram rows: fp8 E4M3 (FN) values times one E8M0 scale per block.

E4M3FN byte ``s eeee mmm``: exponent bias 7; e = 0 is subnormal (``m/8 * 2^-6``); ``x1111111``
(0x7F, 0xFF) is NaN; no infinities; max 448. E8M0 byte e: ``2^(e - 127)``; 0xFF is NaN. The
product is computed in float32 (exact: at most 4 significant bits, exponent >= -136, overflow to
inf only for 448 * 2^127 and the like) and, for bfloat16, rounded to nearest even.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["E4M3_TO_F32", "E8M0_TO_F32", "dequantize"]


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 0xF) & (man == 0x7), np.nan, mag)
    return (sign * mag).astype(np.float32)


def _e8m0_table() -> np.ndarray:
    e = np.arange(256)
    return np.where(e == 0xFF, np.nan, np.ldexp(1.0, e - 127)).astype(np.float32)


E4M3_TO_F32: np.ndarray = _e4m3_table()
"""float32 value of each fp8 E4M3FN byte."""
E8M0_TO_F32: np.ndarray = _e8m0_table()
"""float32 value of each E8M0 scale byte (2^-127 is a float32 subnormal, exact)."""


def _bytes(a: Any, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.itemsize != 1:
        raise TypeError(f"{name} must hold 1-byte elements (raw fp8 / e8m0 bytes), got {arr.dtype}")
    return arr.view(np.uint8)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a (quiet) NaN: rounding could carry a payload into the exponent
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def dequantize(rows: Any, scales: Any, dtype: Any = np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize gathered rows: ``value[..., j] = e4m3(rows[..., j]) * e8m0(scales[..., j // B])``.

    Parameters
    ----------
    rows : array_like, shape ``[..., D]``
        Raw fp8 E4M3FN bytes (uint8, or any 1-byte dtype such as ml_dtypes.float8_e4m3fn).
    scales : array_like, shape ``[..., D // B]``
        Raw E8M0 bytes; B = D / scales.shape[-1] columns share a scale (32 in V4.1).
    dtype : numpy dtype or str
        ``float32`` or ``bfloat16`` (an ``ml_dtypes.bfloat16`` array).
    out : numpy.ndarray, optional
        Destination of shape ``[..., D]`` and dtype ``dtype`` (for bfloat16 also a uint16 array of
        the bit patterns, e.g. ``torch_tensor.view(torch.uint16).numpy()``).

    Returns
    -------
    numpy.ndarray
        The values (``out`` when given).
    """
    r = _bytes(rows, "rows")
    s = _bytes(scales, "scales")
    if r.ndim < 1 or s.ndim != r.ndim or r.shape[:-1] != s.shape[:-1]:
        raise ValueError(f"rows {r.shape} and scales {s.shape} must agree in all but the last dimension")
    d, n_scales = r.shape[-1], s.shape[-1]
    if n_scales == 0 or d % n_scales:
        raise ValueError(f"rows have {d} columns, not a multiple of the {n_scales} scales per row")
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    block = d // n_scales
    values = E4M3_TO_F32[r].reshape(*r.shape[:-1], n_scales, block)
    with np.errstate(over="ignore", invalid="ignore"):  # 448 * 2^127 overflows to inf, as it should
        values *= E8M0_TO_F32[s][..., None]
    values = values.reshape(r.shape)
    if name == "float32":
        if out is None:
            return values
        _check_out(out, r.shape, ("float32",))
        out[...] = values
        return out
    bits = _f32_to_bf16_bits(values)
    if out is None:
        import ml_dtypes

        return bits.view(ml_dtypes.bfloat16)
    _check_out(out, r.shape, ("bfloat16", "uint16", "int16"))
    out.view(np.uint16)[...] = bits
    return out


def _check_out(out: Any, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.shape != shape or out.dtype.name not in dtypes:
        raise ValueError(f"out must be {' or '.join(dtypes)} of shape {shape}, got {out.dtype} {out.shape}")
