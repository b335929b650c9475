"""``tiny-v41``: the two pack inputs with DeepSeek-V4.1-Flash's real tensor names, dtypes and layout, tiny.

``synth_tiny_v41(out)`` writes

* ``out/Mia-DeepSeek-V4.1-Flash-EXL3-3.0bpw/``: the EXL3 checkpoint. Native namespace
  (``layers.N.*``, ``mtp.S.*``, ``embed``, ``head``); EXL3 routed experts (3 bpw mul1; MTP 4 bpw) and shared
  experts, EXL3 attention (``wq_a``, ``wq_b``, ``wkv``, grouped ``wo_a.slice.G``, ``wo_b``), compressor on the
  KV-source layers, indexer on the index-source layers, EXL3 Engram ``wkv``, a 6 bpw head; BF16 norms, router
  and embedding; FP32 hyper-connection, sink and bias tensors; vision/aligner tensors (which a text-only pack
  drops); nested ``config.json`` (``text_config`` + ``vision_config``), ``quantization_config.json``, index,
  a BPE tokenizer with the V4.1 special tokens and a chat template;
* ``out/DeepSeek-V4.1-Flash-engram/``: the release's ``config.json``, its full index (most shards absent, as
  after the real partial download), ``inference/engram.py`` (a labelled stand-in), and shards 47 and 48 with
  the Engram tables ``layers.N.engram.embed.weight`` F8_E4M3 ``[rows, 256]`` + ``.scale`` F8_E8M0
  ``[rows, 8]`` (rows = the sum of the layer's bucket primes) among other tensors.

Every tensor is a deterministic function of (seed, name). Sizes: :class:`TinyV41` (about 10 MB in all).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets import _common as c
from pack_tools.st import RawTensor, atomic_write_bytes, atomic_write_json, raw
from pack_tools.v41 import engram_primes

__all__ = [
    "FLASH",
    "DataGen",
    "Lazy",
    "LazyGen",
    "Spec",
    "SpecGen",
    "TinyV41",
    "plan_shards",
    "synth_tiny_v41",
    "tiny_v41_config",
    "write_streamed_shards",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<｜System｜>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<｜User｜><tool_result>{{ m['content'] }}</tool_result>"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
)


@dataclasses.dataclass(frozen=True, slots=True)
class TinyV41:
    """Dimensions of the tiny model (every EXL3 dimension a multiple of 128, as EXL3 requires).

    The defaults are the smallest V4.1 that upstream vLLM 0.32's CUDA kernels build and run (the shape proven by
    the gpu-vllm kit's smoke test): FlashMLA's sparse attention needs 64 query heads of 512 (rope 64) and an index
    top-k of 512; a KV-source layer must be compressed (ratio 1 or 2) and a consumer reads a source of its own
    ratio, so layers 2 and 3 are both sources. Engram uses the real hashing shape (8 heads, 4-grams: 24 rows of
    256 per token, a 6144-wide ``wkv``).
    """

    hidden: int = 1024
    intermediate: int = 256
    layers: int = 4
    experts: int = 16
    experts_per_tok: int = 2
    heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 256
    o_groups: int = 8
    o_lora_rank: int = 256
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    vocab: int = 1024
    mtp: int = 1
    mtp_experts: int = 4
    engram_layers: tuple[int, ...] = (1, 2)
    engram_vocab: int = 1000
    engram_heads: int = 8
    engram_max_ngram: int = 4
    kv_source_layers: tuple[int, ...] = (2, 3)
    index_source_layers: tuple[int, ...] = (2, 3)
    candidate_source_layer: int = -1
    routed_bits: int = 3
    mtp_bits: int = 4
    dense_bits: int = 4
    head_bits: int = 6
    exl3_shards: int = 3

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "head_dim", "q_lora_rank", "o_lora_rank", "index_head_dim", "vocab"):
            v = getattr(self, f)
            if v <= 0 or v % 128:
                raise ValueError(f"TinyV41.{f}: must be a positive multiple of 128, got {v}")
        if (self.heads * self.head_dim) % self.o_groups or (self.heads * self.head_dim // self.o_groups) % 128:
            raise ValueError("TinyV41.o_groups: heads * head_dim / o_groups must be a multiple of 128")
        if any(not 0 <= i < self.layers for i in self.engram_layers + self.kv_source_layers):
            raise ValueError("TinyV41: engram / kv-source layer ids must be decoder layers")
        if any(not 0 <= i < self.layers for i in self.index_source_layers):
            raise ValueError("TinyV41.index_source_layers: index-source layer ids must be decoder layers")
        if any(not any(s <= i for s in self.kv_source_layers) for i in self.index_source_layers):
            raise ValueError(
                "TinyV41.index_source_layers: each needs a kv-source layer at or below it (whose "
                "indexer produces the keys it reads)"
            )
        if self.vocab < len(c.V41_SPECIAL_TOKENS) + 257:
            raise ValueError(f"TinyV41.vocab: must hold the byte alphabet and the special tokens, got {self.vocab}")


ENGRAM_DIM = 256  # the real table row width (engram_head_dim)

#: DeepSeek-V4.1-Flash's own dimensions (reference-system.md section 10; MTP/DSpark layers have 128 experts).
#: Shapes the reference does not state are derived from the config (see benches/bench_real_shape.py).
FLASH = TinyV41(
    hidden=5120, intermediate=2304, layers=40, experts=384, experts_per_tok=6, heads=64, head_dim=512,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, index_heads=32, index_head_dim=128, hc_mult=4,
    vocab=129280, mtp=3, mtp_experts=128, engram_layers=(1, 14), engram_vocab=16_000_000, engram_heads=8,
    engram_max_ngram=4, kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    routed_bits=3, mtp_bits=4, dense_bits=4, head_bits=6, exl3_shards=45,
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """A tensor's dtype and shape without data; ``fill`` is a 0-dim int32 marker's value."""

    dtype: str
    shape: tuple[int, ...]
    fill: int | None = None

    @property
    def nbytes(self) -> int:
        from pack_tools.st import DTYPE_SIZES

        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


class Gen(Protocol):
    """Makes one tensor (or one EXL3 linear's tensor set) by name: data (:class:`DataGen`) or specs."""

    def bf16(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Any: ...
    def f32(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Any: ...
    def fp8_e4m3(self, name: str, shape: tuple[int, ...]) -> Any: ...
    def e8m0_scales(self, name: str, shape: tuple[int, ...]) -> Any: ...
    def raw_int8(self, name: str, shape: tuple[int, ...]) -> Any: ...
    def exl3(self, prefix: str, k: int, n: int, bits: float) -> dict[str, Any]: ...


class DataGen:
    """Random data, a deterministic function of (seed, name)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def bf16(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> RawTensor:
        return c.bf16(self.seed, name, shape, scale, offset)

    def f32(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> RawTensor:
        return c.f32(self.seed, name, shape, scale, offset)

    def fp8_e4m3(self, name: str, shape: tuple[int, ...]) -> RawTensor:
        return c.fp8_e4m3(self.seed, name, shape)

    def e8m0_scales(self, name: str, shape: tuple[int, ...]) -> RawTensor:
        return c.e8m0_scales(self.seed, name, shape)

    def raw_int8(self, name: str, shape: tuple[int, ...]) -> RawTensor:
        return c.raw_int8(self.seed, name, shape)

    def exl3(self, prefix: str, k: int, n: int, bits: float) -> dict[str, np.ndarray]:
        return c.exl3(self.seed, prefix, k, n, bits)


class SpecGen:
    """Dtypes and shapes only (for header-only, real-size layouts)."""

    def bf16(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Spec:
        return Spec("BF16", shape)

    def f32(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Spec:
        return Spec("F32", shape)

    def fp8_e4m3(self, name: str, shape: tuple[int, ...]) -> Spec:
        return Spec("F8_E4M3", shape)

    def e8m0_scales(self, name: str, shape: tuple[int, ...]) -> Spec:
        return Spec("F8_E8M0", shape)

    def raw_int8(self, name: str, shape: tuple[int, ...]) -> Spec:
        return Spec("I8", shape)

    def exl3(self, prefix: str, k: int, n: int, bits: float) -> dict[str, Spec]:
        from cpu_tier.exl3 import MARKERS

        return {
            f"{prefix}.trellis": Spec("I16", (k // 16, n // 16, int(16 * bits))),
            f"{prefix}.suh": Spec("F16", (k,)),
            f"{prefix}.svh": Spec("F16", (n,)),
            f"{prefix}.mul1": Spec("I32", (), MARKERS["mul1"]),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Lazy:
    """A tensor not made yet: its spec, the unit it belongs to (the tensors made together and kept in one shard:
    one EXL3 linear's tensor set, or a single tensor) and ``make``, which returns the whole unit's data."""

    spec: Spec
    unit: str
    make: Callable[[], dict[str, Any]]


class LazyGen:
    """Specs now, data on demand (:class:`DataGen`'s, so the bytes equal an in-memory build's): for writing a
    checkpoint shard by shard with bounded memory (:func:`write_streamed_shards`)."""

    def __init__(self, seed: int) -> None:
        self._data = DataGen(seed)
        self._specs = SpecGen()

    def _one(self, name: str, spec: Spec, make: Callable[[], Any]) -> Lazy:
        return Lazy(spec, name, lambda: {name: make()})

    def bf16(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Lazy:
        return self._one(name, Spec("BF16", shape), lambda: self._data.bf16(name, shape, scale, offset))

    def f32(self, name: str, shape: tuple[int, ...], scale: float = 0.02, offset: float = 0.0) -> Lazy:
        return self._one(name, Spec("F32", shape), lambda: self._data.f32(name, shape, scale, offset))

    def fp8_e4m3(self, name: str, shape: tuple[int, ...]) -> Lazy:
        return self._one(name, Spec("F8_E4M3", shape), lambda: self._data.fp8_e4m3(name, shape))

    def e8m0_scales(self, name: str, shape: tuple[int, ...]) -> Lazy:
        return self._one(name, Spec("F8_E8M0", shape), lambda: self._data.e8m0_scales(name, shape))

    def raw_int8(self, name: str, shape: tuple[int, ...]) -> Lazy:
        return self._one(name, Spec("I8", shape), lambda: self._data.raw_int8(name, shape))

    def exl3(self, prefix: str, k: int, n: int, bits: float) -> dict[str, Lazy]:
        def make() -> dict[str, Any]:
            return dict(self._data.exl3(prefix, k, n, bits))

        return {name: Lazy(spec, prefix, make) for name, spec in self._specs.exl3(prefix, k, n, bits).items()}


def plan_shards(tensors: dict[str, Lazy], shard_bytes: int) -> list[dict[str, Any]]:
    """Units in first-appearance order, packed into shards of at most ``shard_bytes`` (a bigger unit alone).

    Returns ``[{"file", "units": [unit, ...], "tensors": [(name, spec), ...], "bytes"}]``; nothing is made.
    """
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes: must be positive, got {shard_bytes}")
    units: dict[str, list[str]] = {}
    for name, lz in tensors.items():
        units.setdefault(lz.unit, []).append(name)
    shards: list[dict[str, Any]] = []
    cur: dict[str, Any] = {"units": [], "tensors": [], "bytes": 0}
    for unit, names in units.items():
        size = sum(tensors[n].spec.nbytes for n in names)
        if cur["units"] and cur["bytes"] + size > shard_bytes:
            shards.append(cur)
            cur = {"units": [], "tensors": [], "bytes": 0}
        cur["units"].append(unit)
        cur["tensors"].extend((n, tensors[n].spec) for n in names)
        cur["bytes"] += size
    shards.append(cur)
    for i, sh in enumerate(shards, start=1):
        sh["file"] = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
    return shards


def write_streamed_shards(root: Path, tensors: dict[str, Lazy], shard_bytes: int, *, progress: bool = False,
                          desc: str = "") -> dict[str, str]:  # fmt: skip
    """Write ``tensors`` shard by shard (:func:`plan_shards`), making each shard's data just before writing it,
    plus the index; memory holds one shard at a time. Returns the weight map.

    Every made tensor is checked against its spec (dtype size x shape), so the plan and the files agree.
    """
    from pack_tools.manifest import INDEX_NAME
    from pack_tools.st import write_safetensors

    shards = plan_shards(tensors, shard_bytes)
    total = sum(sh["bytes"] for sh in shards)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc or f"shards -> {root}")
    weight_map: dict[str, str] = {}
    try:
        for sh in shards:
            made: dict[str, Any] = {}
            for unit in sh["units"]:
                first = next(n for n, _ in sh["tensors"] if tensors[n].unit == unit)
                made.update(tensors[first].make())
            ordered: dict[str, Any] = {}
            for name, spec in sh["tensors"]:
                t = made[name] if isinstance(made[name], RawTensor) else raw(made[name])
                if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                    raise AssertionError(f"{name}: made {t.dtype} {tuple(t.shape)}, planned {spec}")
                ordered[name] = t
            write_safetensors(root / sh["file"], ordered, {"format": "pt"})
            weight_map.update({name: sh["file"] for name in ordered})
            del made, ordered
            if bar is not None:
                bar.update(sh["bytes"])
    finally:
        if bar is not None:
            bar.close()
    atomic_write_json(root / INDEX_NAME, {"metadata": {"total_size": total},
                                          "weight_map": dict(sorted(weight_map.items()))})  # fmt: skip
    return weight_map


def tiny_v41_config(d: TinyV41 = TinyV41(), compressed_vocab: int | None = None) -> dict[str, Any]:
    """The nested V4.1 ``config.json`` (without quantization_config) for dimensions ``d``.

    ``compressed_vocab`` is ``engram_compressed_vocab_size``: the number of classes of the tokenizer's Engram
    token map (vLLM checks it against the map it builds from the tokenizer); default: a placeholder for callers
    that write no tokenizer.
    """
    if compressed_vocab is None:
        compressed_vocab = d.vocab - 64
    primes = engram_primes(d.engram_vocab, d.engram_heads, d.engram_max_ngram, len(d.engram_layers))
    ratios = [0, 0] + [2 if i < (d.layers + 2) // 2 else 1 for i in range(2, d.layers)] + [0] * d.mtp
    text = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "moe_intermediate_size": d.intermediate,
        "num_attention_heads": d.heads,
        "num_key_value_heads": 1,
        "head_dim": d.head_dim,
        "qk_rope_head_dim": 64,
        "q_lora_rank": d.q_lora_rank,
        "o_lora_rank": d.o_lora_rank,
        "o_groups": d.o_groups,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        # the release's context: 1M positions (YaRN x16 over 64k), so a Flash-shaped pack serves 262k-token prompts
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.experts_per_tok,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 128,
        "compress_ratios": ratios,
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": list(d.kv_source_layers),
        "index_source_layer_ids": list(d.index_source_layers),
        "index_n_heads": d.index_heads,
        "index_head_dim": d.index_head_dim,
        "index_topk": d.index_topk,
        "candidate_source_layer_id": d.candidate_source_layer,
        "candidate_topk_blocks": 2048 if d.candidate_source_layer >= 0 else 0,
        "candidate_block_size": 8,
        "hc_mult": d.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": list(d.engram_layers),
        "engram_num_embeddings": [sum(p) for p in primes],
        "engram_max_ngram_size": d.engram_max_ngram,
        "engram_vocab_size": d.engram_vocab,
        "engram_n_heads": d.engram_heads,
        "engram_head_dim": ENGRAM_DIM,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": compressed_vocab,
        "num_nextn_predict_layers": d.mtp,
        "dspark_block_size": 5,
        "dspark_noise_token_id": d.vocab - 1,
        "dspark_target_layer_ids": [d.layers - 1],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": d.mtp_experts,
        "dspark_num_experts_per_tok": d.experts_per_tok,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": d.vocab - 1,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": d.vocab - 1,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 1,
            "hidden_size": 128,
            "patch_size": 4,
        },
    }


def _layer_tensors(d: TinyV41, g: Gen, root: str, layer: int, is_mtp: bool) -> dict[str, Any]:
    H, I, hc = d.hidden, d.intermediate, d.hc_mult
    mix = (2 + hc) * hc
    t: dict[str, Any] = {}
    p = f"{root}."
    t[p + "attn_norm.weight"] = g.bf16(p + "attn_norm.weight", (H,), 0.05, 1.0)
    t[p + "ffn_norm.weight"] = g.bf16(p + "ffn_norm.weight", (H,), 0.05, 1.0)
    for sub in ("attn", "ffn"):
        t[f"{p}hc_{sub}_fn"] = g.f32(f"{p}hc_{sub}_fn", (mix, hc * H))
        t[f"{p}hc_{sub}_base"] = g.f32(f"{p}hc_{sub}_base", (mix,), 0.1)
        t[f"{p}hc_{sub}_scale"] = g.f32(f"{p}hc_{sub}_scale", (3,), 0.1, 1.0)
    a = p + "attn."
    db = d.mtp_bits if is_mtp else d.dense_bits
    t.update(g.exl3(a + "wq_a", H, d.q_lora_rank, db))
    t.update(g.exl3(a + "wkv", H, d.head_dim, db))
    t.update(g.exl3(a + "wq_b", d.q_lora_rank, d.heads * d.head_dim, db))
    t[a + "q_norm.weight"] = g.bf16(a + "q_norm.weight", (d.q_lora_rank,), 0.05, 1.0)
    t[a + "kv_norm.weight"] = g.bf16(a + "kv_norm.weight", (d.head_dim,), 0.05, 1.0)
    for grp in range(d.o_groups):
        t.update(g.exl3(f"{a}wo_a.slice.{grp}", d.heads * d.head_dim // d.o_groups, d.o_lora_rank, db))
    t.update(g.exl3(a + "wo_b", d.o_groups * d.o_lora_rank, H, db))
    t[a + "attn_sink"] = g.f32(a + "attn_sink", (d.heads,), 0.5)
    if not is_mtp and layer in d.kv_source_layers:
        cp = a + "compressor."
        ratio = 2 if layer < (d.layers + 2) // 2 else 1
        t.update(g.exl3(cp + "wkv", H, d.head_dim, db))
        t.update(g.exl3(cp + "wgate", H, d.head_dim, db))
        t[cp + "ape"] = g.f32(cp + "ape", (ratio, d.head_dim))
        t[cp + "norm.weight"] = g.bf16(cp + "norm.weight", (d.head_dim,), 0.05, 1.0)
    if not is_mtp and layer in d.index_source_layers:
        ip = a + "indexer."
        t.update(g.exl3(ip + "wq_b", d.q_lora_rank, d.index_heads * d.index_head_dim, db))
        if layer in d.kv_source_layers:  # only an index source that is also a KV source produces (owns) the keys;
            # the others reuse the keys of the KV source below them and have no wk / k_norm (upstream's ``owns_k``)
            t.update(g.exl3(ip + "wk", d.head_dim, d.index_head_dim, db))  # the compressor's latent -> index keys
            t[ip + "k_norm.weight"] = g.bf16(ip + "k_norm.weight", (d.index_head_dim,), 0.05, 1.0)
        t[ip + "weights_proj.weight"] = g.bf16(ip + "weights_proj.weight", (d.index_heads, H))
    f = p + "ffn."
    n_exp = d.mtp_experts if is_mtp else d.experts
    t[f + "gate.weight"] = g.bf16(f + "gate.weight", (n_exp, H))
    t[f + "gate.bias"] = g.f32(f + "gate.bias", (n_exp,), 0.01)
    t[f + "gate.bias_vl"] = g.f32(f + "gate.bias_vl", (n_exp,), 0.01)
    rb = d.mtp_bits if is_mtp else d.routed_bits
    for e in range(n_exp):
        t.update(g.exl3(f"{f}experts.{e}.w1", H, I, rb))
        t.update(g.exl3(f"{f}experts.{e}.w3", H, I, rb))
        t.update(g.exl3(f"{f}experts.{e}.w2", I, H, rb))
    t.update(g.exl3(f + "shared_experts.w1", H, I, db))
    t.update(g.exl3(f + "shared_experts.w3", H, I, db))
    t.update(g.exl3(f + "shared_experts.w2", I, H, db))
    if not is_mtp and layer in d.engram_layers:
        ep = p + "engram."
        cols = (d.engram_max_ngram - 1) * d.engram_heads
        t.update(g.exl3(ep + "wkv", cols * ENGRAM_DIM, (hc + 1) * H, db))
        t[ep + "q_weight"] = g.bf16(ep + "q_weight", (hc, H), 0.05, 1.0)
        t[ep + "k_weight"] = g.bf16(ep + "k_weight", (hc, H), 0.05, 1.0)
    if is_mtp:
        t[p + "enorm.weight"] = g.bf16(p + "enorm.weight", (H,), 0.05, 1.0)
        t[p + "hnorm.weight"] = g.bf16(p + "hnorm.weight", (H,), 0.05, 1.0)
        t[p + "norm.weight"] = g.bf16(p + "norm.weight", (H,), 0.05, 1.0)
        t.update(g.exl3(p + "e_proj", H, H, db))
        t.update(g.exl3(p + "h_proj", H, H, db))
        t[p + "hc_head_fn"] = g.f32(p + "hc_head_fn", (hc, hc * H))
        t[p + "hc_head_base"] = g.f32(p + "hc_head_base", (hc,), 0.1)
        t[p + "hc_head_scale"] = g.f32(p + "hc_head_scale", (1,), 0.1, 1.0)
    return t


def exl3_checkpoint_tensors(d: TinyV41, g: Gen) -> tuple[dict[str, Any], list[list[str]]]:
    """All tensors of the EXL3 checkpoint (made by ``g``), and the per-layer groups that stay in one shard."""
    H, hc = d.hidden, d.hc_mult
    t: dict[str, Any] = {}
    groups: list[list[str]] = []
    t["embed.weight"] = g.bf16("embed.weight", (d.vocab, H))
    for i in range(d.layers):
        lt = _layer_tensors(d, g, f"layers.{i}", i, False)
        groups.append(list(lt))
        t.update(lt)
    for s in range(d.mtp):
        lt = _layer_tensors(d, g, f"mtp.{s}", d.layers + s, True)
        groups.append(list(lt))
        t.update(lt)
    t["norm.weight"] = g.bf16("norm.weight", (H,), 0.05, 1.0)
    t["hc_head_fn"] = g.f32("hc_head_fn", (hc, hc * H))
    t["hc_head_base"] = g.f32("hc_head_base", (hc,), 0.1)
    t["hc_head_scale"] = g.f32("hc_head_scale", (1,), 0.1, 1.0)
    t.update(g.exl3("head", H, d.vocab, d.head_bits))
    # The vision tower and aligner (a text-only pack leaves them out), one of them EXL3.
    t["vision.patch_embed.weight"] = g.bf16("vision.patch_embed.weight", (128, 48))
    t.update(g.exl3("vision.blocks.0.mlp.fc1", 128, 128, d.dense_bits))
    t["aligner.proj.weight"] = g.bf16("aligner.proj.weight", (H, 128))
    t["image_newline"] = g.bf16("image_newline", (H,))
    return t, groups


def engram_release_tensors(d: TinyV41, g: Gen) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
    """Shard 47/48 contents of the original release (FP8), and index entries of the shards not downloaded."""
    H, hc = d.hidden, d.hc_mult
    primes = engram_primes(d.engram_vocab, d.engram_heads, d.engram_max_ngram, len(d.engram_layers))
    cols = (d.engram_max_ngram - 1) * d.engram_heads
    shards: dict[int, dict[str, Any]] = {47: {}, 48: {}}
    for i, layer in enumerate(d.engram_layers):
        shard = shards[47 if i % 2 == 0 else 48]
        rows = sum(primes[i])
        ep = f"layers.{layer}.engram."
        shard[ep + "embed.weight"] = g.fp8_e4m3(ep + "embed.weight", (rows, ENGRAM_DIM))
        shard[ep + "embed.scale"] = g.e8m0_scales(ep + "embed.scale", (rows, ENGRAM_DIM // 32))
        n_out, n_in = (hc + 1) * H, cols * ENGRAM_DIM
        shard[ep + "wkv.weight"] = g.fp8_e4m3(ep + "wkv.weight", (n_out, n_in))
        shard[ep + "wkv.scale"] = g.e8m0_scales(ep + "wkv.scale", (n_out // 32, n_in // 32))
        shard[ep + "q_weight"] = g.bf16("release." + ep + "q_weight", (hc, H), 0.05, 1.0)
        shard[ep + "k_weight"] = g.bf16("release." + ep + "k_weight", (hc, H), 0.05, 1.0)
    # Other release tensors that live in the same shards: FP4 experts (I8-packed + E8M0 scales) and a norm
    # whose name the EXL3 checkpoint also has (the pack must take it from the EXL3 checkpoint).
    last = f"layers.{d.layers - 1}.ffn.experts.0.w1."
    shards[47][last + "weight"] = g.raw_int8(last + "weight", (d.intermediate, H // 2))
    shards[47][last + "scale"] = g.e8m0_scales(last + "scale", (d.intermediate, H // 32))
    shards[48]["mtp.0.norm.weight"] = g.bf16("release.mtp.0.norm.weight", (H,), 0.05, 1.0)
    absent = {
        "embed.weight": "model-00001-of-00048.safetensors",
        "layers.0.attn.wq_a.weight": "model-00001-of-00048.safetensors",
        "layers.0.attn.wq_a.scale": "model-00001-of-00048.safetensors",
        "layers.0.ffn.experts.0.w1.weight": "model-00002-of-00048.safetensors",
        "head.weight": "model-00046-of-00048.safetensors",
    }
    return shards, absent


def synth_tiny_v41(out: Path, seed: int = 0, dims: TinyV41 | None = None, *, shard_bytes: int | None = None,
                   progress: bool = False, preset: str = "tiny-v41") -> Path:  # fmt: skip
    """Write the tiny V4.1 EXL3 checkpoint and Engram release under ``out`` (see module docstring).

    ``shard_bytes``: write the EXL3 checkpoint shard by shard (``write_streamed_shards``: shards of at most this
    many bytes, each made just before it is written, so memory stays bounded at any ``dims``; ``progress`` shows a
    bar) instead of ``dims.exl3_shards`` shards made in memory; the input receipt then lists sizes only (no
    sha256 of every byte). ``preset`` is the name recorded in the receipts.

    Returns ``out``. Deterministic: the same (dims, seed, shard_bytes) gives byte-identical files.
    """
    d = dims or TinyV41()
    out = Path(out)
    ex = out / EXL3.dirname
    en = out / ENGRAM.dirname
    ex.mkdir(parents=True, exist_ok=True)
    (en / "inference").mkdir(parents=True, exist_ok=True)

    size = c.write_tokenizer(ex, d.vocab, CHAT_TEMPLATE)
    if size != d.vocab:  # pragma: no cover - write_tokenizer raises first
        raise ValueError("tokenizer size differs from the vocabulary")
    from engram_mmap.hashing import build_token_map

    _, compressed_vocab = build_token_map(str(ex / "tokenizer.json"))
    cfg = tiny_v41_config(d, compressed_vocab)
    if shard_bytes is None:
        tensors, groups = exl3_checkpoint_tensors(d, DataGen(seed))
        c.write_shards(ex, tensors, d.exl3_shards, groups=groups)
        del tensors
    else:
        lazy, _ = exl3_checkpoint_tensors(d, LazyGen(seed))
        write_streamed_shards(ex, lazy, shard_bytes, progress=progress, desc=f"{preset} -> {ex}")
    ex_cfg = dict(cfg)
    ex_cfg["quantization_config"] = {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": float(d.routed_bits),
        "head_bits": d.head_bits,
        "calibration": {"rows": 250, "cols": 2048},
        "out_scales": "always",
        "codebook": "mul1",
    }
    atomic_write_json(ex / "config.json", ex_cfg)
    atomic_write_json(ex / "quantization_config.json", ex_cfg["quantization_config"])
    atomic_write_json(ex / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                                                      "temperature": 1.0, "top_p": 0.95})  # fmt: skip

    shards, absent = engram_release_tensors(d, DataGen(seed))
    weight_map: dict[str, str] = dict(absent)
    from pack_tools.st import write_safetensors

    for num, st in shards.items():
        fname = f"model-{num:05d}-of-00048.safetensors"
        write_safetensors(en / fname, st, {"format": "pt"})
        weight_map.update({n: fname for n in st})
    total = sum(t.data.nbytes for st in shards.values() for t in st.values())
    atomic_write_json(en / "model.safetensors.index.json",
                      {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})  # fmt: skip
    en_cfg = dict(cfg)
    en_cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
                                     "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}  # fmt: skip
    atomic_write_json(en / "config.json", en_cfg)
    atomic_write_bytes(
        en / "inference" / "engram.py",
        b"# Synthetic stand-in written by `pack-tools synth --preset tiny-v41` for the release's\n"
        b"# inference/engram.py. The pack does not read this file; it is here so the directory has the\n"
        b"# same file set as the real partial download.\n",
    )
    info = {"preset": preset, "seed": seed, "dims": dataclasses.asdict(d)}
    hashes = shard_bytes is None
    c.write_input_receipt(ex, source="synth", hash_files=hashes,
                          extra={"repo_id": EXL3.repo_id, "revision": None, **info})  # fmt: skip
    c.write_input_receipt(en, source="synth", hash_files=hashes,
                          extra={"repo_id": ENGRAM.repo_id, "revision": None, **info})  # fmt: skip
    return out


def expected_engram_rows(d: TinyV41 = TinyV41()) -> list[int]:
    """Rows of each Engram table for dimensions ``d`` (sum of the layer's bucket primes)."""
    return [sum(p) for p in engram_primes(d.engram_vocab, d.engram_heads, d.engram_max_ngram, len(d.engram_layers))]


def total_experts(d: TinyV41 = TinyV41()) -> int:
    return d.layers * d.experts
