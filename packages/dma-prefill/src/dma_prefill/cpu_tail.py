"""The CPU tail of a hybrid prefill step: the plan's trailing batches computed on the host by ``cpu_tier``.

On mid-size steps the last ``cpu_tail_batches`` batches are not streamed; the host computes them while the GPU
runs the others. ``DmaPrefill.run_layer`` calls ``begin`` before it queues the GPU batches (so the routed rows
of x start their device-to-host copy at once, on a side stream) and ``finish`` after (the host computes, and
the result is added into ``out`` on the compute stream, behind the GPU batches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import torch

from cpu_tier import ExpertTier, Picks

from .config import PROJECTIONS
from .plan import PrefillPlan
from .store import ExpertStore

__all__ = ["CpuTail", "CpuTierTail"]


class CpuTail(Protocol):
    """What ``DmaPrefill.run_layer(cpu_tail=...)`` calls for ``plan.cpu_batches``."""

    #: the SwiGLU clamp the tail applies (must equal ``PrefillConfig.swiglu_limit``)
    swiglu_limit: float | None

    def begin(self, layer: int, x: torch.Tensor, plan: PrefillPlan) -> Any:
        """Start the tail (before the GPU batches are queued); returns a handle for ``finish``."""
        ...

    def finish(self, handle: Any, out: torch.Tensor) -> None:
        """Add ``sum w * expert(x)`` of the tail's routes into ``out`` in the device's stream order."""
        ...


@dataclasses.dataclass
class _Pending:
    layer: int
    tokens: torch.Tensor  # unique tokens of the tail's routes (device of the plan)
    x_host: torch.Tensor  # float32 [U, H] rows of x (pinned when CUDA)
    picks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # local row, expert, weight (host)
    ready: Any  # CUDA event of the device-to-host copies, or None


class CpuTierTail:
    """A ``CpuTail`` over ``cpu_tier.ExpertTier``, reading the experts in place from the store's host memory
    (the single home copy; nothing is copied).

    Parameters
    ----------
    store : the host expert store; every layer in ``layers`` is registered with ``tier``.
    tier : an open ``ExpertTier`` (its precision and threads are the caller's choice).
    swiglu_limit : the routed experts' SwiGLU clamp (``PrefillConfig.swiglu_limit``; None = none).
    layers : the store's layers to register (default: all).
    register : False when ``tier`` already holds these layers under the store's layer ids (e.g. a served model's
        decode tier over the same home copy); the tail then only submits to it.
    """

    def __init__(
        self,
        store: ExpertStore,
        tier: ExpertTier,
        *,
        swiglu_limit: float | None,
        layers: tuple[int, ...] | None = None,
        register: bool = True,
    ) -> None:
        self.store = store
        self.tier = tier
        self.swiglu_limit = swiglu_limit
        self.layers = tuple(store.layer_ids if layers is None else layers)
        if not register:  # the tier already holds these layers (the same experts, under the same ids)
            return
        for lid in self.layers:
            views = {p: [store.view(lid, e, p) for e in range(store.spec(lid).num_experts)] for p in PROJECTIONS}
            tier.add_layer(lid, views["gate"], views["up"], views["down"], swiglu_limit=swiglu_limit)

    def begin(self, layer: int, x: torch.Tensor, plan: PrefillPlan) -> _Pending | None:
        if layer not in self.layers:
            raise ValueError(f"CpuTierTail: layer {layer} was not registered (registered: {self.layers})")
        experts = plan.cpu_experts
        if experts.size == 0:
            return None
        dev = plan.sorted_tokens.device
        idx = torch.from_numpy(np.concatenate([np.arange(*plan.rows(int(e))) for e in experts])).to(dev)
        tok = plan.sorted_tokens[idx]
        uniq, local = torch.unique(tok, return_inverse=True)
        cuda = x.is_cuda
        if cuda:
            side = torch.cuda.Stream(device=x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                rows = x.index_select(0, uniq.to(x.device)).to(torch.float32)
                x_host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
                x_host.copy_(rows, non_blocking=True)
                picks = tuple(
                    t.to("cpu", non_blocking=True)
                    for t in (local.to(torch.int32), plan.sorted_experts[idx].to(torch.int32), plan.sorted_weights[idx])
                )
                ready = torch.cuda.Event()
                ready.record(side)
            for t in (idx, local, uniq):  # made on the compute stream, read by the side one: not reused before
                t.record_stream(side)
        else:
            x_host = x.index_select(0, uniq.to(x.device)).to(torch.float32).contiguous()
            picks = (local.to(torch.int32), plan.sorted_experts[idx].to(torch.int32), plan.sorted_weights[idx])
            ready = None
        return _Pending(layer, uniq, x_host, picks, ready)  # type: ignore[arg-type]

    def finish(self, handle: _Pending | None, out: torch.Tensor) -> None:
        if handle is None:
            return
        if handle.ready is not None:
            handle.ready.synchronize()  # the copies only, not the GPU batches queued since
        tokens, experts, weights = (t.numpy() for t in handle.picks)
        y = torch.empty(handle.x_host.shape, dtype=torch.float32, pin_memory=out.is_cuda)
        self.tier.forward(handle.layer, handle.x_host, Picks(tokens, experts, weights), out=y)
        out.index_add_(0, handle.tokens.to(out.device), y.to(out.device, non_blocking=True))
