"""Writers of synthetic Engram tables in the real V4.1 layout (tests and benchmarks).

Tensor names are ``layers.<N>.engram.embed.weight`` (F8_E4M3 ``[rows, head_dim]``) and
``layers.<N>.engram.embed.scale`` (F8_E8M0 ``[rows, head_dim // 32]``). Data can come from an array,
from a chunk generator (large files written in pieces) or be left as a hole (sparse file).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping

import numpy as np

from .safetensors_header import DTYPE_BYTES

__all__ = ["random_chunks", "write_safetensors", "write_v41_engram_shard"]

# Array bytes, a generator of the bytes [start, start + n) of the tensor, or None for a hole.
Source = np.ndarray | Callable[[int, int], bytes] | None


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, tuple[str, tuple[int, ...], Source]],
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = 64 << 20,
    fsync: bool = True,
) -> None:
    """Write a safetensors file tensor by tensor, never holding more than one chunk.

    Parameters
    ----------
    path : path-like
        Output file (overwritten).
    tensors : mapping
        name -> (dtype string, shape, source). A numpy source must have exactly the tensor's byte
        size; a callable gets (start, n) and returns n bytes; None leaves a hole (reads as zeros).
    metadata : mapping of str to str, optional
        ``__metadata__``.
    chunk_bytes : int
        Bytes per callable call.
    fsync : bool
        Flush to disk before returning, so the pages are clean and can be evicted (cold benchmarks).
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    layout = []
    for name, (dtype, shape, source) in tensors.items():
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        layout.append((name, nbytes, source))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, nbytes, source in layout:
            if source is None:
                f.seek(nbytes, os.SEEK_CUR)
            elif isinstance(source, np.ndarray):
                if source.nbytes != nbytes:
                    raise ValueError(f"tensor {name!r}: array has {source.nbytes} bytes, the header says {nbytes}")
                f.write(np.ascontiguousarray(source).tobytes())
            else:
                for start in range(0, nbytes, chunk_bytes):
                    n = min(chunk_bytes, nbytes - start)
                    data = source(start, n)
                    if len(data) != n:
                        raise ValueError(f"tensor {name!r}: chunk source returned {len(data)} bytes, wanted {n}")
                    f.write(data)
        f.truncate(8 + len(raw) + offset)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def random_chunks(seed: int) -> Callable[[int, int], bytes]:
    """A chunk source of random bytes (each chunk seeded by ``(seed, start)``: reproducible)."""

    def source(start: int, n: int) -> bytes:
        return np.random.default_rng((seed, start)).bytes(n)

    return source


def write_v41_engram_shard(
    path: str | os.PathLike[str],
    layer_rows: Mapping[int, int],
    head_dim: int = 256,
    quant_block: int = 32,
    fill: str = "random",
    seed: int = 0,
) -> None:
    """One shard with the Engram tables of several layers, in the V4.1 layout.

    Parameters
    ----------
    path : path-like
        Output .safetensors file.
    layer_rows : mapping of int to int
        Engram layer -> table rows.
    head_dim, quant_block : int
        Row width and columns per scale.
    fill : {"random", "sparse"}
        Random bytes (really written) or holes (a sparse file: reading holes is not disk I/O).
    seed : int
        Seed of the random bytes.
    """
    if fill not in ("random", "sparse"):
        raise ValueError(f"fill must be 'random' or 'sparse', got {fill!r}")
    tensors: dict[str, tuple[str, tuple[int, ...], Source]] = {}
    for i, (layer, rows) in enumerate(layer_rows.items()):
        prefix = f"layers.{layer}.engram.embed"
        for j, (suffix, dtype, cols) in enumerate(
            (("weight", "F8_E4M3", head_dim), ("scale", "F8_E8M0", head_dim // quant_block))
        ):
            src = random_chunks(seed * 1000 + 2 * i + j) if fill == "random" else None
            tensors[f"{prefix}.{suffix}"] = (dtype, (rows, cols), src)
    write_safetensors(path, tensors, metadata={"format": "pt"})
