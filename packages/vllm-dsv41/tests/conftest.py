"""Fixtures: a tiny-demo pack for unit tests (the served demo is tested in apps/server), its host home and the
float64 reference of its routed experts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools.presets.tiny_demo import synth_tiny_demo

    return synth_tiny_demo(tmp_path_factory.mktemp("vllm-dsv41") / "tiny-demo")


@pytest.fixture(scope="module")
def home(demo_pack: Path) -> Iterator[Any]:
    """The demo pack's routed experts mapped (``ExpertHome``; not CUDA-registered)."""
    from vllm_dsv41.home import ExpertHome

    with ExpertHome(demo_pack) as h:
        yield h


@pytest.fixture(scope="module")
def reference(home: Any) -> Any:
    """``ReferenceExperts`` (float64) over the home's layers, no SwiGLU clamp."""
    from vllm_dsv41.reference import ReferenceExperts

    ref = ReferenceExperts()
    for lx in home.layers():
        ref.add_layer(lx.layer, lx.gate, lx.up, lx.down, swiglu_limit=None)
    return ref
