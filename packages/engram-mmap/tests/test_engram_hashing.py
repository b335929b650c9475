"""EngramHasher and build_token_map against slow, independent references written here."""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pytest

from engram_mmap import EngramConfig, EngramHasher, build_token_map

# ------------------------------------------------------------------------------ slow reference


def _ref_is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def _ref_geometry(layer_ids, max_ngram, n_heads, vocab_sizes, compressed, seed):
    """Primes / offsets / multipliers per layer, following the published recipe line by line."""
    taken: set[int] = set()
    geo = {}
    for layer in layer_ids:
        primes = []
        for n in range(2, max_ngram + 1):
            current = vocab_sizes[n - 2] - 1
            for _ in range(n_heads):
                candidate = current + 1
                while candidate in taken or not _ref_is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                primes.append(candidate)
                current = candidate
        offsets, total = [], 0
        for p in primes:
            offsets.append(total)
            total += p
        half = max(1, ((2**63 - 1) // compressed) // 2)
        rng = np.random.default_rng(seed + 10007 * layer)
        mult = [int(v) * 2 + 1 for v in rng.integers(low=0, high=half, size=(max_ngram,), dtype=np.int64)]
        geo[layer] = (primes, offsets, mult)
    return geo


def _ref_row_ids(tokens, live, token_map, pad_id, layer, cfg_args):
    """Plain Python loops over the whole sequence (positions from 0), Python ints throughout."""
    layer_ids, max_ngram, n_heads, vocab_sizes, compressed, seed = cfg_args
    primes, offsets, mult = _ref_geometry(layer_ids, max_ngram, n_heads, vocab_sizes, compressed, seed)[layer]
    pad = int(token_map[pad_id])
    out = []
    for t in range(len(tokens)):
        slot = []
        blocked = False
        for shift in range(max_ngram):
            if t - shift < 0 or not live[t - shift]:
                blocked = True
            slot.append(pad if blocked else int(token_map[tokens[t - shift]]))
        row = []
        rolling = slot[0] * mult[0]
        col = 0
        for n in range(2, max_ngram + 1):
            rolling ^= slot[n - 1] * mult[n - 1]
            for _ in range(n_heads):
                row.append(rolling % primes[col] + offsets[col])
                col += 1
        out.append(row)
    return np.array(out, dtype=np.int64).reshape(len(tokens), (max_ngram - 1) * n_heads)


SMALL = dict(layer_ids=(2, 5, 9), max_ngram_size=4, n_heads=3, vocab_sizes=(97, 131, 61), compressed_vocab_size=40,
             pad_token_id=3, seed=11)  # fmt: skip


def _small_cfg():
    cfg = EngramConfig(**SMALL)
    args = (cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads, cfg.vocab_sizes, cfg.compressed_vocab_size, cfg.seed)
    return cfg, args


@pytest.fixture(scope="module")
def small():
    cfg, args = _small_cfg()
    rng = np.random.default_rng(5)
    token_map = rng.integers(0, cfg.compressed_vocab_size, size=60)  # 60 raw ids -> 40 classes
    token_map[: cfg.compressed_vocab_size] = np.arange(cfg.compressed_vocab_size)
    return cfg, args, token_map, EngramHasher(cfg, token_map)


def test_geometry_matches_reference(small) -> None:
    cfg, args, _, _ = small
    ref = _ref_geometry(*args)
    for layer in cfg.layer_ids:
        primes, offsets, mult = ref[layer]
        assert cfg.primes(layer).ravel().tolist() == primes
        assert cfg.offsets(layer).ravel().tolist() == offsets
        assert cfg.multipliers(layer).tolist() == mult
        assert cfg.table_rows(layer) == sum(primes)


def test_row_ids_match_reference_random_tokens_and_masks(small) -> None:
    cfg, args, token_map, hasher = small
    rng = np.random.default_rng(0)
    for trial in range(6):
        length = int(rng.integers(1, 120))
        tokens = rng.integers(0, token_map.size, size=length)
        live = rng.random(length) > (0.0 if trial == 0 else 0.2)
        for layer in cfg.layer_ids:
            ref = _ref_row_ids(tokens, live, token_map, cfg.pad_token_id, layer, args)
            got = hasher.row_ids(tokens, layer, mask=None if trial == 0 else live)
            assert got.dtype == np.int64 and got.shape == (length, cfg.n_cols)
            np.testing.assert_array_equal(got, ref)
            assert (got >= 0).all() and (got < cfg.table_rows(layer)).all()
        all_layers = hasher.row_ids_all(tokens, mask=None if trial == 0 else live)
        assert all_layers.shape == (len(cfg.layer_ids), length, cfg.n_cols)
        for i, layer in enumerate(cfg.layer_ids):
            one = hasher.row_ids(tokens, layer, mask=None if trial == 0 else live)
            np.testing.assert_array_equal(all_layers[i], one)


def test_chunked_with_lookback_equals_whole(small) -> None:
    cfg, _, token_map, hasher = small
    rng = np.random.default_rng(1)
    length = 200
    tokens = rng.integers(0, token_map.size, size=length)
    live = rng.random(length) > 0.15
    layer = cfg.layer_ids[1]
    whole = hasher.row_ids(tokens, layer, mask=live)
    for _ in range(5):
        cuts = np.sort(rng.choice(np.arange(1, length), size=int(rng.integers(1, 30)), replace=False))
        bounds = [0, *cuts.tolist(), length]
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            # Give a random amount of history: all of it, exactly max_ngram-1, or less than that
            # only when the sequence start is that close (short lookback == sequence start).
            back = 0 if rng.random() < 0.5 else max(0, a - (cfg.max_ngram_size - 1))
            parts.append(
                hasher.row_ids(
                    tokens[a:b],
                    layer,
                    lookback=tokens[back:a] if a else None,
                    mask=live[a:b],
                    lookback_mask=live[back:a] if a else None,
                )
            )
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    # Decode: one token per call with lookback.
    steps = [
        hasher.row_ids(tokens[t : t + 1], layer, lookback=tokens[max(0, t - 3) : t], mask=live[t : t + 1],
                       lookback_mask=live[max(0, t - 3) : t])
        for t in range(length)
    ]  # fmt: skip
    np.testing.assert_array_equal(np.concatenate(steps), whole)


def test_padding_at_start_and_mask_semantics(small) -> None:
    cfg, args, token_map, hasher = small
    layer = cfg.layer_ids[0]
    tokens = np.array([7, 8, 9, 10, 11, 12, 13, 14])
    base = hasher.row_ids(tokens, layer)
    # The first position: every n-gram slot but the token itself is padding, i.e. the same rows as a
    # token preceded by three pad tokens.
    pad = cfg.pad_token_id
    with_pads = hasher.row_ids(np.array([pad, pad, pad, 7]), layer, mask=np.array([True] * 4))
    np.testing.assert_array_equal(base[0], with_pads[3])
    # A masked token at position 3 changes positions 3..6 (n-grams through it) and nothing else.
    live = np.ones(8, bool)
    live[3] = False
    masked = hasher.row_ids(tokens, layer, mask=live)
    np.testing.assert_array_equal(masked[:3], base[:3])
    np.testing.assert_array_equal(masked[7:], base[7:])
    assert (masked[3:7] != base[3:7]).any(axis=1).all()
    # The masked token's own rows are those of an all-pad n-gram.
    all_pad = hasher.row_ids(np.array([pad]), layer)
    np.testing.assert_array_equal(masked[3], all_pad[0])
    # Lookback longer than max_ngram-1 uses only its tail.
    a = hasher.row_ids(tokens[5:], layer, lookback=tokens[:5])
    b = hasher.row_ids(tokens[5:], layer, lookback=tokens[2:5])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, base[5:])


def test_v41_geometry_with_large_multipliers(v41_text: dict) -> None:
    cfg = EngramConfig.from_hf_config({"text_config": v41_text})
    hasher = EngramHasher(cfg)  # identity map: ids are compressed classes
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.compressed_vocab_size, size=64)
    tokens[:3] = cfg.compressed_vocab_size - 1  # the largest class times the largest multiplier
    live = rng.random(64) > 0.1
    args = (cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads, cfg.vocab_sizes, cfg.compressed_vocab_size, cfg.seed)
    token_map = np.arange(cfg.compressed_vocab_size)
    for layer in cfg.layer_ids:
        ref = _ref_row_ids(tokens, live, token_map, cfg.pad_token_id, layer, args)
        got = hasher.row_ids(tokens, layer, mask=live)
        np.testing.assert_array_equal(got, ref)
        assert (got >= 0).all() and (got < cfg.table_rows(layer)).all()


