"""The served demo equals the float64 numpy reference built from ``cpu_tier.exl3`` (``vllm_dsv41.reference``).

The running demo server (vLLM + this plugin: EXL3 attention dequantized at load, routed experts in the CPU
expert tier) returns the log-probabilities of every prompt position and of the generated tokens;
``ReferenceDemoModel`` recomputes them from the pack's files alone. Both run the same tokens, so any error in
the plugin's EXL3 loading, shard placement, expert routing hand-off or expert math shows up as a logprob gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsv41_server.testing import DemoServer
from vllm_dsv41.reference import ReferenceDemoModel

pytestmark = pytest.mark.slow

PROMPTS = [
    "The weather in Paris",
    "Hello world, what is the weather in Tokyo today? Please think step by step before you answer.",
    "one two three four five six seven eight nine ten, and then the model streams its experts",
    '{"name": "get_weather", "arguments": {"city": "London"}}',
]
#: float32 (vLLM) against float64 (reference) through 2 layers: measured gaps are ~1e-5.
ATOL = 2e-3


@pytest.fixture(scope="module")
def reference(demo_server: DemoServer) -> ReferenceDemoModel:
    return ReferenceDemoModel(demo_server.pack_dir)


@pytest.fixture(scope="module")
def client(demo_server: DemoServer) -> Any:
    from openai import OpenAI

    c = OpenAI(base_url=demo_server.base_url + "/v1", api_key=demo_server.api_key, max_retries=0, timeout=300)
    yield c
    c.close()


def _served(client: Any, prompt: str, max_tokens: int) -> Any:
    return client.completions.create(
        model="tiny-demo",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=5,
        extra_body={"prompt_logprobs": 5, "return_token_ids": True},
    ).choices[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_served_logprobs_equal_the_reference(client: Any, reference: ReferenceDemoModel, prompt: str) -> None:
    choice = _served(client, prompt, max_tokens=6)
    prompt_ids = choice.model_extra["prompt_token_ids"]
    out_ids = choice.model_extra["token_ids"]
    assert len(prompt_ids) >= 4 and len(out_ids) == 6
    ref = reference.logprobs(prompt_ids + out_ids)  # [T, vocab]

    gaps = []
    served_prompt = choice.model_extra["prompt_logprobs"]
    assert served_prompt[0] is None and len(served_prompt) == len(prompt_ids)
    for pos in range(1, len(prompt_ids)):
        entries = served_prompt[pos]
        assert str(prompt_ids[pos]) in entries  # the actual token is always reported
        for tok, entry in entries.items():
            gaps.append(abs(entry["logprob"] - ref[pos - 1, int(tok)]))
    for j, top in enumerate(choice.logprobs.top_logprobs):
        pos = len(prompt_ids) + j - 1
        # greedy: the served token is the reference's best (unless two candidates are within ATOL)
        best = np.sort(ref[pos])[-2:]
        if best[1] - best[0] > ATOL:
            assert out_ids[j] == int(np.argmax(ref[pos])), f"step {j}"
        gaps.append(abs(choice.logprobs.token_logprobs[j] - ref[pos, out_ids[j]]))
        assert top  # keyed by decoded text: random tokens that decode alike share one entry
    gaps_arr = np.array(gaps)
    assert gaps_arr.size > 20
    assert gaps_arr.max() < ATOL, f"max |served - reference| logprob = {gaps_arr.max():.3g}"


def test_reference_is_not_trivially_flat(demo_server: DemoServer, reference: ReferenceDemoModel) -> None:
    """The comparison above means something only if the logits depend on the experts: drop them and they move."""
    ids = list(range(3, 40))
    full = reference.logits(ids)
    experts = reference.experts
    saved = experts.forward
    try:
        experts.forward = lambda layer, x, ids_, w: np.zeros_like(x)  # type: ignore[method-assign]
        no_experts = reference.logits(ids)
    finally:
        experts.forward = saved  # type: ignore[method-assign]
    assert np.abs(full - no_experts).max() > 100 * ATOL
    assert Path(demo_server.pack_dir, "model.safetensors").is_file()
