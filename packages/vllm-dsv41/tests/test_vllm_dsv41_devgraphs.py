"""devgraphs.DeviceGraphs' bookkeeping with an injected graph (the CUDA graphs themselves: the GPU test in
test_vllm_dsv41_tiered.py, ``test_on_the_gpu_layer_graphs_replay_the_device_path``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from vllm_dsv41.devgraphs import DeviceGraphs, GraphCaptureError


class _Graph:
    """Records its capture; a replay runs the captured work again (what a CUDA graph's replay does on the device)."""

    made: list[_Graph] = []

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.work: Callable[[], None] | None = None
        self.replays = 0
        _Graph.made.append(self)

    def capture(self, work: Callable[[], None]) -> None:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.work = work

    def replay(self) -> None:
        assert self.work is not None
        self.replays += 1
        self.work()


def test_a_key_runs_eagerly_twice_is_captured_on_the_second_call_and_replayed_after() -> None:
    _Graph.made.clear()
    g = DeviceGraphs(torch.device("cpu"), factory=_Graph)
    calls: list[str] = []
    assert [g.run("a", lambda: calls.append("a")) for _ in range(4)] == ["first", "captured", "replayed", "replayed"]
    assert calls == ["a"] * 4  # every call's work done once: eagerly twice (a capture runs nothing), then replays
    assert (g.eager, g.captures, g.replays, len(g)) == (2, 1, 2, 1)
    assert len(_Graph.made) == 1 and _Graph.made[0].replays == 2
    assert g.run("b", lambda: calls.append("b")) == "first"  # another key: its own count
    g.clear()
    assert len(g) == 0 and g.run("a", lambda: calls.append("a")) == "first"  # cleared: seen afresh


def test_keys_past_the_limit_stay_eager(caplog: pytest.LogCaptureFixture) -> None:
    g = DeviceGraphs(torch.device("cpu"), max_graphs=2, factory=_Graph)
    for key in "abc":
        for _ in range(3):
            g.run(key, lambda: None)
    assert len(g) == 2 and g.captures == 2 and g.run("c", lambda: None) == "eager"
    assert sum("the most allowed" in r.getMessage() for r in caplog.records) == 1  # said once
    with pytest.raises(ValueError, match="max_graphs"):
        DeviceGraphs(torch.device("cpu"), max_graphs=0, factory=_Graph)


def test_a_failed_capture_raises_with_its_cause() -> None:
    # (a launch the capture forbids is a bug of the captured work; a failed CUDA capture can leave the caching
    # allocator mid-capture, so nothing goes on as if it had not happened)
    g = DeviceGraphs(torch.device("cpu"), factory=lambda: _Graph(fail=True))
    calls: list[int] = []
    assert g.run("a", lambda: calls.append(1)) == "first"
    with pytest.raises(GraphCaptureError, match="layer_graphs: the capture .* failed .*operation not permitted") as e:
        g.run("a", lambda: calls.append(1))
    assert isinstance(e.value.__cause__, RuntimeError) and calls == [1, 1] and len(g) == 0


def test_cuda_graphs_need_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceGraphs(torch.device("cpu"))
