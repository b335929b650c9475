"""Safetensors for the pack tools: headers (engram-mmap's reader, errors as :class:`PackError`) and writing.

Reading is :mod:`engram_mmap.safetensors_header` (the project's one header reader): a damaged file gives a
message naming the file and the tensor, and a 5 GB shard costs one small read. Writing always goes through
safetensors' own serializer (``safetensors.serialize_file``); dtypes numpy lacks (BF16, F8_E4M3, F8_E8M0) are
passed as raw bytes with the safetensors dtype name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize_file

from engram_mmap.safetensors_header import (
    DTYPE_BYTES,
    Header,
    SafetensorsFormatError,
    TensorInfo,
    header_problems,
    parse_header,
)
from pack_tools.errors import PackError

__all__ = [
    "DTYPE_SIZES",
    "Header",
    "RawTensor",
    "TensorInfo",
    "atomic_write_bytes",
    "atomic_write_json",
    "header_problems",
    "raw",
    "read_header",
    "tensor_bytes",
    "write_safetensors",
]

#: Bytes per element of every safetensors dtype (engram_mmap.safetensors_header.DTYPE_BYTES).
DTYPE_SIZES: dict[str, int] = DTYPE_BYTES

# safetensors dtype name -> the name its Python serializer (TensorSpec) accepts.
_SPEC_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "U64": "uint64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16",
    "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip

_NUMPY_NAMES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "uint64": "U64",
    "int32": "I32", "uint32": "U32", "int16": "I16", "uint16": "U16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL",
}  # fmt: skip


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def read_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Parse the header of a safetensors file (:func:`engram_mmap.safetensors_header.parse_header`).

    Parameters
    ----------
    path : the file.
    display : the name used in error messages (defaults to the path).

    Raises
    ------
    PackError naming the file (and the tensor where one is at fault) when the file is missing, shorter than
    its header, or the header is not a valid safetensors header (bad length, bad JSON, bad entries).
    Offsets are *not* checked against the file size here; use :func:`header_problems`.
    """
    name = display or os.fspath(path)
    try:
        return parse_header(path, display=name)
    except FileNotFoundError:
        raise PackError(f"{name}: file not found") from None
    except IsADirectoryError:
        raise PackError(f"{name}: is a directory, expected a safetensors file") from None
    except SafetensorsFormatError as e:
        raise PackError(str(e)) from None


# ----------------------------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True, slots=True)
class RawTensor:
    """Tensor bytes with a safetensors dtype name; lets numpy-less dtypes (BF16, F8) be written."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # contiguous, little-endian; any numpy dtype of the right byte size

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown safetensors dtype {self.dtype!r}")
        if not self.data.flags.c_contiguous:
            raise ValueError("RawTensor.data must be C-contiguous")
        want = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.data.nbytes != want:
            raise ValueError(f"RawTensor {self.dtype} {list(self.shape)} needs {want} bytes, got {self.data.nbytes}")


def raw(array: np.ndarray, dtype: str | None = None) -> RawTensor:
    """Wrap a numpy array; ``dtype`` overrides the safetensors dtype name (e.g. ``"BF16"`` for uint16 bits)."""
    a = np.asarray(array)  # not ascontiguousarray: it turns 0-dim markers into shape (1,)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    name = dtype or _NUMPY_NAMES.get(a.dtype.name)
    if name is None:
        raise ValueError(f"no safetensors dtype for numpy dtype {a.dtype}; pass dtype=")
    return RawTensor(name, tuple(int(d) for d in a.shape), a)


def tensor_bytes(t: RawTensor | np.ndarray) -> int:
    return t.data.nbytes if isinstance(t, RawTensor) else int(np.asarray(t).nbytes)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, RawTensor | np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` with safetensors' serializer, atomically (temporary file, fsync, rename).

    Values are :class:`RawTensor` or plain numpy arrays of a numpy-native dtype.
    """
    p = Path(path)
    keep: list[RawTensor] = []
    specs: dict[str, Any] = {}
    for k, v in tensors.items():
        t = v if isinstance(v, RawTensor) else raw(v)
        keep.append(t)
        specs[k] = TensorSpec(
            dtype=_SPEC_NAMES[t.dtype], shape=list(t.shape), data_ptr=t.data.ctypes.data, data_len=t.data.nbytes
        )
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        serialize_file(specs, str(tmp), metadata=dict(metadata) if metadata else None)
        os.chmod(tmp, 0o666 & ~_UMASK)  # the serializer creates 0600 files; packs are read by other users
        _fsync_path(tmp)
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    del keep
    return p


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same directory, fsync, rename)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    return p


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    """``json.dumps(obj, indent, sort_keys)`` plus a newline, written atomically; deterministic bytes."""
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
