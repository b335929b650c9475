"""Fixtures: a tiny-demo pack for unit tests (the served demo is tested in apps/server), its host home, the
float64 reference of its routed experts, and a runner of code under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


def _run_interpreted(code: str, oks: int, timeout: float) -> None:
    """Run ``code`` in a subprocess under Triton's interpreter (``TRITON_INTERPRET=1`` must precede Triton's
    import), with a fresh ``SEED`` and this folder as ``TESTS_DIR`` in its environment; it must exit 0 and print
    ``oks`` lines starting "ok " (the seed is in the failure message)."""
    pytest.importorskip("triton")
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(seed), TESTS_DIR=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"seed {seed}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.stdout.count("ok ") == oks, r.stdout


@pytest.fixture
def interpreted() -> Callable[[str, int, float], None]:
    """``interpreted(code, oks, timeout)``: ``code`` run under Triton's interpreter in a subprocess (above)."""
    return _run_interpreted