def test_row_ids_input_errors(small) -> None:
    cfg, _, token_map, hasher = small
    layer = cfg.layer_ids[0]
    with pytest.raises(ValueError, match="token id 60 is outside"):
        hasher.row_ids([1, 60], layer)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        hasher.row_ids([-1], layer)
    with pytest.raises(ValueError, match="1-D"):
        hasher.row_ids([[1, 2]], layer)
    with pytest.raises(ValueError, match="mask"):
        hasher.row_ids([1, 2], layer, mask=[1, 0])
    with pytest.raises(ValueError, match="not an Engram layer"):
        hasher.row_ids([1, 2], 3)
    with pytest.raises(ValueError, match="lookback_mask given without lookback"):
        hasher.row_ids([1, 2], layer, lookback_mask=np.array([True]))
    with pytest.raises(ValueError, match="classes must lie in"):
        EngramHasher(cfg, np.array([0, 1, cfg.compressed_vocab_size]))
    assert hasher.row_ids(np.zeros(0, np.int64), layer).shape == (0, cfg.n_cols)


def _random_batch(rng, token_map, cfg, requests: int, with_masks: bool):
    """A vLLM-like step: R requests, each a whole sequence of which the chunk is a suffix. Returns
    (sequences, live masks, chunk starts) per request."""
    seqs, lives, starts = [], [], []
    for _ in range(requests):
        length = int(rng.integers(0, 40))
        start = int(rng.integers(0, length + 1)) if rng.random() < 0.7 else 0
        seqs.append(rng.integers(0, token_map.size, size=length))
        lives.append(rng.random(length) > (0.2 if with_masks else -1.0))
        starts.append(start)
    return seqs, lives, starts


