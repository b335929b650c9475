"""The trace format (round trip, validation naming file and array), the recorder, the synthetic generator."""

from __future__ import annotations

import numpy as np
import pytest

from expert_cache import SyntheticTraceConfig, Trace, TraceRecorder, generate, load_trace, static_oracle_hit_rate
from expert_cache.sim import access_stream


def tiny(**kw: object) -> SyntheticTraceConfig:
    base: dict[str, object] = dict(
        num_layers=3,
        num_experts=32,
        top_k=4,
        decode_steps=200,
        mean_decode_tokens=50,
        mean_prompt_tokens=700,
        prefill_rows=8,
    )
    base.update(kw)
    return SyntheticTraceConfig(**base)  # type: ignore[arg-type]


def test_round_trip(tmp_path) -> None:
    tr = generate(tiny(streams=2))
    p = tmp_path / "t.npz"
    tr.save(p)
    back = load_trace(p)
    np.testing.assert_array_equal(back.ids, tr.ids)
    np.testing.assert_array_equal(back.rows_per_step, tr.rows_per_step)
    np.testing.assert_array_equal(back.tokens_per_step, tr.tokens_per_step)
    assert back.num_experts == 32 and back.meta["source"] == "synthetic"
    assert back.meta["generator"]["streams"] == 2
    assert (back.num_layers, back.top_k) == (3, 4)
    assert back.ids.dtype == np.int16


def test_generator_shape_and_prefill_steps() -> None:
    cfg = tiny(streams=3)
    tr = generate(cfg)
    decode = (tr.tokens_per_step == 3) & (tr.rows_per_step == 3)
    assert int(decode.sum()) >= 200  # 200 decode steps (+ maybe a 3-token prompt)
    big = tr.tokens_per_step > 512
    assert big.any() and np.all(tr.rows_per_step[big] == 8)  # long prompts: a sample of 8 rows
    small = ~decode & ~big
    assert small.any() and np.all(tr.rows_per_step[small] == tr.tokens_per_step[small])  # short prompts: all rows
    assert tr.ids.min() >= 0 and tr.ids.max() < 32
    s = np.sort(tr.ids, axis=2)
    assert not np.any(s[:, :, 1:] == s[:, :, :-1])  # distinct experts per token and layer
    np.testing.assert_array_equal(generate(cfg).ids, tr.ids)  # deterministic
    assert not np.array_equal(generate(tiny(streams=3, seed=1)).ids, tr.ids)


def test_generator_knobs_move_the_statistics() -> None:
    """Skew raises what a fixed set can hit; locality raises consecutive-token overlap."""
    lo = static_oracle_hit_rate(generate(tiny(zipf_request=0.2, decode_steps=300)), 12)
    hi = static_oracle_hit_rate(generate(tiny(zipf_request=1.5, decode_steps=300)), 12)
    assert hi > lo + 0.1

    def overlap(tr: object) -> float:
        ids = tr.ids[tr.rows_per_step[0] :]  # type: ignore[attr-defined]
        same = [len(set(ids[i, layer]) & set(ids[i + 1, layer])) for i in range(150) for layer in range(3)]
        return float(np.mean(same)) / 4

    a = overlap(generate(tiny(locality=0.0, mean_decode_tokens=1e6)))
    b = overlap(generate(tiny(locality=3.0, mean_decode_tokens=1e6)))
    assert b > a + 0.2


def test_drift_changes_the_hot_set() -> None:
    base = tiny(decode_steps=400, mean_decode_tokens=1e6, zipf_request=1.5)
    still = generate(base)
    moving = generate(tiny(decode_steps=400, mean_decode_tokens=1e6, zipf_request=1.5, drift=50.0))
    n = access_stream(still).size
    assert static_oracle_hit_rate(moving, 12) < static_oracle_hit_rate(still, 12) - 0.03
    assert n > 0


