"""EXL3 in vLLM through its public quantization interface (``quant_method: "exl3"`` in ``config.json``).

* ``Exl3Config`` (registered with ``register_quantization_config("exl3")``) decides per layer, from which
  modules the checkpoint stores as EXL3, what method the layer gets.
* ``Exl3LinearMethod`` (``vllm_dsv41.methods``): dense EXL3 linears, dequantized once after loading
  (``cpu_tier.exl3.reconstruct``) and applied as a plain GEMM.
* ``Exl3HostExpertsMethod`` (``vllm_dsv41.methods``, a ``FusedMoEMethodBase``): routed experts stay in host
  memory and run in the expert runtime (``vllm_dsv41.experts``); vLLM keeps doing the routing and the shared
  experts.

This module imports only vLLM's quantization base, so that the plugin's ``register()`` stays light; the
methods are imported when vLLM builds the model.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from .checkpoint import exl3_modules, tensor_names
from .config import Dsv41PluginConfig

logger = init_logger("vllm.dsv41")  # under "vllm": printed with vLLM's own log lines

QUANT_METHOD = "exl3"

__all__ = ["QUANT_METHOD", "Exl3Config"]


class Exl3Config(QuantizationConfig):
    """The ``quantization_config`` of an EXL3 checkpoint (exllamav3's format) as vLLM sees it."""

    def __init__(self, raw: dict[str, Any]) -> None:
        super().__init__()
        self.raw = dict(raw)
        #: Checkpoint module prefixes stored as EXL3 (vLLM names after the model's renames); None until
        #: ``maybe_update_config`` read the checkpoint.
        self.exl3_modules: frozenset[str] | None = None
        self._runtime: Any = None
        self._runtime_handle: int | None = None

    def __getstate__(self) -> dict[str, Any]:  # the runtime lives in the worker that built the model
        state = self.__dict__.copy()
        state["_runtime"] = None
        state["_runtime_handle"] = None
        return state

    def __repr__(self) -> str:
        n = "?" if self.exl3_modules is None else len(self.exl3_modules)
        return f"Exl3Config(bits={self.raw.get('bits')}, codebook={self.raw.get('codebook')}, exl3_modules={n})"

    # ----------------------------------------------------------------------------------- vLLM interface

    def get_name(self) -> str:  # type: ignore[override]
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no GPU kernels of our own: the CPU tier and dequantized dense weights

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        method = config.get("quant_method")
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method: expected {QUANT_METHOD!r}, got {method!r}")
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        self.exl3_modules = exl3_modules(tensor_names(model_name))
        if not self.exl3_modules:
            raise ValueError(f"{model_name}: quant_method is 'exl3' but no tensor ends in '.trellis'")

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.exl3_modules is None:
            return
        mapped = hf_to_vllm_mapper.apply_list([f"{m}.trellis" for m in sorted(self.exl3_modules)])
        self.exl3_modules = frozenset(n[: -len(".trellis")] for n in mapped)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        from .methods import Exl3HostExpertsMethod, Exl3LinearMethod

        modules = self._modules()
        if isinstance(layer, RoutedExperts):
            if any(m.startswith(prefix + ".") for m in modules):
                return Exl3HostExpertsMethod(layer.moe_config, self)
            return None
        if isinstance(layer, LinearBase):
            if self._is_exl3_linear(prefix):
                return Exl3LinearMethod(prefix, self._linear_parts(prefix))
            return UnquantizedLinearMethod()
        if isinstance(layer, VocabParallelEmbedding) and prefix in modules:
            raise NotImplementedError(
                f"{prefix}: EXL3-quantized embeddings and output heads are not supported yet "
                "(store this module as a plain .weight)"
            )
        return None

    # ----------------------------------------------------------------------------------------- helpers

    def _modules(self) -> frozenset[str]:
        if self.exl3_modules is None:
            raise RuntimeError("Exl3Config: the checkpoint was not scanned (maybe_update_config not called)")
        return self.exl3_modules

    def _linear_parts(self, prefix: str) -> list[str]:
        """The checkpoint modules a vLLM linear is made of (several for a fused one, in vLLM's order)."""
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf)
        return [f"{parent}.{s}" if parent else s for s in shards] if shards else [prefix]

    def _is_exl3_linear(self, prefix: str) -> bool:
        names = self._linear_parts(prefix)
        flags = [n in self._modules() for n in names]
        if any(flags) and not all(flags):
            exl3 = [n for n, f in zip(names, flags, strict=True) if f]
            plain = [n for n, f in zip(names, flags, strict=True) if not f]
            raise ValueError(
                f"{prefix}: fused from {names}, of which {exl3} are EXL3 and {plain} are not; "
                "a fused layer needs all parts in one format"
            )
        return all(flags)

    def expert_runtime(self) -> tuple[Any, int]:
        """The model's expert runtime and its custom-op handle, created on first use (in the worker)."""
        if self._runtime is None:
            from vllm.config import get_current_vllm_config

            from .experts import CpuExpertRuntime, register_runtime

            plugin_config = Dsv41PluginConfig.from_vllm_config(get_current_vllm_config())
            logger.info("dsv41: routed experts in host memory, computed by cpu-tier (%s)", plugin_config)
            self._runtime = CpuExpertRuntime(plugin_config)
            self._runtime_handle = register_runtime(self._runtime)
        assert self._runtime_handle is not None
        return self._runtime, self._runtime_handle
