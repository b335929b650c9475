"""Fixtures: a tiny-demo pack for unit tests, and the session's shared demo server (dsv41_server.testing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv41_server.testing import DemoServer, release_shared_demo_server, shared_demo_server


@pytest.fixture(scope="session")
def demo_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools.presets.tiny_demo import synth_tiny_demo

    return synth_tiny_demo(tmp_path_factory.mktemp("vllm-dsv41") / "tiny-demo")


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    server = shared_demo_server(tmp_path_factory.mktemp("demo-server"))
    yield server
    release_shared_demo_server()
