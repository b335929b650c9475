"""The expert runtime (cpu_tier.ExpertTier behind the ``dsv41::routed_experts`` op) against the numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_tier.exl3 import Exl3Tensor
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41.experts import CpuExpertRuntime, register_runtime, routed_experts, unregister_runtime
from vllm_dsv41.reference import ReferenceExperts

LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 8, 2, 256


def _experts(pack: Path, layer: int) -> list[list[Exl3Tensor]]:
    from safetensors import safe_open

    with safe_open(str(pack / "model.safetensors"), framework="numpy") as f:
        return [
            [Exl3Tensor.from_safetensors(f, f"model.layers.{layer}.mlp.experts.{e}.{p}") for e in range(EXPERTS)]
            for p in ("gate_proj", "up_proj", "down_proj")
        ]


@pytest.fixture(scope="module")
def runtimes(demo_pack: Path) -> tuple[int, ReferenceExperts]:
    ref = ReferenceExperts()
    runtime = CpuExpertRuntime(Dsv41PluginConfig(precision="exact"))
    for layer in range(LAYERS):
        gate, up, down = _experts(demo_pack, layer)
        ref.add_layer(layer, gate, up, down, swiglu_limit=None)
        runtime.add_layer(layer, gate, up, down, swiglu_limit=None)
    handle = register_runtime(runtime)
    yield handle, ref
    unregister_runtime(handle)


def _routing(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(EXPERTS, size=TOP_K, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, size=(tokens, TOP_K))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("layer", range(LAYERS))
def test_routed_experts_op_matches_reference(runtimes: tuple[int, ReferenceExperts], tokens: int, layer: int) -> None:
    handle, ref = runtimes
    rng = np.random.default_rng(100 * tokens + layer)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    ids, w = _routing(rng, tokens)
    out = routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), handle, layer)
    assert out.dtype == torch.float32 and out.shape == (tokens, HIDDEN)
    expected = ref.forward(layer, x, ids, w)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=2e-5 * scale)


def test_int32_ids_bf16_activations_and_empty_batches(runtimes: tuple[int, ReferenceExperts]) -> None:
    handle, ref = runtimes
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((5, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
    ids, w = _routing(rng, 5)
    out = routed_experts(x, torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(w), handle, 1)
    assert out.dtype == torch.bfloat16
    expected = ref.forward(1, x.float().numpy(), ids, w)
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=0, atol=2e-2 * np.abs(expected).max())
    empty = routed_experts(torch.zeros(0, HIDDEN), torch.zeros(0, TOP_K, dtype=torch.int64), torch.zeros(0, TOP_K), handle, 0)
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match=r"\[T, 256\]"):
        routed_experts(torch.zeros(2, 128), torch.zeros(2, TOP_K, dtype=torch.int64), torch.zeros(2, TOP_K), handle, 0)


def test_op_has_a_shape_only_fake(runtimes: tuple[int, ReferenceExperts]) -> None:
    handle, _ = runtimes
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(9, HIDDEN)
        out = torch.ops.dsv41.routed_experts(x, torch.empty(9, TOP_K, dtype=torch.int64), torch.empty(9, TOP_K), handle, 0)
        assert out.shape == (9, HIDDEN)
