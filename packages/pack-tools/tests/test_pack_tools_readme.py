"""The README's python blocks run as written, in order, in one namespace, in a scratch directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    assert blocks, "README.md has no python example"
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {"__name__": "__readme__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{README.name} python block {i + 1}", "exec"), ns)  # noqa: S102
    out = capsys.readouterr().out
    assert "DeepseekV41ForCausalLM 4 MoE layers, 16 experts per layer" in out, out
