"""Shared fixtures of the engram-mmap tests (test modules cannot import each other)."""

from __future__ import annotations

import pytest

# The published DeepSeek-V4.1-Flash text_config engram fields (exl3-format.md 8.2, reference-system.md 7.1).
V41_TEXT = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16000000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
}


@pytest.fixture
def v41_text() -> dict:
    """A fresh copy of V4.1-Flash's engram text_config fields."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in V41_TEXT.items()}
