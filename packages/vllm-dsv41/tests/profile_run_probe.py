"""Run by ``test_vllm_dsv41_fidelity.test_profile_run_with_unwritten_attention``: the demo pack served by vLLM's CPU
build with its warm-up (memory-profiling) forward on, where vLLM's CPU attention returns its output buffer unwritten;
here that buffer is filled with NaN, the worst it may hold, so the test does not depend on what memory it reuses.
Prints the greedy token ids and ``OK``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patch below must reach the engine: one process


def main(pack: Path) -> None:
    from vllm import SamplingParams
    from vllm.v1.attention.backends import cpu_attn

    from vllm_dsv41.fidelity import build_llm

    forward = cpu_attn.CPUAttentionBackendImpl.forward
    seen = {"profile": 0}

    def nan_when_unwritten(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                           attn_metadata: Any, output: Any = None, *args: Any, **kw: Any) -> Any:  # fmt: skip
        if attn_metadata is None and output is not None:
            output.fill_(float("nan"))
            seen["profile"] += 1
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw)

    cpu_attn.CPUAttentionBackendImpl.forward = nan_when_unwritten  # type: ignore[method-assign]
    # vLLM's CPU runner runs its warm-up forward only when compiling: trace once with dynamo, run eagerly
    compiled = {"enforce_eager": False, "compilation_config": {"mode": 2, "backend": "eager"}}
    llm = build_llm(pack, runtime="cpu", max_model_len=256, extra=compiled)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0]
    assert seen["profile"] > 0, "no forward without attention metadata ran: the probe tested nothing"
    print(list(out.token_ids))
    print("OK")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
