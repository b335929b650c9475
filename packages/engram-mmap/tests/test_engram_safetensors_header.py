"""engram_mmap.safetensors_header as a library: parse_header's fields, header_problems' file-level checks."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from engram_mmap.safetensors_header import (
    DTYPE_BYTES,
    SafetensorsFormatError,
    header_problems,
    parse_header,
    read_header,
)


def _raw(path, entries: dict, data: bytes) -> bytes:
    header = json.dumps(entries).encode()
    head = struct.pack("<Q", len(header)) + header
    path.write_bytes(head + data)
    return head


def test_parse_header_matches_the_safetensors_library(tmp_path) -> None:
    rng = np.random.default_rng()
    arrays = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.integers(-9, 9, (7,), dtype=np.int16),
        "c": np.zeros((0, 4), np.float16),
    }
    path = tmp_path / "x.safetensors"
    save_file(arrays, str(path), metadata={"format": "np"})
    h = parse_header(path)
    assert h.metadata == {"format": "np"} and h.file_size == path.stat().st_size
    raw = path.read_bytes()
    assert h.sha256 == hashlib.sha256(raw[: h.data_start]).hexdigest()
    assert header_problems(h) == []
    for name, a in arrays.items():
        t = h.tensors[name]
        assert (t.name, t.shape, t.nbytes, t.numel) == (name, a.shape, a.nbytes, a.size)
        assert DTYPE_BYTES[t.dtype] == a.itemsize
        assert raw[t.offset : t.offset + t.nbytes] == a.tobytes()
    assert read_header(path) == h.tensors


def test_file_level_problems(tmp_path) -> None:
    path = tmp_path / "f.safetensors"
    _raw(path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6)  # fmt: skip
    assert header_problems(parse_header(path), "F") == ["F: b: data overlaps tensor a (offsets 2 < 4)"]
    read_header(path)  # overlaps are legal to read

    _raw(path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 9)
    h = parse_header(path, display="G")
    assert header_problems(h) == [f"G: 5 bytes after the last tensor (file is {h.file_size} bytes, header accounts "
                                  f"for {h.data_start + 4})"]  # fmt: skip

    entries = {f"t{i}": {"dtype": "Q8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(25)}
    _raw(path, entries, b"\0" * 25)
    lines = header_problems(parse_header(path), "H", limit=20)
    assert len(lines) == 21 and lines[-1] == "H: ... and 5 more problems in this file"
    assert header_problems(parse_header(path), "H", only=["t3"]) == ["H: t3: unknown dtype 'Q8'"]
    with pytest.raises(SafetensorsFormatError, match="t0: unknown dtype 'Q8'"):
        read_header(path)


def test_missing_file_is_not_a_format_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        parse_header(tmp_path / "absent.safetensors")
