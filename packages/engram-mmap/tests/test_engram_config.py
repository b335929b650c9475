"""EngramConfig: the V4.1 geometry checksum, primes, multipliers, config parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engram_mmap import EngramConfig
from engram_mmap.config import is_prime, next_prime

# numpy default_rng(10007 * layer).integers(0, (int64max // 99092) // 2, 4) * 2 + 1, pinned: numpy does
# not promise its Generator streams across versions, and a change would silently rehash the table.
V41_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


def _sieve_primes(lo: int, hi: int) -> list[int]:
    """Primes in [lo, hi) by trial division with a plain sieve of small primes (independent of is_prime)."""
    limit = int(hi**0.5) + 1
    small = np.ones(limit + 1, bool)
    small[:2] = False
    for i in range(2, int(limit**0.5) + 1):
        if small[i]:
            small[i * i :: i] = False
    ps = np.flatnonzero(small)
    return [n for n in range(max(lo, 2), hi) if all(n % p for p in ps if p * p <= n)]


def test_v41_table_rows_match_engram_num_embeddings(v41_text: dict) -> None:
    cfg = EngramConfig.from_hf_config({"text_config": v41_text})
    assert [cfg.table_rows(layer) for layer in (1, 14)] == [384006168, 384016682]
    assert cfg.n_cols == 24 and cfg.scale_cols == 8 and cfg.head_dim == 256
    # Without the stated rows the geometry is still computed, and gives the same numbers.
    text = {k: v for k, v in v41_text.items() if k != "engram_num_embeddings"}
    cfg2 = EngramConfig.from_hf_config({"text_config": text})
    assert [cfg2.table_rows(layer) for layer in (1, 14)] == [384006168, 384016682]


def test_v41_primes_are_the_48_consecutive_primes_above_vocab(v41_text: dict) -> None:
    cfg = EngramConfig.from_hf_config({"text_config": v41_text})
    drawn = np.concatenate([cfg.primes(1).ravel(), cfg.primes(14).ravel()]).tolist()
    expected = _sieve_primes(16_000_000, 16_001_000)[:48]
    assert drawn == expected
    for layer in (1, 14):
        primes, offsets = cfg.primes(layer).ravel(), cfg.offsets(layer).ravel()
        assert offsets[0] == 0
        assert (offsets[1:] == offsets[:-1] + primes[:-1]).all()
        assert offsets[-1] + primes[-1] == cfg.table_rows(layer)


def test_v41_multipliers_pinned(v41_text: dict) -> None:
    cfg = EngramConfig.from_hf_config({"text_config": v41_text})
    bound = (np.iinfo(np.int64).max // 99092) // 2
    for layer, expected in V41_MULTIPLIERS.items():
        got = cfg.multipliers(layer)
        assert got.dtype == np.int64 and got.tolist() == expected
        assert (got % 2 == 1).all() and (got <= 2 * bound + 1).all()
        # The bound guarantees class * multiplier fits in int64.
        assert int(got.max()) * (99092 - 1) < 2**63


def test_prime_order_resets_per_order_and_skips_taken() -> None:
    # Different per-order vocab sizes: each order restarts its search at vocab - 1, skipping taken primes.
    cfg = EngramConfig(
        layer_ids=(3, 0), max_ngram_size=3, n_heads=2, vocab_sizes=(10, 12), compressed_vocab_size=5, pad_token_id=0
    )
    # layer 3: order 2 from 9: 11, 13; order 3 from 11: 17, 19 (13 taken)
    # layer 0: order 2 from 9: 23, 29 (11, 13, 17, 19 taken); order 3 from 11: 31, 37
    assert cfg.primes(3).tolist() == [[11, 13], [17, 19]]
    assert cfg.primes(0).tolist() == [[23, 29], [31, 37]]
    assert cfg.table_rows(3) == 60 and cfg.table_rows(0) == 120


def test_is_prime_against_sieve_and_known_values() -> None:
    limit = 20000
    expected = set(_sieve_primes(0, limit))
    assert {n for n in range(limit) if is_prime(n)} == expected
    # Strong pseudoprimes to several small bases and big known primes.
    for composite in (561, 3215031751, 2152302898747, 3474749660383, 341550071728321, 3825123056546413051):
        assert not is_prime(composite)
    for prime in (2**31 - 1, 2**61 - 1, 18446744073709551557, 16000057):
        assert is_prime(prime)
    assert next_prime(16000056) == 16000057
    assert next_prime(16000056, {16000057}) == 16000079


def test_from_hf_config_sources(tmp_path, v41_text: dict) -> None:
    flat = dict(v41_text)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": v41_text}))
    a = EngramConfig.from_hf_config(tmp_path)
    b = EngramConfig.from_hf_config(tmp_path / "config.json")
    c = EngramConfig.from_hf_config(flat)
    assert a == b == c
    assert a.layer_ids == (1, 14) and a.vocab_sizes == (16000000,) * 3 and a.pad_token_id == 2 and a.seed == 0
    # A per-order list and the engram_pad_id spelling.
    text = {k: v for k, v in v41_text.items() if k not in ("engram_num_embeddings", "engram_pad_token_id")}
    text.update(engram_vocab_size=[100, 200, 300], engram_pad_id=7)
    d = EngramConfig.from_hf_config({"text_config": text})
    assert d.vocab_sizes == (100, 200, 300) and d.pad_token_id == 7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engram_n_heads": None}, "missing field 'engram_n_heads'"),
        ({"engram_layer_ids": "1,14"}, "'engram_layer_ids' must be a list"),
        ({"engram_max_ngram_size": 4.0}, "'engram_max_ngram_size' must be an int"),
        ({"engram_n_heads": True}, "'engram_n_heads' must be an int"),
        ({"engram_num_embeddings": [384006168, 384016683]}, "layer 14 states 384016683 rows"),
        ({"engram_num_embeddings": [384006168]}, "one per Engram layer"),
        ({"engram_vocab_size": [16000000, 16000000]}, "one per n-gram order"),
        ({"engram_max_ngram_size": 1, "engram_vocab_size": [5]}, "max_ngram_size: must be >= 2"),
        ({"engram_head_dim": 100}, "head_dim: must be a positive multiple"),
        ({"engram_layer_ids": [1, 1]}, "layer_ids: must be distinct"),
    ],
)
def test_from_hf_config_errors_name_the_field(change: dict, message: str, v41_text: dict) -> None:
    text = dict(v41_text)
    for key, value in change.items():
        if value is None:
            del text[key]
        else:
            text[key] = value
    with pytest.raises(ValueError, match=message):
        EngramConfig.from_hf_config({"text_config": text})


def test_config_is_frozen_and_layer_checked(v41_text: dict) -> None:
    cfg = EngramConfig.from_hf_config(v41_text)
    with pytest.raises(AttributeError):
        cfg.n_heads = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="layer 2 is not an Engram layer"):
        cfg.table_rows(2)
