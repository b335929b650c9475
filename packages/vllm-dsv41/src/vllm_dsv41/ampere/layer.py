"""The Ampere attention inside vLLM 0.32's DeepSeek-V4.1 model: subclasses of upstream's classes, no file patched.

``DeepseekV41TritonAttention`` is a ``DeepseekV4Attention`` (upstream's layer: projections, norms, compressor,
KV-sharing topology, metadata plumbing all stay upstream's) whose Hopper-only pieces are ours:

=========================================================  ====================================================
upstream (CUDA, sm_90+)                                    here
=========================================================  ====================================================
fp8_ds_mla KV records (Triton ``float8e4nv``: sm_89+)      plain bf16 rows (``use_fp8_ds_mla_layout = False``)
                                                           holding upstream's FP8-rounded values (``fp8.py``)
``_C.fused_deepseek_v4_qnorm_rope_kv_rope_*_insert``       ``kernels.rope_q_kv_insert``
``_C.fused_deepseek_v4_kv_rope_insert`` (``forward_kv``)   ``kernels.rope_q_kv_insert`` (no query)
compressed rows ``rope_quant_insert`` (584-byte record)    ``kernels.compressed_kv_insert`` (``TritonCompressor``)
FlashMLA ``flash_mla_with_kvcache`` / ``_sparse_fwd``      ``kernels.sparse_mqa_attention``
FlashMLA ``get_mla_metadata`` (SWA metadata builder)       no tile scheduler (``TritonSWAMetadataBuilder``)
indexer keys ``indexer_k_norm_rope_store`` (FP8/MXFP4)     ``kernels.indexer_k_store`` (bf16 keys)
indexer queries ``fused_indexer_q_rope_quant`` (FP8)       ``kernels.indexer_q_rope`` (bf16 queries)
``SparseAttnIndexer``: DeepGEMM MQA logits + CUDA top-k    ``TritonIndexerOp``: ``ops.index_topk``
``dsv41_o_proj``: DeepGEMM ``fp8_einsum`` / fused WO-A,    ``kernels.inv_rope_grouped`` + ``torch.bmm`` on a
inverse RoPE with PDL                                      bf16 ``wo_a``
=========================================================  ====================================================

Reused unchanged (arch-neutral Triton; ``python -m vllm_dsv41.ampere.aot --upstream`` compiles them for sm_8x):
the compressor (``fused_save_compress_norm``), the compressed-cache insert on bf16 rows (``rope_quant_insert``,
with ``kv_rounding="bf16"``), the candidate-block filter, the SWA / compressed slot mapping and index metadata
kernels.

``Dsv41PluginConfig.attention_kv_rounding`` (default "fp8") decides whether the
store kernels round the window and compressed rows, the index keys and the index queries as upstream's FP8 caches
do (``fp8.py``: the values stay bf16, the cache size does not change) or keep them unrounded ("bf16").

The attention and the indexer's selection run in an eager break of vLLM's breakable CUDA graphs (they size work
from host-side metadata); the builders report ``AttentionCGSupport.NEVER`` so vLLM keeps graphs PIECEWISE.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.attention import DeepseekV4Attention, DeepseekV4Indexer
from vllm.models.deepseek_v41.compressor import DeepseekCompressor
from vllm.models.deepseek_v41.sparse_mla import (
    DeepseekV4SparseMLABackend,
    DeepseekV4SparseMLAMetadataBuilder,
    DeepseekV41SparseSWAMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla import sparse_swa
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

from ..config import Dsv41PluginConfig
from . import kernels, ops

__all__ = [
    "DeepseekV41TritonAttention",
    "TritonCompressor",
    "TritonIndexer",
    "TritonIndexerOp",
    "TritonSWABackend",
    "TritonSWAMetadataBuilder",
    "TritonSparseMLABackend",
]

_LAYER_TYPES = tuple(getattr(sparse_swa, n) for n in dir(sparse_swa) if n.startswith("_LAYER_TYPE_"))


def _min_capability(capability: Any) -> bool:
    return capability is not None and int(capability.major) >= 8


class TritonSparseMLAMetadataBuilder(DeepseekV4SparseMLAMetadataBuilder):
    """Upstream's compressed-cache metadata (slot mapping, block table); attention runs outside CUDA graphs."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class TritonSparseMLABackend(DeepseekV4SparseMLABackend):
    """The compressed KV cache of the Triton path: bf16 rows, any GPU from sm_80."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "DSV41_TRITON_SPARSE"

    @staticmethod
    def get_builder_cls() -> type[TritonSparseMLAMetadataBuilder]:
        return TritonSparseMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return _min_capability(capability)


class TritonSWAMetadataBuilder(DeepseekV41SparseSWAMetadataBuilder):
    """Upstream's V4.1 SWA metadata (window indices, prefill plan) without FlashMLA's tile-scheduler plans."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, Any]:
        return dict.fromkeys(_LAYER_TYPES)


