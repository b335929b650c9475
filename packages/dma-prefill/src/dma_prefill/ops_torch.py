"""Pure-torch EXL3 expert math: the CPU path, the fallback on any device, and the second test reference.

``decode_torch`` is bit-exact against ``cpu_tier.exl3.decode`` (same integer arithmetic, done in int64; the codebook
computed per element, or looked up in ``codebook_table``, every state's value from ``cpu_tier.exl3.codebook_values``).
``linear_torch`` / ``expert_torch`` follow the EXL3 forward order ``H(x * suh) @ W_inner -> H -> * svh`` in the
requested float dtype (float32 on the fake device, float64 for references).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np
import torch

from cpu_tier.exl3 import (
    CODEBOOK_MULT,
    CODEBOOKS,
    LOP3_AND,
    LOP3_XOR,
    MUL1_BIAS,
    MUL1_SCALE,
    Codebook,
    bits_from_trellis,
    codebook_values,
    hadamard_matrix,
    stream_windows,
    tensor_core_perm,
)

from .config import Projection

__all__ = [
    "codebook_table",
    "decode_torch",
    "expert_torch",
    "hadamard_128_torch",
    "hadamard_pm1",
    "linear_torch",
    "swiglu",
]

# The format's constants and bit-stream rules are cpu_tier.exl3's; this module only redoes the arithmetic in torch.
_stream_index = functools.cache(stream_windows)


def codebook_torch(states: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """int64 states in [0, 65535] -> fp16 values, bit-exactly like exllamav3's GPU codebooks."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    mult, add = CODEBOOK_MULT[codebook]
    x = (states * mult + add) & 0xFFFFFFFF
    if codebook == "mul1":
        bs = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        # exact in float64 (and in float32); one rounding to fp16, to nearest even
        return ((bs + 1024).to(torch.float64) * MUL1_SCALE + MUL1_BIAS).to(torch.float32).to(torch.float16)
    x = (x & LOP3_AND) ^ LOP3_XOR
    lo = (x & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)
    hi = (x >> 16).to(torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)
    return (lo + hi).to(torch.float16)  # exact fp32 sum, one rounding (as __hadd)


@functools.cache
def _codebook_values_np(codebook: Codebook) -> np.ndarray:
    return codebook_values(np.arange(65536, dtype=np.int64), codebook)


