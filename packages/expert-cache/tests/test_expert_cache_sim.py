"""simulate() basics and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from expert_cache import ExpertCacheConfig, SyntheticTraceConfig, generate, simulate
from expert_cache.sim import main


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    tr = generate(
        SyntheticTraceConfig(num_layers=4, num_experts=32, top_k=3, decode_steps=300, mean_decode_tokens=100, seed=5)
    )
    p = tmp_path_factory.mktemp("tr") / "t.npz"
    tr.save(p)
    return p


def test_cli_json(trace_path, capsys) -> None:
    assert main(["--trace", str(trace_path), "--slots", "20", "--policy", "lru", "--json", "--belady"]) == 0
    out = json.loads(capsys.readouterr().out)
    st = out["stats"]
    assert out["source"] == "synthetic" and out["config"]["policy"] == {"name": "lru"}
    assert st["num_slots"] == 20 and 0 < st["hit_rate"] < 1 and st["accesses"] == st["hits"] + st["misses"]
    assert out["belady_hit_rate"] >= st["hit_rate"]


def test_cli_as_module(trace_path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expert_cache.sim",
            "--trace",
            str(trace_path),
            "--slots",
            "16",
            "--policy",
            "decayed",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(r.stdout)["stats"]["num_slots"] == 16
    assert r.stderr == ""


def test_trace_cli(tmp_path) -> None:
    out = tmp_path / "g.npz"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expert_cache.trace",
            "--out",
            str(out),
            "--num-layers",
            "2",
            "--num-experts",
            "16",
            "--top-k",
            "2",
            "--decode-steps",
            "30",
            "--streams",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stderr == "" and "L=2 E=16 K=2" in r.stdout
    from expert_cache import load_trace

    tr = load_trace(out)
    assert tr.meta["generator"]["streams"] == 2 and int((tr.rows_per_step == 2).sum()) >= 30
    bad = subprocess.run(
        [sys.executable, "-m", "expert_cache.trace", "--out", str(out), "--streams", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "streams: must be an int >= 1" in bad.stderr


def test_cli_errors(trace_path, capsys) -> None:
    assert main(["--trace", str(trace_path), "--slots", "99999"]) == 2
    assert "num_slots: must be <=" in capsys.readouterr().err
    assert main(["--trace", str(trace_path) + ".missing", "--slots", "4"]) == 2
    assert "not a readable .npz" in capsys.readouterr().err


def test_geometry_mismatch(trace_path) -> None:
    from expert_cache import load_trace

    tr = load_trace(trace_path)
    with pytest.raises(ValueError, match="num_experts: config has 16, the trace has 32"):
        simulate(tr, ExpertCacheConfig(num_layers=4, num_experts=16, slot_bytes=1, num_slots=4))
    with pytest.raises(ValueError, match="num_layers: config has 3"):
        simulate(tr, ExpertCacheConfig(num_layers=3, num_experts=32, slot_bytes=1, num_slots=4))


def test_more_slots_never_hurt_the_decayed_policy_much(trace_path) -> None:
    from expert_cache import load_trace

    tr = load_trace(trace_path)
    rates = [
        simulate(tr, ExpertCacheConfig(num_layers=4, num_experts=32, slot_bytes=1, num_slots=n)).hit_rate
        for n in (8, 32, 128)
    ]
    assert rates[0] < rates[1] < rates[2]
    full = simulate(
        tr,
        ExpertCacheConfig(num_layers=4, num_experts=32, slot_bytes=1, num_slots=128, admit_limit=128, replan_every=1),
    )
    assert full.evicts == 0 and full.hit_rate > 0.9  # every key fits: only first touches miss
