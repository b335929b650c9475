"""DeepSeek-V4.1 packs (CPU side): the model class under upstream's name, and which method each V4.1 module gets."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def v41_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pack_tools import build_pack
    from pack_tools.origin import ENGRAM, EXL3
    from pack_tools.presets.tiny_v41 import synth_tiny_v41

    root = tmp_path_factory.mktemp("v41")
    synth_tiny_v41(root / "in")
    return build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "pack", jobs=1)


def test_registered_under_the_upstream_architecture_name() -> None:
    from vllm import ModelRegistry

    from vllm_dsv41 import register
    from vllm_dsv41.v41 import Dsv41ForCausalLM

    register()
    model_cls = ModelRegistry._try_load_model_cls("DeepseekV41ForCausalLM")
    assert model_cls is Dsv41ForCausalLM
    from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM as Upstream

    assert issubclass(model_cls, Upstream)


def test_exl3_config_names_every_v41_module(v41_pack: Path) -> None:
    import json

    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    from vllm_dsv41.quant import Exl3Config

    raw = json.loads((v41_pack / "config.json").read_text())
    hf = DeepseekV41Config(**{k: v for k, v in raw.items() if k != "model_type"})
    q = Exl3Config.from_config({"quant_method": "exl3", "bits": 3.0})
    q.maybe_update_config(str(v41_pack), hf_config=hf)
    assert q.is_v41
    from vllm_dsv41.v41 import configure_exl3_names  # what Dsv41ForCausalLM does at construction

    configure_exl3_names(q, hf)
    L = "language_model.model.layers"
    # EXL3 on the GPU: attention (fused wq_a + wkv), wq_b, wo_b, shared experts, indexer wq_b, Engram wkv, head
    for prefix, parts in [
        (f"{L}.0.attn.fused_wqa_wkv", [f"{L}.0.attn.wq_a", f"{L}.0.attn.wkv"]),
        (f"{L}.3.attn.wq_b", [f"{L}.3.attn.wq_b"]),
        (f"{L}.1.attn.wo_b", [f"{L}.1.attn.wo_b"]),
        (f"{L}.2.ffn.shared_experts.gate_up_proj", [f"{L}.2.ffn.shared_experts.w1", f"{L}.2.ffn.shared_experts.w3"]),
        (f"{L}.2.ffn.shared_experts.down_proj", [f"{L}.2.ffn.shared_experts.down_proj"]),
        (f"{L}.3.attn.indexer.wq_b", [f"{L}.3.attn.indexer.wq_b"]),
        (f"{L}.1.engram.wkv", [f"{L}.1.engram.wkv"]),
        ("language_model.lm_head", ["language_model.lm_head"]),
    ]:
        assert q._is_exl3_linear(prefix), prefix
        assert q._linear_parts(prefix) == parts
    # FP16 in the pack (reconstructed by pack-tools), loaded as they are
    for prefix in (f"{L}.0.attn.wo_a", f"{L}.2.attn.compressor.fused_wkv_wgate", f"{L}.3.attn.indexer.wk",
                   f"{L}.3.attn.indexer.weights_proj", f"{L}.0.ffn.gate"):  # fmt: skip
        assert not q._is_exl3_linear(prefix), prefix
    # routed experts under the MoE runner's prefix; MTP modules land under .mtp. (no vLLM module there: not served),
    # never on a decoder layer
    assert any(m.startswith(f"{L}.3.ffn.experts.") for m in q.exl3_modules)
    mtp = [m for m in q.exl3_modules if "mtp" in m]
    assert mtp and all(m.startswith("language_model.model.mtp.") for m in mtp)
    assert not any(m.startswith(f"{L}.4.") for m in q.exl3_modules)


def test_pack_loader_skips_what_the_model_does_not_load(v41_pack: Path) -> None:
    from vllm_dsv41.home import expert_tensor
    from vllm_dsv41.loader import Dsv41ModelLoader
    from vllm_dsv41.v41 import v41_weights_mapper

    counts = {"tensors": 0, "bytes": 0}
    names = [n for n, _ in Dsv41ModelLoader._dense_weights(None, v41_pack, v41_weights_mapper(), counts)]  # type: ignore[arg-type]
    assert not [n for n in names if expert_tensor(n) is not None]
    assert not [n for n in names if n.startswith("mtp.")]
    assert "head.trellis" in names and "layers.1.engram.embed.weight" in names
    mapped = v41_weights_mapper().apply_list(["head.trellis", "layers.0.attn.wq_a.trellis", "layers.0.ffn.gate.bias"])
    assert mapped == ["language_model.lm_head.trellis", "language_model.model.layers.0.attn.wq_a.trellis",
                      "language_model.model.layers.0.ffn.gate.e_score_correction_bias"]  # fmt: skip


def test_expert_problems_name_the_file(v41_pack: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from vllm_dsv41.home import expert_problems

    assert expert_problems(v41_pack) == []
    bad = tmp_path / "bad"
    shutil.copytree(v41_pack, bad, symlinks=False)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 512
    (bad / "config.json").write_text(json.dumps(cfg))
    problems = expert_problems(bad)
    assert problems and ".safetensors: layers.0.ffn.experts.0.w1.trellis: trellis" in problems[0]
    assert "the config needs 1024 x 512" in problems[0]
    cfg["text_config"]["moe_intermediate_size"] = 256
    cfg["text_config"]["n_routed_experts"] = 17
    (bad / "config.json").write_text(json.dumps(cfg))
    assert "experts [16] are missing (16 of 17)" in expert_problems(bad)[0]
    first = sorted(bad.glob("model-*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:100])  # truncated: one line naming the file, nothing that follows from it
    problems = expert_problems(bad)
    assert len(problems) == 1 and first.name in problems[0]


_PROBE = """
import sys
from vllm.engine.arg_utils import EngineArgs
EngineArgs(model=sys.argv[1], load_format="dsv41", limit_mm_per_prompt={"image": 0},
           max_model_len=1024).create_engine_config()
