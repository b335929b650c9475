"""vLLM's parallelism with the plugin's expert runtimes: pipeline parallel served, the rest refused.

Pipeline parallel (``pipeline_parallel_size`` N > 1): vLLM runs one worker process per stage, each building only
its contiguous range of decoder layers (``make_layers`` over ``vllm.distributed.utils.get_pp_indices``: the
partition is vLLM's, including its ``VLLM_PP_LAYER_PARTITION`` override; this module never computes one of its
own). In each stage the plugin

* maps only that stage's routed experts from the pack (``ExpertHome(pack, layers=...)``, the MoE layers the stage
  built): the stages' mappings of one file are the same page-cache pages, so every expert still has one host
  copy, and each stage page-locks only its own share;
* builds its own expert runtime over them (its own CPU tier, VRAM expert cache and staging buffers);
* gives its CPU tier a share of the cores (:func:`rank_cpu_config`).

Tensor, expert, data and context parallelism are refused with a message (:func:`check_parallel`); the README's
"Parallelism" section has the numbers behind that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .config import Dsv41PluginConfig

__all__ = [
    "check_parallel",
    "check_stage_layers",
    "moe_layers_of",
    "pp_layers",
    "pp_position",
    "rank_cpu_config",
    "rank_plugin_config",
    "split_evenly",
]


def pp_layers(num_hidden_layers: int, rank: int, size: int) -> range:
    """The decoder layers pipeline stage ``rank`` of ``size`` builds: vLLM's own answer (``get_pp_indices``)."""
    from vllm.distributed.utils import get_pp_indices

    if not 0 <= rank < size:
        raise ValueError(f"pipeline rank {rank} is not in [0, {size})")
    start, end = get_pp_indices(num_hidden_layers, rank, size)
    return range(start, end)


def pp_position() -> tuple[int, int]:
    """``(rank, size)`` of this process in vLLM's pipeline-parallel group; ``(0, 1)`` where none exists (tests,
    tools that build layers outside an engine)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    group = ps.get_pp_group()
    return int(group.rank_in_group), int(group.world_size)


def moe_layers_of(model: Any) -> tuple[int, ...]:
    """The MoE layers whose routed experts this model (this pipeline stage) runs, ascending."""
    from .methods import Exl3HostExpertsMethod

    return tuple(sorted({m.quant_method.layer_index for m in model.modules()
                         if isinstance(getattr(m, "quant_method", None), Exl3HostExpertsMethod)}))  # fmt: skip


def split_evenly(items: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``items`` cut into ``parts`` contiguous runs whose lengths differ by at most one (the first runs longer)."""
    n, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + n + (i < r)
        out.append(tuple(items[start:end]))
        start = end
    return out


def rank_cpu_config(cfg: Dsv41PluginConfig, rank: int, size: int, usable: Sequence[int] | None = None) -> Any:
    """The CPU tier's settings (cpu-tier's ``CpuTierConfig``) of pipeline stage ``rank`` of ``size``.

    * ``pp_cpus`` given: stage ``rank`` is pinned to ``pp_cpus[rank]`` (``size`` lists needed);
    * else ``cpu.cpus`` given: those cores split evenly into ``size`` contiguous runs, stage ``rank`` pinned to its
      run (at least one core per stage);
    * else: unpinned, an even share of ``usable`` (default: the cores this process may run on) as threads, at
      least one.

    ``cpu.threads``, when set, is the total over the stages, split evenly (at least one per stage); 0 keeps one
    thread per core of the stage's share. With ``size == 1`` and no ``pp_cpus`` it is ``cfg.cpu`` unchanged.
    Errors name the field.
    """
    from cpu_tier import CpuTierConfig
    from cpu_tier.config import usable_cpus

    cpu: CpuTierConfig = cfg.cpu
    if not 0 <= rank < size:
        raise ValueError(f"pipeline rank {rank} is not in [0, {size})")
    if size == 1 and not cfg.pp_cpus:
        return cpu
    if cfg.pp_cpus and len(cfg.pp_cpus) != size:
        raise ValueError(f"pp_cpus: {len(cfg.pp_cpus)} core lists for pipeline_parallel_size {size}; give one list "
                         "per pipeline rank")  # fmt: skip
    if cpu.threads and cpu.threads < size:
        raise ValueError(f"cpu.threads: {cpu.threads} threads in total for {size} pipeline ranks; give at least one "
                         "per rank (or 0: one per core)")  # fmt: skip
    threads = split_evenly(range(cpu.threads), size)[rank] if cpu.threads else ()
    if cfg.pp_cpus:
        cores, field = cfg.pp_cpus[rank], f"pp_cpus[{rank}]"
    elif cpu.cpus:
        if len(cpu.cpus) < size:
            raise ValueError(f"cpu.cpus: {len(cpu.cpus)} cores {list(cpu.cpus)} for {size} pipeline ranks; give at "
                             "least one core per rank, or per-rank lists in pp_cpus")  # fmt: skip
        cores, field = split_evenly(cpu.cpus, size)[rank], "cpu.cpus"
    else:
        have = len(usable if usable is not None else usable_cpus())
        n = len(threads) if cpu.threads else max(1, len(split_evenly(range(have), size)[rank]))
        return dataclasses.replace(cpu, threads=n)
    try:
        return dataclasses.replace(cpu, cpus=tuple(cores), threads=len(threads))
    except ValueError as e:
        raise ValueError(f"{field} (pipeline rank {rank}): {e}") from None


