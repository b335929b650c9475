"""The vLLM entry point and the ``exl3`` quantization config (imports vLLM: ~20 s on a small machine)."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_exactly_one_entry_point() -> None:
    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.dist and ep.dist.name == "vllm-dsv41"]
    assert [(ep.name, ep.value) for ep in ours] == [("dsv41", "vllm_dsv41.plugin:register")]


# get_quantization_config imports vLLM's whole quantization zoo, which trips torch's own deprecation warnings.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_register_is_idempotent() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_dsv41 import ARCHITECTURES, register
    from vllm_dsv41.quant import Exl3Config

    register()
    register()
    assert QUANTIZATION_METHODS.count("exl3") == 1
    assert get_quantization_config("exl3") is Exl3Config
    assert set(ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())


def test_exl3_config_reads_the_checkpoint(demo_pack: Path) -> None:
    from vllm_dsv41.quant import Exl3Config

    with pytest.raises(ValueError, match="quant_method"):
        Exl3Config.from_config({"quant_method": "gptq"})
    cfg = Exl3Config.from_config({"quant_method": "exl3", "bits": 3.0})
    with pytest.raises(RuntimeError, match="not scanned"):
        cfg._is_exl3_linear("model.layers.0.self_attn.o_proj")
    cfg.maybe_update_config(str(demo_pack))
    cfg.packed_modules_mapping.update({"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert cfg._is_exl3_linear("model.layers.0.self_attn.qkv_proj")
    assert cfg._is_exl3_linear("model.layers.1.self_attn.o_proj")
    assert not cfg._is_exl3_linear("model.layers.0.mlp.gate")
    cfg.exl3_modules = cfg.exl3_modules - {"model.layers.0.self_attn.k_proj"}
    with pytest.raises(ValueError, match="a fused layer needs all parts in one format"):
        cfg._is_exl3_linear("model.layers.0.self_attn.qkv_proj")
    assert cfg.__getstate__()["_runtime"] is None


def test_exl3_config_without_trellis_is_an_error(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from vllm_dsv41.quant import Exl3Config

    save_file({"w.weight": np.zeros(4, np.float16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor ends in '.trellis'"):
        Exl3Config.from_config({"quant_method": "exl3"}).maybe_update_config(str(tmp_path))
