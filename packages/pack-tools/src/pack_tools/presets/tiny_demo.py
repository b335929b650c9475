"""The ``tiny-demo`` pack: a small MoE model that vLLM's CPU build runs, with EXL3 routed experts.

The architecture is Qwen3-MoE (plain GQA attention, which vLLM's CPU attention backends support at any
head size) registered under our plugin's name ``Dsv41DemoForCausalLM``:

* 2 decoder layers, hidden 256, 4 query heads and 2 KV heads of 64, vocabulary 512;
* every layer is MoE: 8 routed experts (intermediate 128), top-2, softmax routing with renormalisation;
* routed experts: one EXL3 linear per expert and projection (``mlp.experts.{e}.{gate,up,down}_proj``),
  3 bits per weight, MUL1 codebook, exactly the layout of an exllamav3 conversion;
* attention projections: EXL3 dense linears (``q/k/v_proj`` 4 bpw MUL1, ``o_proj`` 4 bpw MCG);
* embeddings, norms, router gate and the output head: float16 tensors.

The weights are random (``cpu_tier.exl3.random_tensor`` for EXL3, scaled normals otherwise), so the demo
serves fluent-looking gibberish; what it proves is the serving path. The tokenizer is a byte-level BPE
trained here with ``tokenizers`` on a generated corpus, and its chat template follows the Qwen3 conventions
(ChatML turns, ``<think>`` reasoning switched by ``enable_thinking``, JSON tool calls inside ``<tool_call>``
tags) so that vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser read what the template writes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cpu_tier.exl3 import Codebook

#: The architecture name the vllm-dsv41 plugin registers for this pack.
ARCHITECTURE = "Dsv41DemoForCausalLM"

VOCAB_SIZE = 512
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
EXPERTS = 8
TOP_K = 2
MOE_INTERMEDIATE = 128
MAX_POSITIONS = 2048

EXPERT_BITS = 3.0
EXPERT_CODEBOOK: Codebook = "mul1"
#: Dense EXL3 linears: name -> (bits, codebook).
ATTENTION_EXL3: dict[str, tuple[float, Codebook]] = {
    "q_proj": (4.0, "mul1"),
    "k_proj": (4.0, "mul1"),
    "v_proj": (4.0, "mul1"),
    "o_proj": (4.0, "mcg"),
}

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

CHAT_TEMPLATE = r"""{%- set thinking = enable_thinking if enable_thinking is defined else false -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_message = messages[0].content -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_message = none -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if system_message %}{{ system_message }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif system_message -%}
<|im_start|>system
{{ system_message }}<|im_end|>
{% endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{% set reasoning = message.reasoning or message.reasoning_content %}{% if reasoning %}<think>
{{ reasoning }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {% if call.function.arguments is mapping %}{{ call.function.arguments | tojson }}{% else %}{{ call.function.arguments }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if thinking %}<think>
{% else %}<think>

</think>

{% endif %}
{%- endif -%}
"""

_WORDS = (
    "the a an of to in on for with by from at as is are was were be been it this that these those "
    "model expert experts layer layers token tokens weight weights memory host device cache page pages "
    "prefill decode stream streams request requests reply answer question tool tools call function "
    "weather city paris tokyo london berlin today tomorrow warm cold rain sun cloud wind degree degrees "
    "think reason step plan check result value number one two three four five six seven eight nine ten "
    "hello world please thank you yes no maybe quick small large fast slow good better best time day"
).split()


def _corpus(rng: np.random.Generator, lines: int = 600) -> list[str]:
    out = []
    for _ in range(lines):
        n = int(rng.integers(4, 14))
        words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            sentence += f" {int(rng.integers(0, 10000))}"
        if rng.random() < 0.1:
            sentence = '{"name": "' + words[0] + '", "arguments": {"city": "' + words[-1] + '"}}'
        out.append(sentence)
    return out


def _train_tokenizer(rng: np.random.Generator) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    size = tok.get_vocab_size()
    if size < VOCAB_SIZE:  # pad with reserved tokens so every logit row decodes to a token
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(VOCAB_SIZE - size)])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny-demo tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float16)


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    from cpu_tier.exl3 import random_tensor

    t: dict[str, np.ndarray] = {}
    t["model.embed_tokens.weight"] = _normal(rng, (VOCAB_SIZE, HIDDEN), 1.0)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = (1.0 + _normal(rng, (HIDDEN,), 0.1)).astype(np.float16)
        t[f"{p}.post_attention_layernorm.weight"] = (1.0 + _normal(rng, (HIDDEN,), 0.1)).astype(np.float16)
        t[f"{p}.self_attn.q_norm.weight"] = (1.0 + _normal(rng, (HEAD_DIM,), 0.1)).astype(np.float16)
        t[f"{p}.self_attn.k_norm.weight"] = (1.0 + _normal(rng, (HEAD_DIM,), 0.1)).astype(np.float16)
        shapes = {
            "q_proj": (HIDDEN, HEADS * HEAD_DIM),
            "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
            "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
            "o_proj": (HEADS * HEAD_DIM, HIDDEN),
        }
        for name, (bits, codebook) in ATTENTION_EXL3.items():
            k, n = shapes[name]
            t.update(random_tensor(k, n, bits, codebook, rng).to_tensors(f"{p}.self_attn.{name}"))
        # Router logits with a spread of a few units, so that the top-2 differs between tokens.
        t[f"{p}.mlp.gate.weight"] = _normal(rng, (EXPERTS, HIDDEN), 3.0 / np.sqrt(HIDDEN))
        for e in range(EXPERTS):
            q = f"{p}.mlp.experts.{e}"
            for name, (k, n) in {
                "gate_proj": (HIDDEN, MOE_INTERMEDIATE),
                "up_proj": (HIDDEN, MOE_INTERMEDIATE),
                "down_proj": (MOE_INTERMEDIATE, HIDDEN),
            }.items():
                t.update(random_tensor(k, n, EXPERT_BITS, EXPERT_CODEBOOK, rng).to_tensors(f"{q}.{name}"))
    t["model.norm.weight"] = (1.0 + _normal(rng, (HIDDEN,), 0.1)).astype(np.float16)
    t["lm_head.weight"] = _normal(rng, (VOCAB_SIZE, HIDDEN), 4.0 / np.sqrt(HIDDEN))
    return t


def _config(tok: Any) -> dict[str, Any]:
    im_end = tok.token_to_id("<|im_end|>")
    eot = tok.token_to_id("<|endoftext|>")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "pad_token_id": eot,
        "torch_dtype": "float16",
        "quantization_config": {
            "quant_method": "exl3",
            "version": "dsv41-tiny-demo",
            "bits": EXPERT_BITS,
            "head_bits": 16,
            "codebook": EXPERT_CODEBOOK,
            "out_scales": "always",
        },
        # Plugin defaults for this pack (vllm_dsv41.Dsv41PluginConfig); the server may override them.
        "dsv41": {"cpu": {"precision": "exact"}},
    }


def synth_tiny_demo(out: Path, seed: int = 0) -> Path:
    """Write the complete ``tiny-demo`` pack into ``out`` and return ``out``.

    The pack is a Hugging Face-style model directory (``config.json``, ``generation_config.json``,
    ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) plus the pack manifest. It is built in
    a temporary sibling directory and renamed into place, so an interrupted run never leaves a partial pack.

    Parameters
    ----------
    out : the pack directory to create; it must not exist or must be empty.
    seed : seed of every random choice (tokenizer corpus and weights); the same seed gives the same pack.

    Returns
    -------
    ``out``.
    """
    from safetensors.numpy import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = _train_tokenizer(rng)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": None,
                    "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>",
                    "unk_token": None,
                    "add_bos_token": False,
                    "add_eos_token": False,
                    "clean_up_tokenization_spaces": False,
                    "model_max_length": MAX_POSITIONS,
                    "chat_template": CHAT_TEMPLATE,
                },
                indent=2,
            )
        )
        config = _config(tok)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps(
                {
                    "bos_token_id": config["bos_token_id"],
                    "eos_token_id": [config["eos_token_id"], config["pad_token_id"]],
                    "pad_token_id": config["pad_token_id"],
                },
                indent=2,
            )
        )
        save_file(_tensors(rng), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_manifest(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_manifest(pack_dir: Path) -> None:
    try:
        from pack_tools.manifest import write_manifest
    except ImportError:  # pack_tools.manifest not landed yet: the pack is complete without it
        return
    write_manifest(pack_dir)
