"""The EXL3 layer methods ``Exl3Config`` hands to vLLM's linear and fused-MoE layers.

The layers receive their EXL3 tensors through empty placeholder parameters (``trellis``, ``suh``, ...) whose
weight loaders put each tensor into a ``TensorStore``; ``process_weights_after_loading`` then builds and
validates ``Exl3Tensor`` objects and hands them on: dense ones are dequantized once
(``cpu_tier.exl3.reconstruct``) and applied as a plain GEMM, routed experts go to the expert runtime.
vLLM keeps doing the routing and the shared experts.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.model_executor.utils import set_weight_attrs

from . import experts as _experts  # noqa: F401  (registers the dsv41::routed_experts custom op)
from .checkpoint import EXL3_SUFFIXES, TensorStore

if TYPE_CHECKING:
    from .quant import Exl3Config

__all__ = ["Exl3HostExpertsMethod", "Exl3LinearMethod"]


def _placeholder(dtype: torch.dtype, loader: Any) -> torch.nn.Parameter:
    """An empty parameter: gives a checkpoint tensor a name to load into, holds nothing."""
    p = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    set_weight_attrs(p, {"weight_loader": loader})
    return p


# ------------------------------------------------------------------------------------------ dense linear

_QKV = {"q": 0, "k": 1, "v": 2}


class Exl3LinearMethod(LinearMethodBase):
    """A dense EXL3 linear (plain or fused from shards), dequantized once after loading."""

    def __init__(self, prefix: str, parts: list[str]) -> None:
        super().__init__()
        self.prefix = prefix
        self.parts = parts  # checkpoint module names, for messages

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if input_size_per_partition != input_size or sum(output_partition_sizes) != output_size:
            raise NotImplementedError(f"{self.prefix}: EXL3 dense linears do not support tensor parallelism yet")
        layer.exl3_store = TensorStore(self.prefix)
        layer.exl3_sizes = (input_size, list(output_partition_sizes))
        for suffix, dtype in EXL3_SUFFIXES.items():
            layer.register_parameter(suffix, _placeholder(dtype, functools.partial(self._load, layer, suffix)))

    def _load(
        self, layer: torch.nn.Module, suffix: str, param: Any, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        shard = getattr(loaded, "shard_id", None) if shard_id is None else shard_id
        n = len(layer.exl3_sizes[1])
        if shard is None and n == 1:
            part = 0
        elif isinstance(shard, str) and shard in _QKV and n == 3:
            part = _QKV[shard]
        elif isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < n:
            part = shard
        else:
            raise ValueError(f"{self.prefix}.{suffix}: unsupported shard id {shard!r} for {n} output part(s)")
        layer.exl3_store.put(part, suffix, loaded)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        k, sizes = layer.exl3_sizes
        store: TensorStore = layer.exl3_store
        names = self.parts if len(self.parts) == len(sizes) else [f"{self.prefix}[{i}]" for i in range(len(sizes))]
        weights = []
        for part, (name, n) in enumerate(zip(names, sizes, strict=True)):
            t = store.build(part, name)
            if (t.k, t.n) != (k, n):
                raise ValueError(f"{name}: EXL3 tensor is {t.k}x{t.n} (in x out), the layer needs {k}x{n}")
            weights.append(t.reconstruct().T)
        w = torch.from_numpy(np.ascontiguousarray(np.concatenate(weights, axis=0)))
        device = layer.trellis.device  # where vLLM built the layer's parameters
        layer.register_buffer("exl3_weight", w.to(device=device, dtype=layer.params_dtype), persistent=False)
        store.clear()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.exl3_weight, bias)


# ------------------------------------------------------------------------------------------ routed experts

_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Exl3HostExpertsMethod(FusedMoEMethodBase):
    """Routed EXL3 experts kept in host memory and computed by the expert runtime."""

    def __init__(self, moe: Any, quant_config: "Exl3Config") -> None:
        super().__init__(moe)
        self.quant_config = quant_config
        self.layer_index = -1
        self.runtime_handle = -1

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        name = layer.layer_name
        par = self.moe.moe_parallel_config
        if par.tp_size != 1 or par.ep_size != 1 or num_experts != self.moe.num_experts:
            raise NotImplementedError(f"{name}: host-resident EXL3 experts need tp=1, ep=1 (got {par})")
        if self.moe.activation != MoEActivation.SILU:
            raise NotImplementedError(f"{name}: EXL3 host experts support SwiGLU (silu) only, got {self.moe.activation}")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(f"{name}: apply_router_weight_on_input is not supported")
        self.layer_index = extract_layer_index(name)
        layer.exl3_store = TensorStore(name)
        layer.exl3_sizes = (num_experts, hidden_size, intermediate_size_per_partition)
        for stem in ("w13", "w2"):
            for suffix, dtype in EXL3_SUFFIXES.items():
                loader = functools.partial(self._load, layer, suffix)
                layer.register_parameter(f"{stem}_{suffix}", _placeholder(dtype, loader))
        _, self.runtime_handle = self.quant_config.expert_runtime()

    def _load(
        self,
        layer: torch.nn.Module,
        suffix: str,
        param: Any = None,
        loaded_weight: torch.Tensor | None = None,
        weight_name: str = "",
        shard_id: str = "",
        expert_id: int = -1,
        return_success: bool = False,
    ) -> bool | None:
        if loaded_weight is None or shard_id not in _PROJ or not 0 <= expert_id < layer.exl3_sizes[0]:
            raise ValueError(f"{layer.layer_name}: cannot place {weight_name!r} (shard {shard_id!r}, expert {expert_id})")
        layer.exl3_store.put((expert_id, shard_id), suffix, loaded_weight)
        return True if return_success else None

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        num_experts, hidden, inter = layer.exl3_sizes
        store: TensorStore = layer.exl3_store
        shapes = {"w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)}
        experts: dict[str, list[Any]] = {}
        for shard, proj in _PROJ.items():
            experts[shard] = []
            for e in range(num_experts):
                name = f"{layer.layer_name}.{e}.{proj}"
                t = store.build((e, shard), name)
                if (t.k, t.n) != shapes[shard]:
                    raise ValueError(f"{name}: EXL3 tensor is {t.k}x{t.n} (in x out), the layer needs {shapes[shard]}")
                experts[shard].append(t)
        store.clear()
        runtime, _ = self.quant_config.expert_runtime()
        runtime.add_layer(
            self.layer_index, experts["w1"], experts["w3"], experts["w2"], swiglu_limit=layer.swiglu_limit
        )

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.ops.dsv41.routed_experts(x, topk_ids, topk_weights, self.runtime_handle, self.layer_index)
