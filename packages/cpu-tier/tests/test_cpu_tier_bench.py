"""The benchmark CLI (python -m cpu_tier.bench) on small shapes: it runs, and its JSON rows carry the probes, the
ceilings and the A/B rows it was asked for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cpu_tier import bench, runnable_isas

SIMD = [i for i in runnable_isas() if i != "scalar"]


@pytest.mark.skipif(not SIMD, reason="the host runs no SIMD variant (scalar-only x86-64)")
def test_quick_bench_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    isa = SIMD[-1]  # the least demanding SIMD variant here (avx2 where present)
    rc = bench.main(
        [
            "--quick",
            "--isa",
            isa,
            "--threads",
            "2",
            "--tokens",
            "1",
            "--iters",
            "1",
            "--cases",
            "fast,kernel",
            "--prefetch-blocks",
            "1,0",
            "--hugepages",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "probe/vector-ports" in text and "# --hugepages:" in text
    rows = json.loads(out.read_text())["rows"]
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    assert {r["threads"] for r in by_case["probe/stream-read"]} == {1, 2}
    for r in by_case["probe/band-read"]:
        assert (r["segment_bytes"], r["stride_bytes"]) == (768, 384 // 16 * 96)
        assert 0.05 < r["ratio_to_probe"] < 20  # the bytes it counts are the bytes it reads (not 1/3 or 3x more)
    ports = {r["threads"]: r for r in by_case["probe/vector-ports"]}
    assert ports[1]["effective_cores"] == pytest.approx(1.0) and ports[1]["steps_per_ns"] > 0.1
    assert 0.2 < ports[2]["effective_cores"] <= 2.0 + 1e-9
    assert len(ports[2]["per_worker_steps_per_ns"]) == 2
    for r in by_case["ceiling/kernel 1 band L2"]:
        assert r["Gweights_per_s"] > 0 and len(r["per_worker_Gw_s"]) == r["threads"]
    # the A/B rows: both prefetch distances, on the ordinary and the huge-page copy, at both thread counts
    for name in (
        "expert/mul1 K=3 fast pf1",
        "expert/mul1 K=3 fast pf0",
        "expert/mul1 K=3 fast huge pf1",
        "expert/mul1 K=3 fast huge pf0",
    ):
        assert {r["threads"] for r in by_case[name]} == {1, 2}, name
        for r in by_case[name]:
            assert r["GBps"] > 0 and r["ratio_to_probe"] > 0
            assert r["prefetch_blocks"] == (0 if name.endswith("pf0") else 1)


def test_band_read_rejects_bad_geometry() -> None:
    from cpu_tier import CpuTierConfig, ExpertTier

    with ExpertTier(CpuTierConfig(threads=1)) as tier:
        probes = tier._mod.bench  # the probes live in their own submodule, off the production Runtime
        assert not any(
            hasattr(tier._rt, f) for f in ("read_bandwidth", "clock_ghz", "port_rates", "kernel_band_seconds")
        )
        assert probes.read_bandwidth(tier._rt, 1 << 20, 1, 768, 768 * 4, 16) > 0
        for seg, stride, rows in ((100, 800, 4), (768, 1000, 4), (768, 768 * 4, 0), (768, 768 * 4, 10_000)):
            with pytest.raises(ValueError, match="read_bandwidth"):
                probes.read_bandwidth(tier._rt, 1 << 20, 1, seg, stride, rows)


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--prefetch-blocks", "5"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cases", "nope"])


@pytest.mark.skipif(not SIMD, reason="the host runs no SIMD variant (scalar-only x86-64)")
def test_anchor_rows_and_rounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--anchor runs the given exl3-cpu-anchor binary (here a stand-in script that checks its arguments and the tier
    and pinning it is asked for, and prints a RESULT line) interleaved with our m=1 fast case over --rounds, and a
    summary row gives min/median/max and the speedup of medians."""
    fake = tmp_path / "bench_a"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = time ] && [ "$5" = job ] || exit 3\n'
        '[ "$EXL3_MOE_CPU_MAX_ISA" = avx2 ] || [ "$EXL3_MOE_CPU_MAX_ISA" = vbmi ] || exit 4\n'
        '[ "$EXL3_MOE_CPU_PIN" = 0 ] || exit 5\n'
        'echo "RESULT kernel=A tier=$EXL3_MOE_CPU_MAX_ISA swz_group=2 planar=1 mode=job threads=$2 experts=$3 '
        "passes=9 wall_s=0.10 build_s=0.1 ms_med=4.0000 ms_min=3.5000 ms_max=5.0000 GBps=3.318 "
        'GBps_per_thread=3.318 out_rms=1.570"\n'
    )
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    isa = SIMD[-1]
    rc = bench.main(
        [
            "--quick",
            "--isa",
            isa,
            "--threads",
            "2",
            "--tokens",
            "1",
            "--iters",
            "1",
            "--cases",
            "fast",
            "--rounds",
            "3",
            "--anchor",
            str(fake),
            "--anchor-seconds",
            "0.1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert "summary (ms/expert min/med/max)" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    for thr in (1, 2):
        anchors = [r for r in rows if r["case"].startswith("anchor/exllamav3") and r["threads"] == thr]
        ours = [r for r in rows if r["case"] == "expert/mul1 K=3 fast" and r["threads"] == thr]
        assert len(anchors) == len(ours) == 3 and [r["round"] for r in ours] == [0, 1, 2]
        assert all(r["ms_per_expert"] == 4.0 and r["max_ms"] == 5.0 for r in anchors)
        assert all(len(r["job_ms_per_expert"]) == 1 and r["p10_ms"] <= r["ms_per_expert"] <= r["p90_ms"] for r in ours)
        (s,) = [r for r in rows if r["case"] == "summary/expert/mul1 K=3 fast" and r["threads"] == thr]
        assert s["anchor_ms_min_med_max"] == [4.0, 4.0, 4.0] and len(s["speedup_over_anchor_per_round"]) == 3
        assert s["speedup_over_anchor_of_medians"] == pytest.approx(4.0 / s["ours_ms_min_med_max"][1])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--anchor", str(tmp_path / "missing")])


@pytest.mark.skipif(not SIMD, reason="the host runs no SIMD variant (scalar-only x86-64)")
@pytest.mark.parametrize("rounds", [1, 2])
def test_exact_at_every_tokens_beside_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str], rounds: int) -> None:
    """--cases fast,exact runs exact at every --tokens beside fast at the same m, round by round (fast then exact in
    even rounds, exact then fast in odd ones), and a summary row per m gives exact's time over fast's (the medians of
    the rounds)."""
    out = tmp_path / "bench.json"
    argv = ["--quick", "--isa", SIMD[-1], "--threads", "1", "--tokens", "1,3", "--iters", "1", "--cases", "fast,exact"]
    assert bench.main([*argv, "--rounds", str(rounds), "--json", str(out)]) == 0
    assert "exact's time" in capsys.readouterr().out
    rows = [r for r in json.loads(out.read_text())["rows"] if r["case"].startswith(("expert/", "summary/"))]
    order = [(r["case"].split(" ")[-1], r["tokens"], r.get("round")) for r in rows]
    for m in (1, 3):
        want = [("fast", m, 0), ("exact", m, 0)]
        if rounds == 2:
            want += [("exact", m, 1), ("fast", m, 1), ("fast", m, None)]
        want += [("exact", m, None)]
        assert order[: len(want)] == want, (m, order)
        order = order[len(want) :]
    assert not order
    for m in (1, 3):
        fast = [r["ms_per_expert"] for r in rows if r.get("precision") == "fast" and r["tokens"] == m]
        exact = [r["ms_per_expert"] for r in rows if r.get("precision") == "exact" and r["tokens"] == m]
        assert len(fast) == len(exact) == rounds
        (s,) = [r for r in rows if r["case"] == "summary/expert/mul1 K=3 exact" and r["tokens"] == m]
        assert s["exact_over_fast_of_medians"] == pytest.approx(float(np.median(exact) / np.median(fast)))
