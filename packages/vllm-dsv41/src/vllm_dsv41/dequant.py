"""EXL3 experts dequantized on any torch device: ``cpu_tier.exl3.reconstruct`` without the numpy round trip.

``reconstruct_torch(tensor, device)`` is the original-basis weight ``W = diag(suh) H W_inner H diag(svh)`` (float32
``(k, n)``, ``y = x @ W``) of one ``Exl3Tensor`` (numpy views of the pack's host home), computed on ``device``:

* ``W_inner``: the trellis copied to the device as it is stored (int16) and decoded there by
  ``dma_prefill.ops_torch.decode_torch``, bit-exact against ``cpu_tier.exl3.decode`` (the stream windows of
  ``cpu_tier.exl3.stream_windows`` in int64, the tile permutation ``tensor_core_perm``; each state's value looked
  up in ``codebook_table``: ``cpu_tier.exl3.codebook_values`` of all 65,536 states);
* the reconstruction in the order of ``cpu_tier.exl3.reconstruct``: float64 from ``W_inner`` on, the Hadamard-128
  along the rows then along the columns (``dma_prefill.ops_torch.hadamard_128_torch``), times ``suh`` then ``svh``,
  one rounding to float32.

The result equals ``reconstruct`` to float32 rounding, not bit for bit: the float64 sums of the Hadamard products
run in the device BLAS's order, not numpy's, and where the float64 values straddle a float32 rounding boundary the
two round to neighbours (at most one float32 ulp apart). The decode is bit-exact.

Temporary memory is bounded: the decode runs ``DECODE_CHUNK_TILES`` tiles at a time and the float64 stage
``CHUNK_ELEMENTS`` weights (whole 128-row blocks) at a time, so a Flash expert's projection (5120 x 2304) needs its
float32 result (47 MB), its fp16 ``W_inner`` (24 MB) and a few hundred MB of temporaries.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from cpu_tier.exl3 import Codebook, Exl3Tensor

__all__ = ["CHUNK_ELEMENTS", "DECODE_CHUNK_TILES", "host_tensor", "reconstruct_torch", "w_inner_torch"]

#: Tiles decoded at a time (the int64 temporaries of the decode: ~2 KiB per tile each, 64 MiB at this size).
DECODE_CHUNK_TILES = 1 << 15
#: Weights taken through the float64 stage at a time (rounded to whole 128-row blocks; 32 MiB per float64 copy).
CHUNK_ELEMENTS = 1 << 22


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``a``'s memory (no copy when ``a`` is C-contiguous). The home's views are read-only
    mappings, which ``torch.from_numpy`` accepts only with a warning: those are wrapped through their address, the
    way ``ExpertHome.cache_home`` wraps its mappings (the tensor must not outlive ``a``, and is never written)."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable or a.nbytes == 0:
        return torch.from_numpy(a)
    raw = torch.frombuffer((ctypes.c_uint8 * a.nbytes).from_address(a.ctypes.data), dtype=torch.uint8)
    return raw.view(torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype).reshape(a.shape)


@functools.cache
def _table(codebook: Codebook, device: torch.device) -> torch.Tensor:
    from dma_prefill.ops_torch import codebook_table

    return codebook_table(codebook, device)


def _resolve(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def w_inner_torch(tensor: Exl3Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor``'s ``W_inner`` decoded on ``device`` (fp16 ``(k, n)``), bit-exact against ``cpu_tier.exl3.decode``:
    the trellis copied there as stored (int16), decoded by ``decode_torch`` with the codebook's table."""
    from dma_prefill.ops_torch import decode_torch

    dev = _resolve(device)
    trellis = host_tensor(tensor.trellis).to(dev)
    return decode_torch(trellis, tensor.codebook, chunk_tiles=DECODE_CHUNK_TILES, table=_table(tensor.codebook, dev))


def reconstruct_torch(tensor: Exl3Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor``'s original-basis weight ``W`` on ``device`` (float32 ``(k, n)``, ``y = x @ W``), as
    ``cpu_tier.exl3.reconstruct`` computes it (to float32 rounding; see the module docstring)."""
    from dma_prefill.ops_torch import hadamard_128_torch

    dev = _resolve(device)
    w_inner = w_inner_torch(tensor, dev)
    suh = host_tensor(tensor.suh).to(dev, torch.float64)
    svh = host_tensor(tensor.svh).to(dev, torch.float64)
    k, n = tensor.k, tensor.n
    out = torch.empty((k, n), dtype=torch.float32, device=dev)
    rows = max(128, CHUNK_ELEMENTS // n // 128 * 128)
    for r in range(0, k, rows):
        m = min(rows, k - r)
        w = w_inner[r : r + m].to(torch.float64)
        # along the rows, block by block: out[128 b + j, c] = sum_i H[i, j] W[128 b + i, c]
        w = hadamard_128_torch(w.mT).mT
        # along the columns: out[r, 128 b + j] = sum_i W[r, 128 b + i] H[i, j]
        w = hadamard_128_torch(w)
        out[r : r + m] = (suh[r : r + m, None] * w * svh[None, :]).to(torch.float32)
    return out
