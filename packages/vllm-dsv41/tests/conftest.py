"""Fixtures: a tiny-demo pack for unit tests (the served demo is tested in apps/server)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools.presets.tiny_demo import synth_tiny_demo

    return synth_tiny_demo(tmp_path_factory.mktemp("vllm-dsv41") / "tiny-demo")
