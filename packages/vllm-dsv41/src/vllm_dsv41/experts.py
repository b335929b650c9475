"""Where routed experts run: the expert runtime behind the plugin's fused-MoE method.

``ExpertRuntime`` is the seam between vLLM and our libraries. The fused-MoE method hands it each MoE layer's
EXL3 expert tensors once (``add_layer``) and then, per forward, the layer's activations and vLLM's routing
decision (``forward``). ``CpuExpertRuntime`` keeps every routed expert in host memory and computes them with
``cpu_tier.ExpertTier``. The GPU tiers (a VRAM expert cache for hot experts, staged-DMA prefill) will be
further implementations of the same protocol that split the picks between the GPU and this CPU runtime; the
vLLM-facing code will not change.

The forward goes through one ``torch.library`` custom op, ``dsv41::routed_experts``, so that a
``torch.compile``-d model sees one opaque call with a shape-only fake.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from cpu_tier.exl3 import Exl3Tensor

from . import metrics
from .config import Dsv41PluginConfig

__all__ = ["CpuExpertRuntime", "ExpertRuntime", "routed_experts"]


class ExpertRuntime(Protocol):
    """Routed experts of every MoE layer of one model instance."""

    def add_layer(
        self,
        layer: int,
        gate: Sequence[Exl3Tensor],
        up: Sequence[Exl3Tensor],
        down: Sequence[Exl3Tensor],
        swiglu_limit: float | None,
    ) -> None:
        """Take ownership of one layer's experts (one tensor per expert; gate/up ``(H, I)``, down ``(I, H)``)."""
        ...

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j topk_weights[t, j] * expert[topk_ids[t, j]](x[t])``; ``x`` ``[T, H]`` -> same shape/dtype."""
        ...

    def close(self) -> None: ...


class CpuExpertRuntime:
    """All routed experts in host memory, computed by ``cpu_tier.ExpertTier``.

    Parameters
    ----------
    config : the plugin configuration (threads, pinning, ISA, precision, spin).
    """

    def __init__(self, config: Dsv41PluginConfig) -> None:
        from cpu_tier import CpuTierConfig, ExpertTier, Picks

        self.config = config
        self._picks = Picks
        self._tier = ExpertTier(
            CpuTierConfig(
                threads=config.cpu_threads,
                cpus=config.cpu_cores,
                isa=config.cpu_isa,
                precision=config.precision,
                spin_us=config.spin_us,
                amx_min_tokens=config.cpu_amx_min_tokens,
            )
        )
        #: The kernel variant the tier runs (e.g. "avx2").
        self.isa: str = self._tier.isa
        self._hidden: dict[int, int] = {}
        self._lock = threading.Lock()
        self._metrics = metrics.tier("cpu")

    def add_layer(
        self,
        layer: int,
        gate: Sequence[Exl3Tensor],
        up: Sequence[Exl3Tensor],
        down: Sequence[Exl3Tensor],
        swiglu_limit: float | None,
    ) -> None:
        self._tier.add_layer(layer, list(gate), list(up), list(down), swiglu_limit=swiglu_limit)
        self._hidden[layer] = gate[0].k

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        hidden = self._hidden[layer]
        if x.ndim != 2 or x.shape[1] != hidden:
            raise ValueError(f"MoE layer {layer}: activations must be [T, {hidden}], got {tuple(x.shape)}")
        xs = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        out = torch.empty_like(xs)
        if xs.shape[0]:
            ids = topk_ids.detach().to(device="cpu", dtype=torch.int32).contiguous().numpy()
            wts = topk_weights.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
            with self._lock:  # one forward at a time: the tier owns one worker pool
                t0 = time.perf_counter()
                self._tier.forward(layer, xs.numpy(), self._picks.from_topk(ids, wts), out=out.numpy())
                self._metrics.forward(time.perf_counter() - t0, picks=ids.size)
        return out.to(device=x.device, dtype=x.dtype)

    def close(self) -> None:
        self._tier.close()


# ------------------------------------------------------------------------------------------ custom op

_RUNTIMES: dict[int, ExpertRuntime] = {}
_NEXT_ID = itertools.count(1)


def register_runtime(runtime: ExpertRuntime) -> int:
    """Make ``runtime`` reachable from the custom op; returns its handle."""
    handle = next(_NEXT_ID)
    _RUNTIMES[handle] = runtime
    return handle


def unregister_runtime(handle: int) -> None:
    runtime = _RUNTIMES.pop(handle, None)
    if runtime is not None:
        runtime.close()


@torch.library.custom_op("dsv41::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, runtime: int, layer: int
) -> torch.Tensor:
    """The routed-expert output of MoE ``layer`` of the runtime with handle ``runtime`` (see ``ExpertRuntime``)."""
    return _RUNTIMES[runtime].forward(layer, x, topk_ids, topk_weights)


@routed_experts.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, runtime: int, layer: int) -> Any:
    return torch.empty_like(x)

