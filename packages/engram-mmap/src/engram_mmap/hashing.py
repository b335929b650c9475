"""Engram n-gram hashing: token ids -> table row ids (DeepSeek's recipe, exl3-format.md 8.3).

Per position t and Engram layer, with ``tok[k]`` the compressed id of the token k positions back
(k = 0..max_ngram-1):

* slot k is *blocked* when t - k is before the sequence start or the token there is masked (a dead
  token such as an image placeholder); blocking is cumulative (once slot k is blocked, so are all
  larger k), and a blocked slot holds the compressed id of ``pad_token_id``;
* ``prod[k] = tok[k] * mult[k]``; ``rolling = prod[0]``; for n = 2..max_ngram:
  ``rolling ^= prod[n-1]`` and, for each head h, ``row = rolling % prime[n][h] + offset[n][h]``.

Hence ``n_orders * n_heads`` row ids per token per layer, depending only on token ids.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .config import EngramConfig

__all__ = ["EngramHasher", "build_token_map"]

_SENTINEL = "\ue000"  # private-use character that lets a token of exactly one space survive Strip


def _load_tokenizer(tokenizer: Any) -> Any:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return Tokenizer.from_file(path)
    # A transformers fast tokenizer: hash with its Rust backend (no clean-up of decoded spaces).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    raise TypeError(
        f"expected a tokenizers.Tokenizer, a transformers fast tokenizer or a tokenizer.json path, "
        f"got {type(tokenizer).__name__}"
    )


def build_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """Compressed token classes of a tokenizer, exactly as DeepSeek builds them for Engram.

    Each id is decoded alone (special tokens kept). Its key is the text normalized by NFKC, NFD,
    StripAccents, Lowercase, ``[ \\t\\r\\n]+`` -> ``" "``, Strip (a text that is exactly one space
    stays one space), or the raw text if normalization leaves nothing; a decode containing U+FFFD
    (a partial UTF-8 byte token) is keyed by its raw token string instead. Ids with equal keys share
    a class; classes are numbered in first-seen id order. The map is not stored in the checkpoint.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer, transformers fast tokenizer, or path
        The model's tokenizer (or its tokenizer.json / folder).

    Returns
    -------
    token_map : numpy.ndarray
        int64 ``[vocab]``: class of each token id (vocab counts added tokens).
    n_classes : int
        Number of classes; must equal the config's ``engram_compressed_vocab_size``.
    """
    from tokenizers import Regex, normalizers

    tok = _load_tokenizer(tokenizer)
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    classes: dict[str, int] = {}
    token_map = np.empty(vocab, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            raw = tok.id_to_token(token_id)
            key = text if raw is None else raw
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = classes.setdefault(key, len(classes))
    return token_map, len(classes)


class EngramHasher:
    """Row ids of the Engram tables for a token sequence.

    Parameters
    ----------
    config : EngramConfig
        Hash geometry.
    token_map : numpy.ndarray or None
        int ``[vocab]`` compressed class per raw token id (from :func:`build_token_map`). None means
        the ids are already compressed (identity map over ``compressed_vocab_size`` ids), which is
        what synthetic tables use.

    Notes
    -----
    Use :meth:`from_tokenizer` for a real model: it checks that the tokenizer yields exactly
    ``compressed_vocab_size`` classes, since every multiplier depends on that number.
    """

    def __init__(self, config: EngramConfig, token_map: np.ndarray | None = None) -> None:
        if token_map is None:
            token_map = np.arange(config.compressed_vocab_size, dtype=np.int64)
        token_map = np.asarray(token_map)
        if token_map.ndim != 1 or token_map.size == 0 or not np.issubdtype(token_map.dtype, np.integer):
            raise ValueError(
                f"token_map: expected a non-empty 1-D integer array, got {token_map.dtype} {token_map.shape}"
            )
        token_map = token_map.astype(np.int64)
        if token_map.min() < 0 or token_map.max() >= config.compressed_vocab_size:
            raise ValueError(
                f"token_map: classes must lie in [0, compressed_vocab_size={config.compressed_vocab_size}), "
                f"got [{token_map.min()}, {token_map.max()}]"
            )
        if config.pad_token_id >= token_map.size:
            raise ValueError(f"pad_token_id {config.pad_token_id} is outside the token map's {token_map.size} ids")
        self.config = config
        self.token_map = token_map
        self.pad_class = int(token_map[config.pad_token_id])
        self._mult = np.stack([config.multipliers(layer) for layer in config.layer_ids])  # [L, max_ngram]
        self._primes = np.stack([config.primes(layer).reshape(-1) for layer in config.layer_ids])  # [L, cols]
        self._offsets = np.stack([config.offsets(layer).reshape(-1) for layer in config.layer_ids])  # [L, cols]

    @classmethod
    def from_tokenizer(cls, config: EngramConfig, tokenizer: Any) -> EngramHasher:
        """Hasher with the token map of ``tokenizer``; ValueError if its class count differs from
        ``config.compressed_vocab_size``."""
        token_map, n_classes = build_token_map(tokenizer)
        if n_classes != config.compressed_vocab_size:
            raise ValueError(
                f"the tokenizer yields {n_classes} compressed classes but engram_compressed_vocab_size is "
                f"{config.compressed_vocab_size}; the hash multipliers would not match the table"
            )
        return cls(config, token_map)

    def _compressed(self, token_ids: Any, mask: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name}: token ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        vocab = self.token_map.size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][0]
            raise ValueError(f"{name}: token id {bad} is outside the tokenizer's {vocab} ids")
        if mask is None:
            live = np.ones(ids.shape, dtype=bool)
        else:
            live = np.asarray(mask)
            if live.dtype != np.bool_ or live.shape != ids.shape:
                raise ValueError(
                    f"{name} mask: expected a bool array of shape {ids.shape}, got {live.dtype} {live.shape}"
                )
        return self.token_map[ids], live

    def _slots(self, token_ids: Any, lookback: Any, mask: Any, lookback_mask: Any) -> np.ndarray:
        """Compressed ids of the max_ngram slots per position, blocked slots already padded: [T, K+1]."""
        k = self.config.max_ngram_size - 1
        cur, live = self._compressed(token_ids, mask, "token_ids")
        if lookback is None:
            if lookback_mask is not None:
                raise ValueError("lookback_mask given without lookback")
            prev, prev_live = np.zeros(0, np.int64), np.zeros(0, bool)
        else:
            prev, prev_live = self._compressed(lookback, lookback_mask, "lookback")
            prev, prev_live = prev[prev.size - min(k, prev.size) :], prev_live[prev.size - min(k, prev.size) :]
        # Positions before the lookback are before the sequence start: dead.
        missing = k - prev.size
        ext = np.concatenate([np.full(missing, self.pad_class, np.int64), prev, cur])
        ext_live = np.concatenate([np.zeros(missing, bool), prev_live, live])
        t = cur.size
        slots = np.empty((t, k + 1), np.int64)
        blocked = np.zeros(t, bool)
        for shift in range(k + 1):
            src = slice(k - shift, k - shift + t)
            blocked |= ~ext_live[src]
            slots[:, shift] = np.where(blocked, self.pad_class, ext[src])
        return slots

    def row_ids(
        self,
        token_ids: Any,
        layer: int,
        lookback: Any = None,
        mask: Any = None,
        lookback_mask: Any = None,
    ) -> np.ndarray:
        """Table row ids of one Engram layer for each position of a token sequence.

        Parameters
        ----------
        token_ids : array_like of int, shape [T]
            Raw token ids of the chunk.
        layer : int
            Engram layer (an entry of ``config.layer_ids``).
        lookback : array_like of int, optional
            Raw ids of the tokens just before the chunk, oldest first (the previous chunk's tail;
            only the last ``max_ngram_size - 1`` are used). Missing or short lookback means the
            sequence starts there: earlier slots are padded.
        mask : array_like of bool, shape [T], optional
            True for live tokens; False marks dead tokens (e.g. image placeholders): n-grams do not
            reach through them and a dead token's own slots are all padding.
        lookback_mask : array_like of bool, optional
            The same for ``lookback``.

        Returns
        -------
        numpy.ndarray
            int64 ``[T, n_orders * n_heads]``, columns in (order, head) order, each in
            ``[0, config.table_rows(layer))``.
        """
        index = self.config._layer_index(layer)
        slots = self._slots(token_ids, lookback, mask, lookback_mask)
        return self._hash(slots, index)

    def row_ids_all(
        self, token_ids: Any, lookback: Any = None, mask: Any = None, lookback_mask: Any = None
    ) -> np.ndarray:
        """:meth:`row_ids` of every Engram layer: int64 ``[n_layers, T, n_orders * n_heads]``."""
        slots = self._slots(token_ids, lookback, mask, lookback_mask)
        return np.stack([self._hash(slots, i) for i in range(len(self.config.layer_ids))])

    def row_ids_batch(
        self,
        token_ids: Any,
        query_start_loc: Any,
        lookback: Any = None,
        mask: Any = None,
        lookback_mask: Any = None,
    ) -> np.ndarray:
        """Row ids of every Engram layer for a batch of requests, flattened as vLLM schedules a step.

        Equal to :meth:`row_ids_all` of each request's chunk with that request's lookback (the known ids
        of its ``lookback`` row), concatenated over requests; computed for the whole batch at once.

        Parameters
        ----------
        token_ids : array_like of int, shape [T]
            Raw token ids of every request's chunk, request after request.
        query_start_loc : array_like of int, shape [R + 1]
            Where each request's chunk starts in ``token_ids`` (vLLM's ``query_start_loc``): 0 first,
            T last, non-decreasing (an empty chunk is allowed).
        lookback : array_like of int, shape [R, max_ngram_size - 1], optional
            Per request, the raw ids of the tokens just before its chunk, **oldest first** (vLLM's
            ``lookback_token_ids`` is newest first: reverse its columns). -1 marks a position before
            the sequence start; such entries may only precede the known ids of a row. None means
            every request starts its sequence with its chunk.
        mask : array_like of bool, shape [T], optional
            True for live tokens (False: dead, e.g. an image placeholder), as in :meth:`row_ids`.
        lookback_mask : array_like of bool, shape [R, max_ngram_size - 1], optional
            The same for ``lookback``.

        Returns
        -------
        numpy.ndarray
            int64 ``[T, n_layers, n_orders * n_heads]`` (token, layer, column: the layout of vLLM's
            Engram hash ids), each in ``[0, config.table_rows(layer))``.
        """
        cfg = self.config
        k = cfg.max_ngram_size - 1
        cur, live = self._compressed(token_ids, mask, "token_ids")
        t = cur.size
        qsl = np.asarray(query_start_loc)
        if qsl.ndim != 1 or qsl.size < 1 or (qsl.size and not np.issubdtype(qsl.dtype, np.integer)):
            raise ValueError(f"query_start_loc: expected a 1-D integer array of R + 1 offsets, got {qsl.dtype} "
                             f"{qsl.shape}")  # fmt: skip
        qsl = qsl.astype(np.int64)
        if qsl[0] != 0 or qsl[-1] != t or (np.diff(qsl) < 0).any():
            raise ValueError(f"query_start_loc: must start at 0, end at the {t} tokens and never decrease, got "
                             f"{qsl.tolist()[:8]}{'...' if qsl.size > 8 else ''}")  # fmt: skip
        r = qsl.size - 1
        if lookback is None:
            if lookback_mask is not None:
                raise ValueError("lookback_mask given without lookback")
            prev = np.full((r, k), self.pad_class, np.int64)
            prev_live = np.zeros((r, k), bool)
        else:
            raw = np.asarray(lookback)
            if raw.shape != (r, k) or (raw.size and not np.issubdtype(raw.dtype, np.integer)):
                raise ValueError(f"lookback: expected integer ids of shape (requests, max_ngram_size - 1) = "
                                 f"{(r, k)}, got {raw.dtype} {raw.shape}")  # fmt: skip
            raw = raw.astype(np.int64)
            known = raw >= 0
            if (known[:, :-1] & ~known[:, 1:]).any():
                row = int(np.nonzero((known[:, :-1] & ~known[:, 1:]).any(axis=1))[0][0])
                raise ValueError(f"lookback: row {row} has an unknown id (-1) after a known one; -1 marks positions "
                                 f"before the sequence start, which can only come first (oldest first)")  # fmt: skip
            vocab = self.token_map.size
            if (raw >= vocab).any():
                bad = int(raw[raw >= vocab][0])
                raise ValueError(f"lookback: token id {bad} is outside the tokenizer's {vocab} ids")
            prev = np.where(known, self.token_map[np.where(known, raw, 0)], self.pad_class)
            prev_live = known
            if lookback_mask is not None:
                lm = np.asarray(lookback_mask)
                if lm.dtype != np.bool_ or lm.shape != (r, k):
                    raise ValueError(
                        f"lookback_mask: expected a bool array of shape {(r, k)}, got {lm.dtype} {lm.shape}"
                    )
                prev_live = prev_live & lm
        if t == 0:
            return np.empty((0, len(cfg.layer_ids), cfg.n_cols), np.int64)
        req = np.repeat(np.arange(r), np.diff(qsl))
        index = np.arange(t)
        pos = index - qsl[:-1][req]  # position in the request's chunk
        slots = np.empty((t, k + 1), np.int64)
        blocked = np.zeros(t, bool)
        for shift in range(k + 1):
            inside = pos >= shift
            src = np.where(inside, index - shift, 0)
            col = np.clip(k - (shift - pos), 0, k - 1)  # lookback column (oldest first) where not inside
            value = np.where(inside, cur[src], prev[req, col])
            alive = np.where(inside, live[src], prev_live[req, col])
            blocked |= ~alive
            slots[:, shift] = np.where(blocked, self.pad_class, value)
        return np.stack([self._hash(slots, i) for i in range(len(cfg.layer_ids))], axis=1)

    def _hash(self, slots: np.ndarray, index: int) -> np.ndarray:
        cfg = self.config
        # Multipliers are bounded so that class * multiplier < 2^63: no int64 overflow.
        prod = slots * self._mult[index]  # [T, K+1]
        rolling = prod[:, 0].copy()
        out = np.empty((slots.shape[0], cfg.n_cols), np.int64)
        primes, offsets = self._primes[index], self._offsets[index]
        for order in range(cfg.n_orders):
            rolling ^= prod[:, order + 1]
            cols = slice(order * cfg.n_heads, (order + 1) * cfg.n_heads)
            out[:, cols] = rolling[:, None] % primes[cols] + offsets[cols]
        return out
