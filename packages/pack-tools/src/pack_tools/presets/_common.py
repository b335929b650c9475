"""Shared pieces of the synthetic presets: per-tensor seeded data, sharding, tokenizer, input receipts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pack_tools.manifest import INDEX_NAME, hash_file
from pack_tools.st import RawTensor, atomic_write_json, raw, tensor_bytes, write_safetensors

__all__ = [
    "IMAGE_TOKEN",
    "V41_SPECIAL_TOKENS",
    "bf16",
    "exl3",
    "f32",
    "fp8_e4m3",
    "rng_for",
    "write_input_receipt",
    "write_shards",
    "write_tokenizer",
]

#: DeepSeek-V4.1's special tokens (reference-system.md section 11); the first three have ids 0, 1, 2
#: (BOS, EOS, pad) as in the release.
V41_SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜action｜>",
    "<｜query｜>",
    "<tool_result>",
    "</tool_result>",
)


def rng_for(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on (seed, tensor name): output is independent of generation order."""
    digest = hashlib.sha256(name.encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def bf16(seed: int, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> RawTensor:
    """Random BF16 (normal * scale + offset), stored as the top 16 bits of float32, rounded to nearest even."""
    x = (rng_for(seed, name).standard_normal(shape) * scale + offset).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return raw(rounded.reshape(shape), "BF16")


def f32(seed: int, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> RawTensor:
    x = (rng_for(seed, name).standard_normal(shape) * scale + offset).astype(np.float32)
    return raw(x)


def fp8_e4m3(seed: int, name: str, shape: tuple[int, ...]) -> RawTensor:
    """Random finite F8_E4M3 (e4m3fn) bytes: every pattern except the two NaNs (0x7F, 0xFF)."""
    b = rng_for(seed, name).integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 0x01
    return raw(b, "F8_E4M3")


def raw_int8(seed: int, name: str, shape: tuple[int, ...]) -> RawTensor:
    """Random I8 bytes (e.g. FP4 pairs packed two per byte, as the release stores its experts)."""
    return raw(rng_for(seed, name).integers(-128, 128, size=shape, dtype=np.int8))


def e8m0_scales(seed: int, name: str, shape: tuple[int, ...]) -> RawTensor:
    """F8_E8M0 block scales 2^(e-127) with e in [117, 127] (values 2^-10 .. 1, as a real table's)."""
    b = rng_for(seed, name).integers(117, 128, size=shape, dtype=np.uint8)
    return raw(b, "F8_E8M0")


def exl3(seed: int, prefix: str, k: int, n: int, bits: float, codebook: str = "mul1") -> dict[str, np.ndarray]:
    """A random valid EXL3 linear (``cpu_tier.exl3.random_tensor``) as its on-disk tensor set."""
    from cpu_tier.exl3 import random_tensor

    t = random_tensor(k, n, bits, codebook, rng_for(seed, prefix))  # type: ignore[arg-type]
    return t.to_tensors(prefix)


def write_shards(
    root: Path,
    tensors: Mapping[str, RawTensor | np.ndarray],
    n_shards: int,
    *,
    pattern: str = "model-{i:05d}-of-{n:05d}.safetensors",
    groups: Iterable[list[str]] | None = None,
    extra_index: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Split ``tensors`` into ``n_shards`` files of about equal size (keeping each group together) + the index.

    ``groups`` lists tensor names that must share a shard (e.g. one layer); ungrouped tensors are their own
    group. ``extra_index`` adds index entries for files that are not written (a partial download).
    Returns the weight map.
    """
    names = list(tensors)
    if groups is None:
        group_list = [[n] for n in names]
    else:
        group_list = [list(g) for g in groups]
        covered = {n for g in group_list for n in g}
        group_list += [[n] for n in names if n not in covered]
    total = sum(tensor_bytes(tensors[n]) for g in group_list for n in g)
    target = total / n_shards
    shards: list[list[str]] = [[]]
    acc = 0
    for g in group_list:
        size = sum(tensor_bytes(tensors[n]) for n in g)
        if acc >= target * len(shards) and len(shards) < n_shards:
            shards.append([])
        shards[-1].extend(g)
        acc += size
    while len(shards) < n_shards:
        shards.append([])
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = pattern.format(i=i, n=n_shards)
        write_safetensors(root / fname, {n: tensors[n] for n in shard}, {"format": "pt"})
        for n in shard:
            weight_map[n] = fname
    full = dict(weight_map)
    if extra_index:
        full.update(extra_index)
    total_size = sum(tensor_bytes(t) for t in tensors.values())
    atomic_write_json(
        root / INDEX_NAME, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(full.items()))}
    )
    return weight_map


#: vLLM's V4.1 image placeholder; its tokenizer must hold it (the release has it as its last special token).
IMAGE_TOKEN = "<｜deepseek_image｜>"


def _tokenizer_corpus() -> list[str]:
    """A fixed training corpus (deterministic, machine-independent) big enough for ~1k BPE merges."""
    lines = [
        "The capital of Japan is Tokyo. The capital of France is Paris.",
        "def add(a, b):\n    return a + b\n",
        "Seventeen times twenty-three is three hundred ninety-one.",
        "A mixture of experts routes each token to a few experts.",
        "Engram tables hold hashed n-gram embeddings read from disk.",
        '{"name": "get_weather", "arguments": {"location": "Paris"}}',
    ]
    words = (
        "expert cache host memory pinned stream prefill decode token layer tensor trellis codebook "
        "hadamard router weight gate shared sparse attention window index compressor engram table "
        "shard pack verify build serve request stream reason tool call answer question number"
    ).split()
    for i in range(600):
        a, b, c = words[i % len(words)], words[(i * 7 + 3) % len(words)], words[(i * 13 + 5) % len(words)]
        lines.append(f"{a} {b} {c} {i} {i * i % 997} {a.capitalize()}{b}_{c}({i}) -> {b}.{c}[{i % 17}]")
    return lines


def write_tokenizer(root: Path, vocab_size: int, chat_template: str | None = None) -> int:
    """A small byte-level BPE tokenizer with exactly ``vocab_size`` ids, as vLLM's V4.1 model requires.

    The V4.1 special tokens take ids 0.. (BOS 0, EOS 1, pad 2), BPE merges follow, reserved filler tokens
    (``<｜reserved_N｜>``, plain added tokens) pad the vocabulary when the corpus gives too few merges, and
    ``<｜deepseek_image｜>`` is the last id (``vocab_size - 1``). Writes ``tokenizer.json`` and
    ``tokenizer_config.json``; returns the vocabulary size (= ``vocab_size``). Deterministic.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        special_tokens=list(V41_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    size = tok.get_vocab_size()
    if size > vocab_size - 1:
        raise ValueError(f"tokenizer has {size} tokens, more than vocab_size - 1 = {vocab_size - 1}")
    fillers = [AddedToken(f"<｜reserved_{i}｜>", special=False) for i in range(vocab_size - 1 - size)]
    if fillers:
        tok.add_tokens(fillers)
    tok.add_special_tokens([IMAGE_TOKEN])
    size = tok.get_vocab_size()
    if size != vocab_size or tok.token_to_id(IMAGE_TOKEN) != vocab_size - 1:
        raise ValueError(
            f"tokenizer: built {size} ids (image token at {tok.token_to_id(IMAGE_TOKEN)}), "
            f"expected exactly {vocab_size} with the image token last"
        )
    tok.save(str(root / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": V41_SPECIAL_TOKENS[0],
        "eos_token": V41_SPECIAL_TOKENS[1],
        "pad_token": V41_SPECIAL_TOKENS[2],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    atomic_write_json(root / "tokenizer_config.json", cfg)
    return size


def write_input_receipt(
    root: Path, *, source: str, extra: Mapping[str, Any] | None = None, hash_files: bool = True
) -> Path:
    """``.pack-tools-input.json``: every file of a synthesized input directory with size (and sha256)."""
    from pack_tools.inputs import INPUT_RECEIPT

    files: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not any(part.startswith(".") for part in Path(rel).parts):
            files[rel] = {"size": p.stat().st_size, "sha256": hash_file(p) if hash_files else None}
    doc = {"source": source, "files": files}
    if extra:
        doc.update(extra)
    return atomic_write_json(root / INPUT_RECEIPT, doc)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
