"""GPU tests of the Engram tables served from the pack's files (device machine: ``scripts/gpu_engram.sh``).

The reference is upstream's own table: vLLM's ``ParallelEngramEmbedding`` with ``cpu_offload=True`` (the whole table
pinned in host memory, read by its Triton lookup kernel over PCIe), loaded through its own weight loader from the
tiny-v41 pack. The rows our path serves (mapped table -> host gather -> pinned staging -> copy -> upstream's kernel
over the staged rows) must equal it bit for bit, whichever way the gather runs: on the worker thread behind a
side stream (served steps), inline (graph capture), or many steps back to back while the GPU lags behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def v41_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools import build_pack
    from pack_tools.origin import ENGRAM, EXL3
    from pack_tools.presets.tiny_v41 import synth_tiny_v41

    root = tmp_path_factory.mktemp("v41-engram-gpu")
    synth_tiny_v41(root / "in")
    return build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "pack", jobs=1)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM's parallel state for one GPU (upstream's embedding asks for its TP and Engram-DP sizes)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    init = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init}", local_rank=0,
                                     backend="gloo")  # fmt: skip
        initialize_model_parallel(1, 1)
        yield
    cleanup_dist_env_and_memory()


def _upstream_tables(pack: Path) -> dict[int, Any]:
    """Upstream's pinned tables (``ParallelEngramEmbedding``, cpu_offload), loaded by its own weight loader."""
    from safetensors import safe_open
    from vllm.models.deepseek_v41.common.engram import ParallelEngramEmbedding

    from engram_mmap import EngramConfig, table_prefix
    from engram_mmap.safetensors_header import resolve_tensor_files

    cfg = EngramConfig.from_hf_config(pack)
    out = {}
    for layer in cfg.layer_ids:
        emb = ParallelEngramEmbedding(cfg.table_rows(layer), cfg.head_dim, tuple(cfg.primes(layer).ravel().tolist()),
                                      cpu_offload=True)  # fmt: skip
        assert emb.weight.is_pinned() and emb.weight.device.type == "cpu"
        names = {emb.weight: f"{table_prefix(layer)}.weight", emb.weight_scale_inv: f"{table_prefix(layer)}.scale"}
        files = resolve_tensor_files(pack, list(names.values()))
        for param, name in names.items():
            with safe_open(files[name], framework="pt") as f:
                param.weight_loader(param, f.get_tensor(name))
        out[layer] = emb
    return out


def _hashes(pack: Path, rng: np.random.Generator, tokens: int) -> torch.Tensor:
    """int32 [T, layers, 24] on the GPU: the hash of random tokens, with ids outside every table mixed in."""
    from engram_mmap import EngramConfig, EngramHasher

    hasher = EngramHasher.from_tokenizer(EngramConfig.from_hf_config(pack), pack / "tokenizer.json")
    ids = hasher.row_ids_batch(rng.integers(0, hasher.token_map.size, size=tokens), [0, tokens]).astype(np.int32)
    bad = rng.random(ids.shape) < 0.03
    ids[bad] = rng.choice(np.array([-1, 2**31 - 1, 10**8], np.int32), size=int(bad.sum()))
    return torch.from_numpy(ids).cuda()


def test_rows_served_equal_upstreams_pinned_table_lookup(v41_pack: Path, tp1: None) -> None:
    from vllm_dsv41.engram import EngramRowGather, MmapEngramEmbedding, open_engram_tables

    upstream = _upstream_tables(v41_pack)
    tables = open_engram_tables(v41_pack)
    rng = np.random.default_rng(0)
    side = torch.cuda.Stream()
    try:
        gathers = {layer: EngramRowGather(t, 512, 24, "cuda", name=f"layer {layer}") for layer, t in tables.items()}
        for tokens in (1, 7, 64, 512):
            hashes = _hashes(v41_pack, rng, tokens)
            for i, layer in enumerate(tables):
                ids = hashes[:, i]  # a strided view, as the model passes it
                want = torch.empty(tokens, 24, 256, dtype=torch.bfloat16, device="cuda")
                upstream[layer].lookup(ids, want)
                for inline in (False, True):
                    got = torch.full((tokens, 24, 256), 7.0, dtype=torch.bfloat16, device="cuda")
                    side.wait_stream(torch.cuda.current_stream())
                    gathers[layer].start(ids, got, side, inline=inline)
                    gathers[layer].finish()
                    torch.cuda.synchronize()
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layer, tokens, inline)
        emb = MmapEngramEmbedding(tables[1], 24, 64, "cuda", layer=1)
        ids = _hashes(v41_pack, rng, 64)[:, 0]
        want = torch.empty(64, 24, 256, dtype=torch.bfloat16, device="cuda")
        upstream[1].lookup(ids, want)
        assert torch.equal(emb(ids).view(torch.int16), want.view(torch.int16))
        for g in (*gathers.values(), emb.rows):
            g.close()
    finally:
        for t in tables.values():
            t.close()


