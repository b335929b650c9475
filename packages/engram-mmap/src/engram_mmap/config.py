"""Engram hash geometry from a DeepSeek config: primes, offsets and multipliers per Engram layer.

Everything here follows DeepSeek's published recipe (``deepseek-ai/Engram`` ``engram_demo_v1.py``
and the V4.1 ``text_config``), see ../../README.md and ../shared/reference/exl3-format.md 8.3:

* primes: for each Engram layer in order, for each n-gram order n = 2..max_ngram, for each head, the
  next prime above the previous one, each order's search restarting at ``vocab_size[n] - 1`` and
  skipping primes already taken (by any layer, order or head);
* offsets: running sum of a layer's primes in (order, head) order; the layer's table has
  ``sum(primes)`` rows (the checksum against ``engram_num_embeddings``);
* multipliers: ``np.random.default_rng(seed + 10007 * layer_id).integers(0, (int64_max //
  compressed_vocab_size) // 2, size=max_ngram_size) * 2 + 1`` (odd int64, bounded so that a
  compressed id times a multiplier cannot overflow int64).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EngramConfig", "is_prime", "next_prime"]

_INT64_MAX = int(np.iinfo(np.int64).max)
_LAYER_SEED_STRIDE = 10007

# Witnesses that make Miller-Rabin deterministic for every n < 3.3 * 10^24 (> 2^64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)


def is_prime(n: int) -> bool:
    """Deterministic primality test (Miller-Rabin with fixed witnesses), exact for n < 3.3e24.

    Parameters
    ----------
    n : int
        Number to test.

    Returns
    -------
    bool
        Whether ``n`` is prime.
    """
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    if n >= 3_317_044_064_679_887_385_961_981:
        raise ValueError(f"is_prime is deterministic only below 3.3e24, got {n}")
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """Smallest prime strictly greater than ``start`` that is not in ``taken``.

    Parameters
    ----------
    start : int
        Exclusive lower bound.
    taken : set of int, optional
        Primes that may not be returned.

    Returns
    -------
    int
        The prime.
    """
    candidate = start + 1
    while candidate in taken or not is_prime(candidate):
        candidate += 1
    return candidate


@functools.lru_cache(maxsize=64)
def _layer_primes(
    layer_count: int, vocab_sizes: tuple[int, ...], n_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Primes as [layer][order - 2][head], drawn exactly in the reference's order."""
    taken: set[int] = set()
    layers = []
    for _ in range(layer_count):
        orders = []
        for vocab in vocab_sizes:
            current = vocab - 1
            heads = []
            for _ in range(n_heads):
                current = next_prime(current, taken)
                taken.add(current)
                heads.append(current)
            orders.append(tuple(heads))
        layers.append(tuple(orders))
    return tuple(layers)


@functools.lru_cache(maxsize=64)
def _multipliers(seed: int, layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    half_bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(seed + _LAYER_SEED_STRIDE * layer_id)
    draws = rng.integers(low=0, high=half_bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) for v in draws * 2 + 1)


