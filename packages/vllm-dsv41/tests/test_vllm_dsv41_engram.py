"""The Engram tables from the pack's files (``vllm_dsv41.engram``), on the CPU, against upstream vLLM's own code.

Upstream's hash and lookup are Triton kernels, which vLLM-CPU cannot run (it disables Triton without a CPU
backend); Triton's interpreter can. ``_interpreted`` rebinds an upstream kernel's code to the real Triton and runs
it in the interpreter, so the references below are upstream's kernels themselves, not re-implementations:

* hashing: ``EngramHasher.row_ids_batch`` (engram-mmap) == upstream's ``_hash_ids_kernel`` for a batch of requests
  == engram-mmap's per-request reference, on tiny-v41's geometry and token map;
* rows: the pack's tables mapped, gathered into host buffers and dequantized on a fake device (the CPU) ==
  upstream's ``_engram_lookup_kernel`` over the whole table held in memory (its pinned-table lookup), bit for bit.

(Triton's interpreter converts the fp8 NaN bytes 0x7F / 0xFF to finite values, unlike the GPU; tiny-v41's tables
hold no NaN, and the byte-pair test compares NaN-ness separately.)
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def v41_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools import build_pack
    from pack_tools.origin import ENGRAM, EXL3
    from pack_tools.presets.tiny_v41 import synth_tiny_v41

    root = tmp_path_factory.mktemp("v41-engram")
    synth_tiny_v41(root / "in")
    return build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "pack", jobs=1)


def _interpreted(kernel: Any) -> Any:
    """An upstream Triton kernel run by Triton's interpreter (numpy on the CPU)."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    raw = getattr(kernel, "fn", kernel)  # a JITFunction where vLLM's Triton is live, the plain function otherwise
    scope = dict(raw.__globals__)
    scope.update(tl=tl, triton=triton)
    fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    return InterpretedFunction(fn)


