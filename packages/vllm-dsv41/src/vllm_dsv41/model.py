"""``Dsv41DemoForCausalLM``: the ``tiny-demo`` pack's architecture.

It is vLLM's Qwen3-MoE model unchanged; what makes it ours is the checkpoint format, which it insists on:
routed experts stored as EXL3 (run by the plugin's expert runtime, in host memory) and EXL3 attention
projections. A pack that names this architecture without an EXL3 ``quantization_config`` fails here with a
message saying so, instead of as a missing-weight error deep in the loader.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from .quant import QUANT_METHOD, Exl3Config

__all__ = ["Dsv41DemoForCausalLM"]


class Dsv41DemoForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE whose routed experts are EXL3 tensors served from host memory."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        quant_config = vllm_config.quant_config
        if not isinstance(quant_config, Exl3Config):
            raise ValueError(
                f"{type(self).__name__}: config.json quantization_config.quant_method must be "
                f"{QUANT_METHOD!r} (got {type(quant_config).__name__ if quant_config else 'none'}); "
                "this architecture exists only for EXL3 packs"
            )
        from .parallel import check_parallel

        check_parallel(vllm_config.parallel_config, quant_config.plugin_config())
        super().__init__(vllm_config=vllm_config, prefix=prefix)
