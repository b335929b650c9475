"""Resident memory of the plugin's per-step path alone: ``dsv41::routed_experts`` (CpuExpertRuntime over
cpu-tier) called in a loop on the tiny-demo pack's experts, without vLLM. Flat RSS here means a memory growth
seen in the served engine is not in this path.

    uv run python apps/server/benches/runtime_memory.py [--calls 200000] [--pack DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--pack", type=Path, default=None, help="a tiny-demo pack (default: build one in a temp dir)")
    a = p.parse_args()

    import numpy as np
    import torch
    from cpu_tier.exl3 import Exl3Tensor
    from dsv41_server.packs import ensure_demo_pack
    from safetensors import safe_open
    from vllm_dsv41 import Dsv41PluginConfig
    from vllm_dsv41.experts import CpuExpertRuntime, register_runtime, routed_experts, unregister_runtime

    pack = a.pack or ensure_demo_pack(Path(tempfile.mkdtemp(prefix="dsv41-mem-")) / "tiny-demo")
    cfg = json.loads((pack / "config.json").read_text())
    layers, experts, top_k, hidden = (cfg[k] for k in ("num_hidden_layers", "num_experts", "num_experts_per_tok",
                                                        "hidden_size"))  # fmt: skip
    runtime = CpuExpertRuntime(Dsv41PluginConfig(cpu_threads=1, precision="exact"))
    with safe_open(str(pack / "model.safetensors"), framework="numpy") as f:
        for layer in range(layers):
            gate, up, down = (
                [Exl3Tensor.from_safetensors(f, f"model.layers.{layer}.mlp.experts.{e}.{part}") for e in range(experts)]
                for part in ("gate_proj", "up_proj", "down_proj")
            )
            runtime.add_layer(layer, gate, up, down, swiglu_limit=None)
    handle = register_runtime(runtime)
    rng = np.random.default_rng(0)
    print(f"# runtime_memory | {pack} | layers={layers} experts={experts} top_k={top_k} hidden={hidden}")
    print(f"{'calls':>10}{'seconds':>10}{'rss_mib':>10}")
    t0 = time.monotonic()
    first = None
    for i in range(a.calls):
        tokens = 64 if i % 50 == 0 else int(rng.integers(1, 9))  # mostly decode-sized steps, some prefills
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
        routed_experts(
            torch.randn(tokens, hidden), torch.from_numpy(ids), torch.rand(tokens, top_k), handle, i % layers
        )
        if (i + 1) % max(1, a.calls // 10) == 0:
            rss = _rss_mib()
            first = rss if first is None else first
            print(f"{i + 1:>10}{time.monotonic() - t0:>10.1f}{rss:>10.1f}", flush=True)
    print(f"# growth after the first tenth: {_rss_mib() - (first or 0):+.1f} MiB")
    unregister_runtime(handle)


if __name__ == "__main__":
    main()
