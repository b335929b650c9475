"""Belady's MIN against brute force on tiny cases, and the access-stream plumbing."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from expert_cache import SyntheticTraceConfig, belady_hit_rate, belady_hits, generate, static_oracle_hit_rate
from expert_cache.sim import access_stream


def brute_force(seq: tuple[int, ...], cap: int, bypass: bool) -> int:
    """Most hits over every admit/evict decision sequence (exhaustive with memo on the cache state)."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        x = seq[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = []
        if bypass or cap == 0:
            options.append(best(i + 1, cache))
        if cap > 0:
            if len(cache) < cap:
                options.append(best(i + 1, cache | {x}))
            else:
                options.extend(best(i + 1, (cache - {v}) | {x}) for v in cache)
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("bypass", [True, False])
def test_belady_equals_brute_force(bypass: bool) -> None:
    rng = np.random.default_rng(1)
    for _ in range(250):
        n = int(rng.integers(1, 13))
        alphabet = int(rng.integers(1, 6))
        cap = int(rng.integers(0, 4))
        seq = tuple(rng.integers(0, alphabet, n).tolist())
        assert belady_hits(seq, cap, bypass) == brute_force(seq, cap, bypass), (seq, cap, bypass)


def test_belady_hand_cases() -> None:
    # Classic: capacity 2 on a b c a b: MIN keeps a on c (a is used before b? no: a at 3, b at 4 -> evict b)
    assert belady_hits([0, 1, 2, 0, 1], 2, bypass=False) == 1
    assert belady_hits([0, 1, 2, 0, 1], 2, bypass=True) == 2  # bypass c: a and b both hit
    assert belady_hits([5, 5, 5], 1) == 2
    assert belady_hits([], 3) == 0 and belady_hits([1, 2], 0) == 0
    with pytest.raises(ValueError, match="num_slots"):
        belady_hits([1], -1)


def test_bypass_never_worse_and_bounds() -> None:
    tr = generate(SyntheticTraceConfig(num_layers=4, num_experts=32, top_k=3, decode_steps=300, seed=2))
    for n in (4, 16, 64):
        a = belady_hit_rate(tr, n, bypass=True)
        b = belady_hit_rate(tr, n, bypass=False)
        s = static_oracle_hit_rate(tr, n)
        assert a >= b - 1e-12 and a >= s - 1e-12 and 0 <= s <= 1
    assert belady_hit_rate(tr, 128) == pytest.approx(1 - len(np.unique(access_stream(tr))) / access_stream(tr).size)


def test_access_stream_is_distinct_keys_of_decode_steps() -> None:
    tr = generate(
        SyntheticTraceConfig(
            num_layers=2, num_experts=8, top_k=2, decode_steps=20, streams=3, mean_prompt_tokens=600, seed=0
        )
    )
    keys = access_stream(tr, prefill_tokens=512)
    n_decode_rows = int(tr.rows_per_step[tr.tokens_per_step <= 512].sum())
    assert keys.size <= n_decode_rows * 2 * 2 and keys.size > 0
    off = 0
    for s in range(tr.num_steps):  # rebuild by hand
        r = int(tr.rows_per_step[s])
        if tr.tokens_per_step[s] <= 512 and r:
            ids = tr.ids[off : off + r]
            want = np.unique(np.concatenate([ids[:, 0, :].ravel(), ids[:, 1, :].ravel() + 8]))
            np.testing.assert_array_equal(keys[: want.size], want)
            keys = keys[want.size :]
        off += r
    assert keys.size == 0


def test_hit_mask_and_a_window_of_steps() -> None:
    """The per-access mask sums to the hit count, and a rate from step s on counts MIN's hits of those steps' own
    accesses (MIN still sees the whole stream): on a cold start it is higher than the whole stream's."""
    from expert_cache import belady_hit_mask

    assert belady_hit_mask([0, 1, 2, 0, 1], 2, bypass=True).tolist() == [False, False, False, True, True]
    rng = np.random.default_rng(3)
    for _ in range(50):
        seq = rng.integers(0, 6, int(rng.integers(0, 30)))
        cap = int(rng.integers(0, 4))
        assert int(belady_hit_mask(seq, cap).sum()) == belady_hits(seq, cap)
    tr = generate(SyntheticTraceConfig(num_layers=2, num_experts=16, top_k=2, decode_steps=40, seed=4))
    keys = access_stream(tr)
    mask = belady_hit_mask(keys, 8)
    assert belady_hit_rate(tr, 8, from_step=0) == pytest.approx(mask.mean())
    # the trace step of each decode access, rebuilt by hand (distinct keys of each decode step's rows)
    steps_l, off = [], 0
    for s in range(tr.num_steps):
        r = int(tr.rows_per_step[s])
        if r and tr.tokens_per_step[s] <= 512:
            ids = tr.ids[off : off + r]
            steps_l.append(np.full(np.unique(np.concatenate([ids[:, 0].ravel(), ids[:, 1].ravel() + 16])).size, s))
        off += r
    steps = np.concatenate(steps_l)
    assert steps.size == keys.size
    for start in (1, 10, 39):
        assert belady_hit_rate(tr, 8, from_step=start) == pytest.approx(mask[steps >= start].mean())
    assert belady_hit_rate(tr, 8, from_step=10) > belady_hit_rate(tr, 8)
    assert belady_hit_rate(tr, 8, from_step=tr.num_steps) == 0.0
