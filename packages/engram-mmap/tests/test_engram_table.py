"""EngramTable on synthetic tables written to tmp_path in the real V4.1 layout."""

from __future__ import annotations

import gc
import json
import os
import struct

import numpy as np
import pytest

from engram_mmap import EngramConfig, EngramFormatError, EngramTable, TableConfig
from engram_mmap.synthetic import write_safetensors, write_v41_engram_shard

D, S = 256, 8


def _table_arrays(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, D), dtype=np.uint8), rng.integers(0, 256, (rows, S), dtype=np.uint8)


def _entry(prefix: str, w: np.ndarray, s: np.ndarray, wdtype: str = "F8_E4M3", sdtype: str = "F8_E8M0") -> dict:
    return {f"{prefix}.weight": (wdtype, w.shape, w), f"{prefix}.scale": (sdtype, s.shape, s)}


@pytest.fixture
def single(tmp_path):
    w, s = _table_arrays(3000, 0)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"layers.0.attn.wq": ("BF16", (4, 4), np.zeros(32, np.uint8)),
                             **_entry("layers.1.engram.embed", w, s)})  # fmt: skip
    return path, w, s


@pytest.fixture
def multi_shard(tmp_path):
    """Layer 1: weight in shard 1, scale in shard 2. Layer 14: both in shard 2 after other tensors."""
    w1, s1 = _table_arrays(1500, 1)
    w14, s14 = _table_arrays(2100, 2)
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_safetensors(tmp_path / shard1, {"embed.weight": ("BF16", (10, 8), np.ones(160, np.uint8)),
                                          "layers.1.engram.embed.weight": ("F8_E4M3", w1.shape, w1)})  # fmt: skip
    write_safetensors(tmp_path / shard2, {"layers.1.engram.embed.scale": ("F8_E8M0", s1.shape, s1),
                                          "layers.2.ffn.w1": ("F32", (3,), np.zeros(12, np.uint8)),
                                          **_entry("layers.14.engram.embed", w14, s14)})  # fmt: skip
    weight_map = {"embed.weight": shard1, "layers.1.engram.embed.weight": shard1,
                  "layers.1.engram.embed.scale": shard2, "layers.2.ffn.w1": shard2,
                  "layers.14.engram.embed.weight": shard2, "layers.14.engram.embed.scale": shard2}  # fmt: skip
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tmp_path, {1: (w1, s1), 14: (w14, s14)}


CONFIGS = [
    TableConfig(),
    TableConfig(num_threads=1, readahead_max_rows=0),
    TableConfig(num_threads=3, dedup=False),
    TableConfig(num_threads=8, readahead_max_rows=10**6),
    TableConfig(num_threads=4, readahead_max_rows=0, random_access=False),
    TableConfig(num_threads=2, resident_scales=True),
    TableConfig(num_threads=2, resident_scales=True, readahead_max_rows=0),
]


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: f"t{c.num_threads}-d{int(c.dedup)}-r{c.readahead_max_rows}-s{int(c.resident_scales)}",
)
def test_gather_matches_arrays(single, config) -> None:
    path, w, s = single
    rng = np.random.default_rng(3)
    with EngramTable.open(path, "layers.1.engram.embed", rows=3000, head_dim=256, config=config) as table:
        assert (table.rows, table.head_dim, table.scale_cols) == (3000, 256, 8)
        for shape in [(1,), (24,), (7, 24), (8192, 2), (40000,)]:
            ids = rng.integers(0, 3000, size=shape)
            rows, scales = table.gather(ids)
            assert rows.shape == (*shape, D) and scales.shape == (*shape, S)
            np.testing.assert_array_equal(rows, w[ids])
            np.testing.assert_array_equal(scales, s[ids])
            unique = np.unique(ids).size
            assert table.last_unique_rows == (unique if config.dedup else ids.size)
        # Heavy duplication, both below and above the parallel-dedup threshold.
        for n in (100, 20000):
            ids = rng.choice(np.array([0, 2999, 17, 1500]), size=n)
            rows, scales = table.gather(ids)
            np.testing.assert_array_equal(rows, w[ids])
            np.testing.assert_array_equal(scales, s[ids])
        # Empty.
        rows, scales = table.gather(np.zeros(0, np.int64))
        assert rows.shape == (0, D) and scales.shape == (0, S)


