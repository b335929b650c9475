"""The served-decode bench's step accounting (``benches/bench_served_decode.py``): the per-run parts of a decode
step from the tiered runtime's counters, and the line that reports them."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _bench() -> Any:
    name = "bench_served_decode"
    if name not in sys.modules:  # (registered before it runs: its dataclasses look their module up)
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "benches" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _counters(**kw: float) -> dict[str, float]:
    b = _bench()
    return {k: float(kw.get(k, 0.0)) for k in b._PART_FIELDS}


def test_step_parts_are_per_step_differences() -> None:
    b = _bench()
    before = _counters(steps=10, layer_seconds=1.0, cpu_run_seconds=0.5, cpu_pred_seconds=0.4, cpu_seconds=0.6,
                       cpu_wait_seconds=0.55, wait_seconds=0.01, begin_seconds=0.2, device_steps=2)  # fmt: skip
    after = _counters(steps=110, layer_seconds=4.0, cpu_run_seconds=2.5, cpu_pred_seconds=2.0, cpu_seconds=2.8,
                      cpu_wait_seconds=2.45, wait_seconds=0.02, pcie_enqueue_seconds=0.1, begin_seconds=0.7,
                      bookkeeping_seconds=0.1, submit_seconds=0.05, finish_seconds=0.2, device_steps=52)  # fmt: skip
    p = b.step_parts(before, after)
    assert p["steps"] == 100
    assert p["layer_ms"] == pytest.approx(30.0)
    assert p["cpu_run_ms"] == pytest.approx(20.0) and p["cpu_pred_ms"] == pytest.approx(16.0)
    assert p["cpu_ms"] == pytest.approx(22.0) and p["cpu_wait_ms"] == pytest.approx(19.0)
    assert p["wait_ms"] == pytest.approx(0.1) and p["pcie_enqueue_ms"] == pytest.approx(1.0)
    assert p["device_share"] == pytest.approx(0.5)
    assert p["begin_ms"] == pytest.approx(5.0) and p["bookkeeping_ms"] == pytest.approx(1.0)
    assert p["submit_ms"] == pytest.approx(0.5) and p["finish_ms"] == pytest.approx(2.0)
    assert b.step_parts(before, before) == {}  # no decode step counted: no parts (not a division by zero)


def test_parts_line_takes_the_median_run() -> None:
    b = _bench()
    runs = []
    for step_ms, cpu_run in ((40.0, 25.0), (35.0, 21.0), (50.0, 30.0)):
        before = _counters()
        after = _counters(steps=100, layer_seconds=(step_ms - 4.0) / 10, cpu_run_seconds=cpu_run / 10,
                          cpu_pred_seconds=2.0, cpu_seconds=(cpu_run + 1.0) / 10, cpu_wait_seconds=cpu_run / 10,
                          begin_seconds=0.6, bookkeeping_seconds=0.2, submit_seconds=0.05,
                          finish_seconds=0.3)  # fmt: skip
        runs.append({"step_s": step_ms / 1e3, "parts": b.step_parts(before, after)})
    line = b.parts_line(runs, 3.5)
    # the median run is the 40 ms one: 36 ms in the MoE layer calls, 4 outside; its job 25 ms against 20 predicted
    assert "MoE layer calls 36.00 ms" in line and "outside them 4.00 ms" in line
    assert "ran 25.00, predicted 20.00: x1.25" in line
    assert "other host work 11.00" in line and "experts off: 3.50 ms" in line
    # begin 6, finish 3, bookkeeping 2: 0 ms between them (36 - 25 - 6 - 3 - 2)
    assert "begin 6.00 (input wait" in line and "submit 0.50" in line and "the step's bookkeeping 2.00" in line
    assert "between begin and finish (the shared expert's launches) 0.00" in line
    assert "the stream held" not in line
    assert "finish less its wait 3.00" in line
    assert "device path" not in line
    assert b.parts_line([{"step_s": 0.01, "parts": {}}], None) == ""  # runtimes without counters: no line


def test_pstats_text_names_the_hot_functions() -> None:
    """The cProfile tables: any code by own time, and ours by cumulative time (the filter names our packages)."""
    import cProfile

    b = _bench()

    def busy() -> int:
        return sum(i * i for i in range(20000))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        busy()
    prof.disable()
    text = b.pstats_text(prof, "unit", 0.0123, rows=10)
    assert text.startswith("cProfile unit: wall 12.3 ms")
    own, ours = text.split("== ours, by cumulative time ==")
    assert "busy" in own and "by own time" in own
    assert "busy" not in ours  # this test's code is not in our packages: the filter leaves it out
    assert re.search(b._OUR_CODE, "/x/site-packages/vllm_dsv41/tiered.py:900(begin)")
    assert re.search(b._OUR_CODE, "/work/packages/cpu-tier/src/cpu_tier/tier.py:10(submit)")
    assert not re.search(b._OUR_CODE, "/work/packages/vllm-dsv41/tests/test_vllm_dsv41_tiered.py:5(_step)")


def test_tiered_cases_name_a_split_then_their_flags_in_order() -> None:
    b = _bench()
    assert b._tiered_case("auto") == ("auto", ())
    assert b._tiered_case("cpu+stream") == ("cpu", ("stream",))
    assert b._tiered_case("auto+stream+graphs") == ("auto", ("stream", "graphs"))
    assert b._tiered_case("pcie+graphs") == ("pcie", ("graphs",))
    for bad in ("gpu", "auto+graphs+stream", "auto+stream+stream", "auto+", "cpu+fast"):
        assert b._tiered_case(bad) is None, bad
