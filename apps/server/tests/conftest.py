"""Fixtures: the shared tiny-demo server (one per test session, see dsv41_server.testing) and an OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dsv41_server.testing import DemoServer, release_shared_demo_server, shared_demo_server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    server = shared_demo_server(tmp_path_factory.mktemp("demo-server"))
    yield server
    release_shared_demo_server()


@pytest.fixture(scope="session")
def client(demo_server: DemoServer) -> Iterator[Any]:
    from openai import OpenAI

    c = OpenAI(base_url=demo_server.base_url + "/v1", api_key=demo_server.api_key, max_retries=0, timeout=300)
    yield c
    c.close()