def test_recorder_and_row_sampling() -> None:
    rec = TraceRecorder(2, 10, 2, max_rows_per_step=4, meta={"model": "x"})
    rec.record_step(1, np.array([[[0, 1], [2, 3]]]))
    rec.record_step(1000, np.tile(np.array([[[4, 5], [6, 7]]]), (100, 1, 1)))
    rec.record_step(600, None)
    tr = rec.trace()
    assert tr.rows_per_step.tolist() == [1, 4, 0] and tr.tokens_per_step.tolist() == [1, 1000, 600]
    assert tr.meta == {"source": "server", "model": "x"}
    with pytest.raises(ValueError, match=r"ids: expected \[rows, 2, 2\]"):
        rec.record_step(1, np.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match="ids: 2 rows for a step of 1 tokens"):
        rec.record_step(1, np.zeros((2, 2, 2)))


def _write(path, **arrays: object) -> None:
    good: dict[str, object] = dict(
        format=np.array("expert-cache-trace"),
        version=np.int64(1),
        num_experts=np.int64(8),
        ids=np.array([[[0, 1]], [[2, 3]]], np.int16),
        rows_per_step=np.array([1, 1], np.int32),
        tokens_per_step=np.array([1, 1], np.int32),
        meta_json=np.array("{}"),
    )
    good.update(arrays)
    np.savez(path, **{k: v for k, v in good.items() if v is not None})


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        (dict(ids=None), r"missing array\(s\) \['ids'\]"),
        (dict(format=np.array("other")), "format is 'other'"),
        (dict(version=np.int64(9)), "version 9 is not supported"),
        (dict(ids=np.array([[[0, 9]], [[2, 3]]], np.int16)), r"ids must be in \[0, 8\)"),
        (dict(ids=np.array([[[1, 1]], [[2, 3]]], np.int16)), "ids row 0 layer 0 routes the same expert twice"),
        (dict(rows_per_step=np.array([1, 2], np.int32)), r"rows_per_step\[1\] = 2 exceeds tokens_per_step\[1\] = 1"),
        (dict(rows_per_step=np.array([1, 0], np.int32)), "rows_per_step sums to 1, ids has 2 rows"),
        (dict(tokens_per_step=np.array([1], np.int32)), "must be 1-D of equal length"),
        (dict(ids=np.zeros((2, 2), np.int16)), r"ids must be \[N, L, K\]"),
        (dict(ids=np.zeros((2, 1, 2), np.float32)), "ids must be integers"),
    ],
)
def test_load_errors_name_file_and_array(tmp_path, change: dict[str, object], msg: str) -> None:
    p = tmp_path / "bad.npz"
    _write(p, **change)
    with pytest.raises(ValueError, match=msg) as ei:
        load_trace(p)
    assert str(p) in str(ei.value)


def test_load_rejects_a_non_npz(tmp_path) -> None:
    p = tmp_path / "x.npz"
    p.write_text("hello")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_trace(p)


def test_generator_config_errors() -> None:
    with pytest.raises(ValueError, match="top_k: must be <= num_experts"):
        SyntheticTraceConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="streams: must be an int >= 1"):
        SyntheticTraceConfig(streams=0)
    with pytest.raises(ValueError, match="prompt_match"):
        SyntheticTraceConfig(prompt_match=1.5)
    with pytest.raises(ValueError, match="zipf_request"):
        SyntheticTraceConfig(zipf_request=-1.0)


def test_trace_create_direct() -> None:
    t = Trace.create(np.zeros((0, 2, 2), np.int16), np.zeros(3, np.int32), np.array([600, 0, 700], np.int32), 4)
    assert t.num_steps == 3 and t.step_ids(1).shape == (0, 2, 2)


def test_repeated_experts_marks_rows_and_layers() -> None:
    from expert_cache import repeated_experts

    ids = np.array([[[0, 1], [2, 2]], [[3, 4], [5, 6]], [[7, 7], [1, 0]]])
    assert repeated_experts(ids).tolist() == [[False, True], [False, False], [True, False]]
    assert repeated_experts(np.zeros((4, 2, 1), np.int16)).tolist() == [[False, False]] * 4  # top-1: never twice
    with pytest.raises(ValueError, match=r"ids must be \[N, L, K\]"):
        repeated_experts(np.zeros((2, 2)))
