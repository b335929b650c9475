"""Host memory of the Engram tables served from the pack's files, while serving (runs on the CPU; any machine).

    python packages/vllm-dsv41/scripts/engram_rss.py [--dir /tmp/dsv41/engram-rss] [--dense-gib 4] [--steps 400]

Two tables are mapped and served step after step through ``vllm_dsv41.engram.EngramRowGather`` (the class the
model's hooks drive; here on host buffers, the CPU "device", so the host side is exactly the served one minus the
copy to the GPU), with a mix of decode steps (1-64 tokens) and prefill chunks (up to ``--prefill`` tokens):

* ``flash-sparse``: V4.1-Flash's real tables (384,006,168 + 384,016,682 rows, 203 GB apparent) as one sparse
  file: the real mapping size and row addresses; reads of holes are zero pages, not disk I/O.
* ``dense``: a dense file of ``--dense-gib`` random bytes (written once, kept): real reads from the disk.

The process's ``RssAnon`` (its own memory: staging buffers, Python) and ``RssFile`` (page-cache pages it has
mapped; the kernel reclaims them under pressure) are sampled every ``--every`` steps. Printed per case: both at
start and at the end, and their growth: the largest sample of the second half of the run minus the largest of
the first half (the allocator's high-water churn with prefill-size temporaries is bounded; a leak grows with
steps). Exit status 1 when ``RssAnon`` grows by more than ``--max-anon-growth-mib``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

MiB = 1 << 20
FLASH_ROWS = {1: 384006168, 14: 384016682}  # DeepSeek-V4.1-Flash's engram_num_embeddings


def _flash_config() -> Any:
    from engram_mmap import EngramConfig

    text_config = {
        "engram_layer_ids": [1, 14], "engram_num_embeddings": list(FLASH_ROWS.values()), "engram_max_ngram_size": 4,
        "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
        "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
    }  # fmt: skip
    return EngramConfig.from_hf_config({"text_config": text_config})


def _mem() -> dict[str, int]:
    from vllm_dsv41.home import process_memory

    return process_memory()


def serve(path: str, cfg: Any, steps: int, every: int, prefill: int, seed: int, threads: int) -> dict[str, Any]:
    """Serve ``steps`` steps of both tables of ``path``; RSS samples and totals."""
    from engram_mmap import EngramHasher, EngramTable, TableConfig
    from vllm_dsv41.engram import EngramRowGather

    table_cfg = TableConfig(num_threads=threads)
    tables = [EngramTable.open_layer(path, cfg, layer, config=table_cfg) for layer in cfg.layer_ids]
    gathers = [EngramRowGather(t, prefill, cfg.n_cols, "cpu", name=f"layer {layer}")
               for t, layer in zip(tables, cfg.layer_ids, strict=True)]  # fmt: skip
    outs = [torch.empty((prefill, cfg.n_cols, cfg.head_dim), dtype=torch.bfloat16) for _ in gathers]
    hasher = EngramHasher(cfg)
    rng = np.random.default_rng(seed)
    samples: list[dict[str, Any]] = []
    rows = 0
    t0 = time.perf_counter()
    try:
        samples.append({"step": 0, **_mem()})
        for step in range(1, steps + 1):
            t = int(rng.integers(1, 65)) if step % 10 else int(rng.integers(prefill // 2, prefill + 1))
            ids = torch.from_numpy(hasher.row_ids_batch(rng.integers(0, cfg.compressed_vocab_size, t), [0, t]))
            ids = ids.to(torch.int32)
            for j, g in enumerate(gathers):
                g.start(ids[:, j], outs[j])
            for g in gathers:
                g.finish()
            rows += 2 * t * cfg.n_cols
            if step % every == 0 or step == steps:
                samples.append({"step": step, **_mem()})
    finally:
        for g in gathers:
            g.close()
        for tb in tables:
            tb.close()
    first = [s for s in samples if s["step"] < steps // 2]
    second = [s for s in samples if s["step"] >= steps // 2]

    def growth(key: str) -> int:
        return max(s[key] for s in second) - max(s[key] for s in first)

    return {"samples": samples, "rows": rows, "row_bytes": rows * (cfg.head_dim + cfg.scale_cols),
            "seconds": time.perf_counter() - t0,
            "anon_growth": growth("RssAnon"), "file_growth": growth("RssFile"),
            "staging_bytes": sum(g.host_bytes for g in gathers)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv41/engram-rss"))
    ap.add_argument("--dense-gib", type=float, default=4.0, help="the dense file's size (0: skip the dense case)")
    ap.add_argument("--cases", default="flash-sparse,dense", help="which cases, comma separated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50, help="sample RSS every this many steps")
    ap.add_argument("--prefill", type=int, default=2048, help="the largest prefill chunk (tokens)")
    ap.add_argument("--threads", type=int, default=16, help="engram-mmap TableConfig.num_threads")
    ap.add_argument("--max-anon-growth-mib", type=float, default=16.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from engram_mmap.bench import _engram_config, _ensure_file
    from engram_mmap.synthetic import write_v41_engram_shard

    a.dir.mkdir(parents=True, exist_ok=True)
    cases: dict[str, tuple[str, Any]] = {}
    wanted = set(a.cases.split(","))
    if "flash-sparse" in wanted:
        sparse = str(a.dir / "flash-sparse.safetensors")
        if not os.path.exists(sparse):
            write_v41_engram_shard(sparse, FLASH_ROWS, fill="sparse")
        cases["flash-sparse"] = (sparse, _flash_config())
    if "dense" in wanted and a.dense_gib > 0:
        dense = str(a.dir / "dense.safetensors")
        cfg = _engram_config(int(a.dense_gib * (1 << 30)))
        _ensure_file(dense, cfg, lambda m: print(m, flush=True))
        cases["dense"] = (dense, cfg)
    results: dict[str, Any] = {}
    bad = False
    print(f"{'case':<14}{'file GiB':>10}{'on disk GiB':>12}{'steps':>7}{'rows read':>12}{'anon MiB':>20}"
          f"{'file MiB':>20}{'anon growth':>13}{'file growth':>13}", flush=True)  # fmt: skip
    for name, (path, cfg) in cases.items():
        r = serve(path, cfg, a.steps, a.every, a.prefill, a.seed, a.threads)
        st = os.stat(path)
        r.update(file_bytes=st.st_size, disk_bytes=st.st_blocks * 512)
        results[name] = r
        s0, s1 = r["samples"][0], r["samples"][-1]
        ga, gf = r["anon_growth"], r["file_growth"]
        anon = f"{s0['RssAnon'] / MiB:.0f} -> {s1['RssAnon'] / MiB:.0f}"
        file = f"{s0['RssFile'] / MiB:.0f} -> {s1['RssFile'] / MiB:.0f}"
        print(f"{name:<14}{st.st_size / (1 << 30):>10.1f}{st.st_blocks * 512 / (1 << 30):>12.2f}{a.steps:>7}"
              f"{r['rows']:>12,}{anon:>20}{file:>20}{ga / MiB:>+12.1f}M{gf / MiB:>+12.1f}M", flush=True)  # fmt: skip
        by_step = ", ".join(f"{s['step']}: {s['RssAnon'] / MiB:.0f}/{s['RssFile'] / MiB:.0f}" for s in r["samples"])
        print(f"  RssAnon / RssFile MiB by step: {by_step}", flush=True)
        bad |= ga > a.max_anon_growth_mib * MiB
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print("RssAnon flat in every case (second half's peak <= first half's + the margin)" if not bad else
          f"RssAnon GREW: the second half's peak exceeds the first half's by > {a.max_anon_growth_mib} MiB",
          flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