@dataclass(frozen=True, slots=True)
class EngramConfig:
    """The Engram hash geometry of one model (DeepSeek-V4.1 ``text_config`` ``engram_*`` fields).

    Parameters
    ----------
    layer_ids : tuple of int
        Decoder layers that own an Engram table, in config order (the prime draw order).
    max_ngram_size : int
        Largest n-gram order; orders 2..max_ngram_size are hashed.
    n_heads : int
        Hash heads per order.
    vocab_sizes : tuple of int
        Per-order bucket size target, one per order 2..max_ngram_size (``engram_vocab_size``; the
        V4.1 config gives one int for all orders). Primes are searched from ``vocab_size - 1`` up.
    compressed_vocab_size : int
        Number of compressed token classes (``engram_compressed_vocab_size``); bounds the multipliers.
    pad_token_id : int
        Raw token id whose compressed class fills blocked n-gram slots (``engram_pad_token_id``).
    head_dim : int
        Values per table row (``engram_head_dim``, 256 in V4.1).
    seed : int
        Base seed of the multiplier generator (0 in every published config).
    num_embeddings : tuple of int or None
        Table rows per layer as stated by the config (``engram_num_embeddings``); when given it
        must equal the rows the primes imply, else ValueError.
    quant_block : int
        Columns per E8M0 scale in the fp8 table (32 in V4.1).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    vocab_sizes: tuple[int, ...]
    compressed_vocab_size: int
    pad_token_id: int
    head_dim: int = 256
    seed: int = 0
    num_embeddings: tuple[int, ...] | None = None
    quant_block: int = 32
    _primes: tuple[tuple[tuple[int, ...], ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(v) for v in self.layer_ids))
        object.__setattr__(self, "vocab_sizes", tuple(int(v) for v in self.vocab_sizes))
        if self.num_embeddings is not None:
            object.__setattr__(self, "num_embeddings", tuple(int(v) for v in self.num_embeddings))
        if not self.layer_ids:
            raise ValueError("layer_ids: at least one Engram layer is needed")
        if len(set(self.layer_ids)) != len(self.layer_ids) or min(self.layer_ids) < 0:
            raise ValueError(f"layer_ids: must be distinct non-negative ints, got {self.layer_ids}")
        if self.max_ngram_size < 2:
            raise ValueError(f"max_ngram_size: must be >= 2, got {self.max_ngram_size}")
        if self.n_heads < 1:
            raise ValueError(f"n_heads: must be >= 1, got {self.n_heads}")
        if len(self.vocab_sizes) != self.max_ngram_size - 1:
            raise ValueError(
                f"vocab_sizes: one per n-gram order 2..{self.max_ngram_size} "
                f"({self.max_ngram_size - 1} values) expected, got {len(self.vocab_sizes)}"
            )
        if min(self.vocab_sizes) < 2:
            raise ValueError(f"vocab_sizes: must be >= 2, got {self.vocab_sizes}")
        if self.compressed_vocab_size < 1:
            raise ValueError(f"compressed_vocab_size: must be >= 1, got {self.compressed_vocab_size}")
        if self.pad_token_id < 0:
            raise ValueError(f"pad_token_id: must be >= 0, got {self.pad_token_id}")
        if self.quant_block < 1 or self.head_dim < 1 or self.head_dim % self.quant_block:
            raise ValueError(
                f"head_dim: must be a positive multiple of quant_block ({self.quant_block}), got {self.head_dim}"
            )
        primes = _layer_primes(len(self.layer_ids), self.vocab_sizes, self.n_heads)
        object.__setattr__(self, "_primes", primes)
        if self.num_embeddings is not None:
            if len(self.num_embeddings) != len(self.layer_ids):
                raise ValueError(
                    f"num_embeddings: one per Engram layer ({len(self.layer_ids)}) expected, "
                    f"got {len(self.num_embeddings)}"
                )
            for layer, stated, per_layer in zip(self.layer_ids, self.num_embeddings, primes, strict=True):
                rows = sum(sum(order) for order in per_layer)
                if rows != stated:
                    raise ValueError(
                        f"num_embeddings: layer {layer} states {stated} rows but its primes sum to {rows}; "
                        "the hash geometry (vocab_sizes, n_heads, max_ngram_size, layer order) does not match "
                        "the table"
                    )

    # ---------------------------------------------------------------------------- construction

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> EngramConfig:
        """Read the ``engram_*`` fields of a Hugging Face config (dict, config.json or its folder).

        The V4.1 config nests them under ``text_config``; a flat config is read as is.

        Parameters
        ----------
        config : mapping or path
            The parsed config.json, the path to it, or the model folder holding it.

        Returns
        -------
        EngramConfig
            Validated against ``engram_num_embeddings`` when the config states it.
        """
        source = "config"
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, Mapping):
                raise ValueError(f"{source}: the top level is not a JSON object")
        text = config.get("text_config", config)
        if not isinstance(text, Mapping):
            raise ValueError(f"{source}: text_config is not an object")

        def need(key: str) -> Any:
            if key not in text:
                raise ValueError(f"{source}: missing field {key!r} (text_config)")
            return text[key]

        def as_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{source}: field {key!r} must be an int, got {value!r}")
            return value

        def as_ints(key: str, value: Any) -> tuple[int, ...]:
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise ValueError(f"{source}: field {key!r} must be a list of ints, got {value!r}")
            return tuple(as_int(key, v) for v in value)

        max_ngram = as_int("engram_max_ngram_size", need("engram_max_ngram_size"))
        vocab = need("engram_vocab_size")
        if isinstance(vocab, Sequence) and not isinstance(vocab, str):
            vocab_sizes = as_ints("engram_vocab_size", vocab)
        else:
            vocab_sizes = (as_int("engram_vocab_size", vocab),) * (max_ngram - 1)
        # The V4.1 release names it engram_pad_token_id; some ports write engram_pad_id.
        pad_key = "engram_pad_token_id" if "engram_pad_token_id" in text else "engram_pad_id"
        stated_rows = text.get("engram_num_embeddings")
        try:
            return cls(
                layer_ids=as_ints("engram_layer_ids", need("engram_layer_ids")),
                max_ngram_size=max_ngram,
                n_heads=as_int("engram_n_heads", need("engram_n_heads")),
                vocab_sizes=vocab_sizes,
                compressed_vocab_size=as_int("engram_compressed_vocab_size", need("engram_compressed_vocab_size")),
                pad_token_id=as_int(pad_key, need(pad_key)),
                head_dim=as_int("engram_head_dim", text.get("engram_head_dim", 256)),
                seed=as_int("engram_seed", text.get("engram_seed", 0)),
                num_embeddings=None if stated_rows is None else as_ints("engram_num_embeddings", stated_rows),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    # ------------------------------------------------------------------------------ geometry

    @property
    def n_orders(self) -> int:
        """Hashed n-gram orders (2..max_ngram_size)."""
        return self.max_ngram_size - 1

    @property
    def n_cols(self) -> int:
        """Row ids per token per layer: ``n_orders * n_heads`` (24 in V4.1)."""
        return self.n_orders * self.n_heads

    @property
    def scale_cols(self) -> int:
        """E8M0 scales per row: ``head_dim // quant_block`` (8 in V4.1)."""
        return self.head_dim // self.quant_block

    def _layer_index(self, layer: int) -> int:
        try:
            return self.layer_ids.index(layer)
        except ValueError:
            raise ValueError(f"layer {layer} is not an Engram layer (layer_ids {self.layer_ids})") from None

    def primes(self, layer: int) -> np.ndarray:
        """Bucket primes of one Engram layer.

        Parameters
        ----------
        layer : int
            An entry of ``layer_ids``.

        Returns
        -------
        numpy.ndarray
            int64 ``[n_orders, n_heads]``.
        """
        return np.array(self._primes[self._layer_index(layer)], dtype=np.int64)

    def offsets(self, layer: int) -> np.ndarray:
        """First row of each (order, head) bucket in the layer's flat table.

        Returns
        -------
        numpy.ndarray
            int64 ``[n_orders, n_heads]``: the running sum of the primes, in (order, head) order.
        """
        flat = self.primes(layer).reshape(-1)
        return (np.cumsum(flat) - flat).reshape(self.n_orders, self.n_heads)

    def table_rows(self, layer: int) -> int:
        """Rows of the layer's table: the sum of its primes (``engram_num_embeddings``)."""
        return int(sum(sum(order) for order in self._primes[self._layer_index(layer)]))

    def multipliers(self, layer: int) -> np.ndarray:
        """Odd hash multipliers of one layer, from numpy's PCG64 with the published seeding.

        Returns
        -------
        numpy.ndarray
            int64 ``[max_ngram_size]``; entry k multiplies the token k positions back.
        """
        self._layer_index(layer)
        return np.array(_multipliers(self.seed, layer, self.max_ngram_size, self.compressed_vocab_size), dtype=np.int64)