def _as_batch(seqs, lives, starts, k):
    """The flattened step, vLLM style: chunk tokens, query_start_loc, lookback [R, k] oldest first (-1 before
    the sequence start), their masks."""
    chunks = [s[a:] for s, a in zip(seqs, starts, strict=True)]
    qsl = np.concatenate([[0], np.cumsum([c.size for c in chunks])]).astype(np.int64)
    lookback = np.full((len(seqs), k), -1, np.int64)
    lookback_live = np.ones((len(seqs), k), bool)
    for r, (s, live, a) in enumerate(zip(seqs, lives, starts, strict=True)):
        n = min(k, a)
        if n:
            lookback[r, k - n :] = s[a - n : a]
            lookback_live[r, k - n :] = live[a - n : a]
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    mask = np.concatenate([live[a:] for live, a in zip(lives, starts, strict=True)]) if chunks else np.zeros(0, bool)
    return tokens, qsl, lookback, lookback_live, mask


def test_batch_of_requests_equals_the_reference_per_request(small) -> None:
    """row_ids_batch (a whole step at once) == the plain-Python reference on each whole sequence, restricted to
    the chunk, == row_ids_all per request with its lookback."""
    cfg, args, token_map, hasher = small
    k = cfg.max_ngram_size - 1
    rng = np.random.default_rng(7)
    for trial in range(8):
        with_masks = trial % 2 == 1
        seqs, lives, starts = _random_batch(rng, token_map, cfg, int(rng.integers(1, 9)), with_masks)
        tokens, qsl, lookback, lookback_live, mask = _as_batch(seqs, lives, starts, k)
        got = hasher.row_ids_batch(tokens, qsl, lookback=lookback, mask=mask if with_masks else None,
                                   lookback_mask=lookback_live if with_masks else None)  # fmt: skip
        assert got.dtype == np.int64 and got.shape == (tokens.size, len(cfg.layer_ids), cfg.n_cols)
        for r, (s, live, a) in enumerate(zip(seqs, lives, starts, strict=True)):
            mine = got[qsl[r] : qsl[r + 1]]
            for i, layer in enumerate(cfg.layer_ids):
                ref = _ref_row_ids(s, live, token_map, cfg.pad_token_id, layer, args)[a:]
                np.testing.assert_array_equal(mine[:, i], ref)
            per_request = hasher.row_ids_all(
                s[a:],
                lookback=s[max(0, a - k) : a] if a else None,
                mask=live[a:] if with_masks else None,
                lookback_mask=live[max(0, a - k) : a] if a and with_masks else None,
            )
            np.testing.assert_array_equal(mine.transpose(1, 0, 2), per_request)  # fmt: skip
    # Every request starting its sequence: no lookback at all.
    tokens = rng.integers(0, token_map.size, size=12)
    qsl = np.array([0, 5, 5, 12])
    got = hasher.row_ids_batch(tokens, qsl)
    np.testing.assert_array_equal(got[:5].transpose(1, 0, 2), hasher.row_ids_all(tokens[:5]))
    np.testing.assert_array_equal(got[5:].transpose(1, 0, 2), hasher.row_ids_all(tokens[5:]))
    assert hasher.row_ids_batch(np.zeros(0, np.int64), [0]).shape == (0, len(cfg.layer_ids), cfg.n_cols)
    assert hasher.row_ids_batch(np.zeros(0, np.int64), [0, 0, 0], np.full((2, k), -1)).shape[0] == 0


