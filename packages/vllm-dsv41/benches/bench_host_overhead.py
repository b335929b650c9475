"""The tiered runtime's own host time per MoE layer call, per decode path (CPU box or GPU machine).

    python packages/vllm-dsv41/benches/bench_host_overhead.py --device cpu --streams 1,2,4

What it does
------------
The routed experts' math is taken out: the hit kernel is a no-op and the CPU tier answers every job at once, so
what is left is the runtime's host work on a decode step's critical path (the cache lookups, the device ops it
queues, the copies to and from pinned memory, the split, the picks handed to the CPU tier, the combine). That
work is serial with the CPU tier (the misses start only when ``begin`` has submitted them), so on the mission's
machine (40 MoE layers, ~25 ms a token at 40 tok/s: 625 us a layer) every 100 us of it costs ~4 ms a token.

1. ``--layers`` Flash-shaped MoE layers at small sizes (``pack-tools synth flash-layer``: Flash's 384 experts,
   hidden / intermediate ``--hidden`` / ``--intermediate``), one host home.
2. Routing: ``expert_cache``'s synthetic trace model, decode steps of S tokens (S = streams).
3. A cache of ``--cache-share`` of each layer's experts, warmed for ``--warmup`` steps; configured rates that
   send about half the misses each way under split "auto".
4. Per (path, S): ``--rounds`` rounds of ``--steps`` steps; per layer call: host microseconds (min / median /
   max of the rounds' means), microseconds from ``begin`` to the CPU job's submit (median; split paths), and
   the kernel launches and copies it queues (counted over 32 steps, replans and fills included: torch ops other
   than views, the routing prep counted as its one Triton launch).

The floor in the same run is the device path (every miss read over PCIe by the hit kernel, no host sync: the
least host work a call can do); each row prints its ratio to it and its share of the 625 us budget. The
``device-staged`` row is the device path on a home the hit kernel cannot read in place (``dev_stage``: a plan
launch and, per round of the transient slots, a copy launch and the hit kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tiered import combined_home_dir, decode_steps  # noqa: E402

BUDGET_US = 1e6 / 40 / 40  # a layer's share of a token at 40 tok/s over Flash's 40 MoE layers


class _NoopKernel:
    """A hit kernel that computes nothing (the runtime's own host work is what is timed)."""

    alignment = 1

    def forward(self, table: Any, x: Any, ids: Any, w: Any, y: Any) -> None:
        pass


class _DoneJob:
    elapsed_s = 1e-5

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def result(self) -> None:
        return None

    def missing(self) -> np.ndarray:
        return np.empty(0, np.int64)

    def cancel(self) -> None:
        pass


class _InstantTier:
    """The runtime's CPU tier with every job done at once (``real``: the tier's own jobs); records when each
    submit came."""

    def __init__(self, tier: Any, clock: list[float], submits: list[float], real: bool = False) -> None:
        self.tier, self.clock, self.submits, self.real = tier, clock, submits, real

    def submit(self, layer: int, x: Any, picks: Any, out: Any = None) -> Any:
        self.submits.append(time.perf_counter() - self.clock[0])
        if self.real:
            return self.tier.submit(layer, x, picks, out=out)
        self.tier._check_picks(picks, x.shape[0], self.tier._layers[layer], layer)  # the real tier's input checks
        return _DoneJob()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)