class TritonSWABackend(DeepseekSparseSWABackend):
    @staticmethod
    def get_builder_cls() -> type[TritonSWAMetadataBuilder]:
        return TritonSWAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return _min_capability(capability)


class TritonIndexerOp(torch.nn.Module):
    """Stands where upstream builds ``SparseAttnIndexer`` (same constructor): scores, candidates, top-k into the
    shared ``topk_indices_buffer`` (request-local entries). Called through ``run`` by the attention layer."""

    def __init__(
        self,
        k_cache: Any,
        quant_block_size: int,
        scale_fmt: str,
        topk_tokens: int,
        head_dim: int,
        max_model_len: int,
        max_total_seq_len: int,
        topk_indices_buffer: torch.Tensor,
        skip_k_cache_insert: bool = False,
        use_fp4_cache: bool = False,
        compress_ratio: int = 1,
        candidate_blocks: torch.Tensor | None = None,
        candidate_block_size: int = 0,
        candidate_write: bool = False,
    ) -> None:
        super().__init__()
        self.k_cache = k_cache
        self.topk_tokens = topk_tokens
        self.compress_ratio = compress_ratio
        self.topk_indices_buffer = topk_indices_buffer
        self.candidate_blocks = candidate_blocks
        self.candidate_block_size = candidate_block_size
        self.candidate_write = candidate_write
        self.swa_prefix: str | None = None  # set by the attention layer: token -> request map, request offsets
        self.max_logits_bytes = ops.DEFAULT_LOGITS_BYTES

    def forward(self, *args: Any) -> None:  # pragma: no cover - the layer calls run()
        raise RuntimeError("TritonIndexerOp runs through DeepseekV41TritonAttention (run(q, weights, positions))")

    def run(self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> None:
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):  # profile run: reserve the score matrix so the KV budget leaves room for it
            torch.empty(self.max_logits_bytes, dtype=torch.uint8, device=q.device)
            return
        assert self.swa_prefix is not None
        imd, swa = md[self.k_cache.prefix], md[self.swa_prefix]
        n = int(imd.num_decode_tokens + imd.num_prefill_tokens)
        ops.index_topk(
            q,
            weights,
            self.k_cache.kv_cache,
            imd.block_table,
            swa.token_to_req_indices,
            positions,
            self.compress_ratio,
            swa.query_start_loc_cpu,
            n,
            int(imd.max_seq_len) // self.compress_ratio,
            self.topk_tokens,
            self.topk_indices_buffer,
            candidates=self.candidate_blocks,
            candidate_write=self.candidate_write,
            candidate_block_size=self.candidate_block_size,
            max_logits_bytes=self.max_logits_bytes,
        )


def _kv_fp8(vllm_config: Any) -> bool:
    """Whether the store kernels round as upstream's FP8 caches (``Dsv41PluginConfig.attention_kv_rounding``)."""
    return Dsv41PluginConfig.from_vllm_config(vllm_config).attention_kv_rounding == "fp8"


class TritonCompressor(DeepseekCompressor):
    """Upstream's compressor whose compressed-cache insert is ours (``kernels.compressed_kv_insert``), so that
    ``kv_rounding="fp8"`` rounds the rows as upstream's 584-byte record does. The attention layer turns its
    compressor into one (``__class__``: upstream builds it inline, with no hook for the class)."""

    def insert_cache(self, latent: torch.Tensor | None, positions: torch.Tensor, rotary_emb: Any) -> None:
        if latent is None:
            return
        md = get_forward_context().attn_metadata
        assert isinstance(md, dict)
        slots = md[self.k_cache_prefix].slot_mapping
        kernels.compressed_kv_insert(
            latent,
            positions,
            rotary_emb.cos_sin_cache,
            self._static_forward_context[self.k_cache_prefix].kv_cache,
            slots,
            self.compress_ratio,
            fp8=True,
        )


