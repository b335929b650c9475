"""Where a CPU-side runtime's logits part from the oracle's: per position KL, and per MoE layer call whether the
two runtimes routed a token to different experts (a router near-tie flipped by the experts' rounding upstream).

    python packages/vllm-dsv41/scripts/routing_flips.py PACK [--precision fast] [--positions 512] [--length 128]

Runs vLLM's CPU build in this process (the runtimes are wrapped to record each call's routing and output), so it
suits the demo and tiny packs. Prints the positions of largest KL and, per layer call, the tokens whose expert set
differs and the relative error of the runtime's expert output against the oracle's.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from cpu_tier.config import PRECISIONS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--runtime", default="cpu", help="the runtime under test (default cpu)")
    ap.add_argument("--precision", choices=PRECISIONS, default=None)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8, help="positions of largest KL to print")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the wrappers below must run in the engine's process

    from vllm_dsv41 import experts as E
    from vllm_dsv41 import fidelity as F

    calls: list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]] = []

    def wrap(cls: Any) -> None:
        orig = cls.forward_into

        def forward_into(self: Any, layer: int, x: Any, ids: Any, w: Any, out: Any) -> None:
            orig(self, layer, x, ids, w, out)
            t = x.shape[0]
            # copies: on the CPU .float().cpu().numpy() is a view of the model's buffers, which later calls reuse
            calls.append((self.name, layer, x[:t].float().cpu().numpy().copy(), ids[:t].cpu().numpy().copy(),
                          out[:t].float().cpu().numpy().copy()))  # fmt: skip

        cls.forward_into = forward_into

    wrap(E.CpuExpertRuntime)
    wrap(E.AllInVramRuntime)
    llm = F.build_llm(a.pack, runtime=a.runtime, cpu_threads=a.cpu_threads, precision=a.precision,
                      max_model_len=max(1024, a.length + 64))  # fmt: skip
    kw: dict[str, Any] = dict(positions=a.positions, length=a.length, greedy_prompts=0, greedy_tokens=1)
    calls.clear()
    ref = F.record_reference(llm, "all-in-vram", **kw)
    ref_calls = [c for c in calls if c[2].shape[0] > 1]  # the prompt passes (the 1-token calls are sampling steps)
    calls.clear()
    test = F.record_reference(llm, a.runtime, **kw)
    test_calls = [c for c in calls if c[2].shape[0] > 1]
    agree, kl = F.compare_logits(np.concatenate(ref.logits), np.concatenate(test.logits))
    print(f"{a.runtime} (precision {a.precision or 'default'}) vs all-in-vram, {agree.size} positions: top-1 "
          f"{agree.mean():.6f}, KL mean {kl.mean():.3e}, max {kl.max():.3e}")  # fmt: skip
    order = np.argsort(-kl)[: a.top]
    worst = ", ".join(f"({i // a.length}, {i % a.length}) {kl[i]:.2e}" for i in order)
    print(f"largest KL (prompt, position): {worst}")
    if len(ref_calls) != len(test_calls):
        print(f"the two runs made {len(ref_calls)} and {len(test_calls)} prompt calls: not compared call by call")
        return 1
    prompt, last_layer = -1, None
    flipped: set[int] = set()  # positions (prompt * length + position) where some layer routed differently
    whole = all(c[2].shape[0] == a.length for c in ref_calls)  # one call per prompt and layer: positions map
    for (_, layer, x0, ids0, out0), (_, _, x1, ids1, out1) in zip(ref_calls, test_calls, strict=True):
        if last_layer is None or layer <= last_layer:
            prompt += 1
        last_layer = layer
        flips = np.nonzero((np.sort(ids0, 1) != np.sort(ids1, 1)).any(1))[0]
        err = np.linalg.norm(out1 - out0, axis=1) / np.maximum(np.linalg.norm(out0, axis=1), 1e-30)
        xerr = np.abs(x1 - x0).max(1) / np.maximum(np.abs(x0).max(1), 1e-30)
        same = np.setdiff1d(np.arange(err.size), flips)
        flipped.update(prompt * a.length + int(i) for i in flips)
        med = float(np.median(err[same])) if same.size else float("nan")
        top = float(err[same].max()) if same.size else 0.0
        there = f" (output rel err there {', '.join(f'{err[i]:.2e}' for i in flips)})" if flips.size else ""
        print(
            f"prompt {prompt} layer {layer}: input rel diff max {xerr.max():.2e}; expert output rel err median "
            f"{med:.2e}, max {top:.2e} where routed alike; routing differs at positions {flips.tolist()}{there}"
        )
    if whole:
        keep = np.setdiff1d(np.arange(kl.size), sorted(flipped))
        print(f"{len(flipped)} of {kl.size} positions routed differently in some layer; at the others: top-1 "
              f"{agree[keep].mean():.6f}, KL mean {kl[keep].mean():.3e}, max {kl[keep].max():.3e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
