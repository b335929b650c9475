"""The README's example runs as written: every ```python block of README.md is executed, in order, in one
namespace (so the example cannot drift from the API)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_has_an_example() -> None:
    blocks = _python_blocks()
    assert blocks, "README.md has no ```python block"
    assert any("Exl3Tensor.from_safetensors" in b for b in blocks)


def test_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "readme_example"}
    for block in _python_blocks():
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own example
    printed = capsys.readouterr().out
    err = float(re.search(r"relative error: ([0-9.eE+-]+)", printed).group(1))  # type: ignore[union-attr]
    assert 0 < err < 5e-3
    assert "(3, 1024)" in printed
