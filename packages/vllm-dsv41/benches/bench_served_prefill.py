"""Prefill speed of the served model (vLLM's DeepSeek-V4.1 with the plugin) against its roofline (GPU machine).

    python packages/vllm-dsv41/benches/bench_served_prefill.py --layers 4 --root /tmp/dsv41/served --json OUT.json

What it does
------------
1. The pack: ``bench_served_decode``'s ``flash-v41`` pack (``--layers`` real-size DeepSeek-V4.1-Flash decoder layers,
   built once under ``--root`` and reused), or ``--pack DIR``.
2. The model as the server builds it (PIECEWISE graphs, vLLM capped at ``--gpu-memory-gib``, chunked prefill of
   ``--chunk`` tokens per step), with the tiered runtime.
3. Per runtime case and prompt length: ``--runs`` timed ``generate`` calls (after one warm-up) of one prompt of
   ``P`` random tokens and one generated token; prompt tok/s = ``P`` / wall time (min / median / max):
   * ``none``: the routed experts switched off (zeros): the non-expert time of the prefill, measured;
   * ``tiered``: the staged prefill on (MoE calls of many tokens stream their busy experts from the host home
     through a ring of VRAM slots lent by the cache, computed as GEMMs; the step rule calibrated at startup).
4. The roofline of the same runs: the bytes the staged prefill copied (counted by the runtime) over the copy
   engine's rate from the host home (measured by the runtime's calibration in this process), plus the ``none``
   case's time at the same length. Ratio = roofline / measured (goal >= 0.80). Each row also gives the peak VRAM
   PyTorch reserved in the timed runs (KV cache, expert cache, ring, activations) and its wall time: with a short
   prompt among ``--prompts`` (e.g. ``100,8192``) that wall time is the time to first token of a short prompt.
5. Scaling: per chunk every MoE layer streams about all of its busy experts once, so the copy time per chunk is
   ``layers x busy experts x expert bytes / H2D rate``; printed for Flash's 40 layers at this run's rate and at
   the mission's PCIe 4 (``--mission-pcie-gbps``), with the arithmetic.

``--json`` gets everything (rows written as they finish). Dry run without a GPU: ``--pack`` the tiny-demo pack
(vLLM-CPU's Qwen3-MoE), ``--cache-mib``, small ``--prompts``: the same code, not the benchmark's numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_served_decode import (  # noqa: E402
    GiB,
    _full_layers,
    _model_rates,
    _use_runtime,
    add_pack_arguments,
    build_flash_pack,
    profile_generate,
)

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[served-prefill {time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)


def _prefill_state(model: Any) -> dict[str, Any]:
    """The staged prefill's counters and calibration (empty without one)."""
    from vllm_dsv41.fidelity import _exl3_config

    rt, _ = _exl3_config(model).expert_runtime()
    pf = getattr(rt, "prefill", None)
    if pf is None:
        return {}
    c = pf.calibration
    return {"bytes": int(pf.bytes_streamed), "calls": int(pf.stats.calls), "tokens": int(pf.stats.tokens),
            "h2d_bps": float(c.h2d_bps) if c else 0.0, "describe": pf.describe()}  # fmt: skip


def _peak_vram(model: Any, reset: bool = False) -> int:
    """Bytes the worker's PyTorch allocator has reserved at most since the last reset (0 without CUDA): the KV
    cache, the expert cache, the ring and the activations all come from it; ``reset`` starts a new window."""
    import torch

    if not torch.cuda.is_available():
        return 0
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.max_memory_reserved())


def prompt(length: int, run: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng([length, run])
    return [{"prompt_token_ids": rng.integers(16, vocab - 16, size=length).tolist()}]


_TIER_FIELDS = ("layer_calls", "hit_picks", "cpu_picks", "pcie_picks", "layer_seconds", "wait_seconds",
                "pcie_enqueue_seconds", "cpu_wait_seconds", "cpu_run_seconds")  # fmt: skip


def _tier_counters(llm: Any) -> dict[str, float]:
    """The tiered runtime's decode-path counters (``TierStats``) now: where a prompt that did not stream spent its
    layer calls (the time to first token of a short prompt); empty for other runtimes."""
    from vllm_dsv41.fidelity import _runtime_stats

    st = llm.apply_model(_runtime_stats)[0]
    return {k: float(st[k]) for k in _TIER_FIELDS if k in st}


def decode_path_line(runs: list[dict[str, Any]]) -> str:
    """The median run's decode-path counters as one line: picks per path and host milliseconds per layer call."""
    d = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2].get("decode_path") or {}
    calls = d.get("layer_calls", 0.0)
    if not calls:
        return ""
    picks = max(d["hit_picks"] + d["cpu_picks"] + d["pcie_picks"], 1.0)

    def ms(k: str) -> str:
        return f"{1e3 * d[k] / calls:.2f}"

    return (f"decode path: {calls:.0f} layer calls, {picks:.0f} picks (hits {d['hit_picks'] / picks:.1%}, CPU "
            f"{d['cpu_picks'] / picks:.1%}, PCIe {d['pcie_picks'] / picks:.1%}); per layer call {ms('layer_seconds')} "
            f"ms: input wait {ms('wait_seconds')}, PCIe queuing {ms('pcie_enqueue_seconds')}, wait for the CPU tier "
            f"{ms('cpu_wait_seconds')} (its run {ms('cpu_run_seconds')})")  # fmt: skip


