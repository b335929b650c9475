"""Upstream's FP8 rounding of the stored attention state, and the option that makes the Ampere path apply it.

What vLLM 0.32 stores on the served path our comparison runs against (an H200, sm_90, ``kv_cache_dtype`` "auto",
which upstream resolves to ``fp8_ds_mla``; the indexer cache at its default "fp8"; a bf16 ``wo_a``), read from
``models/deepseek_v41/attention.py``, ``common/ops/{fused_compress_quant_cache,indexer_k_store}.py``,
``models/deepseek_v4/common/ops/{cache_utils,fused_indexer_q}.py`` and ``nvidia/ops/fused_indexer_q_cutedsl.py``:

==========================  =====================================================================================
tensor                      how it is rounded
==========================  =====================================================================================
sliding-window KV row       the V4 ``fp8_ds_mla`` record (584 B, ``_C.fused_deepseek_v4_*_quant_insert``; its
(512: 448 NoPE + 64 RoPE)   Triton twin ``quantize_and_insert_k_cache``): the 448 NoPE dims in 7 blocks of 64, each
                            block ``x / 2^e`` clamped to +-448 and cast to e4m3, its scale stored as the UE8M0
                            byte ``e + 127``; the 64 RoPE dims stay bf16 (rotated in fp32, rounded once)
compressed KV row           the same record and rule (``rope_quant_insert`` -> ``_rope_quant_insert_kernel``), the
                            NoPE dims taken from the compressor's bf16 latent, RoPE at the group's first position
indexer key (128)           ``indexer_k_norm_rope_store`` (FP8, not MXFP4): k_norm, RoPE, bf16, then the whole
                            key as one block: e4m3 values and one fp32 scale ``2^e`` (132 B)
indexer query (128 / head)  ``fused_indexer_q_rope_quant`` (CuTe kernel on CUDA, Triton twin): RoPE, bf16, then
                            each (token, head) as one block; ``2^e`` folded into the head weights, which
                            DeepGEMM's ``fp8_mqa_logits`` multiply by ``relu(q_fp8 . k_fp8 * k_scale)``
attention query, output     not rounded (bf16 into FlashMLA; with a bf16 ``wo_a`` the output projection's FP8
                            activation quantization is off)
==========================  =====================================================================================

The scale rule, shared by all four: ``e = ceil(log2(max(amax, 1e-4) / 448))`` over the block's values (``amax`` of
bf16 values; the fp32 ratio is ``amax * fp32(1 / 448)``), a power of two (UE8M0), so no value exceeds 448 after
scaling and the cast is round-to-nearest-even onto e4m3 (3 mantissa bits, subnormal step 2^-9). Upstream's kernels
compute ``e`` with ``ceil(log2(.))`` (Triton) or from the ratio's bits (CuTe); on bf16 amaxes they agree: the ratio
is either an exact power of two (amax = 1.75 * 2^k) or at least 2^-9 relative away from one. Reading, upstream
dequantizes ``e4m3 * 2^e`` to bf16, exactly (at most 4 significant bits times a power of two), so a bf16 cache
holding those values is what FlashMLA and DeepGEMM compute with (DeepGEMM's fp8 products are exact in fp32 too).

On Blackwell upstream writes a different record (MXFP8: all 512 dims incl. RoPE, blocks of 32); it is not emulated.

``Dsv41PluginConfig.attention_kv_rounding = "fp8"`` (the default) makes the Ampere path's store kernels apply
exactly that rounding (integer and fp32 arithmetic: Ampere has no e4m3 conversion) and keep the values in its bf16
rows; "bf16" stores the values unrounded. The KV memory is the same either way (``layout.py``); what changes is
which numerics the model runs with. "fp8" is the default because it reproduces the numerics of upstream on Hopper
and of DeepSeek's reference inference (FP8 KV and index cache), which is what the model is served and evaluated
with, so a sm_8x card answers like a Hopper one; "bf16" keeps more precision in the cache (a ~3 % relative
difference per layer's attention, the size of e4m3 rounding) for whoever prefers it. It is one field of the plugin's
configuration (``additional_config["dsv41"]["attention_kv_rounding"]``; the server's ``--attention-kv-rounding``).

``round_blocks`` is the torch reference of the rounding (``torch.float8_e4m3fn`` casts with upstream's scale
rule), which the tests hold the kernels to, bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["round_blocks", "ue8m0_exponents"]

FP8_MAX = 448.0


def ue8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``e`` of upstream's scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` (fp32 math, as its Triton kernels)."""
    y = amax.float().clamp(min=1e-4) * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    return torch.ceil(torch.log2(y)).to(torch.int32)


def round_blocks(x: torch.Tensor, block: int, exponents: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` [..., n] rounded per block of ``block`` last-dim values as upstream stores it in FP8: scaled by
    ``2^-e`` (UE8M0 of the block's amax, or ``exponents`` [..., n / block]), clamped to +-448, cast to
    ``torch.float8_e4m3fn`` and back, times ``2^e``."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    e = ue8m0_exponents(xb.abs().amax(-1)) if exponents is None else exponents.to(torch.int32)
    scale = torch.ldexp(torch.ones_like(xb[..., 0]), e)[..., None]
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape)