def test_batch_input_errors(small) -> None:
    cfg, _, token_map, hasher = small
    k = cfg.max_ngram_size - 1
    tokens = np.arange(6)
    with pytest.raises(ValueError, match="query_start_loc: must start at 0, end at the 6 tokens"):
        hasher.row_ids_batch(tokens, [0, 4])
    with pytest.raises(ValueError, match="query_start_loc: must start at 0"):
        hasher.row_ids_batch(tokens, [0, 4, 3, 6])
    with pytest.raises(ValueError, match="query_start_loc: expected a 1-D integer array"):
        hasher.row_ids_batch(tokens, [[0, 6]])
    with pytest.raises(ValueError, match=r"lookback: expected integer ids of shape \(requests, max_ngram_size - 1\)"):
        hasher.row_ids_batch(tokens, [0, 6], np.zeros((1, k + 1), np.int64))
    with pytest.raises(ValueError, match="lookback: row 1 has an unknown id"):
        hasher.row_ids_batch(tokens, [0, 2, 6], np.array([[-1, -1, 4], [3, -1, 5]]))
    with pytest.raises(ValueError, match="lookback: token id 60 is outside"):
        hasher.row_ids_batch(tokens, [0, 6], np.array([[1, 2, 60]]))
    with pytest.raises(ValueError, match="lookback_mask given without lookback"):
        hasher.row_ids_batch(tokens, [0, 6], lookback_mask=np.ones((1, k), bool))
    with pytest.raises(ValueError, match="lookback_mask: expected a bool array"):
        hasher.row_ids_batch(tokens, [0, 6], np.zeros((1, k), np.int64), lookback_mask=np.ones((1, k)))
    with pytest.raises(ValueError, match="token id 60 is outside"):
        hasher.row_ids_batch([1, 60], [0, 2])


# ------------------------------------------------------------------------------ token map


def _ref_key(text: str, raw: str) -> str:
    """The normalization chain with Python's unicodedata instead of the tokenizers normalizers."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if unicodedata.category(c) != "Mn")
    s = s.lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        return " "
    s = s.strip()
    return s or text


def _byte_level_tokenizer(words: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<｜begin▁of▁sentence｜>", special=True)])
    return tok


# Byte-level alphabet: Ġ = space, Ċ = \n, ĉ = \t, Ã© = é (two bytes), Ã alone = a partial UTF-8 byte.
WORDS = ["<unk>", "hello", "Hello", "HELLO", "Ġhello", "ĠHéllo".replace("é", "Ã©"), "Ġ", "ĠĠ", "Ċ", "ĉĠ",
         "Ã", "Ã©", "e", "E", "Ġe", "ï¬ģ", "fi", "FI", "Ġ.", ".", "Ã¤", "Â¨", "Ãł", "ĠĠhelloĠĠworldĊ",
         "helloĠworld", "ðŁ", "ðŁĺ"]  # fmt: skip


def test_build_token_map_matches_unicodedata_reference() -> None:
    tok = _byte_level_tokenizer(WORDS)
    token_map, n_classes = build_token_map(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert token_map.shape == (vocab,) and token_map.dtype == np.int64
    keys: dict[str, int] = {}
    expected = []
    for i in range(vocab):
        text = tok.decode([i], skip_special_tokens=False)
        expected.append(keys.setdefault(_ref_key(text, tok.id_to_token(i)), len(keys)))
    assert token_map.tolist() == expected
    assert n_classes == len(keys)
    cls = {w: token_map[tok.token_to_id(w)] for w in WORDS}
    # Case, accents and a leading space collapse; lone spaces and newlines stay one " " class.
    assert cls["hello"] == cls["Hello"] == cls["HELLO"] == cls["Ġhello"]
    assert cls["Ã©"] == cls["e"] == cls["E"] == cls["Ġe"]
    assert cls["Ġ"] == cls["ĠĠ"] == cls["Ċ"] == cls["ĉĠ"]
    assert cls["ï¬ģ"] == cls["fi"] == cls["FI"]  # NFKC folds the ligature
    assert cls["Ġ."] == cls["."]
    # Partial UTF-8 bytes keep their raw token string: distinct classes, not merged via U+FFFD.
    assert len({cls["Ã"], cls["ðŁ"], cls["ðŁĺ"]}) == 3
    assert cls["Ã"] != cls["Ã©"]


def test_from_tokenizer_checks_class_count(tmp_path, v41_text: dict) -> None:
    tok = _byte_level_tokenizer(WORDS)
    _, n_classes = build_token_map(tok)
    text = {**v41_text, "engram_compressed_vocab_size": n_classes, "engram_vocab_size": 101}
    del text["engram_num_embeddings"]
    cfg = EngramConfig.from_hf_config(text)
    hasher = EngramHasher.from_tokenizer(cfg, tok)
    assert hasher.token_map.size == tok.get_vocab_size(with_added_tokens=True)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    np.testing.assert_array_equal(EngramHasher.from_tokenizer(cfg, tmp_path).token_map, hasher.token_map)
    bad = EngramConfig.from_hf_config({**text, "engram_compressed_vocab_size": n_classes + 1})
    with pytest.raises(ValueError, match=f"yields {n_classes} compressed classes"):
        EngramHasher.from_tokenizer(bad, tok)
    with pytest.raises(FileNotFoundError):
        build_token_map(tmp_path / "missing")
