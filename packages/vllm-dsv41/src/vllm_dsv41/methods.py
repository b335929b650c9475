"""The EXL3 layer methods ``Exl3Config`` hands to vLLM's linear and fused-MoE layers.

Dense linears receive their EXL3 tensors through empty placeholder parameters (``trellis``, ``suh``, ...) whose
weight loaders put each tensor into a ``TensorStore``; ``process_weights_after_loading`` then builds and
validates ``Exl3Tensor`` objects: on a GPU they stay EXL3 in VRAM and run through a GPU EXL3 kernel
(``vllm_dsv41.dense``); on the CPU (the demo) they are dequantized once and applied as a plain GEMM.

Routed experts never pass through vLLM's weight reader: the plugin's model loader maps them from the pack (the
host home, ``vllm_dsv41.home``) and ``process_weights_after_loading`` hands each layer's views to the expert
runtime. vLLM keeps doing the routing; the method also runs the shared experts itself (it declares that it
overlaps them), before the routed-expert op, so no auxiliary stream straddles the op's eager CUDA-graph break.
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

from . import experts as _experts
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
    """A dense EXL3 linear (plain or fused from shards): EXL3 kernels on a GPU, dequantized once on the CPU."""

    def __init__(self, prefix: str, parts: list[str], quant_config: Exl3Config | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.parts = parts  # checkpoint module names, for messages
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: Any,
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
        layer.exl3_params_dtype = params_dtype
        for suffix, dtype in EXL3_SUFFIXES.items():
            layer.register_parameter(suffix, _placeholder(dtype, functools.partial(self._load, layer, suffix)))

    def _load(self, layer: Any, suffix: str, param: Any, loaded: torch.Tensor, shard_id: Any = None) -> None:
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

    def process_weights_after_loading(self, layer: Any) -> None:
        k, sizes = layer.exl3_sizes
        store: TensorStore = layer.exl3_store
        names = self.parts if len(self.parts) == len(sizes) else [f"{self.prefix}[{i}]" for i in range(len(sizes))]
        tensors = []
        for part, (name, n) in enumerate(zip(names, sizes, strict=True)):
            t = store.build(part, name)
            if (t.k, t.n) != (k, n):
                raise ValueError(f"{name}: EXL3 tensor is {t.k}x{t.n} (in x out), the layer needs {k}x{n}")
            tensors.append(t)
        store.clear()
        device = layer.trellis.device  # where vLLM built the layer's parameters
        if device.type == "cuda":
            from .dense import Exl3DenseLinear

            backend = self.quant_config.plugin_config().dense_kernel if self.quant_config is not None else "auto"
            layer.exl3_dense = Exl3DenseLinear(tensors, device, backend, names)
        else:
            w = np.concatenate([t.reconstruct().T for t in tensors], axis=0)
            w_t = torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=layer.exl3_params_dtype)
            layer.register_buffer("exl3_weight", w_t, persistent=False)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dense = getattr(layer, "exl3_dense", None)
        if dense is not None:
            y = dense(x)
            return y if bias is None else y + bias
        return torch.nn.functional.linear(x, layer.exl3_weight, bias)


# ------------------------------------------------------------------------------------------ routed experts


@functools.cache
def _eager_routed() -> Any:
    """The routed-expert op as an eager break of vLLM's breakable CUDA graphs.

    Decorated on first use (vLLM's decorator reads whether breakable graphs are on when it is applied, which
    is known only once the engine's configuration exists). Outside a capture it is a plain call.
    """
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    def call(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, runtime: int, layer: int) -> None:
        _runtime_for_call(runtime)
        torch.ops.dsv41.routed_experts_out(x, ids, w, out, runtime, layer)

    return eager_break_during_capture(call)


@functools.cache
def _eager_split() -> tuple[Any, Any]:
    """The two halves of a runtime with ``begin``/``finish`` (the tiered one) as eager breaks: the shared expert
    is queued on the GPU between them, while the CPU tier computes the misses."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    def begin(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, runtime: int,
              layer: int) -> None:  # fmt: skip
        rt = _runtime_for_call(runtime)
        if hasattr(rt, "begin"):
            rt.begin(layer, x, ids, w)
        else:  # a runtime switched in without the two halves (e.g. the oracle in the fidelity tool): whole, here
            torch.ops.dsv41.routed_experts_out(x, ids, w, out, runtime, layer)

    def finish(out: torch.Tensor, runtime: int, layer: int) -> None:
        rt: Any = _experts.get_runtime(runtime)
        if hasattr(rt, "finish"):
            rt.finish(layer, out)

    return eager_break_during_capture(begin), eager_break_during_capture(finish)


