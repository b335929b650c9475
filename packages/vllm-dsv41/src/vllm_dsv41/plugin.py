"""The plugin's single ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers, the model-inspection
subprocess), so it is idempotent and cheap: it imports vLLM's registries and our quantization config, never a
model or a kernel, and nothing that initialises CUDA.
"""

from __future__ import annotations

#: Our model architectures: ``config.json`` ``architectures[0]`` -> lazily imported class.
ARCHITECTURES: dict[str, str] = {
    "Dsv41DemoForCausalLM": "vllm_dsv41.model:Dsv41DemoForCausalLM",
}

#: The vLLM minor version this plugin is written against (its extension points move between minors).
VLLM_SERIES = "0.32."

_registered = False


def register() -> None:
    """Register the ``exl3`` quantization method and our model architectures with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from .quant import QUANT_METHOD, Exl3Config

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise RuntimeError(
            f"vllm-dsv41 is written against vLLM {VLLM_SERIES}x, but this environment has vLLM {vllm.__version__}"
        )
    if QUANT_METHOD not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_METHOD)(Exl3Config)
    supported = ModelRegistry.get_supported_archs()
    for arch, target in ARCHITECTURES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    _registered = True
