"""Safetensors header parsing with validation, and index (weight_map) resolution.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data; offsets are relative to
byte 8 + N. Only the header is read; tensors are mapped, never loaded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

__all__ = ["EngramFormatError", "TensorInfo", "read_header", "resolve_tensor_files"]

# Bytes per element of every safetensors dtype (the validation needs all of them to check sizes).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024  # the reference safetensors implementation refuses larger headers


class EngramFormatError(ValueError):
    """A table file or index is malformed (the message names the file and the tensor)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in its file.

    Attributes
    ----------
    path : str
        The shard file.
    name : str
        Tensor name.
    dtype : str
        Safetensors dtype string.
    shape : tuple of int
        Tensor shape.
    offset : int
        Absolute byte offset of the data in the file.
    nbytes : int
        Data size in bytes.
    """

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file.

    Checks: the length prefix fits in the file, the JSON is an object of tensor entries with a known
    dtype, a shape of non-negative ints and ``data_offsets`` with ``end - begin`` equal to the
    shape's byte size, every tensor inside the file. Overlaps are not checked (they are legal to read).

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
    EngramFormatError
        Anything malformed, naming the file (and the tensor where one is at fault).
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise EngramFormatError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise EngramFormatError(f"{path}: header length {n} exceeds {_MAX_HEADER} bytes (not safetensors?)")
        if 8 + n > size:
            raise EngramFormatError(f"{path}: header length {n} runs past the end of the {size}-byte file (truncated?)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngramFormatError(f"{path}: the header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise EngramFormatError(f"{path}: the header is not a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise EngramFormatError(f"{where}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise EngramFormatError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise EngramFormatError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise EngramFormatError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if begin < 0 or end < begin or end - begin != nbytes:
            raise EngramFormatError(
                f"{where}: data_offsets {offsets} do not hold {nbytes} bytes ({dtype} {tuple(shape)})"
            )
        if end > data_size:
            raise EngramFormatError(
                f"{where}: data ends at byte {data_start + end} but the file has {size} bytes (truncated?)"
            )
        tensors[name] = TensorInfo(path, name, dtype, tuple(shape), data_start + begin, nbytes)
    return tensors


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
        Tensor name -> shard path. A tensor the index does not list raises EngramFormatError; a
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
        raise EngramFormatError(f"{path}: not a valid JSON index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise EngramFormatError(f"{path}: no weight_map object")
    folder = os.path.dirname(os.path.abspath(path))
    files = {}
    for name in names:
        shard = weight_map.get(name)
        if shard is None:
            raise EngramFormatError(f"{path}: tensor {name!r} is not in the weight_map")
        if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.split("/"):
            raise EngramFormatError(f"{path}: tensor {name!r} maps to an invalid shard name {shard!r}")
        shard_path = os.path.join(folder, shard)
        if not os.path.exists(shard_path):
            raise FileNotFoundError(f"{shard_path}: shard of tensor {name!r} (listed in {path}) does not exist")
        files[name] = shard_path
    return files
