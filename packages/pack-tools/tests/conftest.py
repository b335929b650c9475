"""Fixtures: the tiny-v41 inputs and pack are built once per session; tests that damage files get a copy."""

from __future__ import annotations

import fnmatch
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import pack_tools.download as dl
from pack_tools import build_pack
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import synth_tiny_v41


class Tiny:
    """A synthesized tiny-v41 models root: the two inputs and (once built) the pack beside them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.exl3 = root / EXL3.dirname
        self.engram = root / ENGRAM.dirname
        self.pack = root / "pack"

    def build(self, **kw: object) -> Path:
        return build_pack(self.exl3, self.engram, self.pack, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_session(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    t = Tiny(tmp_path_factory.mktemp("tiny-v41"))
    synth_tiny_v41(t.root, seed=0)
    t.build()
    return t


@pytest.fixture
def tiny(tiny_session: Tiny, tmp_path: Path) -> Tiny:
    """A private copy (inputs + pack; the pack's links are relative, so they resolve inside the copy)."""
    dst = tmp_path / "models"
    shutil.copytree(tiny_session.root, dst, symlinks=True)
    return Tiny(dst)


@pytest.fixture
def tiny_inputs(tiny_session: Tiny, tmp_path: Path) -> Tiny:
    """A private copy of the inputs only (no pack yet)."""
    dst = tmp_path / "models"
    shutil.copytree(tiny_session.root, dst, symlinks=True, ignore=shutil.ignore_patterns("pack"))
    return Tiny(dst)


# ----------------------------------------------------------------------------------- a fake hub


EXL3_FILES = {
    "config.json": b"{}",
    "quantization_config.json": b"{}",
    "model.safetensors.index.json": b"{}",
    "model-00001-of-00002.safetensors": b"a" * 100,
    "model-00002-of-00002.safetensors": b"b" * 50,
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "chat_template.jinja": b"{{x}}",
    "README.md": b"readme",
    "images/banner.png": b"png",
    ".gitattributes": b"*",
}
ENGRAM_FILES = {
    "config.json": b"{}",
    "model.safetensors.index.json": b"{}",
    "inference/engram.py": b"# engram",
    "inference/model.py": b"# model",
    "model-00046-of-00048.safetensors": b"x" * 10,
    "model-00047-of-00048.safetensors": b"y" * 30,
    "model-00048-of-00048.safetensors": b"z" * 40,
    "README.md": b"readme",
}


class FakeHub:
    """Records every call; serves the files above; can be told to deliver a short file."""

    def __init__(self, short: str | None = None) -> None:
        self.repos = {(EXL3.repo_id, EXL3.revision): EXL3_FILES, (ENGRAM.repo_id, ENGRAM.revision): ENGRAM_FILES}
        self.list_calls: list[tuple[str, str, str | None]] = []
        self.download_calls: list[dict] = []
        self.short = short

    def list_files(self, repo_id, revision, token):
        self.list_calls.append((repo_id, revision, token))
        files = self.repos[(repo_id, revision)]
        return [
            dl.RemoteFile(p, len(b), hashlib.sha256(b).hexdigest() if p.endswith(".safetensors") else None)
            for p, b in files.items()
        ]

    def snapshot_download(self, repo_id, revision, allow_patterns, local_dir, max_workers, token):
        self.download_calls.append(dict(repo_id=repo_id, revision=revision, allow_patterns=list(allow_patterns),
                                        local_dir=Path(local_dir), max_workers=max_workers, token=token))  # fmt: skip
        for p, b in self.repos[(repo_id, revision)].items():
            if any(fnmatch.fnmatch(p, pat) for pat in allow_patterns):
                dst = Path(local_dir) / p
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(b[:-1] if p == self.short else b)
        return Path(local_dir)


@pytest.fixture
def fake_hub_factory() -> Callable[..., FakeHub]:
    return FakeHub


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """A FakeHub installed as the CLI's default hub."""
    hub = FakeHub()
    monkeypatch.setattr(dl, "default_hub", lambda: hub)
    return hub