def test_dedup_survives_adversarial_hash_collisions(single) -> None:
    path, w, s = single
    # Ids that share their top hash bits would all land in one dedup partition.
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 3000, size=30000)
    with EngramTable.open(path, "layers.1.engram.embed", config=TableConfig(num_threads=16)) as table:
        rows, scales = table.gather(ids)
    np.testing.assert_array_equal(rows, w[ids])
    np.testing.assert_array_equal(scales, s[ids])


def test_gather_into_caller_buffers_numpy_and_torch(single) -> None:
    path, w, s = single
    torch = pytest.importorskip("torch")
    ids = np.array([[5, 6, 5], [2999, 0, 1]])
    with EngramTable.open(path, "layers.1.engram.embed") as table:
        out_r, out_s = np.empty((2, 3, D), np.uint8), np.empty((6, S), np.uint8)
        got_r, got_s = table.gather(ids, out_r, out_s)
        assert got_r is out_r and got_s is out_s
        np.testing.assert_array_equal(out_r, w[ids])
        np.testing.assert_array_equal(out_s.reshape(2, 3, S), s[ids])
        # torch CPU tensors through DLPack, fp8 dtypes included (pinned memory needs CUDA; same path).
        tr = torch.empty((6, D), dtype=torch.float8_e4m3fn)
        ts = torch.empty((6, S), dtype=torch.uint8)
        table.gather(torch.from_numpy(ids), tr, ts)
        np.testing.assert_array_equal(tr.view(torch.uint8).numpy(), w[ids.ravel()])
        np.testing.assert_array_equal(ts.numpy(), s[ids.ravel()])
        # Wrong buffers are refused with the argument's name.
        with pytest.raises(ValueError, match="out_rows must hold 6 rows of 256 bytes"):
            table.gather(ids, np.empty((6, 128), np.uint8), out_s)
        with pytest.raises(TypeError, match="out_scales must have a 1-byte dtype"):
            table.gather(ids, out_r, np.empty((6, S), np.float32))
        with pytest.raises(ValueError, match="out_rows must be C-contiguous"):
            table.gather(ids, np.empty((6, 2 * D), np.uint8)[:, ::2], out_s)
        ro = np.empty((6, D), np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="out_rows is read-only"):
            table.gather(ids, ro, out_s)
        with pytest.raises(TypeError, match="row_ids must be integers"):
            table.gather(np.array([1.0, 2.0]))


def test_out_of_range_ids_raise_and_leave_outputs_untouched(single) -> None:
    path, w, s = single
    with EngramTable.open(path, "layers.1.engram.embed") as table:
        for bad in ([0, 3000], [-1, 5], [2**40]):
            out_r = np.full((len(bad), D), 7, np.uint8)
            out_s = np.full((len(bad), S), 7, np.uint8)
            with pytest.raises(IndexError, match=f"row id {[b for b in bad if not 0 <= b < 3000][0]} at flat index"):
                table.gather(bad, out_r, out_s)
            assert (out_r == 7).all() and (out_s == 7).all()
            with pytest.raises(IndexError):
                table.gather_async(bad)
            with pytest.raises(IndexError):
                table.prefetch(bad)
            with pytest.raises(IndexError):
                table.prefetch(bad, wait=True)


