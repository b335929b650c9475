"""DeepSeek-V4.1 EXL3 packs on upstream vLLM's V4.1 model, under upstream's own architecture name.

``Dsv41ForCausalLM`` subclasses vLLM's ``DeepseekV41ForCausalLM`` (the VL wrapper; text-only with
``limit_mm_per_prompt={"image": 0}``) and is registered as ``"DeepseekV41ForCausalLM"``, so everything vLLM
keys on that name stays on: the Engram config, breakable CUDA graphs, the ``deepseek_v41`` tokenizer mode and
parsers. For packs that are not EXL3 (an FP8 release) it is upstream's model unchanged.

For an EXL3 pack it adds what upstream lacks:

* checkpoint names -> vLLM names: upstream's VL weight mapper plus the EXL3 head (``head.trellis`` ...), also
  given to ``Exl3Config`` (upstream sets its mapper per instance and keeps ``packed_modules_mapping`` on the inner
  text model, where vLLM's quant-config wiring does not look);
* an EXL3 output head (upstream builds an unquantized ``ParallelLMHead``): ``Exl3LMHead`` runs the head through
  the dense EXL3 kernels, never materializing a bf16 ``[vocab, hidden]`` weight;
* the checks the expert runtime needs: CUDA graphs must be PIECEWISE or off (FULL graphs would capture the CPU
  tier), pipeline parallel only (``vllm_dsv41.parallel``; the head lives on the last stage).

For every V4.1 pack (EXL3 or not) it picks the attention kernels (``Dsv41PluginConfig.attention``): below compute
capability 9.0, or when forced, the layers are built with ``vllm_dsv41.ampere``'s Triton attention.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Any

import torch
from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM

from .quant import Exl3Config

__all__ = [
    "EXL3_HEAD_PREFIX",
    "PACKED_MODULES",
    "Dsv41ForCausalLM",
    "Exl3LMHead",
    "ampere_attention_scope",
    "upstream_breaks_enabled",
    "v41_weights_mapper",
]

#: The vLLM module name of the text model's output head inside the VL wrapper.
EXL3_HEAD_PREFIX = "language_model.lm_head"
#: vLLM's fused V4.1 modules and the checkpoint modules they are made of (upstream's inner-model table).
PACKED_MODULES: dict[str, list[str]] = {
    "gate_up_proj": ["w1", "w3"],
    "fused_wqa_wkv": ["wq_a", "wkv"],
    "fused_wkv_wgate": ["wkv", "wgate"],
}
_COMPRESSOR_RE = re.compile(r"^layers\.(?P<layer>\d+)\.attn\.compressor\.(?P<what>ape|wgate\.weight)$")
_HEAD_RE = re.compile(r"^head\.(trellis|suh|svh|su|sv|mcg|mul1|bias)$")


def v41_weights_mapper(expert_dtype: str = "fp4", linear_scale_name: str = "weight_scale_inv") -> Any:
    """Upstream's V4.1 VL weight mapper plus the EXL3 head's tensors (``head.<part>`` -> the wrapper's head)."""
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.models.deepseek_v41.nvidia.model import DeepseekV41LLMForCausalLM
    from vllm.models.deepseek_v41.nvidia.vl_model import _make_deepseek_v4_vl_weights_mapper

    assert DeepseekV41LLMForCausalLM.packed_modules_mapping == PACKED_MODULES, "upstream's fused modules changed"
    base = _make_deepseek_v4_vl_weights_mapper(expert_dtype, linear_scale_name)
    return base | WeightsMapper(orig_to_new_regex={_HEAD_RE: EXL3_HEAD_PREFIX + r".\1"})


class Exl3LMHead(torch.nn.Module):
    """The output head as an EXL3 linear (``hidden -> vocab``), driven by vLLM's ``LogitsProcessor``."""

    def __init__(self, quant: Exl3Config, vocab_size: int, hidden_size: int, params_dtype: torch.dtype,
                 prefix: str = EXL3_HEAD_PREFIX) -> None:  # fmt: skip
        super().__init__()
        from .methods import Exl3LinearMethod

        self.tp_size = 1
        self.num_embeddings = self.org_vocab_size = vocab_size
        self.embedding_dim = hidden_size
        self.quant_method = Exl3LinearMethod(prefix, [prefix], quant)
        self.quant_method.create_weights(self, hidden_size, [vocab_size], hidden_size, vocab_size, params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - vLLM calls quant_method.apply
        return self.quant_method.apply(self, x)


class Dsv41ForCausalLM(DeepseekV41ForCausalLM):
    """vLLM's DeepSeek-V4.1, serving EXL3 packs through the dsv41 plugin (see the module docstring)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        quant = vllm_config.quant_config
        if isinstance(quant, Exl3Config):
            configure_exl3_names(quant, vllm_config.model_config.hf_config)
            _check_serving_config(vllm_config, quant)
        with ampere_attention_scope(vllm_config), _engram_hook(vllm_config, quant) as engram_on_disk:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # (dsv41 Engram, Ampere: blocks at the end)
        self._dsv41_engram_on_disk = engram_on_disk
        if not isinstance(quant, Exl3Config):
            return  # not an EXL3 pack: upstream's model, unchanged
        cfg = self.config
        expert_dtype = getattr(cfg, "expert_dtype", "fp4")
        from vllm.models.deepseek_v41.nvidia.model import _linear_scale_param_name

        self.hf_to_vllm_mapper = v41_weights_mapper(expert_dtype, _linear_scale_param_name(vllm_config, expert_dtype))
        lm = self.language_model
        from vllm.model_executor.models.utils import PPMissingLayer

        if quant.is_exl3(EXL3_HEAD_PREFIX) and not isinstance(lm.lm_head, PPMissingLayer):  # the last stage's head
            lm.lm_head = Exl3LMHead(quant, cfg.vocab_size, cfg.hidden_size, vllm_config.model_config.dtype,
                                    prefix=f"{prefix + '.' if prefix else ''}{EXL3_HEAD_PREFIX}")  # fmt: skip
        self._has_bias_vl = getattr(cfg, "vision_n_layers", 0) > 0

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Checkpoint tensors a text-only EXL3 pack carries but this model does not load (skipped unread).

        ``<moe>.gate.bias_vl`` routes image tokens; without a vision tower upstream creates no parameter for it.
        ``hc_head_*`` is V4's learned output mix, which V4.1 does not have (upstream has no parameter for it).
        """
        if _engram_table_on_disk(self, name):  # dsv41 Engram: the tables are read from the pack's files
            return True
        if name.startswith("hc_head"):  # V4's learned head mix; V4.1 collapses with the last pre-mix instead
            return True
        m = _COMPRESSOR_RE.match(name)
        if m:  # V4.1's compressor has no position embedding, and a gate only at compress ratio 2
            ratios = getattr(self.config, "compress_ratios", None) or []
            layer = int(m["layer"])
            return m["what"] == "ape" or (layer < len(ratios) and int(ratios[layer]) <= 1)
        return not getattr(self, "_has_bias_vl", True) and name.endswith(".ffn.gate.bias_vl")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not self.is_unused_checkpoint_weight(n))


def configure_exl3_names(quant: Exl3Config, hf_config: Any) -> None:
    """Give ``Exl3Config`` the V4.1 names: mapped module names and the fused-module table (once)."""
    if getattr(quant, "_v41_named", False):
        return
    quant._v41_named = True
    expert_dtype = getattr(hf_config, "expert_dtype", "fp4")
    quant.apply_vllm_mapper(v41_weights_mapper(expert_dtype).get_rename_mapper())
    quant.packed_modules_mapping = dict(PACKED_MODULES)


def upstream_breaks_enabled() -> bool:
    """Whether upstream's V4.1 eager breaks (attention, Engram prefetch) are live in this process.

    vLLM's ``eager_break_during_capture`` decides when it decorates, at import: vLLM imports the V4.1 model while
    it still builds its config (the multimodal registry resolves the class), before it turns breakable CUDA graphs
    on, so in that process the breaks are plain calls unless ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` was in the
    environment first (``vllm_dsv41.vllm_env_for_pack`` says so; the server and the tools set it). Upstream's own
    model survives that (its whole forward is then one captured segment); ours cannot, because the routed-expert
    op must break the graph, and a captured Engram prefetch fork would straddle the break.
    """
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    return hasattr(DeepseekV4Attention._prepare_and_attn_eager, "__wrapped__")


def _check_serving_config(vllm_config: Any, quant: Exl3Config) -> None:
    from .parallel import check_parallel

    cfg = quant.plugin_config()
    check_parallel(vllm_config.parallel_config, cfg)
    mode = vllm_config.compilation_config.cudagraph_mode
    if cfg.runtime in ("cpu", "all-in-vram") and mode is not None and mode.has_piecewise_cudagraphs() \
            and not upstream_breaks_enabled():  # fmt: skip
        raise RuntimeError(
            "dsv41: vLLM's V4.1 eager breaks were decorated before breakable CUDA graphs were enabled in this "
            "process, so the routed-expert op's break would split a captured Engram prefetch: set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 in the environment before vLLM starts (vllm_dsv41.vllm_env_for_pack; "
            "the dsv41 server and tools do), or serve with enforce_eager=True"
        )
    if cfg.runtime in ("cpu", "all-in-vram") and mode is not None and mode.has_full_cudagraphs():
        raise ValueError(
            f"dsv41: cudagraph_mode {mode.name} captures FULL CUDA graphs, which would freeze the {cfg.runtime!r} "
            "expert runtime's host work into the graph: serve with compilation_config={'cudagraph_mode': "
            "'PIECEWISE'} (the expert op becomes an eager break; the server does this) or enforce_eager=True"
        )


# ---------------------------------------------------------------------------------------------------------------
# dsv41 Engram (vllm_dsv41.engram): with ``Dsv41PluginConfig.engram == "mmap"`` (the default) the Engram tables of
# an EXL3 pack stay in the pack's files; upstream's pinned copies are never made and vLLM never reads the tables.


def _engram_hook(vllm_config: Any, quant: Any) -> contextlib.AbstractContextManager[bool]:
    """While upstream's model is built: its ``Engram`` bound to the mapped-table subclass (EXL3 packs, "mmap")."""
    if not isinstance(quant, Exl3Config):
        return contextlib.nullcontext(False)
    from .engram import engram_construction

    return engram_construction(vllm_config, quant.plugin_config().engram)


def _engram_table_on_disk(model: Any, name: str) -> bool:
    """Whether checkpoint tensor ``name`` is an Engram table this model serves from the pack's files."""
    if not getattr(model, "_dsv41_engram_on_disk", False):
        return False
    from .engram import is_engram_table_tensor

    return is_engram_table_tensor(name)


# ------------------------------------------------------------------------------ Ampere attention (issue 19)


def ampere_attention_scope(vllm_config: Any) -> contextlib.AbstractContextManager[Any]:
    """The scope in which upstream's V4.1 layers are built: with ``vllm_dsv41.ampere``'s Triton attention when the
    plugin config's ``attention`` asks for it ("triton"), or for "auto" on a GPU below compute capability 9.0."""
    from .ampere.select import device_capability, triton_attention_scope, wants_triton
    from .config import Dsv41PluginConfig

    quant = vllm_config.quant_config
    cfg = quant.plugin_config() if isinstance(quant, Exl3Config) else Dsv41PluginConfig.from_vllm_config(vllm_config)
    return triton_attention_scope(wants_triton(cfg.attention, device_capability()))
