"""The ``dsv41_*`` metrics: recorded in one process, collected in another (as the engine and the API server
do), and scraped from the running demo server's ``/metrics``."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

RECORD = """
import sys
from vllm_dsv41 import metrics as m
cpu = m.tier("cpu")
cpu.forward(0.002, picks=12)
cpu.forward(0.003, picks=4)
m.tier("gpu_cache").forward(0.0005, picks=30)
m.cache_lookups(hits=30, misses=10)
m.cache_fill(experts=2, nbytes=4096)
m.staged_prefill(nbytes=8_000_000_000, seconds=0.5)
m.cpu_deadline_miss(recomputed_picks=7)
m.engram_gather(0.0002)
try:
    m.tier("tpu")
except ValueError as e:
    print(e)
"""


def _collect(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name.startswith("dsv41_")
    }


def test_metrics_cross_processes_through_the_multiprocess_directory(tmp_path: Path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for _ in range(2):  # two processes (an engine restarted, or the engine and the API server): values add up
        proc = subprocess.run([sys.executable, "-c", RECORD], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "tier: expected one of ('cpu', 'gpu', 'gpu_cache', 'pcie', 'streamed'), got 'tpu'" in proc.stdout
    v = _collect(tmp_path)
    assert v["dsv41_expert_forward_seconds_count", (("tier", "cpu"),)] == 4
    assert v["dsv41_expert_forward_seconds_sum", (("tier", "cpu"),)] == pytest.approx(0.010)
    assert v["dsv41_expert_forward_seconds_bucket", (("le", "0.0025"), ("tier", "cpu"))] == 2
    assert v["dsv41_expert_picks_total", (("tier", "cpu"),)] == 32
    assert v["dsv41_expert_picks_total", (("tier", "gpu_cache"),)] == 60
    assert v["dsv41_expert_picks_total", (("tier", "streamed"),)] == 0  # every tier's series exists
    assert v["dsv41_expert_picks_total", (("tier", "gpu"),)] == 0
    assert v["dsv41_expert_cache_lookups_total", (("result", "hit"),)] == 60
    assert v["dsv41_expert_cache_lookups_total", (("result", "miss"),)] == 20
    assert v["dsv41_expert_cache_fills_total", ()] == 4
    assert v["dsv41_expert_cache_fill_bytes_total", ()] == 8192
    assert v["dsv41_prefill_staged_bytes_total", ()] == 16e9
    assert v["dsv41_prefill_staged_seconds_total", ()] == 1.0
    assert v["dsv41_prefill_staged_gbps_sum", ()] == pytest.approx(32.0)  # two transfers at 16 GB/s
    assert v["dsv41_prefill_staged_gbps_bucket", (("le", "14.0"),)] == 0
    assert v["dsv41_prefill_staged_gbps_bucket", (("le", "16.0"),)] == 2
    assert v["dsv41_cpu_deadline_misses_total", ()] == 2
    assert v["dsv41_cpu_recomputed_picks_total", ()] == 14
    assert v["dsv41_engram_gather_seconds_count", ()] == 2


# ------------------------------------------------------------------------------------- the demo server


def _scrape(server: Any) -> dict[tuple[str, str], float]:
    """``{(name, labels as written): value}`` of the server's ``dsv41_*`` lines."""
    r = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line.startswith("dsv41_"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            out[name, labels.rstrip("}")] = float(value)
    return out


@pytest.mark.slow
def test_metrics_on_the_server_are_documented_present_and_move(demo_server: Any, client: Any) -> None:
    text = httpx.get(demo_server.base_url + "/metrics", headers={"Authorization": f"Bearer {demo_server.api_key}"},
                     timeout=30).text  # fmt: skip
    for name in ("dsv41_expert_forward_seconds", "dsv41_expert_picks", "dsv41_expert_cache_lookups",
                 "dsv41_expert_cache_fills", "dsv41_expert_cache_fill_bytes", "dsv41_prefill_staged_bytes",
                 "dsv41_prefill_staged_seconds", "dsv41_prefill_staged_gbps", "dsv41_cpu_deadline_misses",
                 "dsv41_cpu_recomputed_picks", "dsv41_engram_gather_seconds"):  # fmt: skip
        assert f"# HELP {name} " in text or f"# HELP {name}_total " in text, name  # counters: with _total
    before = _scrape(demo_server)
    for tier in ("cpu", "gpu", "gpu_cache", "pcie", "streamed"):
        assert ("dsv41_expert_picks_total", f'tier="{tier}"') in before
    nonce = secrets.token_hex(8)  # a prompt no earlier request shares a prefix-cache block with: all of it is computed
    r = client.chat.completions.create(
        model="tiny-demo", messages=[{"role": "user", "content": f"{nonce} Count the experts."}], max_tokens=5,
        temperature=0.0,
    )  # fmt: skip
    after = _scrape(demo_server)
    def moved(name: str) -> float:
        return after[name, 'tier="cpu"'] - before[name, 'tier="cpu"']

    calls, seconds = moved("dsv41_expert_forward_seconds_count"), moved("dsv41_expert_forward_seconds_sum")
    picks = moved("dsv41_expert_picks_total")
    # The demo: 2 MoE layers, top-2 of 8 experts. Every step (prefill, then one per further token) calls each layer
    # once, and every token of the prompt and of the answer but the last is routed to 2 experts in each layer.
    tokens = r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert calls == 2 * r.usage.completion_tokens, (calls, r.usage)
    assert picks == 2 * 2 * tokens, (picks, r.usage)
    assert 0 < seconds < 60
    for tier in ("gpu", "gpu_cache", "pcie", "streamed"):  # the CPU runtime computes every pick
        assert after["dsv41_expert_picks_total", f'tier="{tier}"'] == 0
    assert httpx.get(demo_server.base_url + "/metrics", timeout=30).status_code == 401
