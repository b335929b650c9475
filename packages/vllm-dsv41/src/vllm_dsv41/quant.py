"""EXL3 in vLLM through its public quantization interface (``quant_method: "exl3"`` in ``config.json``).

* ``Exl3Config`` (registered with ``register_quantization_config("exl3")``) decides per layer, from which
  modules the checkpoint stores as EXL3, what method the layer gets.
* ``Exl3LinearMethod`` (``vllm_dsv41.methods``): dense EXL3 linears (EXL3 kernels on a GPU, dequantized once
  on the CPU).
* ``Exl3HostExpertsMethod`` (``vllm_dsv41.methods``, a ``FusedMoEMethodBase``): routed experts stay in the
  pack's host home and run in the expert runtime (``vllm_dsv41.experts``); vLLM keeps doing the routing.

The config also owns, per model instance (in the worker that builds it), the host home of the experts (set by
the plugin's model loader), the expert runtime and the routed op's output buffers. This module imports only
vLLM's quantization base, so that the plugin's ``register()`` stays light; the methods are imported when vLLM
builds the model.
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
#: vLLM's (and the pack's) architecture name of DeepSeek-V4.1.
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"

__all__ = ["QUANT_METHOD", "V41_ARCHITECTURE", "Exl3Config"]


class Exl3Config(QuantizationConfig):
    """The ``quantization_config`` of an EXL3 checkpoint (exllamav3's format) as vLLM sees it."""

    def __init__(self, raw: dict[str, Any]) -> None:
        super().__init__()
        self.raw = dict(raw)
        #: Checkpoint module prefixes stored as EXL3 (vLLM names after the model's renames); None until
        #: ``maybe_update_config`` read the checkpoint.
        self.exl3_modules: frozenset[str] | None = None
        self._reset_instance_state()

    def _reset_instance_state(self) -> None:
        self._runtime: Any = None
        self._runtime_handle: int | None = None
        self._call_path: str | None = None
        self._cuda_graphs = False
        self._home: Any = None
        self._plugin_config: Dsv41PluginConfig | None = None
        #: The model's dtype, the activations' the expert runtime receives (set with the runtime).
        self.activation_dtype: torch.dtype = torch.float32
        self._out_buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:  # the runtime and the home live in the worker that built the model
        state = self.__dict__.copy()
        for k in ("_runtime", "_runtime_handle", "_call_path", "_home", "_plugin_config"):
            state[k] = None
        state["_out_buffers"] = {}
        return state

    def __repr__(self) -> str:
        n = "?" if self.exl3_modules is None else len(self.exl3_modules)
        return f"Exl3Config(bits={self.raw.get('bits')}, codebook={self.raw.get('codebook')}, exl3_modules={n})"

    # ----------------------------------------------------------------------------------- vLLM interface

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the CPU tier and our Triton kernels need nothing; exllamav3's kernels check for themselves

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
        # V4.1's module names are given at model construction (``Dsv41ForCausalLM`` calls ``configure_exl3_names``):
        # importing vLLM's V4.1 model code here, while vLLM is still building its config, would freeze its
        # eager-break decorators (they read whether breakable CUDA graphs are on when they are applied) as off.
        self.is_v41 = V41_ARCHITECTURE in (getattr(hf_config, "architectures", None) or [])

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
                return Exl3LinearMethod(prefix, self._linear_parts(prefix), self)
            return UnquantizedLinearMethod()
        if isinstance(layer, VocabParallelEmbedding) and prefix in modules:
            raise NotImplementedError(
                f"{prefix}: EXL3-quantized embeddings are not supported (store this module as a plain .weight)"
            )
        return None

    # ----------------------------------------------------------------------------------------- helpers

    def _modules(self) -> frozenset[str]:
        if self.exl3_modules is None:
            raise RuntimeError("Exl3Config: the checkpoint was not scanned (maybe_update_config not called)")
        return self.exl3_modules

    def is_exl3(self, prefix: str) -> bool:
        """Whether the (vLLM-named) module ``prefix`` is stored as EXL3."""
        return prefix in self._modules()

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

    # ------------------------------------------------------------------------- per-model-instance state

    def plugin_config(self) -> Dsv41PluginConfig:
        """The plugin configuration of the model being built (read from vLLM's current config once)."""
        if self._plugin_config is None:
            from vllm.config import get_current_vllm_config

            self._plugin_config = Dsv41PluginConfig.from_vllm_config(get_current_vllm_config())
        return self._plugin_config

    def rank_plugin_config(self) -> Dsv41PluginConfig:
        """The plugin configuration as this pipeline stage runs it (its share of the CPU tier's cores; see
        ``vllm_dsv41.parallel.rank_plugin_config``); ``plugin_config()`` itself with one stage."""
        from .parallel import pp_position, rank_plugin_config

        return rank_plugin_config(self.plugin_config(), *pp_position())

    def expert_runtime(self) -> tuple[Any, int]:
        """The model's expert runtime and its custom-op handle, created on first use (in the worker)."""
        if self._runtime is None:
            from vllm.config import get_current_vllm_config

            from .experts import call_path, make_runtime, register_runtime

            vcfg = get_current_vllm_config()
            cfg = self.rank_plugin_config()
            device = torch.device(getattr(getattr(vcfg, "device_config", None), "device", None) or "cpu")
            max_tokens = int(getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", 0) or 0)
            share = None
            util = getattr(getattr(vcfg, "cache_config", None), "gpu_memory_utilization", None)
            if device.type == "cuda" and util:
                share = int(float(util) * torch.cuda.get_device_properties(device).total_memory)
            dtype = getattr(getattr(vcfg, "model_config", None), "dtype", None)
            self.activation_dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
            self._runtime = make_runtime(cfg, device, max_tokens=max_tokens, home=self.home, vllm_share_bytes=share,
                                         activation_dtype=self.activation_dtype)  # fmt: skip
            self._call_path = call_path(self._runtime, device)
            mode = getattr(getattr(vcfg, "compilation_config", None), "cudagraph_mode", None)
            eager = bool(getattr(getattr(vcfg, "model_config", None), "enforce_eager", False))
            self._cuda_graphs = device.type == "cuda" and not eager and str(getattr(mode, "name", mode)) != "NONE"
            self._runtime_handle = register_runtime(self._runtime)
            extra = ""
            if cfg.runtime in ("cpu", "tiered"):
                dtype_name = str(self.activation_dtype).removeprefix("torch.")
                extra = (f", cpu-tier {self._runtime.isa}, {cfg.effective_threads} threads, {self._runtime.precision} "
                         f"(precision {cfg.cpu.precision!r}, {dtype_name} activations)")  # fmt: skip
            if cfg.runtime in ("cpu", "tiered") and cfg.cpu.cpus:
                extra += f", pinned to cores {list(cfg.cpu.cpus)}"
            logger.info("dsv41: routed experts on the %r expert runtime%s", cfg.runtime, extra)
        assert self._runtime_handle is not None
        return self._runtime, self._runtime_handle

    def set_runtime(self, runtime: Any) -> Any:
        """Put ``runtime`` in the model's expert-runtime slot; returns the runtime it replaces.

        The slot keeps its custom-op handle, so CUDA graph segments captured with the old runtime call the new
        one. The caller adds the layers (``home().layers()``) to ``runtime`` first and closes the old one.
        """
        from .experts import replace_runtime

        old, _ = self.expert_runtime()
        if self._cuda_graphs and self._call_path == "op" and runtime is not old:
            raise RuntimeError(
                f"the model was built with the graph-safe expert runtime {old.name!r} and CUDA graphs: its expert "
                f"calls are captured in the graphs, so {getattr(runtime, 'name', runtime)!r} cannot replace it. Build "
                "the model with the runtime under test and switch the graph-safe one in (vllm_dsv41.fidelity does)"
            )
        # the eager call paths run any runtime ("split" calls forward_into in its first half for one without
        # begin/finish); on the CPU the op runs the current runtime on every call
        assert self._runtime_handle is not None
        replace_runtime(self._runtime_handle, runtime)
        self._runtime = runtime
        return old

    @property
    def call_path(self) -> str | None:
        """How the model calls the expert runtime, fixed when it is built (``experts.call_path``): "op",
        "eager" or "split" (None before the runtime exists)."""
        return self._call_path

    def attach_home(self, home: Any) -> None:
        """Give the model its host home of the experts (the plugin's model loader calls this)."""
        self._home = home

    def home(self) -> Any:
        if self._home is None:
            raise RuntimeError(
                "the routed experts' host home was not built: load EXL3 packs with load_format='dsv41' "
                "(the plugin's model loader maps the experts from the pack)"
            )
        return self._home

    def moe_out_buffer(self, rows: int, hidden: int, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        """The persistent output buffer of the routed op for ``hidden``/``dtype`` (shared by all MoE layers)."""
        dev = torch.device(device) if device is not None else torch.empty(0).device  # vLLM builds under its device
        key = (hidden, dtype, dev)
        buf = self._out_buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty((rows, hidden), dtype=dtype, device=dev)
            self._out_buffers[key] = buf
        return buf
