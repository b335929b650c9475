"""The plugin's single ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers, the model-inspection
subprocess), so it is idempotent and cheap: it imports vLLM's registries and our quantization config, never a
model or a kernel, and nothing that initialises CUDA.
"""

from __future__ import annotations

#: Our model architectures: ``config.json`` ``architectures[0]`` -> lazily imported class. The V4.1 entry
#: replaces upstream's registration under the same name (our class is upstream's for non-EXL3 packs).
ARCHITECTURES: dict[str, str] = {
    "Dsv41DemoForCausalLM": "vllm_dsv41.model:Dsv41DemoForCausalLM",
    "DeepseekV41ForCausalLM": "vllm_dsv41.v41:Dsv41ForCausalLM",
}

#: The vLLM minor version this plugin is written against (its extension points move between minors).
VLLM_SERIES = "0.32."

_registered = False


def register() -> None:
    """Register the ``exl3`` quantization method, our model architectures and the ``dsv41`` model loader."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from .quant import QUANT_METHOD, Exl3Config

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise RuntimeError(
            f"vllm-dsv41 is written against vLLM {VLLM_SERIES}x, but this environment has vLLM {vllm.__version__}"
        )
    if QUANT_METHOD not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_METHOD)(Exl3Config)
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)  # overwrites upstream's entry for the V4.1 name
    from .loader import LOAD_FORMAT

    register_model_loader(LOAD_FORMAT)(_loader_class())
    _registered = True


def _loader_class() -> type:
    from .loader import Dsv41ModelLoader

    return Dsv41ModelLoader
