"""The committed ``_native.pyi`` is what nanobind's stub generator writes for the built extension."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nanobind.stubgen")

STUB = Path(__file__).resolve().parents[1] / "src" / "engram_mmap" / "_native.pyi"


def test_native_stub_is_current(tmp_path: Path) -> None:
    out = tmp_path / "_native.pyi"
    r = subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "engram_mmap._native", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_text() == STUB.read_text(), (
        "src/engram_mmap/_native.pyi is stale: regenerate it with "
        "python -m nanobind.stubgen -m engram_mmap._native -o packages/engram-mmap/src/engram_mmap/_native.pyi"
    )