def test_invalid_ids_give_zero_rows_when_asked(single) -> None:
    """invalid="zero": ids outside the table (vLLM's -1 for dead tokens, garbage) give zero bytes, like vLLM's
    own Engram lookup; the valid ids around them are read as usual, sync and async, deduplicated or not."""
    path, w, s = single
    rng = np.random.default_rng(3)
    for config in (TableConfig(), TableConfig(num_threads=4, readahead_max_rows=0), TableConfig(dedup=False)):
        with EngramTable.open(path, "layers.1.engram.embed", config=config) as table:
            for n in (7, 5000):
                ids = rng.integers(0, 3000, size=n)
                bad = rng.random(n) < 0.3
                ids[bad] = rng.choice([-1, -7, 3000, 2**40], size=int(bad.sum()))
                want_r, want_s = w[np.where(bad, 0, ids)], s[np.where(bad, 0, ids)]
                want_r[bad], want_s[bad] = 0, 0
                out_r = np.full((n, D), 7, np.uint8)
                out_s = np.full((n, S), 7, np.uint8)
                table.gather(ids, out_r, out_s, invalid="zero")
                np.testing.assert_array_equal(out_r, want_r)
                np.testing.assert_array_equal(out_s, want_s)
                rows, scales = table.gather_async(ids, invalid="zero").wait()
                np.testing.assert_array_equal(rows, want_r)
                np.testing.assert_array_equal(scales, want_s)
            with pytest.raises(ValueError, match="invalid must be 'raise' or 'zero'"):
                table.gather([1], invalid="clip")  # type: ignore[arg-type]


def test_table_tensor_names() -> None:
    from engram_mmap import table_prefix, table_tensor_layer

    assert table_prefix(14) == "layers.14.engram.embed"
    assert table_tensor_layer("layers.14.engram.embed.weight") == 14
    assert table_tensor_layer("model.layers.1.engram.embed.scale") == 1
    for other in ("layers.1.engram.wkv.weight", "layers.1.engram.embed.weight_scale_inv", "embed.weight",
                  "mtp.0.engram.embed.weight"):  # fmt: skip
        assert table_tensor_layer(other) is None


def test_multi_shard_index(multi_shard) -> None:
    folder, arrays = multi_shard
    text = {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
            "engram_vocab_size": 10, "engram_compressed_vocab_size": 9, "engram_pad_token_id": 0}  # fmt: skip
    rng = np.random.default_rng(5)
    for source in (folder, folder / "model.safetensors.index.json"):
        for layer, (w, s) in arrays.items():
            with EngramTable.open(source, f"layers.{layer}.engram.embed") as table:
                assert table.rows == w.shape[0]
                ids = rng.integers(0, table.rows, size=(300, 24))
                rows, scales = table.gather(ids)
                np.testing.assert_array_equal(rows, w[ids])
                np.testing.assert_array_equal(scales, s[ids])
    assert os.path.basename(EngramTable.open(folder, "layers.1.engram.embed").scale.path).startswith("model-00002")
    # open_layer checks the rows the hash geometry implies: here they differ from the synthetic table.
    cfg = EngramConfig.from_hf_config({"text_config": text})
    with pytest.raises(EngramFormatError, match=f"has 1500 rows, expected {cfg.table_rows(1)}"):
        EngramTable.open_layer(folder, cfg, 1)


def test_async_gather_and_prefetch(single) -> None:
    path, w, s = single
    rng = np.random.default_rng(6)
    with EngramTable.open(path, "layers.1.engram.embed", config=TableConfig(num_threads=4)) as table:
        batches = [rng.integers(0, 3000, size=(int(n), 24)) for n in (1, 500, 8192, 3)]
        handles = [table.gather_async(ids) for ids in batches]
        prefetch = table.prefetch(batches[2])
        for ids, handle in zip(batches, handles, strict=True):
            rows, scales = handle.wait()
            assert handle.done()
            np.testing.assert_array_equal(rows, w[ids])
            np.testing.assert_array_equal(scales, s[ids])
            assert handle.unique_rows == np.unique(ids).size
        prefetch.wait()
        assert prefetch.done()
        # Dropping handles without waiting is safe: the gather's buffers stay alive until it ends.
        for _ in range(20):
            table.gather_async(rng.integers(0, 3000, size=5000))
            table.prefetch(rng.integers(0, 3000, size=5000))
        gc.collect()
        # Pending work is finished by close().
        pending = [table.gather_async(ids) for ids in batches]
    assert table.closed
    for ids, handle in zip(batches, pending, strict=True):
        rows, _ = handle.wait()
        np.testing.assert_array_equal(rows, w[ids])
    with pytest.raises(RuntimeError, match="closed"):
        table.gather([1])
    with pytest.raises(RuntimeError, match="closed"):
        table.gather_async([1])
    table.close()  # idempotent


