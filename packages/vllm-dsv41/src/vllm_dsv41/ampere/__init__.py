"""DeepSeek-V4.1 attention for GPUs below Hopper (RTX 3090 / A100: sm_86 / sm_80), in Triton.

Upstream vLLM 0.32 runs V4.1 attention only on sm_90+ (FlashMLA sparse kernels, DeepGEMM indexer logits, FP8
KV records that Triton cannot write below sm_89). This subpackage is the plugin's own path:

* ``kernels``: the Triton kernels (KV insert with RoPE, compressed-row insert, sparse MQA attention over window +
  selected compressed rows, index keys and queries, indexer scores, exact top-k, the output's inverse RoPE);
* ``fp8``: how upstream rounds what it stores (FP8 e4m3 with power-of-two scales), the option that makes our
  store kernels round the same way in bf16 (``Dsv41PluginConfig.attention_kv_rounding``, default "fp8") and the torch
  reference of that rounding;
* ``ops``: the indexer's selection (scores -> V4.1's candidate blocks -> top-k) and the slot bookkeeping;
* ``reference``: float64 torch references of every kernel (the tests compare against them);
* ``layer``: the vLLM side (``DeepseekV41TritonAttention`` and its backends, indexer and metadata builders),
  imported only when vLLM builds the model;
* ``select``: which attention the model gets (``Dsv41PluginConfig.attention``: auto = ours below compute
  capability 9.0);
* ``layout``: the KV-cache bytes of this layout against upstream's;
* ``aot``: ahead-of-time compilation of every kernel for sm_80/sm_86 and the scan for instructions they lack.

The KV cache holds plain bf16 rows (upstream's "plain-row" layout, which its FlashInfer backend also uses); by
default they hold the values upstream's FP8 records would (``fp8``).
"""

from __future__ import annotations

__all__ = ["aot", "fp8", "kernels", "layout", "ops", "reference", "select"]