def count_ops(fn: Any, verbose: bool = False) -> int:
    """Kernel launches and copies ``fn`` queues: torch ops other than views (slices and reshapes launch nothing),
    each call of the runtime's routing prep counted as the one launch it is on a GPU (``route_prep``: its torch
    definition runs on a CPU device, a Triton kernel, invisible to torch's dispatch, on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import vllm_dsv41.tiered as tiered

    names: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not func.is_view:
                names[func.__name__] = names.get(func.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    def one_launch(real: Any, label: str) -> Any:
        """``real`` counted as the one Triton launch it is on a GPU (its CPU definition's ops not counted)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            before = dict(names)
            r = real(*args, **kwargs)
            names.clear()
            names.update(before)
            names[label] = names.get(label, 0) + 1
            return r

        return call

    # (absent before 2026-12-02: an A/B against an older tree)
    patched = [(mod, attr, getattr(mod, attr)) for mod, attr in ((tiered, "prepare_routing"),) if hasattr(mod, attr)]
    staging = getattr(tiered, "DeviceStaging", None)  # the device path's staged read (dev_stage): plan, copy per round
    if staging is not None:
        patched += [(staging, "plan", staging.plan), (staging, "copy", staging.copy)]
    labels = {"prepare_routing": "route_prep (one launch)", "plan": "dev_stage plan (one launch)",
              "copy": "dev_stage copy (one launch a round)"}  # fmt: skip
    for mod, attr, real in patched:
        setattr(mod, attr, one_launch(real, labels[attr]))
    try:
        with Count():
            fn()
    finally:
        for mod, attr, real in patched:
            setattr(mod, attr, real)
    if verbose:
        print("  ops:", ", ".join(f"{k} {v}" for k, v in sorted(names.items(), key=lambda kv: -kv[1])))
    return sum(names.values())


#: The runtime's counters (``TierStats``) whose per-call means each row reports (host microseconds by part).
_HOST_PARTS = ("layer_calls", "begin_seconds", "bookkeeping_seconds", "submit_seconds", "finish_seconds",
               "cpu_wait_seconds", "cpu_run_seconds")  # fmt: skip


def parts_text(parts: dict[str, float]) -> str:
    """A row's host microseconds per layer call by part, from the runtime's own counters."""
    return (f"begin {parts['begin_seconds']:.1f} (submit {parts['submit_seconds']:.1f}), step bookkeeping "
            f"{parts['bookkeeping_seconds']:.1f}, finish less its wait {parts['finish_seconds']:.1f}; the CPU job "
            f"{parts['cpu_run_seconds']:.1f}, waited {parts['cpu_wait_seconds']:.1f}")  # fmt: skip


def run_case(home: Any, path: str, streams: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from cpu_tier import CpuTierConfig
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.config import TieredConfig
    from vllm_dsv41.split import Rates
    from vllm_dsv41.tiered import TieredRuntime, _expert_bytes

    lids = sorted(home.layer_ids)
    lx0 = next(iter(home.layers()))
    eb = _expert_bytes(lx0)
    split = {"split-cpu": "cpu", "split-auto": "auto", "device": "pcie", "device-staged": "pcie"}[path]
    # device-staged: the device path on a home its hit kernel cannot read in place (dev_stage's plan and copies)
    read = "staged" if path == "device-staged" else "auto"
    real = args.tier == "real"
    # (a real job is timed against configured rates, not the machine's: its deadline must not cut it)
    tcfg = TieredConfig(split=split, split_probe=0, hit_kernel="reference", prefill=False,
                        deadline_factor=1000.0 if real else 4.0, split_feedback=0.0, pcie_read=read)  # fmt: skip
    # --pin: this (the host's) thread on the first usable core, the CPU tier's workers on the others
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    pinned = args.pin and real and len(cpus) > 1
    ccfg = CpuTierConfig(threads=args.cpu_threads if real else 1, cpus=cpus[1:] if pinned else ())
    if pinned:  # (after the config: it checks its cores against this thread's)
        os.sched_setaffinity(0, {cpus[0]})
    cfg = Dsv41PluginConfig(cpu=ccfg, runtime="tiered", tiered=tcfg)
    # rates that balance a decode call's misses about half and half (the split's work is what is timed)
    rates = Rates(cpu_bps=20e9, pcie_bps=20e9, gpu_bps=1e12, source="bench", cpu_fixed_s=1e-5, pcie_fixed_s=1e-5)
    cache_bytes = int(args.cache_share * lx0.num_experts * len(lids) * eb)
    rt = TieredRuntime(cfg, home, device, rates=rates, cache_bytes=cache_bytes,
                       hits_factory=lambda lx, d: _NoopKernel())  # fmt: skip
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    rt.allow_cache()  # (a served model's runtime waits for vLLM's KV cache; here there is none)
    clock, submits = [0.0], []
    rt._tier = _InstantTier(rt._tier, clock, submits, real=real)
    n_count = 32  # steps whose torch ops are counted (two replan periods of the default replan_every 16)
    # distinct steps throughout (a trace replayed in a loop would end up all hits)
    steps = decode_steps(len(lids), lx0.num_experts, streams, args.warmup + n_count + args.rounds * args.steps,
                         args.seed)  # fmt: skip
    h = lx0.hidden
    x = torch.randn(streams, h, device=device)
    out = torch.empty(streams, h, device=device)
    w = torch.full((streams, steps[0].shape[2]), 1.0 / steps[0].shape[2], device=device)
    # [L, S, K] per step: each layer's [S, K] routing contiguous, as a router's output is
    ids = [torch.from_numpy(np.ascontiguousarray(s.transpose(1, 0, 2), dtype=np.int32)).to(device) for s in steps]
    begin = rt.begin

    def timed_begin(*a: Any) -> None:
        clock[0] = time.perf_counter()
        begin(*a)

    rt.begin = timed_begin  # type: ignore[method-assign]

    def step(i: int) -> None:
        s = ids[i % len(ids)]
        for j, lid in enumerate(lids):
            rt.forward_into(lid, x, s[j], w, out)

    try:
        with torch.inference_mode():
            for i in range(args.warmup):
                step(i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ops = count_ops(lambda: [step(args.warmup + i) for i in range(n_count)], args.verbose)
            ops /= n_count * len(lids)
            means = []
            before = {k: getattr(rt.stats, k) for k in _HOST_PARTS}
            for r in range(args.rounds):
                submits.clear()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    step(args.warmup + n_count + r * args.steps + i)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                means.append((time.perf_counter() - t0) / (args.steps * len(lids)) * 1e6)
            st = rt.stats
            calls = max(st.layer_calls - before["layer_calls"], 1)
            parts = {k: 1e6 * (getattr(st, k) - before[k]) / calls for k in _HOST_PARTS if k != "layer_calls"}
            if path == "device-staged" and (rt._dstage is None or st.device_steps == 0):
                raise RuntimeError("device-staged: the device path's staged read did not run")
    finally:
        rt.close()
        if pinned:
            os.sched_setaffinity(0, set(cpus))
    return {
        "path": path, "streams": streams, "us_min": min(means), "us_median": statistics.median(means),
        "us_max": max(means), "submit_us": 1e6 * statistics.median(submits) if submits else None,
        "ops_per_call": ops, "hit_rate": st.hit_rate, "cpu_share": st.cpu_picks / max(st.picks, 1),
        "pcie_share": st.pcie_picks / max(st.picks, 1), "tier": args.tier,
        "parts_us": parts,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (the host work alone) or cuda (with real launches)")
    ap.add_argument("--layers", type=int, default=40,
                    help="MoE layers (Flash's 40: the per-step work amortized as served)")  # fmt: skip
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--root", type=Path, default=Path("/tmp/dsv41/host-overhead"))
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--paths", default="device,device-staged,split-cpu,split-auto",
                    help="device (misses read in place), device-staged (misses staged by the GPU: dev_stage), "
                    "split-cpu, split-auto")  # fmt: skip
    ap.add_argument("--cache-share", type=float, default=0.3, help="share of each layer's experts the cache holds")
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tier",
        choices=("instant", "real"),
        default="instant",
        help="instant: every CPU job done at once (the host work alone); real: the CPU tier computes "
        "them (does its work slow the host's? use --hidden 4096 --intermediate 2048 for Flash's sizes)",
    )
    ap.add_argument("--cpu-threads", type=int, default=8, help="the real CPU tier's threads")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="with --tier real: this thread on the first usable core, the CPU tier's on the others",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verbose", action="store_true", help="print the torch ops counted, by name")
    args = ap.parse_args()
    from vllm_dsv41.home import ExpertHome

    device = torch.device(args.device)
    shape = {"hidden": args.hidden, "intermediate": args.intermediate}
    home = ExpertHome(combined_home_dir(args.root, args.layers, shape), register=device.type == "cuda")
    experts = next(iter(home.layers())).num_experts
    print(f"host work per MoE layer call ({args.device}; {args.layers} layers of {experts}"
          f" experts, hit kernel no-op, CPU tier {args.tier}; {args.rounds} rounds x {args.steps} steps; budget "
          f"{BUDGET_US:.0f} us a layer at 40 tok/s over 40 layers)", flush=True)  # fmt: skip
    rows = []
    for s in [int(v) for v in args.streams.split(",")]:
        floor = None
        for path in args.paths.split(","):
            r = run_case(home, path, s, args, device)
            if path == "device":
                floor = r["us_median"]
            r["floor_ratio"] = floor / r["us_median"] if floor else None
            r["budget_share"] = r["us_median"] / BUDGET_US
            rows.append(r)
            sub = f"{r['submit_us']:6.1f}" if r["submit_us"] is not None else "     -"
            fr = f"{r['floor_ratio']:.2f}" if r["floor_ratio"] is not None else "-"
            print(f"{path:>10} S={s}: {r['us_min']:7.1f} / {r['us_median']:7.1f} / {r['us_max']:7.1f} us a call "
                  f"(min/median/max), begin to CPU submit {sub} us, {r['ops_per_call']:5.1f} launches a call; "
                  f"ratio device path / this {fr}; {r['budget_share']:.2f} of the budget; picks: hits "
                  f"{r['hit_rate']:.2f}, CPU {r['cpu_share']:.2f}, PCIe {r['pcie_share']:.2f}", flush=True)  # fmt: skip
            print(f"{'':>10}        host us a call by part: {parts_text(r['parts_us'])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
