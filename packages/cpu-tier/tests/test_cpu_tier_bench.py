"""The benchmark CLI (python -m cpu_tier.bench) on small shapes: it runs, and its JSON rows carry the probes, the
ceilings and the A/B rows it was asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpu_tier import bench, runnable_isas

SIMD = [i for i in runnable_isas() if i != "scalar"]


@pytest.mark.skipif(not SIMD, reason="the host runs no SIMD variant (scalar-only x86-64)")
def test_quick_bench_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    isa = SIMD[-1]  # the least demanding SIMD variant here (avx2 where present)
    rc = bench.main(["--quick", "--isa", isa, "--threads", "2", "--tokens", "1", "--iters", "1",
                     "--cases", "fast,kernel", "--prefetch-blocks", "1,0", "--hugepages", "--json", str(out)])
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
    for name in ("expert/mul1 K=3 fast pf1", "expert/mul1 K=3 fast pf0", "expert/mul1 K=3 fast huge pf1",
                 "expert/mul1 K=3 fast huge pf0"):
        assert {r["threads"] for r in by_case[name]} == {1, 2}, name
        for r in by_case[name]:
            assert r["GBps"] > 0 and r["ratio_to_probe"] > 0
            assert r["prefetch_blocks"] == (0 if name.endswith("pf0") else 1)


def test_band_read_rejects_bad_geometry() -> None:
    from cpu_tier import CpuTierConfig, ExpertTier

    with ExpertTier(CpuTierConfig(threads=1)) as tier:
        probes = tier._mod.bench  # the probes live in their own submodule, off the production Runtime
        assert not any(hasattr(tier._rt, f) for f in ("read_bandwidth", "clock_ghz", "port_rates", "kernel_band_seconds"))
        assert probes.read_bandwidth(tier._rt, 1 << 20, 1, 768, 768 * 4, 16) > 0
        for seg, stride, rows in ((100, 800, 4), (768, 1000, 4), (768, 768 * 4, 0), (768, 768 * 4, 10_000)):
            with pytest.raises(ValueError, match="read_bandwidth"):
                probes.read_bandwidth(tier._rt, 1 << 20, 1, seg, stride, rows)


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--prefetch-blocks", "5"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cases", "nope"])
