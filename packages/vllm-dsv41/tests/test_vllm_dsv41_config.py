"""Dsv41PluginConfig: validation, the nested cpu-tier config, and how it reaches the plugin through vLLM's config."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from cpu_tier import CpuTierConfig
from engram_mmap import TableConfig
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41.config import TieredConfig


def test_defaults_and_frozen() -> None:
    cfg = Dsv41PluginConfig()
    assert cfg.cpu == CpuTierConfig()
    assert (cfg.runtime, cfg.dense_kernel, cfg.register_host_memory, cfg.attention) == ("cpu", "auto", True, "auto")
    assert (cfg.engram, cfg.engram_table) == ("mmap", TableConfig())
    assert cfg.effective_threads >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.runtime = "all-in-vram"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"cpu": {"threads": -1}}, "threads"),
        ({"cpu": {"threads": True}}, "threads"),
        ({"cpu": {"cpus": [0, 0]}}, "cpus"),
        ({"cpu": {"isa": "sse2"}}, "isa"),
        ({"cpu": {"precision": "approx"}}, "precision"),
        ({"cpu": {"spin_us": 1.5}}, "spin_us"),
        ({"cpu": {"amx_min_tokens": 10}}, "amx_min_tokens"),
        ({"cpu": {"prefetch_blocks": 9}}, "prefetch_blocks"),
        ({"cpu": {"bogus": 1}}, "bogus"),
        ({"cpu": 3}, "cpu"),
        ({"runtime": "gpu"}, "runtime"),
        ({"dense_kernel": "cutlass"}, "dense_kernel"),
        ({"register_host_memory": "yes"}, "register_host_memory"),
        ({"attention": "flashmla"}, "attention"),
        ({"cpu_threads": 4}, "cpu_threads"),  # the old flat names are gone: the cpu-tier config is nested
        ({"engram": "ram"}, "engram"),
        ({"engram_table": {"num_threads": 0}}, "num_threads"),
        ({"engram_table": {"bogus": 1}}, "engram_table: unknown field 'bogus'"),
        ({"engram_table": 4}, "engram_table"),
        ({"tiered": {"cache_gib": -1}}, "cache_gib"),
        ({"tiered": {"policy": "fifo"}}, "policy"),
        ({"tiered": {"split": "gpu"}}, "split"),
        ({"tiered": {"split_feedback": -0.1}}, "split_feedback"),
        ({"tiered": {"hit_kernel": "cublas"}}, "hit_kernel"),
        ({"tiered": {"pcie_read": "zero-copy"}}, "pcie_read"),
        ({"tiered": {"pcie_stage_slots": 0}}, "pcie_stage_slots"),
        ({"tiered": {"replan_every": 0}}, "replan_every"),
        ({"tiered": {"admit_limit": 1.5}}, "admit_limit"),
        ({"tiered": {"deadline_factor": True}}, "deadline_factor"),
        ({"tiered": {"trace_path": 3}}, "trace_path"),
        ({"tiered": {"cpu_drive": "gpu"}}, "cpu_drive"),
        ({"tiered": {"stream_share": "yes"}}, "stream_share"),
        ({"tiered": {"layer_graphs": 1}}, "layer_graphs"),
        ({"tiered": {"bogus": 1}}, "bogus"),
        ({"tiered": 3}, "tiered"),
    ],
)
def test_bad_values_name_the_field_and_the_source(values: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        Dsv41PluginConfig.from_mapping(values, "somewhere")
    assert str(info.value).startswith("somewhere")


def test_mapping_round_trip_reaches_every_cpu_tier_field() -> None:
    cpu = CpuTierConfig(threads=4, isa="amx", precision="fast", spin_us=0, amx_min_tokens=8, prefetch_blocks=2,
                        slab_blocks=3)  # fmt: skip
    table = TableConfig(num_threads=8, dedup=False, readahead_max_rows=0, random_access=False, resident_scales=True)
    tiered = TieredConfig(cache_gib=3.5, cache_margin_gib=0.5, policy="decayed", replan_every=8, admit_limit=16,
                          split="pcie", hit_kernel="triton", cpu_gbps=40.0, pcie_gbps=20.0, deadline_factor=0.0,
                          deadline_floor_ms=1.0, trace_path="/tmp/t.npz", stats_every=0)  # fmt: skip
    cfg = Dsv41PluginConfig(cpu=cpu, runtime="all-in-vram", dense_kernel="triton", register_host_memory=False,
                            attention="triton", tiered=tiered, engram="upstream", engram_table=table)  # fmt: skip
    assert Dsv41PluginConfig.from_mapping(cfg.to_mapping()) == cfg
    assert set(cfg.to_mapping()["tiered"]) == {f.name for f in dataclasses.fields(TieredConfig)}
    assert cfg.effective_threads == 4
    # every CpuTierConfig and TableConfig field travels (nothing mirrored, nothing dropped), and every own field
    assert set(cfg.to_mapping()["cpu"]) == {f.name for f in dataclasses.fields(CpuTierConfig)}
    assert cfg.to_mapping()["engram_table"] == dataclasses.asdict(table)
    assert set(cfg.to_mapping()) == {f.name for f in dataclasses.fields(Dsv41PluginConfig)}


def _vllm_config(pack: dict | None, extra: dict | None) -> SimpleNamespace:
    hf = SimpleNamespace() if pack is None else SimpleNamespace(dsv41=pack)
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), additional_config=extra or {})


def test_from_vllm_config_merges_pack_defaults_and_overrides_field_by_field() -> None:
    assert Dsv41PluginConfig.from_vllm_config(_vllm_config(None, None)) == Dsv41PluginConfig()
    cfg = Dsv41PluginConfig.from_vllm_config(
        _vllm_config(
            {"cpu": {"precision": "fast", "spin_us": 10}, "dense_kernel": "triton"},
            {"dsv41": {"cpu": {"spin_us": 0}, "runtime": "all-in-vram", "attention": "upstream"}},
        )  # fmt: skip
    )
    assert (cfg.cpu.precision, cfg.cpu.spin_us, cfg.dense_kernel, cfg.runtime) == ("fast", 0, "triton", "all-in-vram")
    assert cfg.attention == "upstream"
    tiered = Dsv41PluginConfig.from_vllm_config(
        _vllm_config({"tiered": {"cache_gib": 4, "split": "cpu"}}, {"dsv41": {"tiered": {"split": "auto"}}})
    ).tiered
    assert (tiered.cache_gib, tiered.split, tiered.policy) == (4, "auto", "hybrid")  # merged field by field
    # engram-mmap's table settings merge field by field too
    cfg = Dsv41PluginConfig.from_vllm_config(
        _vllm_config(
            {"engram_table": {"num_threads": 16, "resident_scales": True}},
            {"dsv41": {"engram_table": {"num_threads": 4}, "engram": "upstream"}},
        )  # fmt: skip
    )
    assert (cfg.engram, cfg.engram_table) == ("upstream", TableConfig(num_threads=4, resident_scales=True))
    with pytest.raises(ValueError, match="config.json 'dsv41': unknown field 'bogus'"):
        Dsv41PluginConfig.from_vllm_config(_vllm_config({"bogus": 1}, None))
    with pytest.raises(ValueError, match="additional_config 'dsv41': cpu: isa"):
        Dsv41PluginConfig.from_vllm_config(_vllm_config(None, {"dsv41": {"cpu": {"isa": "x"}}}))
