"""Command line: flags -> ``ServerConfig`` -> pack -> preflight -> vLLM.

``uv run apps/server`` (no flags) builds or reuses the tiny-demo pack and serves it on 127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cpu_tier.config import ISAS, PRECISIONS
from vllm_dsv41.config import (
    ATTENTIONS,
    CPU_DRIVES,
    DENSE_KERNELS,
    HIT_KERNELS,
    KV_ROUNDINGS,
    PCIE_READS,
    SPLITS,
    Dsv41PluginConfig,
    TieredConfig,
)

from .config import ServerConfig, default_demo_dir
from .errors import ExitCode, ServerError

__all__ = ["main", "parse_args"]

_TIERED = TieredConfig()  # the defaults the help texts name (one home: vllm_dsv41.config)
_PLUGIN = Dsv41PluginConfig()

log = logging.getLogger("dsv41_server")


def _cores(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (expected e.g. 0-3,8)") from None
        out.extend(range(a, b + 1))
    return tuple(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv41-server",
        description="OpenAI-compatible server for DeepSeek-V4.1 EXL3 packs, and for the tiny demo pack on CPU.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--pack", type=Path, help="pack directory to serve")
    what.add_argument("--demo", action="store_true", help="serve the tiny-demo pack on CPU (the default)")
    p.add_argument("--demo-dir", type=Path, default=None, help=f"tiny-demo pack cache (default {default_demo_dir()})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key-file", type=Path, default=None,
        help="file holding the API key clients must send (required unless --host is a loopback address)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="model id for clients (default: by pack kind)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: by pack kind)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="concurrent sequences (default 4)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache in GiB, CPU packs (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90, help="VRAM fraction, GPU packs")
    g = p.add_argument_group("CPU expert tier")
    g.description = "Unset options keep the pack's setting (config.json 'dsv41'), else the plugin's default."
    g.add_argument("--cpu-threads", type=int, help="worker threads (0: one per usable CPU)")
    g.add_argument("--cpu-cores", type=_cores, help="CPUs to pin the workers to, e.g. 0-7")
    g.add_argument("--cpu-isa", choices=ISAS)
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help=f"the CPU tier's arithmetic (default {_PLUGIN.cpu.precision}: fast for a bf16/fp16 model (the GPU packs), "
        "exact for a float32 one (the demo); exact: fp32 activations, the exact fp16 codebook values; fast: int16 "
        "activations, ~2x faster, its error (~2e-4 per linear) under bf16's own rounding, at the noise floor on the "
        "Flash-sized pack)",
    )
    g.add_argument("--spin-us", type=int, help="idle spin before sleeping, microseconds")
    g.add_argument(
        "--cpu-amx-min-tokens",
        type=int,
        help="with --cpu-isa amx (or auto on AMX CPUs): fewest tokens per expert chunk on the AMX kernel",
    )
    g.add_argument("--cpu-prefetch-blocks", type=int, help="the kernels' software prefetch distance (0..4)")
    e = p.add_argument_group("GPU path")
    e.add_argument(
        "--expert-runtime",
        choices=("cpu", "tiered", "all-in-vram"),
        help="where routed experts run: the CPU tier from the host home (default); tiered (the hottest "
        "in a VRAM cache on the GPU, the misses on the CPU tier or read over PCIe); or all "
        "dequantized in VRAM (the oracle; only packs that fit)",
    )
    e.add_argument(
        "--dense-kernel",
        choices=DENSE_KERNELS,
        help="GPU kernel of the dense EXL3 linears (default auto: exllamav3's where it imports)",
    )
    e.add_argument(
        "--attention",
        choices=ATTENTIONS,
        help="DeepSeek-V4.1 attention kernels: upstream (vLLM's FlashMLA/DeepGEMM, sm_90+), triton (the "
        "plugin's, any GPU from sm_80: RTX 3090, A100) or auto (default: triton below sm_90)",
    )
    p.add_argument(
        "--attention-kv-rounding",
        choices=KV_ROUNDINGS,
        help="what the plugin's Triton attention stores in its bf16 KV rows: fp8 (rounded as upstream's FP8 caches "
        f"store them: Hopper's numerics) or bf16 (unrounded); default {_PLUGIN.attention_kv_rounding}",
    )
    t = p.add_argument_group("Tiered expert runtime (--expert-runtime tiered)")
    t.add_argument(
        "--cache-gib",
        type=float,
        help="VRAM for the expert cache (default 0: what vLLM leaves free after its KV cache, minus the "
        "margin; vLLM's share is --gpu-memory-utilization)",
    )
    t.add_argument(
        "--cache-margin-gib", type=float, help=f"VRAM left free beside the cache (default {_TIERED.cache_margin_gib:g})"
    )
    t.add_argument(
        "--cache-policy",
        choices=("hybrid", "decayed", "lru", "lfu", "arc"),
        help="the cache policy (default hybrid; decayed = the reference system's)",
    )
    t.add_argument(
        "--miss-split",
        choices=SPLITS,
        help="where cache misses run: auto (the cost model from rates measured at startup, default), "
        "all on the CPU tier, or all read over PCIe by the GPU",
    )
    t.add_argument(
        "--split-probe",
        type=int,
        help="with --miss-split auto: steps per decode batch size measured on each of the split path and the "
        "device path (every miss over PCIe, no host sync) before the faster is kept (0: always the split; "
        f"default {_TIERED.split_probe})",
    )
    t.add_argument(
        "--split-feedback",
        type=float,
        help="how much each layer call's measured CPU-tier and PCIe times correct the split's startup rates (a "
        f"weight in [0, 1]; 0: the startup rates only; default {_TIERED.split_feedback:g})",
    )
    t.add_argument(
        "--cpu-drive",
        choices=CPU_DRIVES,
        help="who drives the CPU tier's share of a decode step: the host thread, waiting for it in every MoE layer "
        "(host), or the GPU stream through CUDA host functions, the host queuing the whole step ahead (stream: "
        f"every miss to the CPU tier unless --stream-share) (default {_TIERED.cpu_drive})",
    )
    t.add_argument(
        "--stream-share",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --cpu-drive stream and --miss-split auto, read a share of each decode call's misses over PCIe "
        "(quota from the startup rates, chosen on the GPU, no host sync; H200: 1.04-1.27x the tok/s without) "
        f"(default {'on' if _TIERED.stream_share else 'off'})",
    )
    t.add_argument(
        "--layer-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the decode-size MoE layer calls of the no-sync paths (the device path; the stream-driven split) as "
        "CUDA graphs instead of ~10-30 launches each (bit for bit the eager calls' results; --no-layer-graphs: eager) "
        f"(default {'on' if _TIERED.layer_graphs else 'off'})",
    )
    t.add_argument(
        "--hit-kernel",
        choices=HIT_KERNELS,
        help="GPU kernel of the cached experts (default auto: the fastest available)",
    )
    t.add_argument(
        "--pcie-read",
        choices=PCIE_READS,
        help="how the GPU reads the misses it computes from the host home: in place (mapped, zero-copy; needs "
        "tensors aligned for the hit kernel), copied into transient VRAM slots first (staged), or auto (default: "
        "mapped where the kernel can, else staged)",
    )
    t.add_argument(
        "--device-stage",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="where PCIe reads are staged, let decode steps stay on the device path with the GPU copying their "
        f"misses into the transient slots itself (default {'on' if _TIERED.device_stage else 'off'})",
    )
    t.add_argument(
        "--pcie-stage-slots",
        type=int,
        metavar="N",
        help="transient VRAM slots of the staged read, one expert each, out of the cache's budget, used in two halves "
        f"(default {_TIERED.pcie_stage_slots})",
    )
    t.add_argument("--cpu-gbps", type=float, help="the cost model's CPU-tier rate in GB/s (default: measured)")
    t.add_argument("--pcie-gbps", type=float, help="the cost model's PCIe read rate in GB/s (default: measured)")
    t.add_argument(
        "--record-routing",
        type=Path,
        metavar="NPZ",
        help="record the served routing to this file at exit (replay: python -m expert_cache.sim)",
    )
    t.add_argument(
        "--tier-stats-every",
        type=int,
        metavar="STEPS",
        help=f"log hit rate, miss shares and ms per step every this many steps (default {_TIERED.stats_every}; 0: never)",
    )
    t.add_argument(
        "--prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stream the experts of big MoE calls through a VRAM ring lent by the cache (default on)",
    )
    t.add_argument(
        "--prefill-min-tokens",
        type=int,
        metavar="TOKENS",
        help="MoE calls of at least this many tokens stream (default 0: the step cost model calibrated at startup)",
    )
    t.add_argument(
        "--prefill-ring-slots",
        type=int,
        help=f"staging slots of the prefill ring (default {_TIERED.prefill_ring_slots})",
    )
    t.add_argument(
        "--prefill-experts-per-batch",
        type=int,
        help=f"experts per staging slot (default {_TIERED.prefill_experts_per_batch})",
    )
    t.add_argument(
        "--prefill-cpu-tail-batches",
        type=int,
        help="on mid-size calls, batches left to the CPU tier instead of streamed (default 0)",
    )
    t.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="TOKENS",
        help="vLLM's max-num-batched-tokens (the prefill chunk; default 8192 on GPU packs)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=None,
        help="largest request body accepted, larger ones get 413 (default: 32 bytes per context token, at least 1 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may still run before they are ended with an error "
        "(default 30; a second signal exits at once)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--check", action="store_true", help="run the preflight checks and exit")
    pp = p.add_argument_group("Parallelism (GPU packs)")
    pp.add_argument(
        "--pipeline-parallel-size", type=int, default=1, metavar="N",
        help="vLLM pipeline stages, one GPU each: each stage runs a contiguous range of layers with its own expert "
        "cache and CPU-tier threads (default 1)",
    )  # fmt: skip
    pp.add_argument(
        "--pp-cores", type=_cores, action="append", metavar="CPUS",
        help="the CPU tier's cores of one pipeline stage, once per stage in order (e.g. --pp-cores 0-15 --pp-cores "
        "16-31); default: --cpu-cores split evenly between the stages, or an even share of the cores unpinned",
    )  # fmt: skip
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[ServerConfig, bool]:
    """Flags -> (``ServerConfig``, check-only)."""
    a = _parser().parse_args(argv)
    # flag -> field of the plugin's nested cpu-tier config (CpuTierConfig)
    cpu_fields = {
        "cpu_threads": "threads",
        "cpu_cores": "cpus",
        "cpu_isa": "isa",
        "precision": "precision",
        "spin_us": "spin_us",
        "cpu_amx_min_tokens": "amx_min_tokens",
        "cpu_prefetch_blocks": "prefetch_blocks",
    }
    plugin: dict[str, object] = {}
    cpu = {f: getattr(a, n) for n, f in cpu_fields.items() if getattr(a, n) is not None}
    if cpu:
        plugin["cpu"] = cpu
    if a.expert_runtime is not None:
        plugin["runtime"] = a.expert_runtime
    if a.dense_kernel is not None:
        plugin["dense_kernel"] = a.dense_kernel
    if a.attention is not None:
        plugin["attention"] = a.attention
    if a.attention_kv_rounding is not None:
        plugin["attention_kv_rounding"] = a.attention_kv_rounding
    # flag -> field of the plugin's nested tiered-runtime config (TieredConfig)
    tiered_fields = {"cache_gib": "cache_gib", "cache_margin_gib": "cache_margin_gib", "cache_policy": "policy",
                     "miss_split": "split", "split_probe": "split_probe", "split_feedback": "split_feedback", "cpu_drive": "cpu_drive",
                     "stream_share": "stream_share", "layer_graphs": "layer_graphs", "hit_kernel": "hit_kernel",
                     "pcie_read": "pcie_read",
                     "device_stage": "device_stage",
                     "pcie_stage_slots": "pcie_stage_slots", "cpu_gbps": "cpu_gbps",
                     "pcie_gbps": "pcie_gbps", "record_routing": "trace_path",
                     "tier_stats_every": "stats_every", "prefill": "prefill",
                     "prefill_min_tokens": "prefill_min_tokens", "prefill_ring_slots": "prefill_ring_slots",
                     "prefill_experts_per_batch": "prefill_experts_per_batch",
                     "prefill_cpu_tail_batches": "prefill_cpu_tail_batches"}  # fmt: skip
    tiered = {f: getattr(a, n) for n, f in tiered_fields.items() if getattr(a, n) is not None}
    if "trace_path" in tiered:
        tiered["trace_path"] = str(tiered["trace_path"])
    if tiered:
        plugin["tiered"] = tiered
    if a.pp_cores:
        plugin["pp_cpus"] = tuple(a.pp_cores)
    try:
        cfg = ServerConfig(
            pack=a.pack,
            demo_dir=a.demo_dir or default_demo_dir(),
            host=a.host,
            port=a.port,
            api_key_file=a.api_key_file,
            served_model_name=a.served_model_name,
            max_model_len=a.max_model_len,
            max_num_seqs=a.max_num_seqs,
            prefill_chunk_tokens=a.prefill_chunk,
            kv_cache_gib=a.kv_cache_gib,
            gpu_memory_utilization=a.gpu_memory_utilization,
            plugin_overrides=plugin,
            log_level=a.log_level,
            max_request_bytes=a.max_request_bytes,
            shutdown_grace_s=a.shutdown_grace,
            pipeline_parallel_size=a.pipeline_parallel_size,
        )
    except ValueError as e:
        raise ServerError(f"bad option: {e}") from None
    return cfg, a.check


def _configure_logging() -> None:
    """The server's log lines on stderr, through a handler of its own (vLLM and its dependencies reconfigure
    the root logger while starting)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s dsv41-server %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit status (``ExitCode``: 2 when refused by the preflight)."""
    _configure_logging()
    try:
        cfg, check_only = parse_args(argv)
        from .packs import ensure_demo_pack, pack_kind
        from .preflight import preflight

        pack = ensure_demo_pack(cfg.demo_dir) if cfg.demo else cfg.pack
        assert pack is not None
        if not pack.is_dir():
            raise ServerError(f"--pack {pack}: not a directory")
        pack = pack.resolve()
        kind = pack_kind(pack)
        result = preflight(cfg, pack, kind)
    except ServerError as e:
        print(f"dsv41-server: error: {e}", file=sys.stderr)
        return ExitCode.REFUSED
    for warning in result.warnings:
        log.warning("%s", warning)
    log.info("preflight passed: %s (%s) on %s:%d", pack, kind.name, cfg.host, cfg.port)
    if check_only:
        return ExitCode.STOPPED
    from .serve import serve

    try:
        code = serve(cfg, pack, kind, result.api_key)
    except Exception:
        log.exception("the server failed to start")
        return ExitCode.START_FAILED
    log.info("exiting with status %d (%s)", code, ExitCode(code).name if code in set(ExitCode) else "signal")
    return code
