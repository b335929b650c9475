"""Safetensors headers: parsing, validation and index (weight_map) resolution. Public API.

The project's one safetensors header reader (pack-tools and the vLLM plugin use it too). Layout: an 8-byte
little-endian header length N, N bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}``, then the data; offsets are relative to byte ``8 + N``. Only the header is read, so a
5 GB shard costs one small read; tensors are mapped or read by the caller.

* :func:`parse_header` - the structure (length field, JSON, entry types) -> :class:`Header`; raises on the first
  structural fault;
* :func:`header_problems` - every consistency problem of a parsed header against itself and the file size, one
  line each (``"file: tensor: what"``);
* :func:`read_header` - both, strict: the tensors of a file, or an error naming the file and the tensor;
* :func:`resolve_tensor_files` - which shard holds each tensor, from an index, a folder or one file.

Every error is a :class:`SafetensorsFormatError` (a ``ValueError``) whose message starts with the file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "DTYPE_BYTES",
    "MAX_HEADER_BYTES",
    "EngramFormatError",
    "Header",
    "SafetensorsFormatError",
    "TensorInfo",
    "header_problems",
    "parse_header",
    "read_header",
    "resolve_tensor_files",
]

#: Bytes per element of every safetensors dtype.
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

#: Largest header the safetensors library itself accepts; anything larger is a damaged length field.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsFormatError(ValueError):
    """A safetensors file or index is malformed (the message names the file, and the tensor where one is at fault)."""


#: engram-mmap's name for the same error (its tables raise it for their own checks too).
EngramFormatError = SafetensorsFormatError


class TensorInfo(NamedTuple):
    """Where one tensor lies in its file (a named tuple: a header of 10^5 entries parses fast).

    Attributes
    ----------
    path : the shard file.
    name : tensor name.
    dtype : safetensors dtype string.
    shape : tensor shape.
    begin, end : ``data_offsets``, relative to the data section.
    data_start : file offset of the data section (``8 + header length``).
    """

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int

    @property
    def offset(self) -> int:
        """Absolute byte offset of the data in the file."""
        return self.data_start + self.begin

    @property
    def nbytes(self) -> int:
        """Data size in bytes (as the offsets say; :func:`header_problems` checks it against dtype and shape)."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed safetensors header.

    Attributes
    ----------
    path : the file.
    display : the name error messages and problems use for the file.
    header_len : N, the JSON's length in bytes.
    tensors : name -> :class:`TensorInfo`, in header order (``__metadata__`` excluded).
    metadata : ``__metadata__`` (string to string).
    sha256 : hash of the ``8 + N`` leading bytes (length field and JSON), e.g. for a manifest.
    file_size : the file's size when read.
    """

    path: str
    display: str
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


def parse_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Read and parse the header of one safetensors file (structure only).

    Checks the length field (non-zero, at most :data:`MAX_HEADER_BYTES`, inside the file), that the header is a
    UTF-8 JSON object, and that every entry has a string dtype, a list-of-ints shape and a ``[begin, end]`` pair
    of ints. Dtype names, sizes and offsets are checked by :func:`header_problems`.

    Parameters
    ----------
    path : the .safetensors file.
    display : the file's name in messages (defaults to ``path``).

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        ``path`` is not a file.
    SafetensorsFormatError
        The structure is malformed (the message names the file, and the tensor where one is at fault).
    """
    path = os.fspath(path)
    name = display or path
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(
                f"{name}: file is {size} bytes, too short for a safetensors header (truncated?)"
            )
        (n,) = struct.unpack("<Q", head)
        if n == 0:
            raise SafetensorsFormatError(f"{name}: header length field is 0, not a valid safetensors header")
        if n > MAX_HEADER_BYTES:
            raise SafetensorsFormatError(
                f"{name}: header length field is {n}, exceeds {MAX_HEADER_BYTES} bytes (not a safetensors file?)"
            )
        if 8 + n > size:
            raise SafetensorsFormatError(
                f"{name}: truncated inside the header (its length field says {n} bytes, which runs past the end "
                f"of the {size}-byte file)"
            )
        body = f.read(n)
    digest = hashlib.sha256(head + body).hexdigest()
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"{name}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise SafetensorsFormatError(f"{name}: safetensors header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsFormatError(f"{name}: __metadata__ is not an object")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    ints = _INT_TYPES
    for key, entry in obj.items():
        # type() checks, not isinstance: JSON gives exact types, and bool (a subclass of int) must not pass
        if type(entry) is not dict:
            raise SafetensorsFormatError(f"{name}: {key}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if type(dtype) is not str:
            raise SafetensorsFormatError(f"{name}: {key}: dtype must be a string, got {dtype!r}")
        if type(shape) is not list or not set(map(type, shape)) <= ints:
            raise SafetensorsFormatError(f"{name}: {key}: shape must be a list of ints, got {shape!r}")
        if type(offsets) is not list or len(offsets) != 2 or not set(map(type, offsets)) <= ints:
            raise SafetensorsFormatError(f"{name}: {key}: data_offsets must be [begin, end], got {offsets!r}")
        tensors[key] = TensorInfo(path, key, dtype, tuple(shape), offsets[0], offsets[1], data_start)
    return Header(path, name, n, tensors, {str(k): str(v) for k, v in meta.items()}, digest, size)


_INT_TYPES = frozenset({int})


def _tensor_problems(h: Header, name: str, only: set[str] | None) -> Iterator[str]:
    avail = h.file_size - h.data_start
    sizes, prod = DTYPE_BYTES, math.prod
    for key, (_path, _name, dtype, shape, begin, end, _start) in h.tensors.items():
        if only is not None and key not in only:
            continue
        itemsize = sizes.get(dtype)
        if itemsize is None:
            yield f"{name}: {key}: unknown dtype {dtype!r}"
            continue
        if shape and min(shape) < 0:
            yield f"{name}: {key}: negative dimension in shape {list(shape)}"
            continue
        want = prod(shape) * itemsize
        if end - begin == want and begin >= 0 and end <= avail:
            continue
        if begin < 0 or end < begin:
            yield f"{name}: {key}: invalid data_offsets [{begin}, {end}]"
        elif end - begin != want:
            yield (
                f"{name}: {key}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"but {dtype} {list(shape)} needs {want}"
            )
        else:
            yield (
                f"{name}: {key}: data ends at byte {h.data_start + end} but the file has {h.file_size} "
                f"bytes (truncated shard)"
            )


def header_problems(
    h: Header, name: str | None = None, only: Iterable[str] | None = None, limit: int = 20
) -> list[str]:
    """Consistency problems of a parsed header against itself and the file size, one line each.

    Checks, per tensor: known dtype, no negative dimension, ``end - begin == numel * itemsize``, non-negative
    offsets, data inside the file; and for the file: no overlapping tensors, no trailing bytes after the last
    tensor. ``only`` restricts the per-tensor checks to those names (the others still count for overlap and
    size). At most ``limit`` per-tensor lines are returned, followed by one line counting the rest. ``name`` is
    the file's name in the lines (default: ``h.display``).
    """
    name = name or h.display
    out: list[str] = []
    extra = 0
    for msg in _tensor_problems(h, name, set(only) if only is not None else None):
        if len(out) < limit:
            out.append(msg)
        else:
            extra += 1
    if extra:
        out.append(f"{name}: ... and {extra} more problems in this file")
    spans = sorted((t.begin, t.end, k) for k, t in h.tensors.items() if t.end > t.begin)
    for (_b0, e0, k0), (b1, _e1, k1) in itertools.pairwise(spans):
        if b1 < e0:
            out.append(f"{name}: {k1}: data overlaps tensor {k0} (offsets {b1} < {e0})")
            break
    avail = h.file_size - h.data_start
    if not out and avail > h.data_size:
        out.append(
            f"{name}: {avail - h.data_size} bytes after the last tensor (file is {h.file_size} bytes, "
            f"header accounts for {h.data_start + h.data_size})"
        )
    return out


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file; its tensors.

    Every tensor must have a known dtype, no negative dimension, ``data_offsets`` that hold exactly its bytes,
    and lie inside the file. Overlaps and trailing bytes are not errors here (they are legal to read).

    Parameters
    ----------
    path : path-like
        The .safetensors file.

    Returns
    -------
    dict
        Tensor name -> :class:`TensorInfo` (``__metadata__`` excluded).

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    SafetensorsFormatError
        Anything malformed, naming the file (and the tensor where one is at fault).
    """
    h = parse_header(path)
    for msg in _tensor_problems(h, h.display, None):
        raise SafetensorsFormatError(msg)
    return h.tensors


def resolve_tensor_files(source: str | os.PathLike[str], names: list[str]) -> dict[str, str]:
    """Which file holds each tensor, from an index json, a model folder or a single shard.

    Parameters
    ----------
    source : path-like
        ``model.safetensors.index.json`` (or any ``*.index.json``), a folder holding one (or a single
        ``model.safetensors``), or a ``.safetensors`` file.
    names : list of str
        Tensor names wanted.

    Returns
    -------
    dict
        Tensor name -> shard path. A tensor the index does not list raises SafetensorsFormatError; a
        listed shard that does not exist raises FileNotFoundError.
    """
    path = os.fspath(source)
    if os.path.isdir(path):
        for candidate in ("model.safetensors.index.json", "model.safetensors"):
            if os.path.exists(os.path.join(path, candidate)):
                path = os.path.join(path, candidate)
                break
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors.index.json or model.safetensors in the folder")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if not path.endswith(".json"):
        return {name: path for name in names}
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"{path}: not a valid JSON index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise SafetensorsFormatError(f"{path}: no weight_map object")
    folder = os.path.dirname(os.path.abspath(path))
    files = {}
    for name in names:
        shard = weight_map.get(name)
        if shard is None:
            raise SafetensorsFormatError(f"{path}: tensor {name!r} is not in the weight_map")
        if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.split("/"):
            raise SafetensorsFormatError(f"{path}: tensor {name!r} maps to an invalid shard name {shard!r}")
        shard_path = os.path.join(folder, shard)
        if not os.path.exists(shard_path):
            raise FileNotFoundError(f"{shard_path}: shard of tensor {name!r} (listed in {path}) does not exist")
        files[name] = shard_path
    return files
