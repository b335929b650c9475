"""Flags, preflight checks and start-up failures (no vLLM engine needed: these run in seconds)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from dsv41_server import ServerConfig, ServerError
from dsv41_server.config import MIN_API_KEY_CHARS, default_max_request_bytes
from dsv41_server.cli import parse_args
from dsv41_server.packs import DEMO, V41, ensure_demo_pack, pack_kind
from dsv41_server.preflight import (
    GiB,
    check_api_key,
    check_cpu,
    check_gpu,
    check_host_ram,
    check_memlock,
    check_pack,
    check_pipeline,
    check_port,
    plugin_config,
    preflight,
)
from dsv41_server.serve import vllm_argv, vllm_env
from dsv41_server.testing import free_port, isolated_env


@pytest.fixture(scope="module")
def demo_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_pack(tmp_path_factory.mktemp("preflight") / "tiny-demo")


def _copy(pack: Path, dst: Path) -> Path:
    shutil.copytree(pack, dst)
    return dst


def _run_server(args: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    env = isolated_env(root)
    return subprocess.run(
        [sys.executable, "-m", "dsv41_server", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _assert_one_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsv41-server: error:")]
    assert len(errors) == 1, proc.stderr
    message = proc.stderr[proc.stderr.index("dsv41-server: error:") :]
    for needle in needles:
        assert needle in message, message
    return message


# --------------------------------------------------------------------------------------------- flags


def test_defaults_serve_the_demo_on_loopback() -> None:
    cfg, check = parse_args([])
    assert cfg.demo and cfg.host == "127.0.0.1" and cfg.loopback and not check
    assert cfg.demo_dir.parts[-2:] == ("dsv41", "tiny-demo")
    assert dict(cfg.plugin_overrides) == {}


def test_flags_map_onto_the_configs(tmp_path: Path) -> None:
    cfg, check = parse_args(
        ["--pack", str(tmp_path), "--host", "0.0.0.0", "--port", "9001", "--cpu-cores", "0-1", "--cpu-isa", "avx2",
         "--precision", "fast", "--max-num-seqs", "8", "--cpu-amx-min-tokens", "4", "--check"]
    )  # fmt: skip
    assert cfg.pack == tmp_path and not cfg.demo and not cfg.loopback and check
    assert cfg.port == 9001 and cfg.max_num_seqs == 8
    assert dict(cfg.plugin_overrides) == {"cpu": {"cpus": (0, 1), "isa": "avx2", "precision": "fast",
                                                  "amx_min_tokens": 4}}  # fmt: skip
    cfg, _ = parse_args(["--expert-runtime", "all-in-vram", "--dense-kernel", "triton", "--cpu-prefetch-blocks", "2",
                         "--attention", "triton", "--attention-kv-rounding", "bf16"])  # fmt: skip
    assert dict(cfg.plugin_overrides) == {"cpu": {"prefetch_blocks": 2}, "runtime": "all-in-vram",
                                          "dense_kernel": "triton", "attention": "triton",
                                          "attention_kv_rounding": "bf16"}  # fmt: skip
    cfg, _ = parse_args(["--expert-runtime", "tiered", "--cache-gib", "6.5", "--cache-margin-gib", "0.5",
                         "--cache-policy", "decayed", "--miss-split", "pcie", "--hit-kernel", "triton",
                         "--cpu-gbps", "40", "--pcie-gbps", "20", "--record-routing", str(tmp_path / "r.npz"),
                         "--tier-stats-every", "0", "--pcie-read", "staged", "--pcie-stage-slots", "12",
                         "--split-feedback", "0.25", "--split-probe", "4", "--no-device-stage", "--cpu-drive", "stream",
                         "--stream-share", "--layer-graphs"])  # fmt: skip
    assert dict(cfg.plugin_overrides) == {"runtime": "tiered", "tiered": {
        "cache_gib": 6.5, "cache_margin_gib": 0.5, "policy": "decayed", "split": "pcie", "split_feedback": 0.25, "split_probe": 4,
        "cpu_drive": "stream", "stream_share": True, "layer_graphs": True, "hit_kernel": "triton",
        "pcie_read": "staged", "device_stage": False, "pcie_stage_slots": 12, "cpu_gbps": 40.0, "pcie_gbps": 20.0,
        "trace_path": str(tmp_path / "r.npz"), "stats_every": 0}}  # fmt: skip
    cfg, _ = parse_args(["--no-prefill", "--prefill-min-tokens", "1024", "--prefill-ring-slots", "4",
                         "--prefill-experts-per-batch", "16", "--prefill-cpu-tail-batches", "2",
                         "--prefill-chunk", "4096"])  # fmt: skip
    assert dict(cfg.plugin_overrides) == {"tiered": {
        "prefill": False, "prefill_min_tokens": 1024, "prefill_ring_slots": 4, "prefill_experts_per_batch": 16,
        "prefill_cpu_tail_batches": 2}}  # fmt: skip
    assert cfg.prefill_chunk_tokens == 4096


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--spin-us", "-1"], "spin_us"),
        (["--port", "70000"], "port"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--cpu-amx-min-tokens", "0"], "amx_min_tokens"),
        (["--cpu-prefetch-blocks", "7"], "prefetch_blocks"),
        (["--pcie-stage-slots", "0"], "pcie_stage_slots"),
        (["--split-feedback", "1.5"], "split_feedback"),
        (["--split-probe", "-1"], "split_probe"),
        (["--cache-gib", "-2"], "cache_gib"),
        (["--tier-stats-every", "-1"], "stats_every"),
        (["--prefill-ring-slots", "0"], "prefill_ring_slots"),
        (["--prefill-chunk", "8"], "prefill_chunk_tokens"),
    ],
)
def test_bad_flag_values_name_the_setting(argv: list[str], needle: str) -> None:
    with pytest.raises(ServerError, match=needle):
        parse_args(argv)


def test_vllm_arguments_per_pack_kind(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"]}))
    cfg = ServerConfig(pack=tmp_path, plugin_overrides={"cpu": {"threads": 2}})
    demo = vllm_argv(cfg, tmp_path, DEMO)
    assert demo[demo.index("--tool-call-parser") + 1] == "hermes"
    assert demo[demo.index("--reasoning-parser") + 1] == "qwen3"
    assert demo[demo.index("--dtype") + 1] == "float32" and "--enforce-eager" in demo
    assert json.loads(demo[demo.index("--additional-config") + 1]) == {"dsv41": {"cpu": {"threads": 2}}}
    assert demo[demo.index("--load-format") + 1] == "dsv41"  # the plugin's loader maps the experts
    assert "--cpu-threads" not in demo  # plugin settings travel in vLLM's additional_config only
    v41 = vllm_argv(cfg, tmp_path, V41)
    assert v41[v41.index("--tool-call-parser") + 1] == "deepseek_v41"
    assert v41[v41.index("--reasoning-parser") + 1] == "deepseek_v41"
    assert v41[v41.index("--tokenizer-mode") + 1] == "deepseek_v41"
    assert v41[v41.index("--load-format") + 1] == "dsv41"
    assert json.loads(v41[v41.index("--limit-mm-per-prompt") + 1]) == {"image": 0}  # text only
    # the routed-expert op is an eager break of vLLM's breakable CUDA graphs: FULL graphs would capture the CPU tier
    assert json.loads(v41[v41.index("--compilation-config") + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert "--api-key" not in demo + v41
    assert v41[v41.index("--dtype") + 1] == "bfloat16" and "--gpu-memory-utilization" in v41
    assert "--gpu-memory-utilization" not in demo
    assert v41[v41.index("--max-num-batched-tokens") + 1] == "8192" and "--max-num-batched-tokens" not in demo
    chunked = ServerConfig(pack=tmp_path, prefill_chunk_tokens=4096)
    assert (
        vllm_argv(chunked, tmp_path, V41)[vllm_argv(chunked, tmp_path, V41).index("--max-num-batched-tokens") + 1]
        == "4096"
    )
    assert vllm_env(cfg, DEMO)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(cfg, V41)
    # vLLM imports the V4.1 model before it turns breakable graphs on: the server turns them on first
    assert vllm_env(cfg, V41)["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in vllm_env(cfg, DEMO)


def test_request_limit_and_shutdown_grace_flags() -> None:
    cfg, _ = parse_args([])
    assert cfg.max_request_bytes is None and cfg.shutdown_grace_s == 30.0
    assert default_max_request_bytes(2048) == 1 << 20  # the floor
    assert default_max_request_bytes(65536) == 2 << 20  # 32 bytes per context token
    cfg, _ = parse_args(["--max-request-bytes", "65536", "--shutdown-grace", "2.5"])
    assert cfg.max_request_bytes == 65536 and cfg.shutdown_grace_s == 2.5
    with pytest.raises(ServerError, match="max_request_bytes"):
        parse_args(["--max-request-bytes", "10"])
    with pytest.raises(ServerError, match="shutdown_grace_s"):
        parse_args(["--shutdown-grace", "-1"])


def test_pack_kind_from_config(tmp_path: Path) -> None:
    for arch, kind in (("Dsv41DemoForCausalLM", DEMO), ("DeepseekV41ForCausalLM", V41)):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert pack_kind(tmp_path) is kind
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ServerError, match="LlamaForCausalLM"):
        pack_kind(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ServerError, match="config.json"):
        pack_kind(tmp_path)


# ---------------------------------------------------------------------------------------- the checks


def test_api_key_rules(tmp_path: Path) -> None:
    assert check_api_key(ServerConfig()) == (None, [])
    key, problems = check_api_key(ServerConfig(host="0.0.0.0"))
    assert key is None and "--api-key-file" in problems[0]
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    f.chmod(0o600)
    assert check_api_key(ServerConfig(api_key_file=f)) == ("s3cret", [])  # loopback: any key
    short = check_api_key(ServerConfig(host="0.0.0.0", api_key_file=f))  # reachable from other machines
    assert short[0] is None and "6 characters" in short[1][0] and f"at least {MIN_API_KEY_CHARS}" in short[1][0]
    f.write_text("x" * (MIN_API_KEY_CHARS - 1) + "\n")
    assert check_api_key(ServerConfig(host="0.0.0.0", api_key_file=f))[0] is None
    f.write_text("x" * MIN_API_KEY_CHARS + "\n")
    assert check_api_key(ServerConfig(host="0.0.0.0", api_key_file=f)) == ("x" * MIN_API_KEY_CHARS, [])
    f.chmod(0o644)
    assert "chmod 600" in check_api_key(ServerConfig(host="0.0.0.0", api_key_file=f))[1][0]
    f.write_text("  \n")
    f.chmod(0o600)
    assert "empty" in check_api_key(ServerConfig(api_key_file=f))[1][0]
    assert "cannot read" in check_api_key(ServerConfig(api_key_file=tmp_path / "missing"))[1][0]


def test_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert "already in use" in check_port("127.0.0.1", port)[0]
    assert check_port("127.0.0.1", free_port()) == []


def test_resource_checks() -> None:
    assert check_host_ram(2 * GiB, available=4 * GiB) == []
    assert "needs about 8.0 GiB and 4.0 GiB is available" in check_host_ram(8 * GiB, available=4 * GiB)[0]
    assert check_memlock(10 * GiB, limit=resource.RLIM_INFINITY) == []
    assert "ulimit -l unlimited" in check_memlock(10 * GiB, limit=64 << 20)[0]


def test_plugin_settings_merge_and_cpu_checks(demo_pack: Path) -> None:
    from cpu_tier import runnable_isas

    merged = plugin_config(demo_pack, {"cpu": {"spin_us": 5}})
    assert (merged.cpu.precision, merged.cpu.spin_us) == ("exact", 5)  # pack default + flag
    assert check_cpu(merged, require_simd=False) == []
    assert "scalar" in runnable_isas()
    assert check_cpu(plugin_config(demo_pack, {"cpu": {"isa": "scalar"}}), require_simd=False) == []
    if "avx512" not in runnable_isas():
        assert "this CPU runs only" in check_cpu(plugin_config(demo_pack, {"cpu": {"isa": "avx512"}}), False)[0]
    with pytest.raises(ValueError, match="cpus"):
        plugin_config(demo_pack, {"cpu": {"cpus": (4095,)}})
    with pytest.raises(ValueError, match="threads"):
        plugin_config(demo_pack, {"cpu": {"threads": -3}})


def test_pipeline_flags_reach_vllm_and_the_plugin(tmp_path: Path) -> None:
    cfg, _ = parse_args(["--pack", str(tmp_path), "--pipeline-parallel-size", "2", "--pp-cores", "0-1",
                         "--pp-cores", "2,3"])  # fmt: skip
    assert cfg.pipeline_parallel_size == 2 and dict(cfg.plugin_overrides) == {"pp_cpus": ((0, 1), (2, 3))}
    argv = vllm_argv(cfg, tmp_path, V41)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"dsv41": {"pp_cpus": [[0, 1], [2, 3]]}}
    assert "--pipeline-parallel-size" not in vllm_argv(parse_args([])[0], tmp_path, V41)  # 1 stage: vLLM's default
    with pytest.raises(ServerError, match="pipeline_parallel_size: expected 1..64"):
        parse_args(["--pipeline-parallel-size", "0"])
    with pytest.raises(ServerError, match=r"pp_cpus\[1\]: cores \[1\] are given twice"):
        parse_args(["--pp-cores", "0-1", "--pp-cores", "1"])


def test_pipeline_check(demo_pack: Path) -> None:
    plugin = plugin_config(demo_pack, {})
    flash = {"text_config": {"num_hidden_layers": 43}}
    assert check_pipeline(1, plugin, DEMO, {}) == []
    assert check_pipeline(2, plugin, V41, flash, gpus=2) == []
    assert "pipeline stages run one per GPU, for GPU packs" in check_pipeline(2, plugin, DEMO, {}, gpus=2)[0]
    assert check_pipeline(2, plugin, V41, flash, gpus=1) == ["--pipeline-parallel-size 2: needs 2 GPUs (one per "
                                                             "stage), 1 visible"]  # fmt: skip
    (p,) = check_pipeline(2, plugin, V41, {"num_hidden_layers": 1}, gpus=2)
    assert "the pack has 1 layers, fewer than the stages" in p
    core = min(os.sched_getaffinity(0))
    (p,) = check_pipeline(2, plugin_config(demo_pack, {"cpu": {"cpus": [core]}}), V41, flash, gpus=2)
    assert "(--cpu-cores / --cpu-threads): cpu.cpus: 1 cores" in p and "for 2 pipeline ranks" in p
    (p,) = check_pipeline(2, plugin_config(demo_pack, {"pp_cpus": [[core], [core + 1], [core + 2]]}), V41, flash,
                          gpus=2)  # fmt: skip
    assert "(--pp-cores): pp_cpus: 3 core lists for pipeline_parallel_size 2" in p
    (p,) = check_pipeline(1, plugin_config(demo_pack, {"pp_cpus": [[core], [core + 1]]}), DEMO, {})
    assert "pp_cpus: 2 core lists for pipeline_parallel_size 1" in p


def test_pipeline_stages_on_the_demo_stop_before_vllm(demo_pack: Path, tmp_path: Path) -> None:
    proc = _run_server(["--pack", str(demo_pack), "--port", str(free_port()), "--pipeline-parallel-size", "2",
                        "--check"], tmp_path)  # fmt: skip
    _assert_one_error(proc, "--pipeline-parallel-size 2: pipeline stages run one per GPU")


def test_gpu_check_on_this_machine() -> None:
    import torch

    problems = check_gpu(1 * GiB, 0.9)
    if torch.cuda.is_available():
        assert problems == []
    else:
        assert "needs an NVIDIA GPU" in problems[0]


def test_v41_pack_on_a_cpu_machine_stops_before_vllm(demo_pack: Path, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the V4.1 refusal is about machines without one")
    with pytest.raises(ServerError) as info:
        preflight(ServerConfig(pack=demo_pack, port=free_port()), demo_pack, V41)
    assert "needs an NVIDIA GPU" in str(info.value)


def test_demo_pack_passes_preflight(demo_pack: Path) -> None:
    result = preflight(ServerConfig(pack=demo_pack, port=free_port()), demo_pack, DEMO)
    assert result.api_key is None and result.pack_info["experts"] == 8 and result.pack_info["layers"] == 2
    assert check_pack(demo_pack) == ([], [])


def test_untracked_files_warn_but_untracked_weights_stop(demo_pack: Path, tmp_path: Path) -> None:
    pack = _copy(demo_pack, tmp_path / "untracked")
    (pack / "NOTES.md").write_text("my notes")
    problems, warnings = check_pack(pack)
    assert problems == [] and len(warnings) == 1 and "NOTES.md" in warnings[0] and "ignores it" in warnings[0]
    result = preflight(ServerConfig(pack=pack, port=free_port()), pack, DEMO)
    assert result.warnings == tuple(warnings)
    (pack / "extra.safetensors").write_bytes(b"\0" * 16)  # vLLM could load it (no index in this pack)
    problems, _ = check_pack(pack)
    assert any("extra.safetensors" in p and "untracked" in p for p in problems)


def test_demo_cache_is_reused_and_repaired(demo_pack: Path, tmp_path: Path) -> None:
    cache = _copy(demo_pack, tmp_path / "tiny-demo")
    before = (cache / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_pack(cache) == cache and (cache / "model.safetensors").stat().st_mtime_ns == before
    with (cache / "model.safetensors").open("r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)
    assert ensure_demo_pack(cache) == cache and check_pack(cache) == ([], [])
    # a demo built by an older version: it verifies, but its plugin settings have an old shape -> rebuilt
    from pack_tools.manifest import hash_file

    cfg = json.loads((cache / "config.json").read_text())
    cfg["dsv41"] = {"precision": "exact"}
    (cache / "config.json").write_text(json.dumps(cfg))
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["files"]["config.json"].update(sha256=hash_file(cache / "config.json"),
                                            size=(cache / "config.json").stat().st_size)  # fmt: skip
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert check_pack(cache)[0] == []  # (it verifies)
    assert ensure_demo_pack(cache) == cache
    assert json.loads((cache / "config.json").read_text())["dsv41"] == {"cpu": {"precision": "exact"}}
    other = tmp_path / "not-a-pack"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ServerError, match="not a tiny-demo pack"):
        ensure_demo_pack(other)
    assert (other / "notes.txt").exists()


# -------------------------------------------------------------------------------- start-up failures


def test_corrupt_pack_fails_with_one_clear_message(demo_pack: Path, tmp_path: Path) -> None:
    pack = _copy(demo_pack, tmp_path / "corrupt")
    with (pack / "model.safetensors").open("r+b") as f:
        f.seek(-1000, os.SEEK_END)
        f.write(b"\x00" * 16)
    proc = _run_server(["--pack", str(pack), "--port", str(free_port())], tmp_path)
    message = _assert_one_error(proc, "fails verification", "model.safetensors")
    assert message.count("\n  - ") <= 6


def test_truncated_pack_fails_with_one_clear_message(demo_pack: Path, tmp_path: Path) -> None:
    pack = _copy(demo_pack, tmp_path / "truncated")
    size = (pack / "model.safetensors").stat().st_size
    os.truncate(pack / "model.safetensors", size // 2)
    message = _assert_one_error(
        _run_server(["--pack", str(pack), "--port", str(free_port())], tmp_path), "model.safetensors"
    )
    # The first problem (the truncation) is the one shown; the damage it causes is counted, not listed.
    lines = [ln for ln in message.splitlines() if ln.startswith("  - ")]
    assert len(lines) == 2, message
    assert "truncated" in lines[0] and "more lines about model.safetensors" in lines[0]
    assert lines[1] == f"  - (every problem: pack-tools verify {pack})"


def test_missing_pack_and_wrong_architecture(demo_pack: Path, tmp_path: Path) -> None:
    _assert_one_error(_run_server(["--pack", str(tmp_path / "nope")], tmp_path), "not a directory")
    pack = _copy(demo_pack, tmp_path / "llama")
    cfg = json.loads((pack / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (pack / "config.json").write_text(json.dumps(cfg))
    _assert_one_error(_run_server(["--pack", str(pack)], tmp_path), "LlamaForCausalLM")


def test_binding_beyond_loopback_needs_an_api_key(demo_pack: Path, tmp_path: Path) -> None:
    proc = _run_server(["--pack", str(demo_pack), "--host", "0.0.0.0", "--port", str(free_port())], tmp_path)
    _assert_one_error(proc, "--api-key-file")
    key = tmp_path / "key"
    key.write_text("k\n")
    key.chmod(0o600)
    _assert_one_error(
        _run_server(["--pack", str(demo_pack), "--host", "0.0.0.0", "--port", str(free_port()), "--api-key-file",
                     str(key), "--check"], tmp_path),
        "1 characters", f"at least {MIN_API_KEY_CHARS}",
    )  # fmt: skip
    key.write_text("k" * MIN_API_KEY_CHARS + "\n")
    ok = _run_server(
        ["--pack", str(demo_pack), "--host", "0.0.0.0", "--port", str(free_port()), "--api-key-file", str(key),
         "--check"], tmp_path,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