def _runtime_for_call(handle: int) -> Any:
    """The runtime behind ``handle``, its VRAM cache allowed once vLLM's KV cache exists (the tiered runtime's cache
    takes what vLLM leaves)."""
    rt: Any = _experts.get_runtime(handle)
    if getattr(rt, "cache_allowed", True) is False and _kv_cache_bound():
        rt.allow_cache()
    return rt


def _kv_cache_bound() -> bool:
    """True once vLLM has bound a real KV cache to the model's attention layers (after its memory profiling)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    for module in get_forward_context().no_compile_layers.values():
        kv = getattr(module, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if isinstance(kv, torch.Tensor) and kv.numel() > 0:
            return True
    return False


class Exl3HostExpertsMethod(FusedMoEMethodBase):
    """Routed EXL3 experts kept in the pack's host home and computed by the expert runtime."""

    #: The weights are views of the host home; nothing to move to the GPU before processing.
    requires_device_loading = False

    def __init__(self, moe: Any, quant_config: Exl3Config) -> None:
        super().__init__(moe)
        self.quant_config = quant_config
        self.layer_index = -1
        self.runtime_handle = -1

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        # The method runs the shared experts itself (in ``apply``, before the routed op): vLLM then forks no
        # auxiliary stream that would straddle the op's eager break in a captured graph.
        return True

    def create_weights(
        self,
        layer: Any,
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
            raise NotImplementedError(
                f"{name}: EXL3 host experts support SwiGLU (silu) only, got {self.moe.activation}"
            )
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(f"{name}: apply_router_weight_on_input is not supported")
        self.layer_index = extract_layer_index(name)
        layer.exl3_sizes = (num_experts, hidden_size, intermediate_size_per_partition)
        for stem in ("w13", "w2"):
            for suffix, dtype in EXL3_SUFFIXES.items():
                loader = functools.partial(self._refuse, layer)
                layer.register_parameter(f"{stem}_{suffix}", _placeholder(dtype, loader))
        # The output buffer the op writes (shared by all MoE layers: a layer's output is consumed before the next
        # layer's op runs); a persistent address, as captured CUDA graph segments read it.
        rows = max(int(getattr(self.moe, "max_num_tokens", 0) or 0), 1)
        self.out = self.quant_config.moe_out_buffer(rows, hidden_size, params_dtype)
        _, self.runtime_handle = self.quant_config.expert_runtime()

    def _refuse(self, layer: Any, param: Any = None, loaded_weight: Any = None, weight_name: str = "",
                **kw: Any) -> bool:  # fmt: skip
        raise ValueError(
            f"{layer.layer_name}: routed expert tensor {weight_name!r} came through vLLM's weight reader; this "
            "plugin maps routed experts from the pack itself: load with load_format='dsv41' (the server does)"
        )

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def process_weights_after_loading(self, layer: Any) -> None:
        num_experts, hidden, inter = layer.exl3_sizes
        experts = self.quant_config.home().layer(self.layer_index)
        if (experts.num_experts, experts.hidden, experts.intermediate) != (num_experts, hidden, inter):
            raise ValueError(
                f"{self.quant_config.home().pack}: MoE layer {self.layer_index} has {experts.num_experts} experts of "
                f"{experts.hidden}x{experts.intermediate}; the model needs {num_experts} of {hidden}x{inter}"
            )
        runtime, _ = self.quant_config.expert_runtime()
        runtime.add_layer(experts, swiglu_limit=getattr(layer, "swiglu_limit", None))

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        out = self.out
        if t > out.shape[0] or out.device != x.device or out.dtype != x.dtype:
            out = self.out = self.quant_config.moe_out_buffer(t, x.shape[1], x.dtype, device=x.device)
        _, handle = self.quant_config.expert_runtime()
        path = self.quant_config.call_path  # fixed when the model was built (experts.call_path)
        split = path == "split"
        if split:  # the runtime's CPU work starts before the shared expert is queued, and overlaps it
            begin, finish = _eager_split()
            begin(x, topk_ids, topk_weights, out, handle, self.layer_index)
        if shared_experts is not None and shared_experts_input is not None:
            from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        if split:
            finish(out, handle, self.layer_index)
        elif path == "op":
            torch.ops.dsv41.routed_experts_out(x, topk_ids, topk_weights, out, handle, self.layer_index)
        else:
            _eager_routed()(x, topk_ids, topk_weights, out, handle, self.layer_index)
        return out[:t]


_ = _experts  # the import registers the dsv41::routed_experts_out op
