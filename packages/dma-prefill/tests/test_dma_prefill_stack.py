"""Accuracy of the whole prefill path on the fake device: a small synthetic layer stack."""

from __future__ import annotations

import torch

from dma_prefill import DmaPrefill, FakeDevice, PrefillConfig
from dma_prefill.reference import SyntheticStack, kl_divergence, per_expert_errors, run_stack


def _prefill(stack: SyntheticStack, exact: bool) -> DmaPrefill:
    cfg = PrefillConfig(num_slots=2, experts_per_batch=4, exact=exact, backend="torch")
    return DmaPrefill(stack.store, cfg, device=FakeDevice(copy_gbps=1.0, launch_cost=1e-4))


def test_stack_kl_against_all_in_memory_reference(stack: SyntheticStack) -> None:
    h0 = stack.embed(64, seed=5)
    ref = stack.reference_logits(h0)
    exact = _prefill(stack, exact=True)
    kl = kl_divergence(ref, run_stack(stack, exact, h0))
    assert exact.device.violations == []
    assert float(kl.mean()) < 1e-9
    fp16 = kl_divergence(ref, run_stack(stack, _prefill(stack, exact=False), h0))
    # fp16 activations are a measurable loss: the KL measurement separates the two paths
    assert float(fp16.mean()) > 100 * float(kl.mean())


def test_per_expert_relative_error(stack: SyntheticStack) -> None:
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(6))
    err = per_expert_errors(stack.store, 1, _prefill(stack, exact=True), x, seed=1)
    assert err["ours"].max() < 4 * err["fp32"].max() + 1e-7
    assert err["ours"].max() < 1e-5
