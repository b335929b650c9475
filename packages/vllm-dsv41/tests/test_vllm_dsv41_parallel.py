"""Pipeline parallelism on the CPU: vLLM's rank-to-layer partition, per-stage host homes, the CPU tier's core split,
the refusals; and (slow) the demo served with 2 pipeline stages by vLLM's CPU build equal to 1 stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cpu_tier.config import usable_cpus
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41.home import ExpertHome, resident_bytes
from vllm_dsv41.parallel import (
    check_parallel,
    check_stage_layers,
    pp_layers,
    rank_cpu_config,
    rank_plugin_config,
    split_evenly,
)

# ------------------------------------------------------------------------------------- rank -> layers


@pytest.mark.parametrize(("layers", "size"), [(2, 2), (40, 2), (43, 2), (43, 3), (61, 4), (7, 7)])
def test_stages_cover_the_layers_contiguously_in_order(layers: int, size: int) -> None:
    stages = [pp_layers(layers, r, size) for r in range(size)]
    assert [x for s in stages for x in s] == list(range(layers))  # contiguous, in rank order, each layer once
    lengths = [len(s) for s in stages]
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1


def test_stages_are_vllms_partition() -> None:
    """vLLM's documented rule (its answer, not ours): the remainder goes to the stages before the last."""
    assert [tuple(pp_layers(43, r, 2)) for r in range(2)] == [tuple(range(22)), tuple(range(22, 43))]
    assert [(s.start, s.stop) for s in (pp_layers(10, r, 4) for r in range(4))] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ValueError, match="pipeline rank 2 is not in"):
        pp_layers(10, 2, 2)


def test_stage_layer_check() -> None:
    assert check_stage_layers([3, 4], range(2, 5), 1, 2, "pack") == (3, 4)
    with pytest.raises(ValueError, match="rank 1 of 3 owns decoder layers \\[1, 2\\) and no MoE layer"):
        check_stage_layers([], range(1, 2), 1, 3, "pack")
    with pytest.raises(RuntimeError, match="MoE layers \\[7\\] outside vLLM's partition \\[2, 5\\)"):
        check_stage_layers([3, 7], range(2, 5), 1, 2, "pack")


# ----------------------------------------------------------------------------------- per-stage homes


def test_stage_homes_are_disjoint_views_of_the_one_home(demo_pack: Path) -> None:
    with ExpertHome(demo_pack, populate=True) as full:
        assert full.layer_ids == (0, 1)
        homes = [ExpertHome(demo_pack, populate=True, layers=[lid]) for lid in full.layer_ids]
        try:
            names = [set(h.tensor_names()) for h in homes]
            assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(full.tensor_names())
            for lid, h in zip(full.layer_ids, homes, strict=True):
                assert h.layer_ids == (lid,)
                assert h.stats.expert_bytes == sum(full.info(n).nbytes for n in h.tensor_names())
                for n in h.tensor_names():  # the same bytes of the same files
                    np.testing.assert_array_equal(h.array(n), full.array(n))
                    assert h.info(n) == full.info(n)
                r = resident_bytes(h)
                assert r["Anonymous"] == 0 and r["Rss"] >= h.stats.expert_bytes  # page-cache pages, no private copy
                other = 1 - lid
                with pytest.raises(KeyError, match=f"MoE layer {other} has no routed experts"):
                    h.layer(other)
                ly = h.layer(lid)
                ref = full.layer(lid)
                assert ly.num_experts == ref.num_experts
                np.testing.assert_array_equal(ly.down[-1].trellis, ref.down[-1].trellis)
                assert h.cache_home().layer_ids == (lid,)  # a stage's VRAM cache holds its own layers only
            assert sum(h.stats.expert_bytes for h in homes) == full.stats.expert_bytes
        finally:
            for h in homes:
                h.close()
    with pytest.raises(KeyError, match=r"MoE layers \[5\] have no routed experts"):
        ExpertHome(demo_pack, layers=[1, 5])


# -------------------------------------------------------------------------------------- core split


def _cores(n: int) -> tuple[int, ...]:
    cores = tuple(usable_cpus())
    if len(cores) < n:
        pytest.skip(f"needs {n} usable cores, this process has {len(cores)}")
    return cores[:n]


