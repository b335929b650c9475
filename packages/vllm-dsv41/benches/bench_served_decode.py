"""Decode speed of the served model (vLLM's DeepSeek-V4.1 with the plugin) against its roofline (GPU machine).

    python packages/vllm-dsv41/benches/bench_served_decode.py --layers 4 --root /tmp/dsv41/served --json OUT.json
    python packages/vllm-dsv41/benches/bench_served_decode.py --layers 4 --build-only       # the pack only

What it does
------------
1. The pack (once, under ``--root``): ``pack-tools``' ``flash-v41`` preset (``--layers`` decoder layers of
   DeepSeek-V4.1-Flash's real size: 384 routed experts of 13.3 MB at 3 bpw per layer, 5.1 GB; reduced vocabulary
   and Engram table, no MTP; see ``pack_tools.presets.flash_v41``) written shard by shard, then ``build_pack`` and
   ``verify_pack``. A pack that verifies is reused.
2. The model, in this process, as the server builds it (``vllm_dsv41.fidelity.build_llm``: the ``dsv41`` loader,
   PIECEWISE CUDA graphs, vLLM capped at ``--gpu-memory-gib`` of the GPU, a ``--kv-cache-gib`` KV cache).
3. The rates the roofline needs, measured now on this machine with the model loaded: the CPU tier's streaming rate
   at one token per expert (``cpu``), the hit kernel reading experts from the page-locked host home over PCIe
   (``pcie``) and from VRAM (``hbm``) (``bench_tiered.measure_rates``).
4. Expert runtimes switched in the loaded model (the runtime slot; captured graphs call the new one), each at 1, 2
   and 4 streams: ``--runs`` timed ``generate`` calls (after one warm-up) of S prompts of ``--prompt-tokens``
   random tokens, ``--gen-tokens`` tokens each, ``ignore_eos``, greedy:
   * ``none``: the routed experts switched off (``NoExpertsRuntime`` writes zeros): the non-expert time of a step
     (attention, router, shared expert, Engram, head, sampling, vLLM's own work), measured, not subtracted;
   * ``tiered`` with misses split ``cpu`` / ``auto`` / ``pcie`` (side by side): the VRAM cache holds the share of
     a 24 GB card's cache these layers get (``--cache-gib-full`` over Flash's 40 layers, times ``--layers``; ``0``:
     what vLLM leaves under the cap, the server's automatic size); each records its routing (a trace);
   * ``cpu``: every routed expert on the CPU tier.
5. Per (runtime, S): decode tok/s (min / median / max over runs) from the model's per-step clock (the time between
   consecutive ``compute_logits`` calls of a request batch: steady-state decode steps, prefill excluded), and the
   roofline of the same steps: per step, hit bytes / hbm + miss bytes / (cpu + pcie for ``auto``; cpu; pcie) +
   the ``none`` runtime's fastest run's step time at the same S (its median moves with the VM's clock), where
   hit and miss bytes are the distinct experts each layer read from VRAM / computed on the CPU tier / read over
   PCIe in those steps (counted by the runtime's own split, not modelled). Ratio = roofline / measured (goal
   >= 0.85). The hit rate over distinct (layer, expert) accesses of the decode steps next to Belady's MIN on the
   recorded trace at the cache's capacity.
6. Scaling: the per-layer figures to Flash's 40 layers on this GPU, and to the mission's machine (RTX 3090 936 GB/s,
   PCIe 4 ~25 GB/s, 24 Zen 3 cores: the CPU tier at ``--mission-cpu-gbps``), arithmetic printed.

``--json`` gets everything (rows are written as they finish, so a run cut by a time limit keeps its rows).
``--time-budget-s`` stops starting new cases past that many seconds (the rest are listed as skipped).

Dry run without a GPU: ``--build-only --small`` builds and verifies a small flash-v41 pack (the same code at tiny
sizes); vLLM's CPU build does not serve V4.1 (its attention needs FlashMLA/DeepGEMM or our Triton path on CUDA),
so the serving part dry-runs on another pack: ``--pack DIR`` (e.g. the tiny-demo pack, vLLM-CPU's Qwen3-MoE) with
``--cache-mib``, small ``--prompt-tokens`` / ``--gen-tokens``; the numbers are then not the benchmark's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30
H200_HBM_GBPS = 4800.0  # the H200's nominal HBM3e bandwidth (GB/s), for the bandwidth-bound scaling below
RTX3090_HBM_GBPS = 936.0
_T0 = time.perf_counter()
#: the tiered cases: the split, then "+stream" for the CPU tier driven by the GPU stream (TieredConfig.cpu_drive)
#: and "+graphs" for the no-sync paths' layer calls as CUDA graphs (TieredConfig.layer_graphs), in that order
_TIERED_SPLITS = ("auto", "cpu", "pcie")
_TIERED_FLAGS = ("stream", "graphs")


def _tiered_case(c: str) -> tuple[str, tuple[str, ...]] | None:
    """A tiered case's split and flags ("auto+stream+graphs" -> ("auto", ("stream", "graphs"))), None if not one."""
    split, *flags = c.split("+")
    ok = split in _TIERED_SPLITS and flags == [f for f in _TIERED_FLAGS if f in flags]
    return (split, tuple(flags)) if ok else None


def _split_of(case: str) -> str:
    """The miss split of a case ("tiered:cpu+stream" -> "cpu"; "cpu", the CPU runtime -> "cpu")."""
    return case.partition(":")[2].partition("+")[0] or "cpu"


