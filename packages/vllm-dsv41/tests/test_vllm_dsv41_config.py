"""Dsv41PluginConfig: validation, and how it reaches the plugin through vLLM's configuration."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from vllm_dsv41 import Dsv41PluginConfig


def test_defaults_and_frozen() -> None:
    cfg = Dsv41PluginConfig()
    assert (cfg.cpu_threads, cfg.cpu_cores, cfg.cpu_isa, cfg.precision, cfg.spin_us) == (0, (), "auto", "exact", 50)
    assert cfg.effective_threads >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_threads = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"cpu_threads": -1}, "cpu_threads"),
        ({"cpu_threads": True}, "cpu_threads"),
        ({"cpu_cores": [0, 0]}, "cpu_cores"),
        ({"cpu_cores": [-1]}, "cpu_cores"),
        ({"cpu_isa": "sse2"}, "cpu_isa"),
        ({"precision": "approx"}, "precision"),
        ({"spin_us": 1.5}, "spin_us"),
        ({"cpu_amx_min_tokens": 0}, "cpu_amx_min_tokens"),
        ({"cpu_amx_min_tokens": 10}, "cpu_amx_min_tokens"),
        ({"threads": 4}, "threads"),
    ],
)
def test_bad_values_name_the_field_and_the_source(values: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        Dsv41PluginConfig.from_mapping(values, "somewhere")
    assert str(info.value).startswith("somewhere: ")


def test_mapping_round_trip() -> None:
    cfg = Dsv41PluginConfig(cpu_threads=4, cpu_cores=(2, 3, 4, 5), cpu_isa="amx", precision="fast", spin_us=0,
                            cpu_amx_min_tokens=8)
    assert Dsv41PluginConfig.from_mapping(cfg.to_mapping()) == cfg
    assert cfg.effective_threads == 4
    assert Dsv41PluginConfig(cpu_cores=(1, 2)).effective_threads == 2


def _vllm_config(pack: dict | None, extra: dict | None) -> SimpleNamespace:
    hf = SimpleNamespace() if pack is None else SimpleNamespace(dsv41=pack)
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), additional_config=extra or {})


def test_from_vllm_config_merges_pack_defaults_and_overrides() -> None:
    assert Dsv41PluginConfig.from_vllm_config(_vllm_config(None, None)) == Dsv41PluginConfig()
    cfg = Dsv41PluginConfig.from_vllm_config(
        _vllm_config({"precision": "fast", "spin_us": 10}, {"dsv41": {"spin_us": 0, "cpu_cores": [0, 1]}})
    )
    assert (cfg.precision, cfg.spin_us, cfg.cpu_cores) == ("fast", 0, (0, 1))
    with pytest.raises(ValueError, match="config.json 'dsv41': unknown field 'bogus'"):
        Dsv41PluginConfig.from_vllm_config(_vllm_config({"bogus": 1}, None))
    with pytest.raises(ValueError, match="additional_config 'dsv41': cpu_isa"):
        Dsv41PluginConfig.from_vllm_config(_vllm_config(None, {"dsv41": {"cpu_isa": "x"}}))