def test_split_evenly() -> None:
    assert split_evenly(range(5), 2) == [(0, 1, 2), (3, 4)]
    assert split_evenly([8, 9, 10, 11], 4) == [(8,), (9,), (10,), (11,)]
    assert split_evenly(range(1), 2) == [(0,), ()]


def test_cpu_cpus_are_split_evenly_between_stages() -> None:
    a, b = _cores(2)
    cfg = Dsv41PluginConfig.from_mapping({"cpu": {"cpus": [a, b], "precision": "fast"}})
    r0, r1 = (rank_cpu_config(cfg, r, 2) for r in range(2))
    assert (r0.cpus, r1.cpus) == ((a,), (b,)) and r0.threads == r1.threads == 0  # one thread per core
    assert r0.precision == r1.precision == "fast"  # everything else is the machine's setting
    assert rank_cpu_config(cfg, 0, 1) is cfg.cpu  # one stage: unchanged
    with pytest.raises(ValueError, match=r"cpu.cpus: 2 cores .* for 3 pipeline ranks"):
        rank_cpu_config(cfg, 0, 3)


def test_pp_cpus_pin_each_stage() -> None:
    a, b = _cores(2)
    cfg = Dsv41PluginConfig.from_mapping({"pp_cpus": [[b], [a]], "cpu": {"threads": 4}})
    assert cfg.pp_cpus == ((b,), (a,))
    r0, r1 = (rank_cpu_config(cfg, r, 2) for r in range(2))
    assert (r0.cpus, r1.cpus, r0.threads, r1.threads) == ((b,), (a,), 2, 2)  # cpu.threads is the total
    with pytest.raises(ValueError, match="pp_cpus: 2 core lists for pipeline_parallel_size 3"):
        rank_cpu_config(cfg, 0, 3)
    assert Dsv41PluginConfig.from_mapping(cfg.to_mapping()) == cfg  # round trip through JSON-able lists
    bad = Dsv41PluginConfig.from_mapping({"pp_cpus": [[a], [10_000]]})
    with pytest.raises(ValueError, match=r"pp_cpus\[1\] \(pipeline rank 1\): cpus: cores \[10000\] are not usable"):
        rank_cpu_config(bad, 1, 2)


def test_unpinned_stages_share_the_usable_cores() -> None:
    cfg = Dsv41PluginConfig()
    got = [rank_cpu_config(cfg, r, 2, usable=range(5)) for r in range(2)]
    assert [(c.cpus, c.threads) for c in got] == [((), 3), ((), 2)]
    assert rank_cpu_config(cfg, 1, 2, usable=[0]).threads == 1  # at least one (vLLM's CPU workers bind one core)
    cfg = Dsv41PluginConfig.from_mapping({"cpu": {"threads": 3}})
    assert [rank_cpu_config(cfg, r, 2).threads for r in range(2)] == [2, 1]
    with pytest.raises(ValueError, match="cpu.threads: 3 threads in total for 4 pipeline ranks"):
        rank_cpu_config(cfg, 0, 4)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pp_cpus": [[0], []]}, r"pp_cpus\[1\]: expected a non-empty list"),
        ({"pp_cpus": [[0, 1], [1]]}, r"pp_cpus\[1\]: cores \[1\] are given twice"),
        ({"pp_cpus": [[0, 0]]}, r"pp_cpus\[0\]: cores \[0\] are given twice"),
        ({"pp_cpus": [["a"]]}, r"pp_cpus\[0\]: expected a non-empty list of core numbers"),
        ({"pp_cpus": [0, 1]}, "pp_cpus: expected one list of cores per pipeline rank"),
        ({"pp_cpus": [[0]], "cpu": {"cpus": [0]}}, "pp_cpus and cpu.cpus: give the cores one way"),
    ],
)
def test_bad_pp_cpus_name_the_field(values: dict, message: str) -> None:
    if "cpu" in values:
        _cores(1)
        values = {**values, "cpu": {"cpus": [usable_cpus()[0]]}}
    with pytest.raises(ValueError, match=message):
        Dsv41PluginConfig.from_mapping(values, "additional_config 'dsv41'")