def test_steps_back_to_back_while_the_gpu_lags(v41_pack: Path, tp1: None) -> None:
    """Twenty steps started and finished without a host sync while the main stream is kept busy (the host runs ahead
    of the GPU): every step's rows are its own (no staging buffer is overwritten before its copy ran)."""
    from vllm_dsv41.engram import EngramRowGather, open_engram_tables

    upstream = _upstream_tables(v41_pack)
    tables = open_engram_tables(v41_pack)
    rng = np.random.default_rng(1)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    try:
        gathers = {layer: EngramRowGather(t, 32, 24, "cuda", name=f"layer {layer}") for layer, t in tables.items()}
        steps = []
        for step in range(20):
            hashes = _hashes(v41_pack, rng, int(rng.integers(1, 33)))
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time on the main stream before this step's hashes are "ready"
            outs = {layer: torch.empty(hashes.shape[0], 24, 256, dtype=torch.bfloat16, device="cuda")
                    for layer in tables}  # fmt: skip
            for i, (layer, g) in enumerate(gathers.items()):
                side.wait_stream(main)
                g.start(hashes[:, i], outs[layer], side)
            torch.cuda._sleep(1_000_000 if step % 2 else 0)  # "the layers before the Engram layer"
            for g in gathers.values():
                g.finish()
            steps.append((hashes, outs))
        torch.cuda.synchronize()
        for hashes, outs in steps:
            for i, layer in enumerate(tables):
                want = torch.empty_like(outs[layer])
                upstream[layer].lookup(hashes[:, i], want)
                assert torch.equal(outs[layer].view(torch.int16), want.view(torch.int16))
        for g in gathers.values():
            g.close()
    finally:
        for t in tables.values():
            t.close()


def test_the_hooks_under_breakable_cuda_graphs(v41_pack: Path, tp1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two hooks of the model's Engram layer as vLLM runs them with breakable CUDA graphs (PIECEWISE +
    VLLM_USE_BREAKABLE_CUDAGRAPH=1): captured once (both hooks are eager breaks; nothing is gathered during the
    capture, whose hash buffer is not written yet), then replayed with new row ids. Every replay re-runs the breaks:
    the worker gathers the new rows while the captured segment between the breaks runs, the segment after the wait
    reads them. A FULL graph (a plain capture) is refused with a message saying how to serve."""
    import types

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, is_breakable_cudagraph_enabled

    from vllm_dsv41.engram import MmapEngramEmbedding, mmap_engram_class, open_engram_tables

    assert is_breakable_cudagraph_enabled()
    cls = mmap_engram_class()
    upstream = _upstream_tables(v41_pack)
    tables = open_engram_tables(v41_pack)
    rng = np.random.default_rng(2)
    tokens = 16
    try:
        emb = MmapEngramEmbedding(tables[1], 24, 64, "cuda", layer=1)
        layer = types.SimpleNamespace(_prefetch_stream=torch.cuda.Stream(), embed_tokens=emb)
        step_ids = torch.zeros(tokens, 24, dtype=torch.int32, device="cuda")  # the step's input (static)
        hashes = torch.empty_like(step_ids)
        rows = torch.empty(tokens, 24, 256, dtype=torch.bfloat16, device="cuda")
        used = torch.empty(tokens, 24, 256, dtype=torch.float32, device="cuda")

        def forward() -> None:
            hashes.copy_(step_ids)  # "the hash kernel" (captured)
            cls._start_prefetch(layer, hashes, rows)  # eager break
            torch.cuda._sleep(1_000_000)  # "the layers before the Engram layer" (captured)
            cls._finish_prefetch(layer, None)  # eager break
            used.copy_(rows.float() * 2)  # "the Engram layer" (captured)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step_ids.copy_(_hashes(v41_pack, rng, tokens)[:, 0])
            forward()  # eager warm-up (Triton compiles)
            capture = BreakableCUDAGraphCapture()
            with capture:
                forward()
            assert capture.num_eager_breaks == 2 and capture.num_graphs == 3
            for _ in range(5):
                ids = _hashes(v41_pack, rng, tokens)[:, 0].contiguous()
                step_ids.copy_(ids)
                capture.replay()
                torch.cuda.current_stream().synchronize()
                want = torch.empty(tokens, 24, 256, dtype=torch.bfloat16, device="cuda")
                upstream[1].lookup(ids, want)
                assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
                assert torch.equal(used, want.float() * 2)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                hashes.copy_(step_ids)  # a captured op, so the graph the refusal leaves is not empty (a warning)
                with pytest.raises(RuntimeError, match="PIECEWISE"):
                    emb.rows.start(hashes, rows, s)
        emb.rows.close()
    finally:
        for t in tables.values():
            t.close()


def test_served_logits_equal_the_all_in_vram_oracle(v41_pack: Path, tmp_path: Path) -> None:
    """The served Engram path (rows gathered from the pack's memory-mapped files, PIECEWISE graphs) against the
    all-in-VRAM oracle with upstream's own pinned Engram tables (read by vLLM's weight loader): two runs of the
    fidelity tool with the same experts (all in VRAM), so only where the Engram rows come from differs. (Run 4 ran
    the served side with the CPU expert tier: 1 of 512 positions flipped, which the CPU tier's own rounding can do
    alone; the tiers' fidelity is measured by their own runs against the oracle's noise floor.)"""
    import json
    import os
    import subprocess
    import sys

    ref = tmp_path / "oracle.npz"
    common = ["--positions", "512", "--length", "128", "--greedy-prompts", "2", "--greedy-tokens", "16",
              "--gpu-memory-gib", "24", "--cpu-threads", "8"]  # fmt: skip
    env = {**os.environ, "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    r = subprocess.run([sys.executable, "-m", "vllm_dsv41.fidelity", str(v41_pack), "--against", "all-in-vram",
                        "--engram", "upstream", "--save-reference", str(ref), *common], capture_output=True,
                       text=True, timeout=560, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "served.json"
    r = subprocess.run([sys.executable, "-m", "vllm_dsv41.fidelity", str(v41_pack), "--runtime", "all-in-vram",
                        "--engram", "mmap", "--reference", str(ref), "--json", str(out), *common], capture_output=True,
                       text=True, timeout=560, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "served from the pack's files" in r.stdout + r.stderr  # the mapped tables, not upstream's
    res = json.loads(out.read_text())
    assert res["positions"] == 512 and res["top1_agreement"] >= 0.999 and res["kl_mean"] <= 1e-4, res