def run_case(llm: Any, length: int, runs: int, vocab: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt(length, 999, vocab), sp, use_tqdm=False)  # warm-up (and the prefill's first episode)
    llm.apply_model(functools.partial(_peak_vram, reset=True))
    out = []
    for run in range(runs):
        before = llm.apply_model(_prefill_state)[0]
        tier0 = _tier_counters(llm)
        t0 = time.perf_counter()
        llm.generate(prompt(length, run, vocab), sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.apply_model(_prefill_state)[0]
        tier1 = _tier_counters(llm)
        streamed = after.get("bytes", 0) - before.get("bytes", 0)
        out.append({"wall_s": wall, "tok_s": length / wall, "bytes": streamed, "h2d_bps": after.get("h2d_bps", 0.0),
                    "streamed_calls": after.get("calls", 0) - before.get("calls", 0),
                    "decode_path": {k: v - tier0.get(k, 0.0) for k, v in tier1.items()},
                    "peak_vram_bytes": llm.apply_model(_peak_vram)[0]})  # fmt: skip
    return out


def summarize(case: str, length: int, runs: list[dict[str, Any]], non_expert: dict[int, float]) -> dict[str, Any]:
    tok = sorted(r["tok_s"] for r in runs)
    wall = statistics.median(r["wall_s"] for r in runs)
    row: dict[str, Any] = {"case": case, "prompt_tokens": length, "runs": runs, "min_tok_s": tok[0],
                           "median_tok_s": statistics.median(tok), "max_tok_s": tok[-1],
                           "median_wall_s": wall}  # fmt: skip
    line = (f"{case:7s} P={length:6d}  {row['median_tok_s']:8.1f} tok/s (min {tok[0]:.1f}, max {tok[-1]:.1f}); "
            f"wall {wall:.3f} s")  # fmt: skip
    peak = max(r.get("peak_vram_bytes", 0) for r in runs)
    if peak:  # the timed runs' peak (the warm-up's first episode excluded)
        row["peak_vram_bytes"] = peak
        line += f"; peak VRAM reserved {peak / 2**30:.2f} GiB"
    h2d = max((r["h2d_bps"] for r in runs), default=0.0)
    copied = statistics.median(r["bytes"] for r in runs)
    if case != "none" and h2d > 0 and length in non_expert:
        roof = copied / h2d + non_expert[length]
        row.update(copied_bytes=copied, h2d_bps=h2d, roofline_s=roof, ratio=roof / wall)
        line += (f"; streamed {copied / 1e9:.2f} GB in {statistics.median(r['streamed_calls'] for r in runs):.0f} "
                 f"MoE calls; roofline {roof:.3f} s = {copied / 1e9:.2f} GB / {h2d / 1e9:.2f} GB/s + non-expert "
                 f"{non_expert[length]:.3f} s; ratio {roof / wall:.2f}")  # fmt: skip
    if case != "none" and (dp := decode_path_line(runs)):
        line += "\n  " + dp
    row["line"] = line
    return row


def scale_lines(rows: list[dict[str, Any]], layers: int, full: int, chunk: int, mission_gbps: float) -> list[str]:
    out = []
    for row in rows:
        if "ratio" not in row:
            continue
        if not row["copied_bytes"]:
            out.append(f"P={row['prompt_tokens']}: nothing streamed (the step rule kept the calls on the decode path)")
            continue
        p, h2d = row["prompt_tokens"], row["h2d_bps"]
        per_layer = row["copied_bytes"] / layers
        chunks = -(-p // chunk)
        out.append(
            f"P={p}: {per_layer / 1e9:.2f} GB streamed per MoE layer over {chunks} chunk(s); at {full} layers "
            f"{per_layer * full / 1e9:.1f} GB: {per_layer * full / h2d:.2f} s at this run's {h2d / 1e9:.1f} GB/s "
            f"= {p / (per_layer * full / h2d):.0f} tok/s copy-bound; at the mission's PCIe 4 {mission_gbps:.0f} GB/s "
            f"{per_layer * full / (mission_gbps * 1e9):.2f} s = {p / (per_layer * full / (mission_gbps * 1e9)):.0f} "
            "tok/s (experts' copies only; the non-expert time adds)"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pack_arguments(ap)
    ap.add_argument("--prompts", default="2048,8192,16384", help="prompt lengths in tokens")
    ap.add_argument("--chunk", type=int, default=8192, help="vLLM's max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--runtimes", default="none,tiered")
    ap.add_argument("--min-tokens", type=int, default=0,
                    help="MoE calls of at least this many tokens stream (0: the calibrated step rule)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpu-memory-gib", type=float, default=24.0)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--cache-gib-full", type=float, default=12.0,
                    help="a 24 GB card's expert cache for Flash's 40 layers (scaled to --layers)")  # fmt: skip
    ap.add_argument("--cache-mib", type=float, default=0.0, help="the cache size outright (dry runs)")
    ap.add_argument("--cpu-threads", type=int, default=8)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (default PIECEWISE)")
    ap.add_argument("--mission-pcie-gbps", type=float, default=25.0)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start no case past this (0: no limit)")
    ap.add_argument(
        "--profile",
        default="",
        help="prompt lengths whose tiered case is profiled once after its timed runs (comma list)",
    )
    ap.add_argument(
        "--tiered",
        type=json.loads,
        default={},
        help="more tiered settings as JSON, e.g. '{\"prefill_ring_slots\": 24}' (the staging ring)",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompts.split(",")]
    cases = a.runtimes.split(",")
    for c in cases:
        if c not in ("none", "tiered"):
            ap.error(f"--runtimes: unknown case {c!r} (none, tiered)")
    if "tiered" in cases and "none" in cases and cases.index("none") > cases.index("tiered"):
        ap.error("--runtimes: 'none' (the non-expert time the roofline adds) must come before 'tiered'")

    pack = a.pack or build_flash_pack(a.root, a.layers, small=a.small)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    from vllm_dsv41.config import vllm_env_for_pack

    for k, v in vllm_env_for_pack(pack, cuda_graphs=not a.eager).items():
        os.environ.setdefault(k, v)
    import torch

    from vllm_dsv41.fidelity import build_llm

    cuda = torch.cuda.is_available()
    cfg = json.loads((pack / "config.json").read_text())
    n_layers = int(cfg.get("text_config", cfg)["num_hidden_layers"])
    full = _full_layers()
    cache_bytes = int(a.cache_mib * (1 << 20)) if a.cache_mib else int(a.cache_gib_full * GiB * n_layers / full)
    extra: dict[str, Any] = {"max_num_seqs": 1, "max_num_batched_tokens": a.chunk}
    if cuda:
        extra["kv_cache_memory_bytes"] = int(a.kv_cache_gib * GiB)
    t = time.perf_counter()
    llm = build_llm(pack, runtime="tiered", tiered={"split": "auto", "stats_every": 0, "cache_gib": cache_bytes / GiB,
                                                         "prefill_min_tokens": a.min_tokens, **a.tiered},
                    eager=a.eager, max_model_len=max(lengths) + 64, gpu_memory_gib=a.gpu_memory_gib,
                    cpu_threads=a.cpu_threads, extra=extra)  # fmt: skip
    log(f"model built in {time.perf_counter() - t:.0f} s ({'PIECEWISE graphs' if cuda and not a.eager else 'eager'}, "
        f"chunk {a.chunk} tokens)")  # fmt: skip
    vocab = len(llm.get_tokenizer())
    base = {"cpu_threads": a.cpu_threads, "policy": "hybrid", "hit_kernel": "auto", "cache_bytes": cache_bytes,
            "device_budget_bytes": int(a.gpu_memory_gib * GiB) if cuda else None, "decode_max_tokens": 1}  # fmt: skip
    probe = llm.apply_model(functools.partial(_use_runtime, spec={**base, "kind": "tiered", "split": "auto"}))[0]
    rates = probe["rates"]
    log(f"decode-path rates (the step rule's): {_model_rates(rates).describe()}")
    doc: dict[str, Any] = {"pack": str(pack), "layers": n_layers, "chunk": a.chunk, "rates": rates, "rows": [],
                           "skipped": [], "args": {k: str(v) for k, v in vars(a).items()},
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}  # fmt: skip

    def save() -> None:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(doc, indent=2))

    non_expert: dict[int, float] = {}
    for case in cases:
        if a.time_budget_s and time.perf_counter() - _T0 > a.time_budget_s:
            doc["skipped"].append(case)
            log(f"{case}: skipped (past --time-budget-s {a.time_budget_s:.0f})")
            continue
        spec = {**base, "kind": case, "split": "auto", "rates": rates, "prefill": True}
        llm.apply_model(functools.partial(_use_runtime, spec=spec))
        if case == "tiered":
            log("staged prefill: " + llm.apply_model(_prefill_state)[0].get("describe", "off"))
        for length in lengths:
            row = summarize(case, length, run_case(llm, length, a.runs, vocab), non_expert)
            if case == "none":
                non_expert[length] = row["median_wall_s"]
            doc["rows"].append(row)
            print(row["line"], flush=True)
            save()
            if case == "tiered" and str(length) in a.profile.split(","):
                profile_generate(llm, f"prefill_P{length}", prompt(length, 7, vocab), 1,
                                 a.json.parent if a.json else None)  # fmt: skip
    doc["scaling"] = scale_lines(doc["rows"], n_layers, full, a.chunk, a.mission_pcie_gbps)
    print("\n".join(doc["scaling"]), flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
