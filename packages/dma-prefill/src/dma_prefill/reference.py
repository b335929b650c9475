"""All-in-memory references and a small synthetic MoE stack, for tests and the accuracy report.

The reference reads each expert straight from the host store, decodes it with ``cpu_tier.exl3.decode`` (the
numpy reference, independent of this package's decoders) and runs the EXL3 forward in float64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from cpu_tier import exl3

from .config import PROJECTIONS, LayerSpec, StoreConfig
from .ops_torch import expert_torch
from .store import ExpertStore, HostExpertStore

__all__ = [
    "SyntheticStack",
    "fill_random",
    "kl_divergence",
    "per_expert_errors",
    "reference_expert",
    "reference_moe",
    "run_stack",
]

MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fill_random(store: HostExpertStore, seed: int = 0) -> None:
    """Fill every expert of every layer with a valid random EXL3 tensor (``cpu_tier.exl3.random_tensor``)."""
    rng = np.random.default_rng(seed)
    for lid in store.layer_ids:
        spec = store.spec(lid)
        for e in range(spec.num_experts):
            for p in PROJECTIONS:
                ps = spec.proj(p)
                store.write(lid, e, p, exl3.random_tensor(ps.k, ps.n, ps.bits, ps.codebook, rng))


def reference_expert(
    store: ExpertStore, layer: int, expert: int, x: torch.Tensor, *, limit: float | None = None,
    dtype: torch.dtype = torch.float64, sequential: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One expert on CPU rows ``x`` in ``dtype`` (float64: the reference; float32: the fp32-noise yardstick,
    with the GEMMs summed blockwise by BLAS or, ``sequential``, strictly in k order)."""
    spec = store.spec(layer)
    weights = {}
    for p in PROJECTIONS:
        cb = spec.proj(p).codebook
        w_inner = torch.from_numpy(exl3.decode(store.numpy(layer, expert, p, "trellis"), cb))
        weights[p] = (w_inner, store.tensor(layer, expert, p, "suh"), store.tensor(layer, expert, p, "svh"))
    return expert_torch(x.cpu(), weights, limit=limit, dtype=dtype, sequential=sequential)