def log(msg: str) -> None:
    print(f"[served-decode {time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ the pack


def build_flash_pack(root: Path, layers: int, *, small: bool = False, jobs: int = 0) -> Path:
    """The flash-v41 pack of ``layers`` layers under ``root`` (reused when it verifies); returns its directory."""
    from pack_tools import build_pack, verify_pack
    from pack_tools.origin import ENGRAM, EXL3
    from pack_tools.presets.flash_v41 import synth_flash_v41
    from pack_tools.presets.tiny_v41 import FLASH, TinyV41

    tag = f"flash-v41-{layers}{'-small' if small else ''}"
    inputs, pack = root / f"{tag}-in", root / tag
    if (pack / "manifest.json").exists():
        t = time.perf_counter()
        problems = verify_pack(pack)
        if not problems:
            log(f"pack {pack}: exists and verifies ({time.perf_counter() - t:.1f} s)")
            return pack
        log(f"pack {pack}: {len(problems)} problems ({problems[0]}); rebuilding")
    receipt = inputs / EXL3.dirname / ".pack-tools-input.json"
    if not receipt.exists():  # the receipt is written last: without it the inputs are incomplete
        t = time.perf_counter()
        opts: dict[str, Any] = (
            {"base": TinyV41(experts=8), "vocab": 1024, "engram_vocab": 1000, "shard_bytes": 1 << 20}
            if small
            else {"base": FLASH}
        )
        synth_flash_v41(inputs, seed=0, layers=layers, progress=True, **opts)
        log(f"synth flash-v41 ({layers} layers{', small' if small else ''}): {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    build_pack(
        inputs / EXL3.dirname, inputs / ENGRAM.dirname, pack, jobs=jobs or max(1, (os.cpu_count() or 2) - 1), force=True
    )
    log(f"build_pack: {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    problems = verify_pack(pack)
    if problems:
        raise SystemExit(f"verify_pack({pack}): " + "; ".join(problems[:5]))
    log(f"verify_pack: 0 problems ({time.perf_counter() - t:.1f} s)")
    return pack


# ------------------------------------------------------------------------------- worker side (the model)
# Module-level functions run through LLM.apply_model (the engine runs in this process); state lives in _W.

_W: dict[str, Any] = {"stamps": [], "timing": False, "meter": None}


@dataclasses.dataclass
class Meter:
    """Distinct experts per decode step and layer, by where they were computed (the runtime's own decision)."""

    expert_bytes: int
    decode_max_tokens: int  # steps of at most this many tokens are decode steps
    on: bool = False  # the per-run counters (timed runs); the totals count every decode step
    steps: int = 0
    hit: int = 0
    cpu: int = 0
    pcie: int = 0
    total_steps: int = 0
    total_hit: int = 0
    total_all: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    # device-path calls (no host copy of their routing): (first layer, tokens, on, ids, hit) as device clones,
    # counted by ``flush`` after the run (reading them on the host inside the step would add a sync per layer)
    pending: list[tuple[bool, int, bool, Any, Any, str, Any]] = dataclasses.field(default_factory=list)

    def defer(self, first_layer: bool, t: int, ids: Any, hit: Any, misses: str = "pcie", shared: Any = None) -> None:
        if t <= self.decode_max_tokens:
            self.pending.append((first_layer, t, self.on, ids.clone(), hit.clone(), misses,
                                 None if shared is None else shared.clone()))  # fmt: skip

    def flush(self) -> None:
        """Count the deferred no-sync calls: hits = distinct resident experts, the distinct others to ``misses``
        (PCIe on the device path, the CPU tier on the stream path; negative ids are vLLM's padding rows, no pick),
        except those in ``shared`` (the stream path's PCIe share), counted as PCIe."""
        pending, self.pending = self.pending, []
        for first, t, on, ids_d, hit_d, misses, shared_d in pending:
            ids, hit = ids_d.cpu().numpy().reshape(-1), hit_d.cpu().numpy().reshape(-1)
            shared = np.zeros_like(hit) if shared_d is None else shared_d.cpu().numpy().reshape(-1)
            on0, self.on = self.on, on
            n_miss = np.unique(ids[~hit & ~shared & (ids >= 0)]).size
            n_shared = np.unique(ids[shared]).size
            self.add(first, t, np.unique(ids[hit]).size, n_miss if misses == "cpu" else 0,
                     (n_miss if misses == "pcie" else 0) + n_shared)  # fmt: skip
            self.on = on0

    def add(self, first_layer: bool, t: int, hit: int, cpu: int, pcie: int) -> None:
        if t > self.decode_max_tokens:
            return
        self.total_steps += first_layer
        self.total_hit += hit
        self.total_all += hit + cpu + pcie
        if self.on:
            self.steps += first_layer
            self.hit, self.cpu, self.pcie = self.hit + hit, self.cpu + cpu, self.pcie + pcie
            if first_layer:
                self.tokens.append(t)

    def reset_run(self) -> None:
        self.steps = self.hit = self.cpu = self.pcie = 0
        self.tokens = []


def _model_device(model: Any) -> Any:
    import torch

    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _layer_count(model: Any) -> int:
    from vllm_dsv41.fidelity import _exl3_config

    return len(list(_exl3_config(model).home().layers()))


def _install_timer(model: Any) -> bool:
    """Stamp every ``compute_logits`` call (one per engine step) while ``_W["timing"]``."""
    if getattr(model, "_dsv41_decode_timer", False):
        return True
    orig = model.compute_logits

    def timed(hidden_states: Any, *a: Any, **k: Any) -> Any:
        if _W["timing"]:
            _W["stamps"].append((time.perf_counter(), int(hidden_states.shape[0])))
        return orig(hidden_states, *a, **k)

    model.compute_logits = timed
    model._dsv41_decode_timer = True
    return True


def _timing(model: Any, on: bool) -> list[tuple[float, int]]:
    _W["timing"] = on
    if on:
        _W["stamps"] = []
    m = _W["meter"]
    if m is not None:
        m.on = on
        if on:
            m.reset_run()
    return list(_W["stamps"])


def _meter(model: Any) -> dict[str, Any]:
    m = _W["meter"]
    if m is None:
        return {}
    m.flush()
    return {k: v for k, v in dataclasses.asdict(m).items() if k != "pending"}


def _metered_classes() -> tuple[type, type]:
    from vllm_dsv41.experts import CpuExpertRuntime
    from vllm_dsv41.tiered import TieredRuntime

    class MeteredTiered(TieredRuntime):  # type: ignore[misc]
        """The tiered runtime, counting each layer's distinct experts per path from its own host-side split (the
        device and stream paths' from clones of their routing and hit mask, counted after the run: two small copies
        a call)."""

        def _begin(self, layer: int, x: Any, topk_ids: Any, topk_weights: Any, t: int) -> Any:
            p = super()._begin(layer, x, topk_ids, topk_weights, t)
            m = _W["meter"]
            if m is not None and p.b is not None:
                ids = p.b.h_ids[:t].numpy().reshape(-1)
                hit = p.b.h_hit[:t].numpy().reshape(-1)
                m.add(
                    layer == min(self._layers),
                    t,
                    np.unique(ids[hit]).size,
                    np.unique(ids[p.cpu_picks]).size,
                    np.unique(ids[p.pcie_picks]).size,
                )
            return p

        def _begin_device(self, layer: int, x: Any, topk_ids: Any, topk_weights: Any, t: int) -> Any:
            p = super()._begin_device(layer, x, topk_ids, topk_weights, t)
            m = _W["meter"]
            if m is not None and p.b is not None:
                r = p.b.at(t)
                m.defer(layer == min(self._layers), t, r.ids, r.hit)
            return p

        def _begin_stream(self, layer: int, x: Any, topk_ids: Any, topk_weights: Any, t: int) -> Any:
            p = super()._begin_stream(layer, x, topk_ids, topk_weights, t)
            m = _W["meter"]
            if m is not None and p.b is not None:
                r = p.b.at(t)
                # the resident picks from the cache's table (the hit mask now also marks the PCIe share)
                resident = (self._cache.slot_of[self._index[layer]][r.ids.clamp(min=0).long()] >= 0) & (r.ids >= 0)
                m.defer(layer == min(self._layers), t, r.ids, resident, misses="cpu", shared=r.hit & ~resident)
            return p

    class MeteredCpu(CpuExpertRuntime):  # type: ignore[misc]
        """The CPU runtime, counting each layer's distinct experts; with the tiered runtime's two halves, so it can
        replace it in a model compiled with it (the whole layer runs in ``finish``, after the shared expert is
        queued on the GPU)."""

        def begin(self, layer: int, x: Any, topk_ids: Any, topk_weights: Any) -> None:
            self._pending_args = (layer, x, topk_ids, topk_weights)

        def finish(self, layer: int, out: Any) -> None:
            pending, self._pending_args = getattr(self, "_pending_args", None), None
            if pending is None or pending[0] != layer:
                raise RuntimeError(f"MoE layer {layer}: finish() without its begin()")
            self.forward_into(layer, pending[1], pending[2], pending[3], out)

        def _compute(self, layer: int, x32: Any, ids: Any, w: Any, out32: Any) -> None:
            super()._compute(layer, x32, ids, w, out32)
            m = _W["meter"]
            if m is not None:
                m.add(layer == min(self._hidden), int(ids.shape[0]), 0, np.unique(ids).size, 0)

    return MeteredTiered, MeteredCpu


def _use_runtime(model: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Put the runtime ``spec`` describes in the model's slot (the old one closed first, its VRAM returned)."""
    import torch

    from vllm_dsv41.config import TieredConfig
    from vllm_dsv41.experts import NoExpertsRuntime
    from vllm_dsv41.fidelity import _exl3_config, _swiglu_limits
    from vllm_dsv41.split import Rates
    from vllm_dsv41.tiered import _expert_bytes

    q = _exl3_config(model)
    home = q.home()
    device = _model_device(model)
    layers = list(home.layers())
    limits = _swiglu_limits(model)
    base = q.plugin_config()
    cfg = dataclasses.replace(base, cpu=dataclasses.replace(base.cpu, **{**spec.get("cpu_config", {}),
                                                                         "threads": spec["cpu_threads"]}))  # fmt: skip
    MeteredTiered, MeteredCpu = _metered_classes()
    kind = spec["kind"]
    r = spec.get("rates")
    new: Any
    if kind == "none":
        new = NoExpertsRuntime()
    elif kind == "cpu":
        new = MeteredCpu(dataclasses.replace(cfg, runtime="cpu"), activation_dtype=q.activation_dtype)
    else:
        tcfg = dataclasses.replace(
            base.tiered,
            split=spec["split"],
            cpu_drive=spec.get("cpu_drive", "host"),
            layer_graphs=bool(spec.get("layer_graphs", False)),
            policy=spec["policy"],
            cache_gib=0.0,
            hit_kernel=spec["hit_kernel"],
            trace_path=spec.get("trace_path", ""),
            cpu_gbps=0.0,
            pcie_gbps=0.0,
            stats_every=0,
            # decode only unless asked (the staged prefill's calibration times two layers per case)
            prefill=bool(spec.get("prefill", False)),
        )
        if spec.get("tiered_config"):  # --tiered-config: more settings, for every tiered case
            tcfg = dataclasses.replace(tcfg, **spec["tiered_config"])
        assert isinstance(tcfg, TieredConfig)
        if r:
            rates = _model_rates(r)
        else:
            rates = Rates(1.0, 1.0)
        new = MeteredTiered(
            dataclasses.replace(cfg, runtime="tiered", tiered=tcfg),
            home,
            device,
            rates=rates,
            cache_bytes=spec.get("cache_bytes"),
            device_budget_bytes=spec.get("device_budget_bytes"),
            activation_dtype=q.activation_dtype,
        )
    for lx in layers:
        new.add_layer(lx, limits.get(lx.layer))
    old = q.set_runtime(new)
    if old is not None and old is not new:
        old.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    info: dict[str, Any] = {"runtime": new.name, "expert_bytes": _expert_bytes(layers[0]), "layers": len(layers),
                            "cpu_precision": getattr(new, "precision", None)}  # fmt: skip
    _W["meter"] = Meter(info["expert_bytes"], spec["decode_max_tokens"]) if kind != "none" else None
    if kind == "tiered":
        new.allow_cache()
        new._create_cache()
        info["slots"] = int(new.cache.num_slots)
        info["experts"] = len(layers) * layers[0].num_experts
        if not r:  # the probe: measure the rates with the cache empty
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_tiered import measure_rates

            info["rates"] = measure_rates(new, layers[0], device)
    return info


def _model_rates(rates: dict[str, Any]) -> Any:
    """The cost model of ``bench_tiered.measure_rates``' numbers (``bench_tiered.model_rates``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tiered import model_rates

    return model_rates(rates, "measured in this run")


# ----------------------------------------------------------------------------------------------- driver


def prompts_for(streams: int, run: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng([streams, run, length])
    return [{"prompt_token_ids": rng.integers(16, vocab - 16, size=length).tolist()} for _ in range(streams)]


def step_period(stamps: list[tuple[float, int]], streams: int) -> float:
    """Seconds per decode step: the mean interval between consecutive logits calls of the ``streams``-row batch,
    from the second call on (the first follows the prefill)."""
    t = [ts for ts, rows in stamps if rows == streams]
    if len(t) < 3:
        raise RuntimeError(
            f"{len(t)} logits calls of {streams} rows recorded ({len(stamps)} in all): too few to time "
            "decode steps (is --gen-tokens >= 3?)"
        )
    return (t[-1] - t[1]) / (len(t) - 2)


#: The tiered runtime's decode-size counters (``TierStats``) a run's parts come from.
_PART_FIELDS = ("steps", "layer_seconds", "cpu_seconds", "cpu_run_seconds", "cpu_pred_seconds", "cpu_wait_seconds",
                "stream_wait_seconds", "wait_seconds", "pcie_enqueue_seconds", "begin_seconds", "bookkeeping_seconds",
                "submit_seconds", "finish_seconds", "device_steps")  # fmt: skip


def _decode_counters(model: Any) -> dict[str, float]:
    """The runtime's decode-size counters now (empty for runtimes without them)."""
    from vllm_dsv41.fidelity import _runtime_stats

    d = _runtime_stats(model).get("decode") or {}
    return {k: float(d.get(k, 0.0)) for k in _PART_FIELDS}


def step_parts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per decode step of a run, from the counters before and after it: the MoE layer calls' host
    time and its parts (the CPU tier's job as run and as predicted at the startup rates, the host's wait for it,
    the inputs' copy to the host, the PCIe share's queuing); empty when the run counted no decode step."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _PART_FIELDS}
    n = d.pop("steps")
    if n <= 0:
        return {}
    out = {k.replace("_seconds", "_ms"): 1e3 * v / n for k, v in d.items() if k.endswith("_seconds")}
    out["steps"] = n
    out["device_share"] = d["device_steps"] / n
    return out


def parts_line(runs: list[dict[str, Any]], non_expert_ms: float | None) -> str:
    """Where the median run's decode steps went: inside the MoE layer calls (the CPU tier's job as run against
    its startup prediction, the host's wait for it, the rest of the host's work there) and outside them (against
    the step with experts off)."""
    with_parts = [r for r in runs if r.get("parts")]
    if not with_parts:
        return ""
    run = sorted(with_parts, key=lambda r: r["step_s"])[len(with_parts) // 2]
    p, step_ms = run["parts"], 1e3 * run["step_s"]
    inside = []
    if p["cpu_run_ms"] > 0:
        pred = p["cpu_pred_ms"]
        x = f": x{p['cpu_run_ms'] / pred:.2f}" if pred > 0 else ""
        inside.append(f"the CPU tier's jobs ran {p['cpu_run_ms']:.2f}, predicted {pred:.2f}{x}; submit to end "
                      f"{p['cpu_ms']:.2f}; the host waited {p['cpu_wait_ms']:.2f} for them")  # fmt: skip
    if p.get("stream_wait_ms", 0.0) > 0:
        inside.append(f"the stream held {p['stream_wait_ms']:.2f} for them (no host wait)")
    between = p["layer_ms"] - p["begin_ms"] - p["cpu_wait_ms"] - p["finish_ms"] - p["bookkeeping_ms"]
    inside.append(f"other host work {p['layer_ms'] - p['cpu_wait_ms']:.2f}: begin {p['begin_ms']:.2f} (input wait "
                  f"{p['wait_ms']:.2f}, the CPU tier's submit {p['submit_ms']:.2f}, PCIe queuing "
                  f"{p['pcie_enqueue_ms']:.2f}), between begin and finish (the shared expert's launches) "
                  f"{between:.2f}, finish less its wait {p['finish_ms']:.2f}, the step's bookkeeping "
                  f"{p['bookkeeping_ms']:.2f}")  # fmt: skip
    line = (f"parts per decode step: MoE layer calls {p['layer_ms']:.2f} ms ({'; '.join(inside)}); outside them "
            f"{step_ms - p['layer_ms']:.2f} ms")  # fmt: skip
    if non_expert_ms is not None:
        line += f" (a step with experts off: {non_expert_ms:.2f} ms)"
    if p["device_share"] > 0:
        line += f"; {p['device_share']:.0%} of the steps on the device path"
    return line


def run_case(llm: Any, streams: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts_for(streams, 999, args.prompt_tokens, vocab), sp, use_tqdm=False)  # warm-up
    runs = []
    for run in range(args.runs):
        before = llm.apply_model(_decode_counters)[0]
        llm.apply_model(functools.partial(_timing, on=True))
        t0 = time.perf_counter()
        outs = llm.generate(prompts_for(streams, run, args.prompt_tokens, vocab), sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        stamps = llm.apply_model(functools.partial(_timing, on=False))[0]
        meter = llm.apply_model(_meter)[0]
        parts = step_parts(before, llm.apply_model(_decode_counters)[0])
        n_out = [len(o.outputs[0].token_ids) for o in outs]
        if n_out != [args.gen_tokens] * streams:
            raise RuntimeError(f"generated {n_out} tokens, expected {args.gen_tokens} per stream")
        period = step_period(stamps, streams)
        runs.append(
            {
                "step_s": period,
                "tok_s": streams / period,
                "wall_s": wall,
                "e2e_tok_s": streams * args.gen_tokens / wall,
                "meter": meter,
                "parts": parts,
            }
        )
    return {"runs": runs}


def profile_generate(llm: Any, label: str, prompts: list[dict[str, list[int]]], max_tokens: int,
                     out_dir: Path | None, rows: int = 25) -> None:  # fmt: skip
    """One greedy ``llm.generate`` of ``prompts`` under ``torch.profiler`` (CPU, and CUDA where there is a GPU; the
    engine runs in this process): the ops by self CUDA time and by self CPU time printed (``rows`` each) and
    written to ``out_dir/profile_<label>.txt``. The wall time includes the profiler's overhead; the host time
    outside any op (numpy, waits, Python) is the wall time minus the ops' CPU total."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    cpu_self = sum(e.self_cpu_time_total for e in ka) / 1e3
    parts = [f"profile {label}: wall {1e3 * wall:.1f} ms (profiled), ops' self CPU time {cpu_self:.1f} ms"]
    if cuda:
        gpu_self = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1e3
        parts[0] += f", ops' self GPU time {gpu_self:.1f} ms"
        parts.append(ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    parts.append(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    text = "\n".join(parts)
    print(text, flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"profile_{label}.txt").write_text(text + "\n")


#: Where the host's Python time of a served step is ours (the plugin and the libraries it composes): a regex on
#: pstats' "file:line(function)"; the packages' directories, not file names (tests are named after them).
_OUR_CODE = r"/(vllm_dsv41|expert_cache|cpu_tier|dma_prefill|engram_mmap)/|/bench_served_decode\.py"


def pstats_text(stats: Any, label: str, wall_s: float, rows: int = 40) -> str:
    """A ``pstats.Stats``' tables as text: the functions by own time (any code) and ours by cumulative time."""
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(stats, stream=buf) if not isinstance(stats, pstats.Stats) else stats
    st.stream = buf  # type: ignore[attr-defined]
    buf.write(f"cProfile {label}: wall {1e3 * wall_s:.1f} ms (profiled; cProfile slows Python calls)\n")
    buf.write("\n== by own time, any code ==\n")
    st.sort_stats("tottime").print_stats(rows)
    buf.write("\n== ours, by cumulative time ==\n")
    st.sort_stats("cumulative").print_stats(_OUR_CODE, rows)
    return buf.getvalue()


def cprofile_generate(llm: Any, label: str, prompts: list[dict[str, list[int]]], max_tokens: int,
                      out_dir: Path | None, rows: int = 40) -> str:  # fmt: skip
    """One greedy ``llm.generate`` of ``prompts`` under ``cProfile`` (the engine runs in this process, so the
    model's forward, vLLM's step and our runtime's host work are all on this thread): where the host's Python
    time goes, by function (``torch.profiler`` names only ops). Written to ``out_dir/cprofile_<label>.txt``."""
    import cProfile

    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        prof.disable()
    text = pstats_text(prof, label, time.perf_counter() - t0, rows)
    print("\n".join(text.splitlines()[: rows + 12]), flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"cprofile_{label}.txt").write_text(text)
    return text


def add_pack_arguments(ap: argparse.ArgumentParser) -> None:
    """The pack's arguments (the served benches share the flash-v41 pack): --layers, --root, --pack, --small."""
    ap.add_argument("--layers", type=int, default=4, help="real-size Flash layers of the pack (>= 3; default 4)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/dsv41/served"))
    ap.add_argument("--pack", type=Path, help="serve this pack instead of building flash-v41 (dry runs)")
    ap.add_argument("--small", action="store_true", help="a small flash-v41 (the same code at tiny sizes; dry runs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pack_arguments(ap)
    ap.add_argument("--build-only", action="store_true", help="build and verify the pack, then stop")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument(
        "--runtimes",
        default="none,tiered:auto,tiered:cpu,tiered:pcie,cpu",
        help="cases, in order (none is needed for the roofline); after a tiered split '+stream': cpu_drive stream, "
        "'+graphs': layer_graphs (e.g. tiered:cpu+stream, tiered:auto+stream+graphs)",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-gib", type=float, default=24.0)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument(
        "--cache-gib-full",
        type=float,
        default=12.0,
        help="the full 40-layer model's expert cache on a 24 GB card; this pack gets its share "
        "(0: what vLLM leaves under --gpu-memory-gib, the server's automatic size)",
    )
    ap.add_argument("--cache-mib", type=float, default=0.0, help="the cache size outright (dry runs)")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--hit-kernel", default="auto")
    ap.add_argument(
        "--no-device-stage",
        action="store_true",
        help="decode calls on a staged home take the split path (TieredConfig.device_stage off)",
    )
    ap.add_argument("--cpu-threads", type=int, default=8)
    ap.add_argument("--cpu-config", type=json.loads, default={},
                    help='more cpu-tier settings for every runtime, JSON (e.g. \'{"spin_us": 2000}\')')  # fmt: skip
    ap.add_argument("--tiered-config", type=json.loads, default={},
                    help='TieredConfig settings for the tiered cases, JSON (e.g. \'{"split_probe": 0}\')')  # fmt: skip
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (default PIECEWISE)")
    ap.add_argument(
        "--mission-cpu-gbps",
        type=float,
        default=70.0,
        help="the CPU tier on the mission's 24 Zen 3 cores (reference-system.md 4.10: 66-80 GB/s)",
    )
    ap.add_argument("--mission-pcie-gbps", type=float, default=25.0)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start no case past this (0: no limit)")
    ap.add_argument(
        "--profile",
        default="",
        help="cases:streams to profile once after their timed runs, e.g. 'tiered:auto:1' (comma list)",
    )
    ap.add_argument(
        "--cprofile",
        default="",
        help="cases:streams to run once under cProfile after their timed runs (Python time by function)",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    streams_list = [int(s) for s in a.streams.split(",")]
    cases = a.runtimes.split(",")
    for c in cases:
        if c not in ("none", "cpu") and not (c.startswith("tiered:") and _tiered_case(c[7:]) is not None):
            flags = "".join(f"[+{f}]" for f in _TIERED_FLAGS)
            ap.error(f"--runtimes: unknown case {c!r} (none, cpu, tiered:{'|'.join(_TIERED_SPLITS)}{flags})")

    if a.cpu_config:
        from vllm_dsv41.config import CpuTierConfig, _nested_config

        try:
            _nested_config(CpuTierConfig, a.cpu_config, "--cpu-config", "cpu-tier settings")
        except ValueError as e:
            ap.error(str(e))
    if a.tiered_config:
        from vllm_dsv41.config import TieredConfig, _nested_config

        try:
            _nested_config(TieredConfig, a.tiered_config, "--tiered-config", "tiered settings")
        except ValueError as e:
            ap.error(str(e))
    pack = a.pack or build_flash_pack(a.root, a.layers, small=a.small)
    if a.build_only:
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    from vllm_dsv41.config import vllm_env_for_pack

    for k, v in vllm_env_for_pack(pack, cuda_graphs=not a.eager).items():
        os.environ.setdefault(k, v)
    import torch

    from vllm_dsv41.fidelity import build_llm

    cuda = torch.cuda.is_available()
    cfg = json.loads((pack / "config.json").read_text())
    n_layers = int(cfg.get("text_config", cfg)["num_hidden_layers"])  # every layer of these packs is a MoE layer
    full_layers = _full_layers()
    cache_bytes = (
        int(a.cache_mib * (1 << 20))
        if a.cache_mib
        else int(a.cache_gib_full * GiB * n_layers / full_layers)
        if a.cache_gib_full
        else None
    )
    t = time.perf_counter()
    extra: dict[str, Any] = {"max_num_seqs": max(streams_list)}
    if cuda:
        extra["kv_cache_memory_bytes"] = int(a.kv_cache_gib * GiB)
    # Built with the tiered runtime, as served: the compiled graphs then call its two halves as eager breaks
    # (the shared expert between them); every runtime switched in below has both halves.
    tiered0: dict[str, Any] = {"split": "auto", "stats_every": 0, "policy": a.policy, "hit_kernel": a.hit_kernel,
                               "device_stage": not a.no_device_stage}  # fmt: skip
    if cache_bytes:
        tiered0["cache_gib"] = cache_bytes / GiB
    llm = build_llm(
        pack,
        runtime="tiered",
        tiered=tiered0,
        eager=a.eager,
        max_model_len=max(1024, a.prompt_tokens + a.gen_tokens + 64),
        gpu_memory_gib=a.gpu_memory_gib,
        cpu_threads=a.cpu_threads,
        extra=extra,
    )
    log(f"model built in {time.perf_counter() - t:.0f} s ({'PIECEWISE graphs' if cuda and not a.eager else 'eager'})")
    llm.apply_model(_install_timer)
    vocab = len(llm.get_tokenizer())
    if llm.apply_model(_layer_count)[0] != n_layers:
        raise RuntimeError(f"{pack}: config.json says {n_layers} layers, the model's host home has another count")
    budget = int(a.gpu_memory_gib * GiB) if cuda else None
    base_spec = {
        "cpu_threads": a.cpu_threads,
        "cpu_config": a.cpu_config,
        "tiered_config": a.tiered_config,
        "policy": a.policy,
        "hit_kernel": a.hit_kernel,
        "cache_bytes": cache_bytes,
        "device_budget_bytes": budget,
        "decode_max_tokens": max(streams_list),
    }

    # the rates, once, with the cache empty (a probe runtime), for every tiered case and the roofline
    probe = llm.apply_model(functools.partial(_use_runtime, spec={**base_spec, "kind": "tiered", "split": "auto"}))[0]
    rates = probe["rates"]
    eb, slots = probe["expert_bytes"], probe["slots"]
    log(
        f"{n_layers} MoE layers, expert {eb / 1e6:.2f} MB; VRAM cache {slots} slots of {probe['experts']} experts "
        f"({slots * eb / GiB:.2f} GiB); CPU tier {probe['cpu_precision']}; rates (of expert weights): "
        f"{_model_rates(rates).describe()}"
    )
    doc: dict[str, Any] = {
        "pack": str(pack),
        "layers": n_layers,
        "expert_bytes": eb,
        "cache_slots": slots,
        "cpu_precision": probe["cpu_precision"],
        "experts": probe["experts"],
        "rates": rates,
        "args": {k: str(v) for k, v in vars(a).items()},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "rows": [],
        "skipped": [],
    }

    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        if a.json:
            a.json.write_text(json.dumps(doc, indent=2))

    non_expert: dict[int, float] = {}
    trace_dir = a.json.parent if a.json else a.root
    for case in cases:
        kind, _, split_drive = case.partition(":")
        split, flags = _tiered_case(split_drive) or ("", ())
        spec = {**base_spec, "kind": kind, "split": split or "auto", "cpu_drive": "stream" if "stream" in flags
                else "host", "layer_graphs": "graphs" in flags, "rates": rates}  # fmt: skip
        trace = trace_dir / f"trace_{split_drive.replace('+', '_')}.npz" if kind == "tiered" else None
        if trace is not None:
            spec["trace_path"] = str(trace)
        if a.time_budget_s and time.perf_counter() - _T0 > a.time_budget_s:
            doc["skipped"].append(case)
            log(f"{case}: skipped (past --time-budget-s {a.time_budget_s:.0f})")
            continue
        info = llm.apply_model(functools.partial(_use_runtime, spec=spec))[0]
        case_rows = []
        for s in streams_list:
            res = run_case(llm, s, a, vocab)
            if f"{case}:{s}" in a.profile.split(","):
                profile_generate(llm, f"{case.replace(':', '_')}_S{s}", prompts_for(s, 7, a.prompt_tokens, vocab),
                                 a.gen_tokens, a.json.parent if a.json else None)  # fmt: skip
            if f"{case}:{s}" in a.cprofile.split(","):
                cprofile_generate(llm, f"{case.replace(':', '_')}_S{s}", prompts_for(s, 7, a.prompt_tokens, vocab),
                                  a.gen_tokens, a.json.parent if a.json else None)  # fmt: skip
            row = summarize(case, s, res["runs"], rates, non_expert, eb, n_layers, full_layers, a)
            row["cache_slots"] = info.get("slots", 0)
            case_rows.append(row)
            doc["rows"].append(row)
            if kind == "none":  # the fastest run: the VM's clock moves the medians by 20-30 % between calls, and
                # a slow `none` would lift every roofline (run 8: medians 3.42 and 5.31 ms at S=2 in two calls)
                non_expert[s] = min(r["step_s"] for r in res["runs"])
            print(row["line"], flush=True)
            if row["parts_line"]:
                print(f"  {row['parts_line']}", flush=True)
            save()
        if kind != "none":
            from vllm_dsv41.fidelity import _runtime_stats

            stats = llm.apply_model(_runtime_stats)[0]
            for row in case_rows:
                row["runtime_stats"] = stats
            if stats.get("describe"):
                print(f"  {case} counters: {stats['describe']}", flush=True)
        if kind == "tiered":  # the trace is written when the runtime closes: switch it out first
            llm.apply_model(functools.partial(_use_runtime, spec={**base_spec, "kind": "none"}))
            belady_rows(case_rows, trace, info["slots"], max(streams_list))
            for row in case_rows:
                print(f"  S={row['streams']}: {row['hit_line']}", flush=True)
            save()
    scaling = scale_lines(doc["rows"], rates, n_layers, full_layers, a, doc["device"])
    doc["scaling"] = scaling
    print("\n".join(scaling["lines"]), flush=True)
    save()
    return 0


def _full_layers() -> int:
    from pack_tools.presets.tiny_v41 import FLASH

    return FLASH.layers


def summarize(
    case: str,
    s: int,
    runs: list[dict[str, Any]],
    rates: dict[str, float],
    non_expert: dict[int, float],
    eb: int,
    n_layers: int,
    full_layers: int,
    a: argparse.Namespace,
) -> dict[str, Any]:
    """One row: tok/s min/median/max, the roofline of the same steps, their ratio."""
    tok = sorted(r["tok_s"] for r in runs)
    steps = [r["step_s"] for r in runs]
    med = statistics.median(steps)
    row: dict[str, Any] = {
        "case": case,
        "streams": s,
        "runs": runs,
        "tok_s_min": tok[0],
        "tok_s_median": statistics.median(tok),
        "tok_s_max": tok[-1],
        "median_step_ms": 1e3 * med,
        "e2e_tok_s_median": statistics.median(r["e2e_tok_s"] for r in runs),
    }
    line = (
        f"{case:18s} S={s}: decode {row['tok_s_median']:.2f} tok/s (min {tok[0]:.2f}, max {tok[-1]:.2f}; "
        f"step {1e3 * med:.2f} ms)"
    )
    meters = [r["meter"] for r in runs if r["meter"]]
    if case != "none" and meters and s in non_expert:
        msteps = sum(m["steps"] for m in meters)
        if msteps == 0:
            raise RuntimeError(f"{case} S={s}: the runtime saw no decode step of <= {s} tokens")
        per_step = {k: sum(m[k] for m in meters) * eb / msteps for k in ("hit", "cpu", "pcie")}
        miss_rate = {"cpu": rates["cpu"], "pcie": rates["pcie"], "auto": rates["cpu"] + rates["pcie"]}
        split = _split_of(case)
        expert_s = per_step["hit"] / rates["hbm"] + (per_step["cpu"] + per_step["pcie"]) / miss_rate[split]
        roof = expert_s + non_expert[s]
        row.update(
            {
                "bytes_per_step": per_step,
                "roofline_step_ms": 1e3 * roof,
                "roofline_expert_ms": 1e3 * expert_s,
                "non_expert_ms": 1e3 * non_expert[s],
                "ratio": roof / med,
                "decode_steps_metered": msteps,
            }
        )
        line += (
            f"; roofline {1e3 * roof:.2f} ms = experts {1e3 * expert_s:.2f} (hits {per_step['hit'] / 1e6:.1f} MB"
            f" / hbm, misses {(per_step['cpu'] + per_step['pcie']) / 1e6:.1f} MB / "
            f"{miss_rate[split] / 1e9:.1f} GB/s) + non-expert {1e3 * non_expert[s]:.2f}; "
            f"ratio {roof / med:.2f} (goal >= 0.85)"
        )
        if rates.get("h2d") and rates.get("d2d"):  # the same with the machine's rates instead of our kernels'
            hw_miss = {"cpu": rates["cpu"], "pcie": rates["h2d"], "auto": rates["cpu"] + rates["h2d"]}[split]
            hw_s = per_step["hit"] / rates["d2d"] + (per_step["cpu"] + per_step["pcie"]) / hw_miss + non_expert[s]
            row.update({"hw_roofline_step_ms": 1e3 * hw_s, "hw_ratio": hw_s / med})
            line += (
                f"; against the machine (copy engine {rates['h2d'] / 1e9:.1f} GB/s from the home, device memory "
                f"{rates['d2d'] / 1e9:.0f} GB/s): roofline {1e3 * hw_s:.2f} ms, ratio {hw_s / med:.2f}"
            )
    elif case != "none":
        line += "; no roofline (run the none case first, at the same streams)"
    row["line"] = line
    ne = non_expert.get(s)
    row["parts_line"] = parts_line(runs, 1e3 * ne if ne is not None else None)
    return row


def belady_rows(rows: list[dict[str, Any]], trace: Path | None, slots: int, decode_max: int) -> None:
    """The served hit rate (distinct accesses of decode steps) next to Belady's MIN on the recorded trace."""
    from expert_cache import belady_hit_rate, load_trace

    if trace is None or not trace.exists():
        for row in rows:
            row["hit_line"] = "no routing trace recorded"
        return
    tr = load_trace(trace)
    bel = belady_hit_rate(tr, slots, prefill_tokens=decode_max)
    for row in rows:
        ms = [r["meter"] for r in row["runs"] if r["meter"]]
        hit = sum(m["hit"] for m in ms) / max(1, sum(m["hit"] + m["cpu"] + m["pcie"] for m in ms))
        total = ms[-1] if ms else {}
        row.update(
            {
                "hit_rate": hit,
                "belady_hit_rate": bel,
                "trace": str(trace),
                "trace_steps": int(tr.num_steps),
                "hit_rate_all_decode_steps": total.get("total_hit", 0) / max(1, total.get("total_all", 0)),
            }
        )
        row["hit_line"] = (
            f"hit rate {hit:.3f} over the timed decode steps' distinct (layer, expert) accesses "
            f"({row['hit_rate_all_decode_steps']:.3f} over all this runtime's decode steps); Belady's "
            f"MIN {bel:.3f} on the recorded trace ({tr.num_steps} steps, decode steps of <= "
            f"{decode_max} tokens) at {slots} slots"
        )


def scale_lines(
    rows: list[dict[str, Any]], rates: dict[str, float], n: int, full: int, a: argparse.Namespace, device: str
) -> dict[str, Any]:
    """Per-layer figures to Flash's ``full`` layers, on this GPU and on the mission's machine (arithmetic shown)."""
    lines = [f"\nScaling (per-layer figures x {full}/{n} layers; the cache keeps this run's per-layer share):"]
    out: list[dict[str, Any]] = []
    hbm_eff = rates["hbm"] / (H200_HBM_GBPS * 1e9)
    m_hbm = RTX3090_HBM_GBPS * 1e9 * hbm_eff
    m_cpu, m_pcie = a.mission_cpu_gbps * 1e9, a.mission_pcie_gbps * 1e9
    lines.append(
        f"  mission rates: hits {RTX3090_HBM_GBPS:.0f} GB/s x {hbm_eff:.2f} (this run's hbm {rates['hbm'] / 1e9:.0f}"
        f" / {H200_HBM_GBPS:.0f} GB/s nominal) = {m_hbm / 1e9:.0f} GB/s; CPU tier {a.mission_cpu_gbps:.0f} GB/s"
        f" (24 Zen 3 cores); PCIe {a.mission_pcie_gbps:.0f} GB/s; non-expert time x {H200_HBM_GBPS:.0f} / "
        f"{RTX3090_HBM_GBPS:.0f} = x{H200_HBM_GBPS / RTX3090_HBM_GBPS:.2f} (bandwidth-bound)"
    )
    for row in rows:
        if "roofline_step_ms" not in row:
            continue
        s, case = row["streams"], row["case"]
        step, ne = row["median_step_ms"], row["non_expert_ms"]
        b = row["bytes_per_step"]
        k = full / n
        step40 = step * k
        miss = b["cpu"] + b["pcie"]
        split = _split_of(case)
        mrate = {"cpu": m_cpu, "pcie": m_pcie, "auto": m_cpu + m_pcie}[split]
        ne_m = ne * H200_HBM_GBPS / RTX3090_HBM_GBPS
        roof_m = k * (b["hit"] / m_hbm * 1e3 + miss / mrate * 1e3 + ne_m)
        at_ratio = roof_m / row["ratio"]
        d = {
            "case": case,
            "streams": s,
            "this_gpu_40_layers_step_ms": step40,
            "this_gpu_40_layers_tok_s": s / step40 * 1e3,
            "mission_roofline_step_ms": roof_m,
            "mission_roofline_tok_s": s / roof_m * 1e3,
            "mission_at_this_ratio_tok_s": s / at_ratio * 1e3,
        }
        out.append(d)
        lines.append(
            f"  {case:12s} S={s}: {device}, {full} layers: {step:.2f} ms x {k:g} = {step40:.1f} ms/step -> "
            f"{d['this_gpu_40_layers_tok_s']:.1f} tok/s. Mission: per step {k:g} x (hits {b['hit'] / 1e6:.0f} MB / "
            f"{m_hbm / 1e9:.0f} GB/s + misses {miss / 1e6:.0f} MB / {mrate / 1e9:.0f} GB/s + non-expert {ne:.2f} x "
            f"{H200_HBM_GBPS / RTX3090_HBM_GBPS:.2f} ms) = {roof_m:.1f} ms -> roofline "
            f"{d['mission_roofline_tok_s']:.1f} tok/s; at this run's ratio {row['ratio']:.2f}: "
            f"{d['mission_at_this_ratio_tok_s']:.1f} tok/s"
        )
    if not out:
        lines.append("  (no row with a roofline)")
    lines.append(
        "  Not scaled: the pack's head (vocab 8192 vs Flash's 129,280: +0.46 GB read per token at 6 bpw), and "
        "Engram on 1 of this pack's layers vs 2 of Flash's 40; the non-expert time is scaled whole by the "
        "layer count (its fixed part, sampling and vLLM's step, scaled with it: an overestimate)."
    )
    return {"lines": lines, "rows": out}


if __name__ == "__main__":
    raise SystemExit(main())
