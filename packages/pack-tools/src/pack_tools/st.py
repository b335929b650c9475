"""Safetensors headers and writing, with the precise error messages the pack tools need.

Reading parses the header ourselves (8-byte little-endian length, then JSON) so that a damaged file gives a
message naming the file and the tensor, and so that a 5 GB shard costs one small read. Writing always goes
through safetensors' own serializer (``safetensors.serialize_file``); dtypes numpy lacks (BF16, F8_E4M3,
F8_E8M0) are passed as raw bytes with the safetensors dtype name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize_file

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

#: Bytes per element of every safetensors dtype the packs use.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip

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

#: Largest header safetensors itself accepts (100 MB); anything larger is a damaged length field.
MAX_HEADER_BYTES = 100_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """One header entry: dtype name, shape and ``[begin, end)`` byte offsets relative to the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """A parsed safetensors header.

    ``data_start`` is the file offset of the data section (``8 + header_len``); ``sha256`` is the hash of the
    ``data_start`` leading bytes (length field and JSON), which is what a manifest records for input shards.
    """

    path: Path
    header_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    sha256: str
    file_size: int

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_size(self) -> int:
        """Bytes the header says the data section holds (the largest end offset)."""
        return max((t.end for t in self.tensors.values()), default=0)


def read_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Parse the header of a safetensors file.

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
    p = Path(path)
    name = display or str(p)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise PackError(f"{name}: file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise PackError(f"{name}: header length field is {n}, not a valid safetensors header")
            if 8 + n > size:
                raise PackError(f"{name}: truncated inside the header ({size} bytes, header needs {8 + n})")
            body = f.read(n)
    except FileNotFoundError:
        raise PackError(f"{name}: file not found") from None
    except IsADirectoryError:
        raise PackError(f"{name}: is a directory, expected a safetensors file") from None
    digest = hashlib.sha256(head + body).hexdigest()
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{name}: header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise PackError(f"{name}: header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise PackError(f"{name}: __metadata__ is not an object")
    tensors: dict[str, TensorInfo] = {}
    for key, entry in obj.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise PackError(f"{name}: {key}: malformed header entry {entry!r}") from None
        if not isinstance(dtype, str):
            raise PackError(f"{name}: {key}: malformed dtype {dtype!r}")
        tensors[key] = TensorInfo(dtype, shape, begin, end)
    return Header(p, n, tensors, {str(k): str(v) for k, v in meta.items()}, digest, size)


def header_problems(h: Header, name: str, only: Iterable[str] | None = None, limit: int = 20) -> list[str]:
    """Consistency problems of a parsed header against itself and the file size.

    Checks, per tensor: known dtype, ``end - begin == numel * itemsize``, non-negative offsets, data inside the
    file; and for the file: no overlapping tensors, no trailing garbage. ``only`` restricts the per-tensor
    checks to those names (the others still count for overlap and size). At most ``limit`` per-tensor lines
    are returned, followed by one line counting the rest.
    """
    out: list[str] = []
    extra = 0
    wanted = set(only) if only is not None else None
    avail = h.file_size - h.data_start

    def add(msg: str) -> None:
        nonlocal extra
        if len(out) < limit:
            out.append(msg)
        else:
            extra += 1

    for key, t in h.tensors.items():
        if wanted is not None and key not in wanted:
            continue
        if t.dtype not in DTYPE_SIZES:
            add(f"{name}: {key}: unknown dtype {t.dtype!r}")
            continue
        if any(d < 0 for d in t.shape):
            add(f"{name}: {key}: negative dimension in shape {list(t.shape)}")
            continue
        want = t.numel * DTYPE_SIZES[t.dtype]
        if t.begin < 0 or t.end < t.begin:
            add(f"{name}: {key}: invalid data_offsets [{t.begin}, {t.end}]")
        elif t.end - t.begin != want:
            add(
                f"{name}: {key}: data_offsets [{t.begin}, {t.end}] hold {t.end - t.begin} bytes, "
                f"but {t.dtype} {list(t.shape)} needs {want}"
            )
        elif t.end > avail:
            add(
                f"{name}: {key}: data ends at byte {h.data_start + t.end} but the file has {h.file_size} "
                f"bytes (truncated shard)"
            )
    if extra:
        out.append(f"{name}: ... and {extra} more problems in this file")
    spans = sorted((t.begin, t.end, k) for k, t in h.tensors.items() if t.end > t.begin)
    for (_b0, e0, k0), (b1, _e1, k1) in itertools.pairwise(spans):
        if b1 < e0:
            out.append(f"{name}: {k1}: data overlaps tensor {k0} (offsets {b1} < {e0})")
            break
    if not out and avail > h.data_size:
        out.append(
            f"{name}: {avail - h.data_size} bytes after the last tensor (file is {h.file_size} bytes, "
            f"header accounts for {h.data_start + h.data_size})"
        )
    return out


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
