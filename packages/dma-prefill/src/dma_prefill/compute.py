"""Computing the routed experts of one staged batch: the backend interface and the pure-torch backend.

A backend (:class:`BatchCompute`) reads the expert records straight out of the staging slot and adds
``weight * expert(x)`` of every route of the batch's experts into the fp32 layer output. :class:`TorchCompute`
(here) runs anywhere; the Triton backend is :class:`dma_prefill.triton_compute.TritonCompute`, its kernel launchers
:mod:`dma_prefill.triton_ops`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import PROJECTIONS, PrefillConfig
from .device import Device
from .layout import ExpertLayout
from .ops_torch import decode_torch, expert_torch
from .plan import PrefillPlan
from .ring import Staged, StagingRing
from .store import ExpertStore

__all__ = ["BatchCompute", "LayerPrep", "TorchCompute"]


@dataclasses.dataclass(eq=False)
class LayerPrep:
    """Per-layer device data derived from a plan once (counts, GEMM tiles)."""

    plan: PrefillPlan
    counts: torch.Tensor | None = None  # int64 [E] on the device
    tiles: torch.Tensor | None = None  # int32 [n, 3]
    tile_ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    bm: int = 64


class BatchCompute:
    """Base: ``prepare`` once per layer, ``run_batch`` once per staged batch; ``computed`` logs (layer, expert)."""

    def __init__(self, store: ExpertStore, config: PrefillConfig, device: Device) -> None:
        self.store = store
        self.config = config
        self.device = device
        self.computed: list[tuple[int, int]] = []

    def prepare(self, plan: PrefillPlan, x: torch.Tensor) -> LayerPrep:
        return LayerPrep(plan)

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        raise NotImplementedError

    def _staged(
        self, ring: StagingRing, st: Staged, prep: LayerPrep
    ) -> tuple[tuple[int, ...], ExpertLayout, torch.Tensor]:
        """The batch's routed experts, the layer's record layout and the staging slot holding them."""
        return tuple(int(e) for e in prep.plan.routed(st.batch)), self.store.layout(st.layer), ring.slot(st)


class TorchCompute(BatchCompute):
    """Per expert: decode from the slot (bit-exact), then the EXL3 forward in float32 with torch.

    ``config.exact=False`` rounds the Hadamard-basis activations to fp16 before each GEMM (the precision of a
    plain fp16 path), which the tests use as the inexact comparison point.
    """

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        plan = prep.plan
        routed, layout, slot = self._staged(ring, st, prep)
        cfg = self.config

        def fn() -> None:
            for e in routed:
                row = st.row(e)
                weights = {
                    p: (
                        decode_torch(layout.view(slot, row, p, "trellis"), layout.spec.proj(p).codebook),
                        layout.view(slot, row, p, "suh"),
                        layout.view(slot, row, p, "svh"),
                    )
                    for p in PROJECTIONS
                }
                r0, r1 = plan.rows(e)
                tok = plan.sorted_tokens[r0:r1]
                w = plan.sorted_weights[r0:r1]
                y = expert_torch(
                    x[tok], weights, limit=cfg.swiglu_limit, dtype=torch.float32, fp16_activations=not cfg.exact
                )
                out.index_add_(0, tok, y * w[:, None])
                self.computed.append((st.layer, e))

        self.device.launch(stream, fn, reads=st.tags(routed), label=f"L{st.layer}b{st.batch}")