def test_stage_plugin_config_gets_its_cores_and_its_own_trace() -> None:
    cfg = Dsv41PluginConfig.from_mapping({"cpu": {"threads": 2}, "tiered": {"trace_path": "/tmp/run/trace.npz"}})
    assert rank_plugin_config(cfg, 0, 1) is cfg
    r1 = rank_plugin_config(cfg, 1, 2)
    assert r1.cpu.threads == 1 and r1.tiered.trace_path == "/tmp/run/trace.pp1.npz" and r1.pp_cpus == ()
    assert (r1.runtime, r1.tiered.cache_gib) == (cfg.runtime, cfg.tiered.cache_gib)


# ----------------------------------------------------------------------------------------- refusals


def _par(**kw: object) -> SimpleNamespace:
    base = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
            "enable_expert_parallel": False, "decode_context_parallel_size": 1,
            "prefill_context_parallel_size": 1}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_pipeline_parallel_is_accepted_the_rest_refused() -> None:
    cfg = Dsv41PluginConfig()
    for runtime in ("cpu", "tiered", "all-in-vram"):
        check_parallel(_par(pipeline_parallel_size=2), Dsv41PluginConfig.from_mapping({"runtime": runtime}))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2 is not supported.*pipeline_parallel_size=2"):
        check_parallel(_par(tensor_parallel_size=2), cfg)
    with pytest.raises(NotImplementedError, match="expert parallel"):
        check_parallel(_par(enable_expert_parallel=True, pipeline_parallel_size=2), cfg)
    with pytest.raises(NotImplementedError, match="data_parallel_size=2 is not supported"):
        check_parallel(_par(data_parallel_size=2), cfg)
    with pytest.raises(NotImplementedError, match="decode_context_parallel_size=2"):
        check_parallel(_par(decode_context_parallel_size=2), cfg)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM's model code
def test_vllm_refuses_tensor_parallel_through_the_demo_model(demo_pack: Path) -> None:
    """The refusal reaches the user through vLLM's own model construction (no engine: the model class alone)."""
    from vllm_dsv41.model import Dsv41DemoForCausalLM
    from vllm_dsv41.quant import Exl3Config

    quant = Exl3Config({"quant_method": "exl3"})
    quant._plugin_config = Dsv41PluginConfig()
    vcfg = SimpleNamespace(quant_config=quant, parallel_config=_par(tensor_parallel_size=2))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2"):
        Dsv41DemoForCausalLM(vllm_config=vcfg)


# --------------------------------------------------------------------------- served: 2 stages == 1 stage


@pytest.mark.slow
def test_demo_served_with_two_pipeline_stages_equals_one(demo_pack: Path, tmp_path: Path) -> None:
    """vLLM's CPU build runs the demo in 2 pipeline stages (2 worker processes, gloo), each mapping one MoE layer's
    experts with its own CPU tier on one core; its logits at every prompt position and its greedy tokens equal the
    1-stage run's (the fidelity tool: ``--save-reference`` at 1 stage, ``--reference`` at 2)."""
    a, b = _cores(2)
    ref, out = tmp_path / "pp1.npz", tmp_path / "pp2.json"
    common = ["--positions", "128", "--length", "64", "--greedy-prompts", "2", "--greedy-tokens", "8",
              "--cpu-threads", "2"]  # fmt: skip
    tool = [sys.executable, "-m", "vllm_dsv41.fidelity", str(demo_pack)]
    r = subprocess.run([*tool, "--against", "cpu", "--save-reference", str(ref), *common], capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # vLLM's CPU workers bind their threads per rank; one NUMA node needs the binding given (vLLM's variable)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{a}|{b}"}
    r = subprocess.run([*tool, "--runtime", "cpu", "--reference", str(ref), "--pipeline-parallel-size", "2",
                        "--json", str(out), *common], capture_output=True, text=True, timeout=900,
                       env=env)  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "pipeline rank 0 of 2: decoder layers [0, 1), routed experts of MoE layers [0] mapped" in log
    assert "pipeline rank 1 of 2: decoder layers [1, 2), routed experts of MoE layers [1] mapped" in log
    assert log.count("'cpu' expert runtime, cpu-tier") == 2 and "1 threads" in log  # 2 threads split 1 + 1
    res = json.loads(out.read_text())
    assert res["positions"] == 128 and res["top1_agreement"] == 1.0 and res["greedy_match"]
    assert res["kl_max"] < 1e-10  # the same fp32 arithmetic, split over two processes