def reference_moe(
    store: ExpertStore,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    limit: float | None = None,
    dtype: torch.dtype = torch.float64,
    sequential: bool = False,
) -> torch.Tensor:
    """``sum_k w_k * expert_k(x)`` for every token, on the CPU in ``dtype`` (``sequential``: GEMMs in k order)."""
    x = x.cpu().to(dtype)
    ids = topk_ids.cpu()
    ws = topk_weights.cpu().to(dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = reference_expert(store, layer, e, x[tok], limit=limit, dtype=dtype, sequential=sequential)
        out.index_add_(0, tok, y * ws[tok, slot][:, None])
    return out


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(softmax(ref) || softmax(logits))`` in float64."""
    p = torch.log_softmax(ref_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1)


@dataclasses.dataclass(eq=False)
class SyntheticStack:
    """A small residual stack of MoE layers with random EXL3 experts, softmax top-k routers and an unembedding.

    ``h <- h + moe_l(rmsnorm(h))`` per layer, logits ``= rmsnorm(h) @ unembed``.
    """

    store: HostExpertStore
    routers: dict[int, torch.Tensor]  # float64 [H, E]
    unembed: torch.Tensor  # float64 [H, V]
    top_k: int

    @classmethod
    def build(
        cls,
        num_layers: int = 3,
        spec: LayerSpec | None = None,
        *,
        top_k: int = 4,
        vocab: int = 512,
        seed: int = 0,
        use_cuda: bool | None = None,
    ) -> SyntheticStack:
        spec = spec or LayerSpec(num_experts=16, hidden=256, intermediate=128)
        store = HostExpertStore({i: spec for i in range(num_layers)}, StoreConfig(progress=False), use_cuda=use_cuda)
        fill_random(store, seed)
        g = torch.Generator().manual_seed(seed)
        routers = {
            i: torch.randn(spec.hidden, spec.num_experts, generator=g, dtype=torch.float64) for i in range(num_layers)
        }
        unembed = torch.randn(spec.hidden, vocab, generator=g, dtype=torch.float64) * 4.0 / spec.hidden**0.5
        return cls(store, routers, unembed, top_k)

    def embed(self, tokens: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(tokens, self.store.spec(0).hidden, generator=g, dtype=torch.float64)

    def route(self, layer: int, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(xn @ self.routers[layer].to(xn), dim=-1)
        w, ids = torch.topk(scores, self.top_k, dim=-1)
        return ids, w / w.sum(-1, keepdim=True)

    def forward(self, h0: torch.Tensor, moe: MoeFn, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Logits ``[T, V]``; ``moe(layer, xn, topk_ids, topk_weights)`` computes one MoE layer."""
        h = h0.to(dtype)
        for layer in sorted(self.routers):
            xn = torch.nn.functional.rms_norm(h, (h.shape[-1],))
            ids, w = self.route(layer, xn)
            h = h + moe(layer, xn, ids, w).to(dtype)
        return torch.nn.functional.rms_norm(h, (h.shape[-1],)) @ self.unembed.to(h)

    def reference_logits(self, h0: torch.Tensor) -> torch.Tensor:
        return self.forward(h0.cpu(), lambda layer, x, i, w: reference_moe(self.store, layer, x, i, w))


def run_stack(
    stack: SyntheticStack, prefill: object, h0: torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Logits of ``stack`` with every MoE layer run by ``prefill`` (a ``DmaPrefill``), in float32 on ``device``.

    Each layer's plan is built from the float32 routing; the next layer's first batches are prefetched.
    """
    from .plan import PrefillPlan
    from .prefill import DmaPrefill

    if not isinstance(prefill, DmaPrefill):
        raise TypeError("prefill must be a DmaPrefill")
    layers = sorted(stack.routers)
    E = stack.store.spec(layers[0]).num_experts

    def moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plan = PrefillPlan.build(ids, w, E, prefill.config.experts_per_batch)
        i = layers.index(layer)
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        out = prefill.run_layer(layer, x.contiguous(), plan, next_layer=nxt)
        prefill.device.synchronize()
        return out

    return stack.forward(h0.to(device), moe, dtype=torch.float32)


def per_expert_errors(
    store: HostExpertStore, layer: int, prefill: object, x: torch.Tensor, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """Route every token of ``x`` to one expert (weight 1) and compare each expert's rows with the reference.

    Returns ``{"ours": [E], "fp32": [E], "fp32_seq": [E]}``: ``max|y - ref| / max|ref|`` per expert for the
    prefill path and for two float32 evaluations of the same formula that differ only in the association of the
    GEMM sums (BLAS blocked, strictly sequential): the spread of fp32-reassociation noise.
    """
    from .plan import PrefillPlan
    from .prefill import DmaPrefill

    if not isinstance(prefill, DmaPrefill):
        raise TypeError("prefill must be a DmaPrefill")
    E = store.spec(layer).num_experts
    T = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(T, generator=g) % E).view(T, 1)
    w = torch.ones(T, 1)
    plan = PrefillPlan.build(ids.to(x.device), w.to(x.device), E, prefill.config.experts_per_batch)
    out = prefill.run_layer(layer, x, plan)
    prefill.device.synchronize()
    out = out.cpu().double()
    ref = reference_moe(store, layer, x, ids, w)
    ref32 = reference_moe(store, layer, x, ids, w, dtype=torch.float32).double()
    ref32s = reference_moe(store, layer, x, ids, w, dtype=torch.float32, sequential=True).double()
    res: dict[str, np.ndarray] = {"ours": np.zeros(E), "fp32": np.zeros(E), "fp32_seq": np.zeros(E)}
    for e in range(E):
        rows = (ids[:, 0] == e).nonzero()[:, 0]
        scale = ref[rows].abs().max()
        res["ours"][e] = float((out[rows] - ref[rows]).abs().max() / scale)
        res["fp32"][e] = float((ref32[rows] - ref[rows]).abs().max() / scale)
        res["fp32_seq"][e] = float((ref32s[rows] - ref[rows]).abs().max() / scale)
    return res
