"""The Ampere attention path (``vllm_dsv41.ampere``) against upstream's FlashMLA/DeepGEMM attention, served.

Two steps, each a separate process (the attention class is fixed when vLLM builds the model):

    python gpu_ampere_check.py run PACK --attention upstream --out DIR/upstream [--speed 8192 65000]
    python gpu_ampere_check.py run PACK --attention triton   --out DIR/triton   [--kv-rounding fp8|bf16] [--speed ...]
    python gpu_ampere_check.py compare DIR/upstream DIR/triton [--min-top1 0.999 --max-kl-mean 1e-4]

``--kv-rounding`` is the plugin's ``Dsv41PluginConfig.attention_kv_rounding`` (``vllm_dsv41.ampere.fp8``, passed
in ``additional_config["dsv41"]``): "fp8" (its default) rounds the stored KV rows, index keys and index
queries as upstream's FP8 caches do, "bf16" keeps them unrounded.

``run`` builds the pack's model (experts all in VRAM, eager: no CUDA graph, no torch.compile, so the wrappers
below see every call), checks which attention class vLLM built, then

* scores fixed prompts (``vllm_dsv41.fidelity``'s corpus and logits capture): the full next-token distribution at
  every position (``logits.npz``);
* records each attention layer's output (``forward_mqa``'s buffer, before ``wo_a``) for the first prompt
  (``layers.npz``, bf16 bits);
* with ``--speed C ...``: for each context C, one prompt of C random tokens and ``--decode`` greedy tokens; every
  call of a layer's eager attention region (the indexer's selection + sparse attention) is timed with CUDA
  events and filed as prefill (more than one token per request) or decode (``speed.json``), with the
  wall-clock time of the prefill and of the decode.

``compare`` prints top-1 agreement and KL(upstream || triton) over every scored position, the per-layer relative
error of the attention outputs, and per phase the ratio triton / upstream of the attention time (min / median /
max over the calls), one row per case. Upstream's attention on Hopper stores FP8 KV records (584 B/token);
ours stores bf16 rows, with "fp8" holding the same rounded values: with "bf16" the per-layer error includes
upstream's FP8 rounding (H200 run 4: 3-9 % per layer, top-1 0.975), and every layer's input already carries the
previous layers' differences.
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

EXPECTED_CLASS = {"triton": "DeepseekV41TritonAttention", "upstream": "DeepseekV4FlashMLAAttention"}

_STATE: dict[str, Any] = {"record": False, "layers": {}, "events": [], "perturb": None, "perturbed": [0.0, 0.0]}


def perturb_(o: Any, rel: float, gen: Any) -> tuple[float, float]:
    """``o`` (an attention output, any float dtype) times ``1 + rel * N(0, 1)`` per element, in place, rounded to
    ``o``'s dtype; returns (sum of squared changes, sum of squares of ``o``) as the rounding left them (in bf16 a
    change smaller than half a unit in the last place rounds away or to one unit: the achieved size is printed)."""
    import torch

    f = o.to(torch.float32, copy=True)  # (a copy also when o is fp32: o is written below)
    noise = torch.randn(f.shape, generator=gen, device=f.device, dtype=torch.float32)
    o.copy_((f * (1.0 + rel * noise)).to(o.dtype))
    d = o.float() - f
    return float((d * d).sum()), float((f * f).sum())


def _attention_layers(model: Any) -> list[Any]:
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    return [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]


def _instrument(model: Any) -> list[str]:
    """Wrap each attention layer's ``forward_mqa`` (records its output) and eager region (CUDA-event timing)."""
    import torch

    names = []
    for layer in _attention_layers(model):
        names.append(type(layer).__name__)
        mqa, region = layer.forward_mqa, layer._sparse_indexer_and_attn

        def forward_mqa(q: Any, kv: Any, positions: Any, output: Any, _f: Any = mqa, _l: Any = layer) -> None:
            _f(q, kv, positions, output)
            if _STATE["perturb"] is not None:  # the attention floor's scoring (run --attn-floor)
                rel, gen = _STATE["perturb"]
                dd, oo = perturb_(output[: q.shape[0], : _l.n_local_heads], rel, gen)
                _STATE["perturbed"][0] += dd
                _STATE["perturbed"][1] += oo
            if _STATE["record"] and q.shape[0] > 1:
                rows = output[: q.shape[0], : _l.n_local_heads].detach().to(torch.bfloat16)
                _STATE["layers"].setdefault(_l.layer_id, []).append(rows.view(torch.int16).cpu().numpy())

        def timed(*args: Any, _f: Any = region, _l: Any = layer) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            r = _f(*args)
            end.record()
            _STATE["events"].append((_l.layer_id, int(args[0].shape[0]), start, end))
            return r

        layer.forward_mqa = forward_mqa
        layer._sparse_indexer_and_attn = timed
    return names


