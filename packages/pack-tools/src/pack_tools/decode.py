"""EXL3 -> FP16 reconstruction for the pack: ``cpu_tier.exl3.decode`` plus an exact, deterministic Hadamard.

``W = diag(suh) . H_k . W_inner . H_n . diag(svh)`` (cpu_tier.exl3's definition). ``cpu_tier.exl3.reconstruct``
applies the Hadamard-128 as a float64 BLAS matmul: correct, but slow on a busy host and its summation order
depends on the BLAS build. Here the transform is a fast Walsh-Hadamard butterfly in float64 without the
1/sqrt(128) factors, which are applied once at the end as the exact power of two 1/128:

* ``W_inner`` is fp16 (|x| < 2^16, quantum 2^-24), so every partial sum of the first transform (at most 128
  terms) fits float64's 53-bit significand: that pass is exact;
* the second pass's sums fit in 54 bits, so at most its last bit is rounded, in a fixed order;
* the result is then scaled by 1/128 (exact), by ``suh`` and ``svh`` (one rounding each) and rounded to fp16.

So the FP16 weights are a deterministic function of the stored bits on every machine (packs built anywhere hash
the same), and agree with ``cpu_tier.exl3.reconstruct(...).astype(float16)`` to within one fp16 rounding step
(both round a float64 value that differs by a few float64 ulps).
"""

from __future__ import annotations

import numpy as np

__all__ = ["fwht128", "reconstruct_fp16"]


def fwht128(x: np.ndarray, axis: int) -> np.ndarray:
    """Unnormalized blockwise Sylvester Walsh-Hadamard-128 along ``axis`` (float64; a new array)."""
    a = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    size = a.shape[-1]
    if size % 128:
        raise ValueError(f"Hadamard-128 needs a length that is a multiple of 128, got {size}")
    lead = a.shape[:-1]
    y = np.array(a, dtype=np.float64, order="C").reshape(-1, 128)  # rows of one 128-block each
    z = np.empty_like(y)
    h = 1
    while h < 128:
        v = y.reshape(-1, 128 // (2 * h), 2, h)
        w = z.reshape(-1, 128 // (2 * h), 2, h)
        np.add(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 0, :])
        np.subtract(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 1, :])
        y, z = z, y
        h *= 2
    return np.moveaxis(y.reshape(*lead, size), -1, axis)


def reconstruct_fp16(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
    """The original-basis weight as FP16 ``[out, in]`` (``nn.Linear.weight`` orientation, i.e. ``W.T``).

    Raises ValueError (from cpu_tier's checks) for a malformed tensor set, and when the weight is not finite
    or overflows FP16.
    """
    from cpu_tier.exl3 import decode

    w_inner = decode(trellis, codebook)  # type: ignore[arg-type]  # fp16 (k, n), bit-exact
    k, n = w_inner.shape
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"suh/svh shapes {suh.shape}/{svh.shape} do not match the trellis ({k}, {n})")
    w = fwht128(fwht128(w_inner, axis=0), axis=1)
    w *= 1.0 / 128.0
    w *= suh.astype(np.float64)[:, None]
    w *= svh.astype(np.float64)[None, :]
    if not np.isfinite(w).all():
        raise ValueError("reconstruction is not finite")
    out = np.ascontiguousarray(w.T).astype(np.float16)
    if not np.isfinite(out).all():
        raise ValueError("reconstruction overflows FP16")
    return out
