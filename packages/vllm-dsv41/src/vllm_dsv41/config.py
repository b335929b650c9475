"""``Dsv41PluginConfig``: the plugin's one configuration object.

It reaches the plugin through vLLM's own configuration, never through environment variables:

* the pack's ``config.json`` may carry pack defaults in a ``"dsv41"`` object (an attribute of vLLM's
  ``hf_config``);
* the server passes overrides as ``additional_config={"dsv41": {...}}`` (vLLM's ``--additional-config``).

Overrides win field by field (the nested ``cpu`` object too). Unknown fields and bad values raise
``ValueError`` naming the field and where it came from. The CPU expert tier's settings are cpu-tier's own
``CpuTierConfig``, nested as ``cpu`` (not mirrored), so every cpu-tier knob is reachable and checked once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from cpu_tier import CpuTierConfig
from engram_mmap import TableConfig

#: The key under which the plugin's settings live in ``config.json`` and in vLLM's ``additional_config``.
CONFIG_KEY = "dsv41"

Runtime = Literal["cpu", "all-in-vram", "tiered"]
DenseKernel = Literal["auto", "exllamav3", "triton"]
EngramMode = Literal["mmap", "upstream"]
Split = Literal["auto", "cpu", "pcie"]
HitKernelName = Literal["auto", "exllamav3", "triton", "reference"]
PcieRead = Literal["auto", "mapped", "staged"]
CpuDrive = Literal["host", "stream"]
Attention = Literal["auto", "upstream", "triton"]
KvRounding = Literal["fp8", "bf16"]
RUNTIMES: tuple[str, ...] = ("cpu", "all-in-vram", "tiered")
DENSE_KERNELS: tuple[str, ...] = ("auto", "exllamav3", "triton")
SPLITS: tuple[str, ...] = ("auto", "cpu", "pcie")
HIT_KERNELS: tuple[str, ...] = ("auto", "exllamav3", "triton", "reference")
PCIE_READS: tuple[str, ...] = ("auto", "mapped", "staged")
CPU_DRIVES: tuple[str, ...] = ("host", "stream")
ENGRAM_MODES: tuple[str, ...] = ("mmap", "upstream")
ATTENTIONS: tuple[str, ...] = ("auto", "upstream", "triton")
KV_ROUNDINGS: tuple[str, ...] = ("fp8", "bf16")
PREFILL_BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
#: vLLM's ``max_num_batched_tokens`` (the prefill chunk) the server sets for GPU packs: 8192 keeps the staged
#: prefill's activations (~1 GB at V4.1-Flash sizes, on top of the ring lent by the cache) under a 24 GB card's
#: margin at 262k-token context settings (the reference system's 16k chunks ran out of memory on 24 GB).
DEFAULT_PREFILL_CHUNK_TOKENS = 8192

__all__ = [
    "ATTENTIONS",
    "CONFIG_KEY",
    "CPU_DRIVES",
    "DEFAULT_PREFILL_CHUNK_TOKENS",
    "DENSE_KERNELS",
    "ENGRAM_MODES",
    "HIT_KERNELS",
    "PCIE_READS",
    "RUNTIMES",
    "SPLITS",
    "Dsv41PluginConfig",
    "TieredConfig",
    "merge_settings",
    "vllm_env_for_pack",
]


def _number(name: str, value: Any, lo: float, hi: float = float("inf")) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}], got {value!r}")


def _integer(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class TieredConfig:
    """The tiered expert runtime (``runtime="tiered"``): the hottest experts in an elastic VRAM cache computed on
    the GPU, the misses on the CPU tier or read over PCIe by the GPU, one combined result.

    Attributes
    ----------
    cache_gib : VRAM for the expert cache. 0 (auto): what vLLM leaves free once its KV cache is allocated, minus
        ``cache_margin_gib`` (vLLM's share is ``gpu_memory_utilization``: set it to what the weights and the KV
        cache need, e.g. 0.5 on a 24 GB card, and the expert cache takes the rest).
    cache_margin_gib : VRAM left free beside the cache (CUDA graphs, the allocator's slack, other processes).
    device_gib : the device memory this process may use in all, GiB (0: the whole card). The automatic cache size
        is capped by it minus what PyTorch has reserved: set it to mimic a smaller card (the H200 as a 24 GB one).
    policy : the cache policy (``expert_cache.POLICIES``; "hybrid" by default, "decayed" = the reference's).
    replan_every : decode steps between two replans of the cache.
    admit_limit : most experts admitted into the cache per replan (bounds the copy traffic).
    split : where misses go. "auto": the cost model (measured rates) splits them between the CPU tier and the
        GPU reading the host home over PCIe so both finish together; "cpu" / "pcie": all of them there.
    hit_kernel : the GPU kernel of the cached experts (``vllm_dsv41.hits``); "auto" picks the fastest available:
        exllamav3's where it imports, ours where the host home is not 16-byte aligned (with ``pcie_read`` "auto":
        ours reads the misses in place, exllamav3 would stage them; ``hits.in_place_backend``).
    pcie_read : how the GPU reads the experts it computes from the host home (the PCIe share of the misses and the
        deadline fallback). "mapped": the hit kernel reads the GPU-mapped home in place (zero-copy; needs the
        home's tensors aligned to the kernel's loads: 16 bytes for exllamav3's); "staged": the copy engine copies
        them into transient VRAM slots first (any alignment; ``pcie_stage_slots`` experts at a time), then the hit
        kernel reads the slots; "auto": mapped where the kernel can read the home in place, else staged.
    pcie_stage_slots : transient VRAM slots of the staged read (each one expert; their memory is taken from the
        cache's budget), used as two halves in turn (a round's copies overlap the previous round's kernel): rounds
        of ``pcie_stage_slots // 2`` experts. Default 16: rounds of 8 (213 MB at Flash's sizes).
    cpu_gbps, pcie_gbps : the cost model's rates (expert bytes per second, in GB/s) of the CPU tier and of the
        GPU's PCIe reads of the host home (mapped or staged, as configured); 0 = measured at startup.
    device_stage : where the GPU stages its PCIe reads ("staged", or "auto" on a home its kernel cannot read in
        place), let decode-size calls still run on the device path, the GPU copying their misses into the transient
        slots itself (``vllm_dsv41.dev_stage``; needs the home's tensors in 4-byte words). False: such calls take
        the split path (the host learns the misses and queues the copy engine's copies).
    split_probe : with split "auto" and a device path (mapped reads, or staged ones with ``device_stage``), each
        decode batch size (tokens per step) runs this many steps on each of two paths, the split (inputs to the
        host, misses split by the cost model) and the device path (every miss read over PCIe by the hit kernel, no
        host sync per layer; what split "pcie" always runs), and keeps the one whose steps take less time, median
        (first MoE layer to the next step's; ``vllm_dsv41.split.PathChooser``; measured again every
        ``REVISIT_STEPS`` steps). 0: always the split.
    split_feedback : how much each layer call's measured times correct the split's startup rates: per path (CPU
        tier, PCIe share) an exponential average of log(measured / predicted seconds) (this weight per call) scales
        that path's rate and fixed cost, so the split follows what the paths take while serving (the CPU tier
        beside vLLM's threads, the PCIe share with its launches) rather than what they took alone at startup.
        The stream-driven CPU tier's jobs are folded in every 64 steps (weighted as that many calls), and the
        shared split's quota table is built again once a rate has moved by over 10%. 0: the startup rates only.
    cpu_drive : who drives the CPU tier's share of a decode-size call. "host": the host thread copies the inputs
        to the host, waits for them, splits the misses, submits the job and, in ``finish``, waits for it (a host
        sync per MoE layer: vLLM's launches between the layers wait for the CPU tier). "stream": the GPU stream
        does, through two CUDA host functions (``cpu_tier.StreamCall``): the inputs copied to pinned buffers, the
        job submitted when the stream reaches it, the stream held until the job is done, the results copied back
        and the picks the CPU tier missed at its deadline computed by the hit kernel from the host home; the host
        thread never waits, so it queues a whole step ahead. Every miss goes to the CPU tier unless
        ``stream_share``; with split "auto" it is the split side the chooser measures against the device path.
        Needs a home the hit kernel reads in place (``pcie_read`` mapped, or "auto" on
        such a home); elsewhere the calls run as "host". Default "stream": on the H200 host it decoded 1.01-1.36x
        the host drive's tok/s in the same run (every miss on the CPU tier; vllm-dsv41 README, run 10); "host"
        splits per expert with the host's view of the routing (token counts, feedback from measured times).
    stream_share : with ``cpu_drive`` "stream" and split "auto", share each decode call's misses between the CPU
        tier and the hit kernel reading the host home, with no host sync: a quota per (tokens, distinct misses)
        from ``split.share_quota_table`` at the startup rates, applied on the device (``route_prep.share_misses``:
        the most-picked missed experts to the GPU). Default on: on the H200 host (vllm-dsv41 README, run 11) split
        "auto" with it decoded 1.04 / 1.15 / 1.27x the tok/s without it at 1 / 2 / 4 streams (same lease).
    layer_graphs : run the decode-size layer calls of the two no-sync paths as CUDA graphs, captured on the second
        call of a shape (``vllm_dsv41.devgraphs``): the device path (every miss read over PCIe by the hit kernel:
        split "pcie", and the steps split "auto" gives it) as one graph a call, the stream-driven split
        (``cpu_drive`` "stream") as two, begin and finish, with the CPU tier's submit and wait as host functions
        inside them. A call then costs its input copies and one launch (two) instead of ~10-30, whose host time
        made the H200's device-path steps the host's (run 10: 5.8-6.4 ms of host time in a 3-layer step's layer
        calls). Default on: on the H200 (run 11) the device path's host time in the layer calls fell from 2.40 to
        0.99 ms a 3-layer step and split "auto" decoded 1.00 / 1.13 / 1.02x the tok/s without graphs at 1 / 2 / 4
        streams; graphs replay bit for bit what the eager calls compute (GPU-tested). Where a hit kernel is not graph
        safe the calls run eagerly (logged once), as they do on a CPU device.
    deadline_factor, deadline_floor_ms : the CPU tier's deadline per layer, ``factor * predicted + floor``; picks
        it has not computed by then are computed by the GPU from the host home (counted, never dropped).
        ``deadline_factor = 0``: no deadline.
    trace_path : record the served routing (``expert_cache.trace`` format, ``.npz``) to this path at exit; the
        policies can then be replayed on it with ``python -m expert_cache.sim``. Empty: no recording.
    stats_every : log the tier's statistics every this many decode steps (0: never).
    prefill : run MoE calls of many tokens through the staged prefill (``vllm_dsv41.prefill``: the experts
        streamed from the host home through a ring of VRAM slots lent by the cache, computed as GEMMs).
    prefill_min_tokens : calls of at least this many tokens stream; 0: the crossover of the step cost model
        calibrated at startup (measured copy and staged-compute rates against the decode path's).
    prefill_ring_slots, prefill_experts_per_batch : the staging ring: slots, and experts per slot (one batch).
        The ring and the decode scratch of one batch (``~(slots + 3.4) x experts`` expert sizes; 1.4 GB at
        V4.1-Flash sizes with the defaults) are lent by the VRAM cache while prefill runs.
    prefill_cpu_tail_batches : on calls up to the model's hybrid limit, the last batches are computed by the CPU
        tier instead of being streamed (0: off).
    prefill_hit_rate : the decode path's expected cache hit rate, for the step cost model (the reference system
        measured 0.38-0.44 on served routes).
    prefill_h2d_gbps : the copy engine's rate from the host home (GB/s); 0 = measured at startup.
    prefill_backend : the staged compute: "auto" (Triton on a GPU), "triton", "torch".
    """

    cache_gib: float = 0.0
    cache_margin_gib: float = 1.0
    device_gib: float = 0.0
    policy: str = "hybrid"
    replan_every: int = 16
    admit_limit: int = 48
    split: Split = "auto"
    hit_kernel: HitKernelName = "auto"
    pcie_read: PcieRead = "auto"
    pcie_stage_slots: int = 16
    cpu_gbps: float = 0.0
    pcie_gbps: float = 0.0
    device_stage: bool = True
    cpu_drive: CpuDrive = "stream"
    stream_share: bool = True
    layer_graphs: bool = True
    split_probe: int = 8
    split_feedback: float = 0.1
    deadline_factor: float = 4.0
    deadline_floor_ms: float = 2.0
    trace_path: str = ""
    stats_every: int = 256
    prefill: bool = True
    prefill_min_tokens: int = 0
    prefill_ring_slots: int = 8
    prefill_experts_per_batch: int = 8
    prefill_cpu_tail_batches: int = 0
    prefill_hit_rate: float = 0.4
    prefill_h2d_gbps: float = 0.0
    prefill_backend: str = "auto"

    def __post_init__(self) -> None:
        from expert_cache.config import POLICIES

        _number("cache_gib", self.cache_gib, 0.0)
        _number("cache_margin_gib", self.cache_margin_gib, 0.0)
        _number("device_gib", self.device_gib, 0.0)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {tuple(POLICIES)}, got {self.policy!r}")
        _integer("replan_every", self.replan_every, 1)
        _integer("admit_limit", self.admit_limit, 1)
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")
        if self.hit_kernel not in HIT_KERNELS:
            raise ValueError(f"hit_kernel: expected one of {HIT_KERNELS}, got {self.hit_kernel!r}")
        if self.pcie_read not in PCIE_READS:
            raise ValueError(f"pcie_read: expected one of {PCIE_READS}, got {self.pcie_read!r}")
        _integer("pcie_stage_slots", self.pcie_stage_slots, 1)
        _number("cpu_gbps", self.cpu_gbps, 0.0)
        _number("pcie_gbps", self.pcie_gbps, 0.0)
        if self.cpu_drive not in CPU_DRIVES:
            raise ValueError(f"cpu_drive: expected one of {CPU_DRIVES}, got {self.cpu_drive!r}")
        if not isinstance(self.stream_share, bool):
            raise ValueError(f"stream_share: expected true or false, got {self.stream_share!r}")
        if not isinstance(self.layer_graphs, bool):
            raise ValueError(f"layer_graphs: expected true or false, got {self.layer_graphs!r}")
        _integer("split_probe", self.split_probe, 0)
        _number("split_feedback", self.split_feedback, 0.0, 1.0)
        _number("deadline_factor", self.deadline_factor, 0.0)
        _number("deadline_floor_ms", self.deadline_floor_ms, 0.0)
        if not isinstance(self.trace_path, str):
            raise ValueError(f"trace_path: expected a path string, got {self.trace_path!r}")
        _integer("stats_every", self.stats_every, 0)
        if not isinstance(self.prefill, bool):
            raise ValueError(f"prefill: expected true or false, got {self.prefill!r}")
        _integer("prefill_min_tokens", self.prefill_min_tokens, 0)
        _integer("prefill_ring_slots", self.prefill_ring_slots, 1)
        _integer("prefill_experts_per_batch", self.prefill_experts_per_batch, 1)
        _integer("prefill_cpu_tail_batches", self.prefill_cpu_tail_batches, 0)
        _number("prefill_hit_rate", self.prefill_hit_rate, 0.0, 1.0)
        _number("prefill_h2d_gbps", self.prefill_h2d_gbps, 0.0)
        if self.prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend: expected one of {PREFILL_BACKENDS}, got {self.prefill_backend!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Dsv41PluginConfig:
    """How the plugin runs the model's EXL3 parts.

    Attributes
    ----------
    cpu : the CPU expert tier (cpu-tier's ``CpuTierConfig``: threads, pinned cores, ISA, precision, spin, AMX
        threshold, prefetch distance, work split). Its ``swiglu_limit`` is not used: each MoE layer passes the
        model's own clamp.
    runtime : where the routed experts run. "cpu": every routed expert in the pack's host home, computed by
        cpu-tier (the served default). "all-in-vram": every routed expert dequantized on the model's device and
        computed by a plain fp32-accumulate path (the oracle every tier is measured against): a layer's experts
        kept in device memory when they take at most half of its free memory, else each routed expert
        dequantized when a call uses it (``AllInVramRuntime``'s "auto").
    dense_kernel : the GPU kernel of the dense EXL3 linears (attention, shared experts, Engram ``wkv``, head).
        "exllamav3": exllamav3's CUDA kernels (needs the ``exllamav3`` package); "triton": ours (decode to fp16
        with dma-prefill's bit-exact Triton decode, then a GEMM); "auto": exllamav3 where it imports, else
        ours. On the CPU the dense linears are dequantized once at load (the demo) and this is ignored.
    register_host_memory : page-lock the host home of the experts with CUDA (``cudaHostRegister``) when a GPU
        is present, so that copies from it are DMA and the GPU can read it in place.
    attention : the DeepSeek-V4.1 attention kernels. "upstream": vLLM's own (FlashMLA, DeepGEMM: compute
        capability 9.0 and up); "triton": the plugin's Triton path for any GPU from sm_80 (``vllm_dsv41.ampere``:
        bf16 KV rows, no Hopper instruction); "auto": ours below compute capability 9.0 (RTX 3090, A100),
        upstream's from Hopper on. Applies to every V4.1 pack, EXL3 or not.
    attention_kv_rounding : what the plugin's Triton attention stores in its bf16 KV rows. "fp8" (default): the
        window and compressed rows, index keys and index queries rounded exactly as upstream's FP8 caches store
        them (``vllm_dsv41.ampere.fp8``: UE8M0 block scales, e4m3 round-to-nearest-even), so a sm_8x card computes
        with the numerics of upstream on Hopper and of DeepSeek's reference inference; "bf16": unrounded (more
        precision than upstream keeps). The KV memory is the same either way. Ignored by upstream's attention.
    tiered : the tiered runtime's settings (``TieredConfig``; used when ``runtime="tiered"``: VRAM cache hits on
        the GPU, misses on the CPU tier or over PCIe).
    engram : where V4.1's Engram tables live while serving. "mmap": in the pack's files, memory-mapped by
        engram-mmap (never read whole, never pinned; host RAM holds what the page cache keeps), each step's rows
        gathered on the host and copied to the GPU (``vllm_dsv41.engram``). "upstream": vLLM's own, read through
        its weight loader and pinned whole in host memory (189 GiB for V4.1-Flash; for comparisons).
    engram_table : engram-mmap's ``TableConfig`` for the mapped tables (gather threads, readahead, and
        ``resident_scales``: the scale tensors copied to RAM, 2.9 GiB per Flash table, so a cold row is one page
        read instead of two). Ignored with ``engram="upstream"``.
    """

    cpu: CpuTierConfig = dataclasses.field(default_factory=CpuTierConfig)
    runtime: Runtime = "cpu"
    dense_kernel: DenseKernel = "auto"
    register_host_memory: bool = True
    attention: Attention = "auto"
    attention_kv_rounding: KvRounding = "fp8"
    tiered: TieredConfig = dataclasses.field(default_factory=TieredConfig)
    engram: EngramMode = "mmap"
    engram_table: TableConfig = dataclasses.field(default_factory=TableConfig)
    pp_cpus: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_pp_cpus(self)
        if not isinstance(self.cpu, CpuTierConfig):
            raise ValueError(f"cpu: expected a CpuTierConfig, got {type(self.cpu).__name__}")
        if not isinstance(self.tiered, TieredConfig):
            raise ValueError(f"tiered: expected a TieredConfig, got {type(self.tiered).__name__}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime: expected one of {RUNTIMES}, got {self.runtime!r}")
        if self.dense_kernel not in DENSE_KERNELS:
            raise ValueError(f"dense_kernel: expected one of {DENSE_KERNELS}, got {self.dense_kernel!r}")
        if not isinstance(self.register_host_memory, bool):
            raise ValueError(f"register_host_memory: expected true or false, got {self.register_host_memory!r}")
        if self.engram not in ENGRAM_MODES:
            raise ValueError(f"engram: expected one of {ENGRAM_MODES}, got {self.engram!r}")
        if not isinstance(self.engram_table, TableConfig):
            got = type(self.engram_table).__name__
            raise ValueError(f"engram_table: expected an engram-mmap TableConfig, got {got}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {self.attention!r}")
        if self.attention_kv_rounding not in KV_ROUNDINGS:
            raise ValueError(f"attention_kv_rounding: expected one of {KV_ROUNDINGS}, got "
                             f"{self.attention_kv_rounding!r}")  # fmt: skip

    @property
    def effective_threads(self) -> int:
        """The thread count the CPU tier will use."""
        return self.cpu.resolved_threads()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> Dsv41PluginConfig:
        """Build from a JSON-like mapping; ``source`` names where it came from in error messages."""
        kwargs = _known_fields(cls, values, source, "plugin settings")
        for name, (nested, what) in _NESTED.items():
            if name in kwargs:
                kwargs[name] = _nested_config(nested, kwargs[name], f"{source}: {name}", what)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_mapping(self) -> dict[str, Any]:
        """The JSON-able form (what the server puts under ``additional_config["dsv41"]``)."""
        cpu = dataclasses.asdict(self.cpu)
        cpu["cpus"] = list(self.cpu.cpus)
        return {"cpu": cpu, "runtime": self.runtime, "dense_kernel": self.dense_kernel,
                "register_host_memory": self.register_host_memory, "attention": self.attention,
                "attention_kv_rounding": self.attention_kv_rounding,
                "tiered": dataclasses.asdict(self.tiered), "engram": self.engram,
                "engram_table": dataclasses.asdict(self.engram_table),
                "pp_cpus": [list(c) for c in self.pp_cpus]}  # fmt: skip

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Dsv41PluginConfig:
        """Merge the pack defaults (``hf_config.dsv41``) with the overrides (``additional_config["dsv41"]``)."""
        merged: dict[str, Any] = {}
        model_config = getattr(vllm_config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        pack = getattr(hf_config, CONFIG_KEY, None)
        if pack is None and hf_config is not None:  # nested V4.1 configs: the pack defaults sit at the top level
            pack = getattr(getattr(hf_config, "text_config", None), CONFIG_KEY, None)
        if pack is not None:
            merged = cls.from_mapping(pack, f"config.json {CONFIG_KEY!r}").to_mapping()
        extra = getattr(vllm_config, "additional_config", None) or {}
        if isinstance(extra, Mapping) and CONFIG_KEY in extra:
            override = extra[CONFIG_KEY]
            cls.from_mapping(override, f"additional_config {CONFIG_KEY!r}")  # validate on its own first
            merged = merge_settings(merged, override)
        return cls.from_mapping(merged, "merged plugin config")


def _check_pp_cpus(cfg: Dsv41PluginConfig) -> None:
    """``pp_cpus`` as a tuple of tuples (lists accepted), each non-empty, disjoint, and not given with ``cpu.cpus``."""
    value = cfg.pp_cpus
    if not isinstance(value, (list, tuple)) or any(not isinstance(c, (list, tuple, range)) for c in value):
        raise ValueError(f"pp_cpus: expected one list of cores per pipeline rank, e.g. [[0, 1], [2, 3]], got {value!r}")
    lists = tuple(tuple(c) for c in value)
    seen: set[int] = set()
    for rank, cores in enumerate(lists):
        if not cores or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cores):
            raise ValueError(f"pp_cpus[{rank}]: expected a non-empty list of core numbers, got {list(cores)!r}")
        twice = sorted(seen.intersection(cores) | {c for c in cores if cores.count(c) > 1})
        if twice:
            raise ValueError(f"pp_cpus[{rank}]: cores {twice} are given twice (each core serves one rank)")
        seen.update(cores)
    if lists and isinstance(cfg.cpu, CpuTierConfig) and cfg.cpu.cpus:
        raise ValueError(
            f"pp_cpus and cpu.cpus: give the cores one way (pp_cpus per rank, or cpu.cpus split evenly between the "
            f"ranks), got both {[list(c) for c in lists]} and {list(cfg.cpu.cpus)}"
        )
    object.__setattr__(cfg, "pp_cpus", lists)


def _known_fields(cls: type, values: Any, source: str, what: str) -> dict[str, Any]:
    """``values`` as keyword arguments of dataclass ``cls``; errors name ``source`` and the unknown field."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: expected an object of {what}, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{source}: unknown field {unknown[0]!r}; known fields: {sorted(fields)}")
    return dict(values)


#: The nested settings objects of the plugin config (merged field by field, one level deep): field -> (its
#: dataclass, what its settings are called in error messages).
_NESTED: dict[str, tuple[type, str]] = {
    "cpu": (CpuTierConfig, "cpu-tier settings"),
    "tiered": (TieredConfig, "tiered-runtime settings"),
    "engram_table": (TableConfig, "engram-mmap table settings"),
}


def _nested_config(cls: type, value: Any, source: str, what: str) -> Any:
    """``value`` (an instance of ``cls`` or a JSON-like mapping of its fields) as ``cls``; errors name ``source``."""
    if isinstance(value, cls):
        return value
    kwargs = _known_fields(cls, value, source, what)
    if cls is CpuTierConfig and isinstance(kwargs.get("cpus"), list):  # a JSON array: the frozen config's tuple
        kwargs["cpus"] = tuple(kwargs["cpus"])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def merge_settings(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``override`` field by field, one level into the nested ``cpu``, ``tiered`` and
    ``engram_table`` objects."""
    out = dict(base)
    for k, v in override.items():
        if k in _NESTED and isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def vllm_env_for_pack(pack: str | os.PathLike[str], *, cuda_graphs: bool = True) -> dict[str, str]:
    """Environment variables vLLM must see, before it is imported, to serve ``pack`` through this plugin.

    The plugin reads and writes no environment variable itself; the applications (the server, the fidelity
    tool) apply what this returns. For DeepSeek-V4.1 packs served with CUDA graphs it is
    ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``: vLLM turns breakable graphs on for V4.1 only after it has imported the
    model, whose eager breaks are fixed when imported (see ``vllm_dsv41.v41.upstream_breaks_enabled``).
    """
    try:
        cfg = json.loads((Path(pack) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{Path(pack) / 'config.json'}: unreadable ({e})") from None
    archs = cfg.get("architectures") or [] if isinstance(cfg, dict) else []
    if cuda_graphs and "DeepseekV41ForCausalLM" in archs:
        return {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    return {}