def _drain_events(num_reqs: int) -> dict[str, list[float]]:
    import torch

    torch.cuda.synchronize()
    out: dict[str, list[float]] = {"prefill": [], "decode": []}
    for _, tokens, s, e in _STATE["events"]:
        out["decode" if tokens <= num_reqs else "prefill"].append(s.elapsed_time(e))
    _STATE["events"].clear()
    return out


def run(a: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model needs the engine in-process
    from vllm import SamplingParams

    from vllm_dsv41 import fidelity

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    llm = fidelity.build_llm(
        a.pack,
        runtime="all-in-vram",
        eager=True,
        max_model_len=a.max_model_len,
        extra={
            "additional_config": {
                "dsv41": {"runtime": "all-in-vram", "attention": a.attention, "attention_kv_rounding": a.kv_rounding},
            },
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "compilation_config": {"mode": 0},  # no torch.compile: the wrappers run as Python on every call
        },
    )
    name = _name(a.attention, a.kv_rounding)
    print(f"[{name}] engine built in {time.perf_counter() - t0:.0f} s", flush=True)
    built = llm.apply_model(_instrument)[0]
    classes = sorted(set(built))
    print(f"[{name}] attention classes built: {classes}", flush=True)
    if classes != [EXPECTED_CLASS[a.attention]]:
        print(f"FAIL: expected {EXPECTED_CLASS[a.attention]} in every layer", flush=True)
        return 1
    llm.apply_model(fidelity._install)
    tok = llm.get_tokenizer()
    prompts = fidelity.make_prompts(tok, a.positions, a.length, getattr(tok, "bos_token_id", None))
    logits = []
    for i, p in enumerate(prompts):
        _STATE["record"] = i == 0
        logits.append(fidelity._logits_of(llm, p))
        _STATE["record"] = False
    _STATE["events"].clear()
    np.savez_compressed(out / "logits.npz", logits=np.concatenate(logits), prompt_lens=[len(p) for p in prompts])
    if a.noise_floor:  # the same prompts with the experts' sums in float64: how far a last-bit change moves them
        llm.apply_model(functools.partial(fidelity._switch, runtime=fidelity.NOISE_FLOOR_RUNTIME))
        floor = [fidelity._logits_of(llm, p) for p in prompts]
        llm.apply_model(functools.partial(fidelity._switch, runtime="all-in-vram"))
        np.savez_compressed(out / "logits_floor.npz", logits=np.concatenate(floor),
                            prompt_lens=[len(p) for p in prompts])  # fmt: skip
        print(f"[{name}] noise floor scored ({fidelity.NOISE_FLOOR_RUNTIME})", flush=True)
        _STATE["events"].clear()  # its attention calls are not the speed runs'
    if a.attn_floor:  # the same prompts with every attention output perturbed by a.attn_floor (relative)
        import torch

        gen = torch.Generator(device="cuda")
        gen.manual_seed(0)
        _STATE["perturb"], _STATE["perturbed"] = (a.attn_floor, gen), [0.0, 0.0]
        floor = [fidelity._logits_of(llm, p) for p in prompts]
        _STATE["perturb"] = None
        dd, oo = _STATE["perturbed"]
        achieved = (dd / oo) ** 0.5 if oo else float("nan")
        np.savez_compressed(out / "logits_attn_floor.npz", logits=np.concatenate(floor),
                            prompt_lens=[len(p) for p in prompts], rel=a.attn_floor, achieved=achieved)  # fmt: skip
        print(f"[{name}] attention floor scored (every attention output x (1 + {a.attn_floor:g} N(0,1)): "
              f"||change|| / ||output|| = {achieved:.3e} after rounding)", flush=True)  # fmt: skip
        _STATE["events"].clear()
    layers = {f"layer{k}": np.concatenate(v) for k, v in _STATE["layers"].items()}
    np.savez_compressed(out / "layers.npz", **layers)
    print(f"[{name}] {sum(len(p) for p in prompts)} positions scored, layers recorded: {sorted(layers)}")
    speed: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    vocab = len(tok)
    for ctx in a.speed:
        ids = rng.integers(300, vocab - 100, size=ctx).tolist()
        # a warm-up request of this length first: its kernels' JIT compiles (Triton specializes on sizes) are no
        # part of either timing (H200 run 6: the first 65k prefill's attention took 2.9 s, mostly compiles, and the
        # decode time, total minus that prefill, came out negative). Prefix caching is off (fidelity.build_llm).
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        _drain_events(1)
        t1 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        prefill_s = time.perf_counter() - t1
        pre = _drain_events(1)
        t1 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=a.decode + 1, temperature=0.0,
                     ignore_eos=True), use_tqdm=False)  # fmt: skip
        total_s = time.perf_counter() - t1
        ev = _drain_events(1)
        speed[str(ctx)] = {
            "prefill_wall_s": prefill_s,
            "decode_wall_s_per_token": max(0.0, total_s - prefill_s) / a.decode,
            "prefill_attn_ms": pre["prefill"],  # every layer's chunks, the first request
            "decode_attn_ms": ev["decode"],  # every layer's decode calls, the second request
            "layers": len(built),
        }
        print(f"[{name}] context {ctx}: prefill {prefill_s:.2f} s wall, attention "
              f"{sum(pre['prefill']):.1f} ms over {len(pre['prefill'])} calls; decode "
              f"{speed[str(ctx)]['decode_wall_s_per_token'] * 1e3:.2f} ms/token wall, attention median "
              f"{statistics.median(ev['decode']) if ev['decode'] else float('nan'):.3f} ms per layer call",
              flush=True)  # fmt: skip
    (out / "speed.json").write_text(json.dumps(speed, indent=1))
    meta = {"attention": a.attention, "kv_rounding": a.kv_rounding, "name": name, "classes": classes}
    (out / "meta.json").write_text(json.dumps({**meta, "pack": str(a.pack)}))
    return 0