class TritonIndexer(DeepseekV4Indexer):
    """Upstream's V4.1 indexer (``wq_b``, ``weights_proj``, ``wk``, ``k_norm``, the short-context shortcut) with bf16
    keys and queries (FP8-rounded with ``kv_rounding="fp8"``) and the Triton selection."""

    attn_cls: ClassVar[Any] = TritonIndexerOp

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(vllm_config.attention_config, "indexer_sparse_logits", False):
            raise ValueError(
                "dsv41 Triton attention: attention_config.indexer_sparse_logits (DeepGEMM sparse MQA "
                "logits over MXFP4 keys) is not supported; leave it off"
            )
        super().__init__(vllm_config, *args, **kwargs)
        self.indexer_weights_dtype = torch.float32
        self.kv_fp8 = _kv_fp8(vllm_config)

    def _produce_k(self, latent: torch.Tensor | None, positions: torch.Tensor, rotary_emb: Any) -> None:
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict) or latent is None:
            return
        assert self.owns_k
        k_pre, _ = self.wk(latent)
        kernels.indexer_k_store(
            k_pre,
            positions,
            rotary_emb.cos_sin_cache,
            self.k_norm.weight,
            self.k_norm.variance_epsilon,
            self.k_cache.kv_cache,
            md[self.k_cache.prefix].slot_mapping,
            self.compress_ratio,
            fp8=self.kv_fp8,
        )

    def forward_q(
        self,
        qr: Any,
        qr_scale: torch.Tensor | None,
        indexer_weights: torch.Tensor,
        positions: torch.Tensor,
        rotary_emb: Any,
    ) -> tuple[torch.Tensor, None, torch.Tensor]:
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_head, self.head_dim)
        weights = torch.empty(q.shape[0], self.n_head, dtype=torch.float32, device=q.device)
        kernels.indexer_q_rope(
            q,
            positions,
            rotary_emb.cos_sin_cache,
            indexer_weights,
            weights,
            self.softmax_scale * self.n_head**-0.5,
            fp8=self.kv_fp8,
        )
        return q, None, weights


