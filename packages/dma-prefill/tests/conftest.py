"""Shared fixtures of the dma-prefill tests (test modules cannot import each other)."""

from __future__ import annotations

import pytest
import torch

from dma_prefill import LayerSpec, StoreConfig
from dma_prefill.reference import SyntheticStack, fill_random
from dma_prefill.store import HostExpertStore

SMALL = LayerSpec(num_experts=16, hidden=256, intermediate=128)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The CI machine has 2 cores shared by everything: torch's intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def small_store() -> HostExpertStore:
    """Two layers of 16 random MUL1 K=3 experts (H=256, I=128), plain host memory."""
    store = HostExpertStore({0: SMALL, 1: SMALL}, StoreConfig(progress=False), use_cuda=False)
    fill_random(store, seed=11)
    return store


@pytest.fixture(scope="session")
def mixed_store() -> HostExpertStore:
    """One layer whose projections use three codebooks and three K (gate MCG 2, up 3INST 4, down MUL1 3.5)."""
    spec = LayerSpec(8, 256, 128, bits=(2, 4, 3.5), codebooks=("mcg", "3inst", "mul1"))
    store = HostExpertStore({5: spec}, StoreConfig(progress=False), use_cuda=False)
    fill_random(store, seed=12)
    return store


@pytest.fixture(scope="session")
def stack() -> SyntheticStack:
    return SyntheticStack.build(num_layers=3, seed=3, use_cuda=False)


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct top-k ids and normalised weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids, w / w.sum(1, keepdim=True)


@pytest.fixture
def make_routing():
    return routing