def _name(attention: str, kv_rounding: str) -> str:
    """A run's label: "upstream", or "triton-fp8" / "triton-bf16" (the Ampere path and its KV rounding)."""
    return attention if attention == "upstream" else f"{attention}-{kv_rounding}"


def _run_name(run: Path, default: str) -> str:
    meta = run / "meta.json"
    return str(json.loads(meta.read_text()).get("name", default)) if meta.exists() else default


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return (min(xs), statistics.median(xs), max(xs)) if xs else (float("nan"),) * 3


def compare(a: argparse.Namespace) -> int:
    from vllm_dsv41.fidelity import compare_logits, noise_floor_gate

    up, tr = Path(a.upstream), Path(a.triton)
    lu, lt = np.load(up / "logits.npz"), np.load(tr / "logits.npz")
    if not np.array_equal(lu["prompt_lens"], lt["prompt_lens"]):
        print("FAIL: the two runs scored different prompts")
        return 1
    agree, kl = compare_logits(lu["logits"], lt["logits"])
    nu, nt = _run_name(up, "upstream"), _run_name(tr, "triton")
    print(f"served logits, {nt} vs {nu} attention: {agree.size} positions, top-1 agreement "
          f"{agree.mean():.5f}, KL mean {kl.mean():.3e} max {kl.max():.3e}")  # fmt: skip
    min_top1 = a.min_top1

    def floor_gate(floor: str, how: str, logits: np.ndarray) -> None:
        """Print how far the upstream run's ``floor`` scoring is from its own, and gate top-1 there if lower."""
        nonlocal min_top1
        fa, fk = compare_logits(lu["logits"], logits)
        print(f"{floor} ({nu} {how} vs {nu}): top-1 agreement {fa.mean():.5f}, KL mean {fk.mean():.3e} max "
              f"{fk.max():.3e}")  # fmt: skip
        if min_top1 is not None and (g := noise_floor_gate(min_top1, float(fa.mean()), fa.size)) < min_top1:
            print(f"top-1 gate: {min_top1:.5f} is above what the {floor} allows ({fa.mean():.5f}, less two standard "
                  f"deviations of its flip count: {g:.5f}); gating there")  # fmt: skip
            min_top1 = g

    if (up / "logits_floor.npz").exists():  # the upstream run's noise floor (run --noise-floor)
        floor_gate("noise floor", "with float64 expert sums", np.load(up / "logits_floor.npz")["logits"])
    if (up / "logits_attn_floor.npz").exists():  # upstream's attention perturbed by its own error's size (--attn-floor)
        af = np.load(up / "logits_attn_floor.npz")
        floor_gate("attention floor", f"with every attention output perturbed, ||change|| / ||output|| "
                   f"{float(af['achieved']):.3e},", af["logits"])  # fmt: skip
    yu, yt = np.load(up / "layers.npz"), np.load(tr / "layers.npz")
    print("per-layer attention output (first prompt, all heads): relative error ||t - u|| / ||u||, max |t - u|")
    for k in sorted(set(yu.files) & set(yt.files), key=lambda s: int(s[5:])):
        u = _bf16(yu[k])
        t = _bf16(yt[k])
        if u.shape != t.shape:
            print(f"  {k}: shapes differ {u.shape} vs {t.shape}")
            continue
        rel = float(np.linalg.norm(t - u) / max(np.linalg.norm(u), 1e-30))
        print(f"  {k}: rel {rel:.3e}, max abs {float(np.abs(t - u).max()):.3e} (|u| max {float(np.abs(u).max()):.3g})")
    su = json.loads((up / "speed.json").read_text()) if (up / "speed.json").exists() else {}
    st = json.loads((tr / "speed.json").read_text()) if (tr / "speed.json").exists() else {}
    if su and st:
        print("speed, triton / upstream (>1: ours slower); attention = the eager region (indexer + sparse attention)")
        print(f"  {'case':<28} {'upstream':>12} {'triton':>12} {'ratio':>7}   per-call ratio min/median/max")
        for ctx in sorted(set(su) & set(st), key=int):
            u, t = su[ctx], st[ctx]
            rows = [
                (f"prefill {ctx}: attention ms", sum(u["prefill_attn_ms"]), sum(t["prefill_attn_ms"]), None),
                (f"prefill {ctx}: wall s", u["prefill_wall_s"], t["prefill_wall_s"], None),
                (f"decode @{ctx}: attention ms", statistics.median(u["decode_attn_ms"]),
                 statistics.median(t["decode_attn_ms"]), (_stats(u["decode_attn_ms"]), _stats(t["decode_attn_ms"]))),
                (f"decode @{ctx}: wall ms/token", 1e3 * u["decode_wall_s_per_token"],
                 1e3 * t["decode_wall_s_per_token"], None),
            ]  # fmt: skip
            for name, x, y, st3 in rows:
                extra = ""
                if st3 is not None:
                    extra = "   " + "/".join(f"{b / a_:.2f}" for a_, b in zip(st3[0], st3[1], strict=True))
                print(f"  {name:<28} {x:12.3f} {y:12.3f} {y / x:7.2f}{extra}")
    bad = (min_top1 is not None and agree.mean() < min_top1) or (
        a.max_kl_mean is not None and kl.mean() > a.max_kl_mean
    )
    gate = f"thresholds top-1 >= {min_top1 if min_top1 is None else round(min_top1, 6)}, KL mean <= {a.max_kl_mean}"
    print(f"PASS ({nt}: {gate})" if not bad else f"FAIL ({nt}): {gate}")
    return 1 if bad else 0


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.int32).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def main(argv: list[str] | None = None) -> int:
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.config import KV_ROUNDINGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("pack")
    r.add_argument("--attention", choices=("upstream", "triton"), required=True)
    r.add_argument("--out", required=True)
    r.add_argument(
        "--kv-rounding",
        choices=KV_ROUNDINGS,
        default=Dsv41PluginConfig().attention_kv_rounding,
        help="the Ampere path's KV rounding (Dsv41PluginConfig.attention_kv_rounding)",
    )
    r.add_argument("--positions", type=int, default=6144, help="scored prompt positions")
    r.add_argument("--length", type=int, default=1536, help="tokens per prompt (> window 128, > top-k 512 entries)")
    r.add_argument("--max-model-len", type=int, default=65536)
    r.add_argument("--max-num-batched-tokens", type=int, default=8192)
    r.add_argument("--speed", type=int, nargs="*", default=[], help="contexts to time (prefill + decode)")
    r.add_argument("--decode", type=int, default=32, help="decode tokens timed per context")
    r.add_argument(
        "--noise-floor",
        action="store_true",
        help="also score the prompts with the experts' sums in float64 (logits_floor.npz); compare then gates "
        "top-1 at this floor (less two standard deviations of its flips) if lower",
    )
    r.add_argument(
        "--attn-floor",
        type=float,
        default=0.0,
        help="also score the prompts with every attention output times 1 + REL x N(0,1) (logits_attn_floor.npz): "
        "how far a change of an attention kernel's own error size moves them (upstream's FlashMLA vs float64: "
        "2.1e-3, H200 runs 4-5); compare then gates top-1 at that floor too (less two standard deviations)",
    )
    c = sub.add_parser("compare")
    c.add_argument("upstream")
    c.add_argument("triton")
    c.add_argument("--min-top1", type=float, default=None)
    c.add_argument("--max-kl-mean", type=float, default=None)
    a = ap.parse_args(argv)
    return run(a) if a.cmd == "run" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