def test_real_v41_row_count_sparse(tmp_path) -> None:
    """A table with the real layer-1 row count (a ~101 GB sparse file): 64-bit offsets, the last row."""
    cfg = EngramConfig.from_hf_config({"text_config": {
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
        "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2}})  # fmt: skip
    rows = cfg.table_rows(1)
    path = tmp_path / "model.safetensors"
    write_v41_engram_shard(path, {1: rows}, fill="sparse")
    with EngramTable.open_layer(path, cfg, 1) as table:
        last = [rows - 1, rows - 2, 0]
        marker_w = np.arange(3 * D, dtype=np.uint32).astype(np.uint8).reshape(3, D)
        marker_s = np.arange(3 * S, dtype=np.uint8).reshape(3, S) + 1
        with open(path, "r+b") as f:
            for i, r in enumerate(last):
                f.seek(table.weight.offset + r * D)
                f.write(marker_w[i].tobytes())
                f.seek(table.scale.offset + r * S)
                f.write(marker_s[i].tobytes())
        rows_out, scales_out = table.gather(last + [rows // 2])
        np.testing.assert_array_equal(rows_out[:3], marker_w)
        np.testing.assert_array_equal(scales_out[:3], marker_s)
        assert not rows_out[3].any() and not scales_out[3].any()  # a hole reads as zeros
        with pytest.raises(IndexError):
            table.gather([rows])


# --------------------------------------------------------------------------------- bad files


def _open_single(path, **kw):
    return EngramTable.open(path, "layers.1.engram.embed", **kw)


def test_missing_files_and_tensors(multi_shard, tmp_path) -> None:
    folder, _ = multi_shard
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        EngramTable.open(tmp_path / "nope.safetensors", "layers.1.engram.embed")
    with pytest.raises(EngramFormatError, match="'layers.3.engram.embed.weight' is not in the weight_map"):
        EngramTable.open(folder, "layers.3.engram.embed")
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors: shard of tensor 'layers.1.engram"):
        EngramTable.open(folder, "layers.1.engram.embed")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json"):
        EngramTable.open(empty, "layers.1.engram.embed")


def test_tensor_absent_from_single_file(single) -> None:
    path, _, _ = single
    with pytest.raises(EngramFormatError, match=r"model.safetensors: no tensor 'layers.14.engram.embed.weight'"):
        EngramTable.open(path, "layers.14.engram.embed")


def test_truncated_file(single) -> None:
    path, _, _ = single
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(EngramFormatError, match=r"model.safetensors: layers.1.engram.embed.scale: .*truncated"):
        _open_single(path)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(EngramFormatError, match="too short"):
        _open_single(path)


def test_file_shrinking_after_open_raises_instead_of_sigbus(single) -> None:
    path, w, _ = single
    with _open_single(path) as table:
        table.gather([0, 2999])
        with open(path, "r+b") as f:
            f.truncate(table.scale.offset)
        with pytest.raises(RuntimeError, match="shrank"):
            table.gather([0])


@pytest.mark.parametrize(
    ("wdtype", "wshape", "sdtype", "sshape", "message"),
    [
        ("BF16", (100, 128), "F8_E8M0", (100, 8), r"'layers.1.engram.embed.weight' has dtype BF16, expected F8_E4M3 or U8"),  # noqa: E501
        ("F8_E5M2", (100, 256), "F8_E8M0", (100, 8), "has dtype F8_E5M2"),
        ("F8_E4M3", (100, 256), "F16", (100, 4), r"'layers.1.engram.embed.scale' has dtype F16, expected F8_E8M0 or U8"),  # noqa: E501
        ("F8_E4M3", (100, 256), "F8_E8M0", (100, 4), r"'layers.1.engram.embed.scale' has shape \(100, 4\), expected \(100, 8\)"),  # noqa: E501
        ("F8_E4M3", (100, 256), "F8_E8M0", (99, 8), r"has shape \(99, 8\), expected \(100, 8\)"),
        ("F8_E4M3", (25600,), "F8_E8M0", (100, 8), "expected 2-D"),
        ("F8_E4M3", (100, 100), "F8_E8M0", (100, 8), "not a positive multiple of 32"),
        ("U8", (100, 256), "U8", (100, 8), None),
    ],
)  # fmt: skip
def test_wrong_dtype_or_shape(tmp_path, wdtype, wshape, sdtype, sshape, message) -> None:
    from engram_mmap.safetensors_header import DTYPE_BYTES

    path = tmp_path / "t.safetensors"
    wbytes = np.zeros(int(np.prod(wshape)) * DTYPE_BYTES[wdtype], np.uint8)
    sbytes = np.zeros(int(np.prod(sshape)) * DTYPE_BYTES[sdtype], np.uint8)
    write_safetensors(path, {"layers.1.engram.embed.weight": (wdtype, wshape, wbytes),
                             "layers.1.engram.embed.scale": (sdtype, sshape, sbytes)})  # fmt: skip
    if message is None:
        with _open_single(path, rows=100, head_dim=256) as table:
            assert table.gather([99])[0].shape == (1, 256)
        with pytest.raises(EngramFormatError, match="has 100 rows, expected 101"):
            _open_single(path, rows=101)
        with pytest.raises(EngramFormatError, match="has 256 columns, expected 512"):
            _open_single(path, head_dim=512)
    else:
        with pytest.raises(EngramFormatError, match=message):
            _open_single(path)


def _raw_file(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length))
        f.write(header)
        f.write(data)


@pytest.mark.parametrize(
    ("header", "length", "message"),
    [
        (b"{not json", None, "header is not valid JSON"),
        (b"[1, 2]", None, "not a JSON object"),
        (b"{}", 10**12, "exceeds"),
        (b"{}", 4000, "truncated inside the header .* runs past the end"),
        (b"{}", 0, "header length field is 0"),
        (b'{"a": 3}', None, "a: header entry is not an object"),
        (b'{"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 1]}}', None, "a: dtype must be a string"),
        (b'{"a": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}', None, "a: unknown dtype 'Q8'"),
        (b'{"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}', None, r"a: negative dimension in shape \[-1\]"),  # noqa: E501
        (b'{"a": {"dtype": "U8", "shape": ["4"], "data_offsets": [0, 4]}}', None, "a: shape must be a list of ints"),
        (b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 3]}}', None, r"a: data_offsets \[0, 3\] hold 3 bytes, but U8 \[4\] needs 4"),  # noqa: E501
        (b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0]}}', None, "data_offsets must be"),
        (b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [3, 2]}}', None, r"a: invalid data_offsets \[3, 2\]"),
        (b'{"a": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}', None, r"bad.safetensors: a: data ends at byte \d+ but the file has \d+ bytes"),  # noqa: E501
        (b'{"__metadata__": [1]}', None, "__metadata__ is not an object"),
    ],
)  # fmt: skip
def test_malformed_headers(tmp_path, header, length, message) -> None:
    from engram_mmap.safetensors_header import read_header

    path = tmp_path / "bad.safetensors"
    _raw_file(path, header, b"\0" * 16, length)
    with pytest.raises(EngramFormatError, match=message):
        read_header(path)


def test_reads_files_written_by_the_safetensors_library(tmp_path) -> None:
    """The header parser against the reference writer (torch fp8 dtypes), not only our own writer."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    w, s = _table_arrays(777, 8)
    tensors = {
        "layers.0.other": torch.arange(33, dtype=torch.bfloat16),
        "layers.1.engram.embed.weight": torch.from_numpy(w).view(torch.float8_e4m3fn),
        "layers.1.engram.embed.scale": torch.from_numpy(s).view(torch.float8_e8m0fnu),
    }
    path = tmp_path / "ref.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    ids = np.random.default_rng(9).integers(0, 777, size=(50, 24))
    with _open_single(path, rows=777, head_dim=256) as table:
        assert (table.weight.dtype, table.scale.dtype) == ("F8_E4M3", "F8_E8M0")
        rows, scales = table.gather(ids)
    np.testing.assert_array_equal(rows, w[ids])
    np.testing.assert_array_equal(scales, s[ids])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        TableConfig(num_threads=0)
    with pytest.raises(ValueError, match="readahead_max_rows"):
        TableConfig(readahead_max_rows=-1)