from vllm_dsv41.v41 import upstream_breaks_enabled
print("BREAKS", upstream_breaks_enabled())
"""


def test_breakable_graph_env_must_precede_vllm(v41_pack: Path) -> None:
    """vLLM imports the V4.1 model while building its config, before it enables breakable CUDA graphs: its eager
    breaks are live only when the environment asks for them first, which ``vllm_env_for_pack`` says to do."""
    import os
    import subprocess
    import sys

    from vllm_dsv41 import vllm_env_for_pack

    env = vllm_env_for_pack(v41_pack)
    assert env == {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    assert vllm_env_for_pack(v41_pack, cuda_graphs=False) == {}
    base = {k: v for k, v in os.environ.items() if k != "VLLM_USE_BREAKABLE_CUDAGRAPH"}
    for extra, expected in (({}, "BREAKS False"), (env, "BREAKS True")):
        r = subprocess.run([sys.executable, "-c", _PROBE, str(v41_pack)], env={**base, **extra}, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
        assert expected in r.stdout, (extra, r.stdout[-2000:], r.stderr[-3000:])


@pytest.mark.parametrize("thinking", [False, True])
def test_a_forced_tool_call_through_upstreams_parsers_and_grammar(v41_pack: Path, thinking: bool) -> None:
    """The pack's tokenizer with upstream's deepseek_v41 parsers, as the server composes them: a forced (named) tool
    call becomes an xgrammar structural tag whose tokens (the DSML special token included) the matcher accepts, and
    the text it forces parses into the call. The tag is the same with thinking on; vLLM then applies it only after
    the reasoning ends, which is why the GPU serve check asks with thinking off (a random model never ends it)."""
    xgr = pytest.importorskip("xgrammar")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(v41_pack), tokenizer_mode="deepseek_v41")
    parser_cls = ParserManager.get_parser(tool_parser_name="deepseek_v41", reasoning_parser_name="deepseek_v41",
                                          enable_auto_tools=True, tokenizer=tok)  # fmt: skip
    assert parser_cls is not None
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    kwargs = {"thinking": thinking}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                max_tokens=64, chat_template_kwargs=kwargs)  # type: ignore[arg-type]  # fmt: skip
    parser = parser_cls(tok, req.tools, chat_template_kwargs=kwargs)
    req = parser.adjust_request(req)
    assert req.structured_outputs is not None and req.structured_outputs.structural_tag
    vocab = len(tok)
    hf = getattr(tok, "tokenizer", tok)
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)).compile_structural_tag(
            req.structured_outputs.structural_tag
        )
    )
    mask = xgr.allocate_token_bitmask(1, vocab)
    forced: list[int] = []
    while not matcher.is_terminated() and len(forced) < 200:
        matcher.fill_next_token_bitmask(mask)
        words = [w & 0xFFFFFFFF for w in mask[0].tolist()]
        allowed = [i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1]
        assert allowed, f"no token allowed after {tok.decode(forced)!r}"
        # the lowest allowed id; where the JSON value is free, a quote closes the string at once
        nxt = next((i for i in allowed if tok.decode([i]) == '"'), allowed[0]) if len(allowed) > 8 else allowed[0]
        assert matcher.accept_token(nxt)
        forced.append(nxt)
    text = tok.decode(forced)
    special = tok.convert_tokens_to_ids("｜DSML｜")
    assert special in forced and '<｜DSML｜ invoke name="get_weather">' in text, text
    reasoning, content, calls = parser_cls(tok, req.tools, chat_template_kwargs={"thinking": False}).parse(
        text, req, enable_auto_tools=True, model_output_token_ids=forced
    )
    assert calls and calls[0].name == "get_weather", (text, content, calls)