def codebook_table(codebook: Codebook, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp16 value of every 16-bit state (``[65536]`` on ``device``): ``cpu_tier.exl3.codebook_values`` over all
    states, so a lookup is the reference itself. An element's value is a pure function of its state, so one gather
    of this 128 KiB table replaces ``codebook_torch``'s integer arithmetic (what ``decode_torch(table=...)`` does)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    return torch.from_numpy(_codebook_values_np(codebook)).to(device, copy=True)  # (not the cached array)


def decode_torch(
    trellis: torch.Tensor, codebook: Codebook, *, chunk_tiles: int = 8192, table: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode an EXL3 trellis to ``W_inner`` (fp16 ``(k, n)``), bit-exact, on the trellis's device.

    Parameters
    ----------
    trellis : int16 ``[k/16, n/16, 16*K]`` (any device; a slot or host-store view works).
    codebook : "3inst", "mcg" or "mul1".
    chunk_tiles : tiles decoded at a time (bounds the int64 temporaries: ~2 KiB per tile each).
    table : ``codebook_table(codebook, trellis.device)``: look the values up instead of computing them (fewer
        kernels on a GPU); None: ``codebook_torch``.
    """
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"trellis must be int16 [k/16, n/16, 16*K], got {trellis.dtype} {tuple(trellis.shape)}")
    bits = bits_from_trellis(np.empty((0, 0, trellis.shape[-1]), dtype=np.int16))
    if table is not None and (
        table.dtype != torch.float16 or table.shape != (65536,) or table.device != trellis.device
    ):
        raise ValueError(f"table must be float16 [65536] on {trellis.device} (codebook_table), got {table.dtype} "
                         f"{tuple(table.shape)} on {table.device}")  # fmt: skip
    tk, tn, _ = trellis.shape
    dev = trellis.device
    i0, i1, shift = (torch.from_numpy(a).to(dev) for a in _stream_index(bits))
    perm = torch.from_numpy(tensor_core_perm()).to(dev)
    out = torch.empty((tk, tn, 256), dtype=torch.float16, device=dev)
    flat = trellis.reshape(tk * tn, -1)
    outf = out.view(tk * tn, 256)
    for s in range(0, tk * tn, chunk_tiles):
        u16 = flat[s : s + chunk_tiles].to(torch.int64) & 0xFFFF
        words = u16[:, 0::2] | (u16[:, 1::2] << 16)
        pair = (words[:, i0] << 32) | words[:, i1]  # int64 wraps; the bits we keep are below bit 64
        states = (pair >> shift) & 0xFFFF
        outf[s : s + chunk_tiles, perm] = codebook_torch(states, codebook) if table is None else table[states]
    return out.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(16 * tk, 16 * tn)


_hadamard_np = functools.cache(functools.partial(hadamard_matrix, 128))


def hadamard_pm1(dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu") -> torch.Tensor:
    """The Sylvester Hadamard-128 with +-1 entries (unnormalised), ``[128, 128]``."""
    return torch.from_numpy(_hadamard_np()).to(dtype=dtype, device=device)


def hadamard_128_torch(x: torch.Tensor) -> torch.Tensor:
    """Blockwise orthonormal Hadamard-128 over the last dim, in ``x.dtype`` (float32/float64)."""
    n = x.shape[-1]
    if n % 128:
        raise ValueError(f"Hadamard-128 needs a last dim that is a multiple of 128, got {n}")
    h = hadamard_pm1(x.dtype, x.device) * (1.0 / math.sqrt(128.0))
    return (x.reshape(*x.shape[:-1], n // 128, 128) @ h).reshape(x.shape)


def matmul_sequential(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed strictly in k order in ``a.dtype``: one rounding per product and per add, the plain
    loop order (one valid fp32 association, beside the blocked/pairwise one of a BLAS ``@``)."""
    acc = torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
    for k in range(a.shape[-1]):
        acc += a[..., k, None] * b[k]
    return acc


def linear_torch(
    x: torch.Tensor,
    w_inner: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    fp16_activations: bool = False,
    sequential: bool = False,
) -> torch.Tensor:
    """``y = H(H(x * suh) @ W_inner) * svh`` in ``dtype``; ``fp16_activations`` rounds ``H(x * suh)`` to fp16
    first (what a plain fp16 GEMM path does); ``sequential`` sums the GEMM in k order (``matmul_sequential``)."""
    xh = hadamard_128_torch(x.to(dtype) * suh.to(dtype))
    if fp16_activations:
        xh = xh.to(torch.float16).to(dtype)
    w = w_inner.to(dtype)
    return hadamard_128_torch(matmul_sequential(xh, w) if sequential else xh @ w) * svh.to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """DeepSeek's clamped SwiGLU: ``silu(min(gate, L)) * clamp(up, -L, L)`` (plain SwiGLU when L is None)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def expert_torch(
    x: torch.Tensor,
    weights: Mapping[Projection, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    limit: float | None = None,
    dtype: torch.dtype = torch.float32,
    fp16_activations: bool = False,
    sequential: bool = False,
) -> torch.Tensor:
    """One routed SwiGLU expert: ``down(swiglu(gate(x), up(x)))``; ``weights[p] = (W_inner, suh, svh)``."""

    def lin(a: torch.Tensor, p: Projection) -> torch.Tensor:
        return linear_torch(a, *weights[p], dtype=dtype, fp16_activations=fp16_activations, sequential=sequential)

    return lin(swiglu(lin(x, "gate"), lin(x, "up"), limit), "down")