class DeepseekV41TritonAttention(DeepseekV4Attention):
    """DeepSeek-V4.1 sparse attention for any CUDA GPU from sm_80 (see the module docstring)."""

    backend_cls = TritonSparseMLABackend
    swa_backend_cls = TritonSWABackend
    use_fp8_ds_mla_layout: ClassVar[bool] = False

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return num_heads  # no kernel constraint on the head count

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        dtype = vllm_config.cache_config.cache_dtype
        if dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"dsv41 Triton attention stores bf16 KV rows; kv_cache_dtype {dtype!r} is not supported "
                "(leave it 'auto')"
            )
        super().__init__(vllm_config, *args, **kwargs)
        self.kv_fp8 = _kv_fp8(vllm_config)
        if self.kv_fp8 and self.compressor is not None:
            self.compressor.__class__ = TritonCompressor
        if self.indexer is not None:
            self.indexer.indexer_op.swa_prefix = self.swa_cache_layer.prefix
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture

        impl = functools.partial(type(self)._indexer_and_attn, self)
        self._sparse_indexer_and_attn = eager_break_during_capture(impl)
        mode = vllm_config.compilation_config.cudagraph_mode
        if mode is not None and mode.has_piecewise_cudagraphs() and self._sparse_indexer_and_attn is impl:
            raise RuntimeError(
                "dsv41 Triton attention runs in an eager break of vLLM's breakable CUDA graphs, which are off in "
                "this process: set VLLM_USE_BREAKABLE_CUDAGRAPH=1 before vLLM starts (vllm_dsv41.vllm_env_for_pack), "
                "or serve with enforce_eager=True"
            )

    # ---------------------------------------------------------------------------------- upstream's hooks

    @property
    def _can_fuse_query_quant(self) -> bool:
        return False  # MXFP8 query quantization is a FlashInfer SM100 path

    def _indexer_cls(self, k_cache: Any) -> type[DeepseekV4Indexer]:
        if k_cache is not None and self.is_kv_source:  # this layer owns the index cache: bf16 keys
            k_cache.head_dim = int(get_current_vllm_config().model_config.hf_config.index_head_dim)
            k_cache.dtype = torch.bfloat16
        return TritonIndexer

    def _fused_qnorm_rope_kv_insert(
        self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        if not isinstance(attn_metadata, dict):
            return q
        slots = attn_metadata[self.swa_cache_layer.prefix].slot_mapping
        kernels.rope_q_kv_insert(
            q,
            kv,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.swa_cache_layer.kv_cache,
            slots,
            num_tokens=min(q.shape[0], slots.numel()),
            fp8=self.kv_fp8,
        )
        return q

    def forward_kv(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        md = get_forward_context().attn_metadata
        qr_kv, kv_score, _ = self._run_parallel_input_projections(hidden_states)
        _, _, kv = self._split_qkv_and_norm(qr_kv)
        if isinstance(md, dict):
            slots = md[self.swa_cache_layer.prefix].slot_mapping
            kernels.rope_q_kv_insert(
                None,
                kv,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.swa_cache_layer.kv_cache,
                slots,
                num_tokens=min(kv.shape[0], slots.numel()),
                fp8=self.kv_fp8,
            )
        if self.compressor is not None:
            latent = self.compressor(kv_score, positions)
            self.compressor.insert_cache(latent, positions, self.rotary_emb)
            if self.indexer is not None and self.indexer.owns_k:
                self.indexer._produce_k(latent, positions, self.indexer_rotary_emb)

    def _indexer_and_attn(
        self,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor | None,
        index_q_scale: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The eager region (upstream's ``_sparse_indexer_and_attn``): selection, then attention."""
        if self.indexer is not None and index_q is not None:
            assert index_weights is not None
            self.indexer.indexer_op.run(index_q, index_weights, positions)
        self.forward_mqa(q, kv, positions, out)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):  # profile / dummy run
            output.zero_()
            return
        swa = md[self.swa_cache_layer.prefix]
        nd, n = int(swa.num_decode_tokens), int(swa.num_decode_tokens + swa.num_prefill_tokens)
        extra: tuple[Any, Any, Any] = (None, None, None)
        if self.compress_ratio > 0:
            cache = self._compressed_kv_cache()
            assert self.topk_indices_buffer is not None and self.compressed_cache_prefix is not None
            rows = md[self.compressed_cache_prefix].block_size // self.compress_ratio
            if rows != cache.shape[1]:
                raise RuntimeError(
                    f"{self.prefix}: compressed cache has {cache.shape[1]} rows per block, the metadata says {rows}"
                )
            slots, counts = ops.global_slots(
                self.topk_indices_buffer[:n],
                swa.token_to_req_indices,
                md[self.compressed_cache_prefix].block_table,
                rows,
                swa.is_valid_token,
            )
            extra = (cache, slots, counts)
        swa_cache = self.swa_cache_layer.kv_cache
        if nd > 0:
            kernels.sparse_mqa_attention(
                q[:nd],
                output[:nd],
                self.scale,
                swa_cache,
                swa.decode_swa_indices,
                swa.decode_swa_lens,
                extra[0],
                None if extra[1] is None else extra[1][:nd],
                None if extra[2] is None else extra[2][:nd],
                self.attn_sink,
            )
        if n > nd:
            kernels.sparse_mqa_attention(
                q[nd:n],
                output[nd:n],
                self.scale,
                swa_cache,
                swa.prefill_swa_indices,
                swa.prefill_swa_lens,
                extra[0],
                None if extra[1] is None else extra[1][nd:n],
                None if extra[2] is None else extra[2][nd:n],
                self.attn_sink,
            )
        if output.shape[0] > n:
            output[n:].zero_()  # CUDA-graph padding rows

    def _o_proj(self, attn_out: Any, positions: torch.Tensor) -> torch.Tensor:
        o = attn_out[:, : self.n_local_heads]
        w = getattr(self.wo_a, "weight", None)
        if (
            not isinstance(w, torch.Tensor)
            or w.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or w.numel() == 0
        ):
            raise NotImplementedError(
                f"{self.prefix}.wo_a: the Triton attention path needs a plain (bf16) wo_a weight, got "
                f"{None if not isinstance(w, torch.Tensor) else w.dtype}; FP8 wo_a goes through DeepGEMM's fp8_einsum "
                "(sm_90+). pack-tools builds EXL3 packs with a bf16 wo_a."
            )
        g, t = self.n_local_groups, o.shape[0]
        x = torch.empty((g, t, (self.n_local_heads // g) * self.head_dim), dtype=o.dtype, device=o.device)
        kernels.inv_rope_grouped(o, positions[:t], self.rotary_emb.cos_sin_cache, g, x)
        z = torch.bmm(x, w.view(g, self.o_lora_rank, -1).transpose(1, 2).to(x.dtype))  # [G, T, R]
        return self._wo_b_proj(z.transpose(0, 1).reshape(t, g * self.o_lora_rank))