def _text_config(pack: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(**json.loads((pack / "config.json").read_text())["text_config"])


def _hasher(pack: Path) -> Any:
    from engram_mmap import EngramConfig, EngramHasher

    return EngramHasher.from_tokenizer(EngramConfig.from_hf_config(pack), pack / "tokenizer.json")


def _whole_tables(pack: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each table read whole into memory (what upstream pins): fp8 rows, uint8 scales."""
    from safetensors import safe_open

    from engram_mmap import EngramConfig, table_prefix
    from engram_mmap.safetensors_header import resolve_tensor_files

    cfg = EngramConfig.from_hf_config(pack)
    out = {}
    for layer in cfg.layer_ids:
        names = [f"{table_prefix(layer)}.weight", f"{table_prefix(layer)}.scale"]
        files = resolve_tensor_files(pack, names)
        got = []
        for name in names:
            with safe_open(files[name], framework="pt") as f:
                got.append(f.get_tensor(name))
        out[layer] = (got[0], got[1].view(torch.uint8))
    return out


def _upstream_lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Upstream's ``ParallelEngramEmbedding.lookup`` (one shard, unsorted) over a whole in-memory table."""
    from vllm.models.deepseek_v41.common.engram import _engram_lookup_kernel

    t, heads = ids.shape
    out = torch.full((t, heads, weight.shape[1]), 7.0, dtype=torch.bfloat16)
    rows = t * heads
    grid = min(-(-rows // 16), 4)  # a persistent grid; its size does not change what is written
    _interpreted(_engram_lookup_kernel)[(grid,)](
        weight, scales, ids, ids, out, 0, weight.shape[0], rows, ids.stride(0), ids.stride(1), HEAD_START=0,
        LOCAL_HEADS=heads, TOTAL_HEADS=heads, DIM=weight.shape[1], QUANT_BLOCK=weight.shape[1] // scales.shape[1],
        BLOCK_R=16, GRID=grid, SORTED=0, PACKED=False, OUT_STRIDE=out.stride(0),
    )  # fmt: skip
    return out


def _step(hasher: Any, rng: np.random.Generator, requests: int) -> dict[str, Any]:
    """A vLLM-like step over whole sequences: each request's chunk is a suffix of its sequence."""
    k = hasher.config.max_ngram_size - 1
    vocab = hasher.token_map.size
    seqs = [rng.integers(0, vocab, size=int(rng.integers(1, 30))) for _ in range(requests)]
    starts = [int(rng.integers(0, s.size)) if rng.random() < 0.7 else 0 for s in seqs]
    dead = [rng.random(s.size) < 0.1 for s in seqs]
    chunks = [s[a:] for s, a in zip(seqs, starts, strict=True)]
    qsl = np.concatenate([[0], np.cumsum([c.size for c in chunks])]).astype(np.int64)
    lookback = np.full((requests, k), -1, np.int64)  # oldest first
    lookback_dead = np.zeros((requests, k), bool)
    for r, (s, a, d) in enumerate(zip(seqs, starts, dead, strict=True)):
        n = min(k, a)
        if n:
            lookback[r, k - n :], lookback_dead[r, k - n :] = s[a - n : a], d[a - n : a]
    return {"tokens": np.concatenate(chunks), "qsl": qsl, "lookback": lookback, "lookback_dead": lookback_dead,
            "dead": np.concatenate([d[a:] for d, a in zip(dead, starts, strict=True)]), "starts": starts,
            "seqs": seqs, "seq_dead": dead}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- hashing


def test_upstream_layout_multipliers_and_token_map_are_engram_mmaps(v41_pack: Path) -> None:
    from transformers import AutoTokenizer
    from vllm.models.deepseek_v41.common.engram import (
        EngramLayout,
        build_compressed_token_map,
        compute_hash_multipliers,
    )

    from engram_mmap import EngramConfig
    from vllm_dsv41.engram import check_layout

    cfg = EngramConfig.from_hf_config(v41_pack)
    layout = EngramLayout(_text_config(v41_pack))
    check_layout(layout, cfg)
    for i, layer in enumerate(cfg.layer_ids):
        assert [list(o) for o in layout.primes[i]] == cfg.primes(layer).tolist()
        assert layout.offsets[i].tolist() == cfg.offsets(layer).ravel().tolist()
        assert layout.num_embeddings[i] == cfg.table_rows(layer)
    mult = compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, layout.compressed_vocab_size)
    assert mult.tolist() == [cfg.multipliers(layer).tolist() for layer in cfg.layer_ids]
    upstream_map, classes = build_compressed_token_map(AutoTokenizer.from_pretrained(str(v41_pack)))
    hasher = _hasher(v41_pack)
    assert classes == cfg.compressed_vocab_size
    assert upstream_map == hasher.token_map.tolist()
    # A layout whose primes differ is refused before any row is read.
    bad = EngramLayout(types.SimpleNamespace(**{**vars(_text_config(v41_pack)), "engram_vocab_size": 1200,
                                                "engram_num_embeddings": layout.num_embeddings}))  # fmt: skip
    with pytest.raises(ValueError, match="hash primes differ"):
        check_layout(bad, cfg)


_HASH_IN_INTERPRETER = """
import sys, types, torch
import triton, triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from vllm.models.deepseek_v41.common.engram import _hash_ids_kernel
raw = getattr(_hash_ids_kernel, "fn", _hash_ids_kernel)
scope = dict(raw.__globals__)
scope.update(tl=tl, triton=triton)
kernel = InterpretedFunction(types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__))
job = torch.load(sys.argv[1])
kernel[job["grid"]](*job["args"], **job["kwargs"])
torch.save(job["args"][12], sys.argv[2])
"""


def _upstream_hash(grid: tuple[int, ...], args: list[Any], kwargs: dict[str, Any], tmp: Path) -> torch.Tensor:
    """Upstream's ``_hash_ids_kernel`` in Triton's interpreter. It calls Triton's library functions (``tl.sum``),
    which are interpreted only when ``TRITON_INTERPRET=1`` precedes Triton's import: a subprocess."""
    import os
    import subprocess
    import sys

    torch.save({"grid": grid, "args": args, "kwargs": kwargs}, tmp / "job.pt")
    r = subprocess.run([sys.executable, "-c", _HASH_IN_INTERPRETER, str(tmp / "job.pt"), str(tmp / "out.pt")],
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def test_batch_hashing_equals_upstream_kernel_and_reference(v41_pack: Path, tmp_path: Path) -> None:
    from vllm.models.deepseek_v41.common.engram import DEAD_ID, EngramLayout, compute_hash_multipliers

    hasher = _hasher(v41_pack)
    cfg = hasher.config
    layout = EngramLayout(_text_config(v41_pack))
    token_map = torch.tensor(hasher.token_map, dtype=torch.int32)
    multipliers = compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, layout.compressed_vocab_size)
    primes, offsets = torch.tensor(layout.primes), layout.offsets
    rng = np.random.default_rng(0)
    for requests in (1, 3, 7):
        s = _step(hasher, rng, requests)
        t = s["tokens"].size
        ours = hasher.row_ids_batch(s["tokens"], s["qsl"], lookback=s["lookback"], mask=~s["dead"],
                                    lookback_mask=~s["lookback_dead"])  # fmt: skip
        # Upstream's kernel (the V2 runner's path: no slot cache): positions from each request's chunk start;
        # lookback newest first, -1 unknown; True = dead.
        positions = np.concatenate([a + np.arange(q1 - q0) for a, q0, q1 in zip(s["starts"], s["qsl"][:-1],
                                                                              s["qsl"][1:], strict=True)])  # fmt: skip
        lookback = torch.from_numpy(s["lookback"][:, ::-1].copy()).to(torch.int32)
        out = torch.full((t, len(cfg.layer_ids), cfg.n_cols), -5, dtype=torch.int32)
        args = [torch.from_numpy(s["tokens"]).to(torch.int32), token_map, torch.from_numpy(s["dead"]),
                torch.from_numpy(positions), None, torch.from_numpy(s["qsl"]).to(torch.int32), multipliers, primes,
                offsets, None, lookback, torch.from_numpy(s["lookback_dead"][:, ::-1].copy()), out, t, 0,
                int(hasher.pad_class)]  # fmt: skip
        kwargs = dict(input_stride=1, mask_stride=1, position_stride=1, table_stride=0, table_col_stride=0,
                      query_stride=1, num_query_rows=requests, num_table_rows=0, max_blocks=0, cache_block_size=1,
                      MAX_NGRAM=cfg.max_ngram_size, num_heads=cfg.n_heads, BLOCK_T=32,
                      BLOCK_H=1 << (cfg.n_heads - 1).bit_length(), dead_id=DEAD_ID, lookback_depth=lookback.shape[1],
                      lookback_row_stride=lookback.stride(0), lookback_col_stride=lookback.stride(1),
                      lookback_mask_row_stride=lookback.shape[1], lookback_mask_col_stride=1)  # fmt: skip
        upstream = _upstream_hash((-(-t // 32), len(cfg.layer_ids)), args, kwargs, tmp_path)
        np.testing.assert_array_equal(upstream.numpy(), ours)
        # and both equal engram-mmap's per-request reference on each whole sequence
        for r, (seq, a, d) in enumerate(zip(s["seqs"], s["starts"], s["seq_dead"], strict=True)):
            whole = hasher.row_ids_all(seq, mask=~d)[:, a:]
            np.testing.assert_array_equal(ours[s["qsl"][r] : s["qsl"][r + 1]].transpose(1, 0, 2), whole)


# ------------------------------------------------------------------------------------------------------- rows


def _row_ids_with_invalid(hasher: Any, rng: np.random.Generator, tokens: int) -> np.ndarray:
    """int32 [T, layers, cols] hashed from random tokens, with some ids outside every table (-1, rows, 2^31 - 1),
    as upstream's dummy hashes and a captured step's uninitialised buffer give."""
    ids = hasher.row_ids_batch(rng.integers(0, hasher.token_map.size, size=tokens), [0, tokens]).astype(np.int32)
    bad = rng.random(ids.shape) < 0.05
    ids[bad] = rng.choice(np.array([-1, 2**31 - 1, 30058, 25874], np.int32), size=int(bad.sum()))
    return ids


def test_rows_on_a_fake_device_equal_upstreams_pinned_table_lookup(v41_pack: Path) -> None:
    from vllm_dsv41.engram import EngramRowGather, MmapEngramEmbedding, open_engram_tables

    hasher = _hasher(v41_pack)
    whole = _whole_tables(v41_pack)
    tables = open_engram_tables(v41_pack)
    rng = np.random.default_rng(1)
    try:
        gathers = {layer: EngramRowGather(t, 64, hasher.config.n_cols, "cpu", name=f"layer {layer}")
                   for layer, t in tables.items()}  # fmt: skip
        for tokens in (1, 5, 64):
            ids = _row_ids_with_invalid(hasher, rng, tokens)
            outs = {}
            # both layers in flight at once, each on its worker thread, as in a served step
            for i, (layer, g) in enumerate(gathers.items()):
                outs[layer] = torch.full((tokens + 3, hasher.config.n_cols, 256), 9.0, dtype=torch.bfloat16)
                g.start(torch.from_numpy(ids[:, i]), outs[layer])
            for i, (layer, g) in enumerate(gathers.items()):
                g.finish()
                ref = _upstream_lookup(*whole[layer], torch.from_numpy(ids[:, i]))
                got = outs[layer]
                assert torch.equal(got[:tokens].view(torch.int16), ref.view(torch.int16)), (layer, tokens)
                assert (got[tokens:] == 9.0).all()  # nothing past the step's tokens is written
                assert g.last is not None and g.last.rows == tokens * hasher.config.n_cols
        # The module upstream's Engram holds: lookup() and forward() give the same rows.
        emb = MmapEngramEmbedding(tables[1], hasher.config.n_cols, 16, "cpu", layer=1)
        ids = torch.from_numpy(_row_ids_with_invalid(hasher, rng, 16)[:, 0])
        ref = _upstream_lookup(*whole[1], ids)
        assert torch.equal(emb(ids).view(torch.int16), ref.view(torch.int16))
        assert not list(emb.parameters()) and emb.num_embeddings == tables[1].rows and emb.cpu_offload
        for g in (*gathers.values(), emb.rows):
            g.close()
    finally:
        for t in tables.values():
            t.close()


def test_dequantize_rows_is_upstreams_arithmetic_on_every_byte_pair() -> None:
    """Every (fp8 byte, scale byte) pair: the torch path == a numpy statement of upstream's formula (scale byte 0
    is 0.0, 255 is +inf) == upstream's kernel in Triton's interpreter (NaN bytes aside, see the module docstring).
    """
    import ml_dtypes

    from engram_mmap.dequant import E4M3_TO_F32
    from vllm_dsv41.engram import dequantize_rows

    values = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row s: every fp8 byte with scale byte s
    scale_bytes = np.repeat(np.arange(256, dtype=np.uint8), 8).reshape(256, 8)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    dequantize_rows(torch.from_numpy(values), torch.from_numpy(scale_bytes), out)
    scale = (np.arange(256, dtype=np.uint32) << 23).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (E4M3_TO_F32[values] * scale[:, None]).astype(ml_dtypes.bfloat16)
    got = out.view(torch.uint16).numpy()
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(out.float().numpy()) == nan).all()
    np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert out[0].float().eq(0).logical_or(out[0].float().isnan()).all()  # scale byte 0 -> 0.0 (NaN * 0 = NaN)
    # Upstream's kernel, interpreted: every finite fp8 byte.
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F])
    rows = torch.from_numpy(values[:, finite].repeat(2, axis=1)[:, :256].copy())
    with np.errstate(over="ignore", invalid="ignore"):  # the interpreter's numpy: 448 x 2^128 overflows to inf
        ref = _upstream_lookup(rows.view(torch.float8_e4m3fn), torch.from_numpy(scale_bytes),
                               torch.arange(256, dtype=torch.int32).view(256, 1))  # fmt: skip
    mine = dequantize_rows(rows, torch.from_numpy(scale_bytes), torch.empty(256, 256, dtype=torch.bfloat16))
    ref = ref.view(256, 256)
    assert torch.equal(ref.isnan(), mine.isnan())
    # The interpreter rounds fp32 subnormals to bf16 its own (numpy) way; the numpy statement above checks those
    # (scale bytes 1-9 with small fp8 values; a real table's scale bytes are near 127).
    normal = ~ref.isnan() & ~((mine.float().abs() < 2.0**-126) & (mine.float() != 0))
    assert int(normal.sum()) > 60000
    assert torch.equal(ref.view(torch.int16)[normal], mine.view(torch.int16)[normal])


def test_gather_protocol_and_errors(v41_pack: Path) -> None:
    from vllm_dsv41.engram import EngramRowGather, open_engram_tables

    tables = open_engram_tables(v41_pack)
    try:
        g = EngramRowGather(tables[1], 8, 24, "cpu", name="layer 1")
        out = torch.zeros(8, 24, 256, dtype=torch.bfloat16)
        g.finish()  # nothing started: nothing to do
        with pytest.raises(ValueError, match=r"row ids must be \[tokens, 24\]"):
            g.start(torch.zeros(2, 23, dtype=torch.int32), out)
        with pytest.raises(ValueError, match="9 tokens in one step, the staging holds max_num_batched_tokens=8"):
            g.start(torch.zeros(9, 24, dtype=torch.int32), torch.zeros(9, 24, 256, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="out must be bfloat16"):
            g.start(torch.zeros(2, 24, dtype=torch.int32), torch.zeros(2, 24, 256))
        g.start(torch.zeros(0, 24, dtype=torch.int32), out)  # an empty step
        g.finish()
        # A step started and not finished (an aborted forward) is settled by the next start.
        g.start(torch.ones(2, 24, dtype=torch.int32), out)
        g.start(torch.full((2, 24), 3, dtype=torch.int32), out)
        g.finish()
        three = out[0, 0].clone()
        g.lookup(torch.full((1, 24), 3, dtype=torch.int32), out)
        assert torch.equal(out[0, 0], three)
        g.close()
    finally:
        for t in tables.values():
            t.close()


# ---------------------------------------------------------------------------------------------------- files


def _copy_pack(pack: Path, dest: Path) -> Path:
    shutil.copytree(pack, dest, symlinks=False)  # real files: the test edits them
    return dest


def test_missing_and_truncated_shards_are_refused_naming_the_file(v41_pack: Path, tmp_path: Path) -> None:
    from engram_mmap import EngramFormatError
    from vllm_dsv41.engram import EngramRowGather, open_engram_tables

    pack = _copy_pack(v41_pack, tmp_path / "pack")
    shard = pack / "engram-model-00047-of-00048.safetensors"
    index = json.loads((pack / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["layers.1.engram.embed.weight"] == shard.name
    data = shard.read_bytes()
    # Truncated: the message names the file (and the first tensor past its end).
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(EngramFormatError, match=rf"{shard.name}: .*truncated shard"):
        open_engram_tables(pack)
    # Missing (a pack whose link to the release's shard dangles): the message names the file.
    shard.unlink()
    shard.symlink_to(tmp_path / "gone" / shard.name)
    with pytest.raises(FileNotFoundError, match=shard.name):
        open_engram_tables(pack)
    # A shard that shrinks after the tables were mapped: the step's gather fails at finish(), naming the file
    # (instead of a SIGBUS in the worker).
    shard.unlink()
    shard.write_bytes(data)
    tables = open_engram_tables(pack)
    try:
        g = EngramRowGather(tables[1], 4, 24, "cpu", name="layer 1")
        with open(shard, "r+b") as f:
            f.truncate(tables[1].weight.offset + 10)
        g.start(torch.ones(2, 24, dtype=torch.int32), torch.zeros(2, 24, 256, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match=rf"{shard.name}' shrank"):
            g.finish()
        g.close()
    finally:
        for t in tables.values():
            t.close()


def test_the_tables_never_reach_vllms_weight_reader(v41_pack: Path) -> None:
    from vllm_dsv41.loader import Dsv41ModelLoader
    from vllm_dsv41.v41 import Dsv41ForCausalLM, v41_weights_mapper

    def names(on_disk: bool) -> list[str]:
        model = types.SimpleNamespace(_dsv41_engram_on_disk=on_disk, _has_bias_vl=False,
                                      config=types.SimpleNamespace(compress_ratios=[0, 0, 2, 2]))  # fmt: skip
        unused = types.MethodType(Dsv41ForCausalLM.is_unused_checkpoint_weight, model)
        counts = {"tensors": 0, "bytes": 0}
        return [n for n, _ in Dsv41ModelLoader._dense_weights(None, v41_pack, v41_weights_mapper(), counts,  # type: ignore[arg-type]
                                                               unused)]  # fmt: skip

    tables = {f"layers.{layer}.engram.embed.{part}" for layer in (1, 2) for part in ("weight", "scale")}
    on_disk = names(True)
    assert not tables & set(on_disk)
    assert "layers.1.engram.wkv.trellis" in on_disk and "layers.1.engram.q_weight" in on_disk  # the rest loads
    assert tables <= set(names(False))  # engram="upstream": vLLM reads and pins them, as before


@pytest.mark.parametrize(
    ("use_v2", "graphs", "warned"),
    [(False, "PIECEWISE", True), (True, "PIECEWISE", False), (False, "NONE", False), (False, None, False)],
)
def test_a_warning_under_the_v1_model_runner_with_graphs(use_v2: bool, graphs: str | None, warned: bool) -> None:
    """Upstream's V4.1 model hashes Engram's n-grams only in steps with attention metadata; vLLM's V1 runner
    captures its graphs without it: the mapped-table hook warns then (and binds upstream's name to ours either
    way, restored after)."""
    import logging

    from vllm.models.deepseek_v41.nvidia import model as nvidia_model

    from vllm_dsv41.engram import engram_construction

    mode = None if graphs is None else types.SimpleNamespace(name=graphs)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(engram_layer_ids=[1])),
        use_v2_model_runner=use_v2,
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
    )
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("vllm.dsv41.engram")
    handler = Keep(level=logging.WARNING)
    log.addHandler(handler)
    original = nvidia_model.Engram
    try:
        with engram_construction(cfg, "mmap") as on:
            assert on and nvidia_model.Engram is not original
    finally:
        log.removeHandler(handler)
    assert nvidia_model.Engram is original
    msgs = [r.getMessage() for r in records]
    assert bool(msgs) == warned, msgs
    if warned:
        assert "V1 model runner" in msgs[0] and graphs in msgs[0] and "--enforce-eager" in msgs[0]
