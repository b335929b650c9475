"""Load time and resident memory of Flash-shaped routed experts in the host home (device machine).

    python3 packages/vllm-dsv41/scripts/gpu_flash_load.py OUT [LAYERS]

Writes LAYERS (default 2) real-size DeepSeek-V4.1-Flash MoE layers with ``pack-tools synth --preset flash-layer``
(384 experts, H 5120, I 2304, MUL1 3 bpw: 5.1 GB each), drops the page cache, then opens them as the server's loader
does (``ExpertHome``: mapped read-only and page-locked with CUDA) and reports per layer and in all: bytes, time, rate
(cold: from the disk), the process's RSS (anon / file) against the expert bytes, and what the 204 GB of a full pack
would take at that rate; then the same warm (page cache full).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30


def main() -> int:
    out = Path(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    from pack_tools import synth
    from pack_tools.presets.flash_layer import FlashLayer
    from vllm_dsv41.home import ExpertHome, process_memory, resident_bytes
    from vllm_dsv41.loader import FULL_PACK_EXPERT_BYTES

    root = Path("/tmp/dsv41/flash")
    dirs = []
    for layer in range(layers):
        d = root / f"layer{layer}"
        if not (d / "model.safetensors.index.json").exists():
            t = time.time()
            synth("flash-layer", d, seed=layer, layer=FlashLayer(layer=layer))
            print(f"synth flash-layer {layer}: {time.time() - t:.0f} s", flush=True)
        dirs.append(d)
    results = {}
    for temp in ("cold", "warm"):
        if temp == "cold":
            subprocess.run(["sync"], check=False)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        before = process_memory()
        t = time.time()
        homes = [ExpertHome(d, register=True) for d in dirs]
        sec = time.time() - t
        mem = process_memory()
        nbytes = sum(h.stats.expert_bytes for h in homes)
        res = [resident_bytes(h) for h in homes]
        row = {
            "layers": layers, "expert_bytes": nbytes, "seconds": sec, "gb_per_s": nbytes / sec / 1e9,
            "rss_before": before["VmRSS"], "rss": mem["VmRSS"], "rss_anon": mem["RssAnon"], "rss_file": mem["RssFile"],
            "home_anonymous": sum(r["Anonymous"] for r in res), "home_rss": sum(r["Rss"] for r in res),
            "full_pack_seconds": FULL_PACK_EXPERT_BYTES / (nbytes / sec),
        }  # fmt: skip
        results[temp] = row
        print(
            f"{temp}: {nbytes / GiB:.2f} GiB of experts in {layers} layers mapped + page-locked in {sec:.1f} s "
            f"({row['gb_per_s']:.2f} GB/s); RSS {mem['VmRSS'] / GiB:.2f} GiB (anon {mem['RssAnon'] / GiB:.2f}, "
            f"file {mem['RssFile'] / GiB:.2f}) = expert bytes {(mem['VmRSS'] - nbytes) / GiB:+.2f} GiB; "
            f"home mappings: Rss {row['home_rss'] / GiB:.2f} GiB, Anonymous {row['home_anonymous']} B; "
            f"a 204 GB pack at this rate: {row['full_pack_seconds']:.0f} s",
            flush=True,
        )
        for h in homes:
            h.close()
    (out / "flash_load.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