def rank_plugin_config(cfg: Dsv41PluginConfig, rank: int, size: int) -> Dsv41PluginConfig:
    """``cfg`` as pipeline stage ``rank`` of ``size`` runs it: its CPU tier's share of the cores
    (:func:`rank_cpu_config`) and, for ``size > 1``, its own routing-trace file (``<stem>.pp<rank><suffix>``: the
    stages record different layers). ``cfg`` itself for one stage."""
    if size == 1 and not cfg.pp_cpus:
        return cfg
    tiered = cfg.tiered
    if size > 1 and tiered.trace_path:
        p = Path(tiered.trace_path)
        tiered = dataclasses.replace(tiered, trace_path=str(p.with_name(f"{p.stem}.pp{rank}{p.suffix}")))
    return dataclasses.replace(cfg, cpu=rank_cpu_config(cfg, rank, size), tiered=tiered, pp_cpus=())


def check_parallel(parallel_config: Any, cfg: Dsv41PluginConfig) -> None:
    """Refuse, with a message, the parallel settings the plugin's expert runtimes cannot serve.

    Served: pipeline parallel (any runtime). Refused: tensor parallel (the EXL3 dense linears and the head are not
    sharded; the routed experts' runtimes take whole layers), expert parallel, data parallel (each replica would
    start its own CPU tier on the same cores and map and page-lock the whole home again), context parallel.
    """
    why = "the dsv41 plugin serves EXL3 packs with pipeline parallelism only (README 'Parallelism')"
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1))
    if tp != 1:
        raise NotImplementedError(
            f"dsv41: tensor_parallel_size={tp} is not supported: the EXL3 dense linears and head run unsharded and "
            f"the routed experts run by whole layers in the {cfg.runtime!r} runtime; to spread the model over {tp} "
            f"GPUs use pipeline_parallel_size={tp} (--pipeline-parallel-size {tp}); {why}"
        )
    if getattr(parallel_config, "enable_expert_parallel", False):
        raise NotImplementedError(
            "dsv41: expert parallel (enable_expert_parallel) is not supported: the routed experts are not vLLM "
            "weights to shard but views of one host home run by the plugin's expert runtime (its VRAM cache "
            f"already keeps the hot experts on the GPU); use pipeline parallel instead; {why}"
        )
    dp = int(getattr(parallel_config, "data_parallel_size", 1))
    if dp != 1:
        raise NotImplementedError(
            f"dsv41: data_parallel_size={dp} is not supported with the plugin's expert runtimes: every replica "
            "would run its own CPU expert tier on the same cores and page-lock the whole expert home again; "
            f"{why}"
        )
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        n = int(getattr(parallel_config, field, 1) or 1)
        if n != 1:
            raise NotImplementedError(f"dsv41: {field}={n} is not supported; {why}")


def check_stage_layers(layers: Iterable[int], stage: range, rank: int, size: int, pack: Any) -> tuple[int, ...]:
    """The MoE layers a pipeline stage built, checked against vLLM's partition (``stage``); raises when the stage
    has none (more stages than MoE layers) or built a layer outside its range."""
    got = tuple(layers)
    if not got:
        raise ValueError(
            f"{pack}: pipeline rank {rank} of {size} owns decoder layers [{stage.start}, {stage.stop}) and no MoE "
            f"layer among them; use a smaller pipeline_parallel_size"
        )
    outside = [x for x in got if x not in stage]
    if outside:
        raise RuntimeError(
            f"{pack}: pipeline rank {rank} of {size} built MoE layers {outside} outside vLLM's partition "
            f"[{stage.start}, {stage.stop}) (the model does not build its layers with vLLM's make_layers)"
        )
    return got
