"""CUDA graphs of the tiered runtime's no-sync paths: a decode-size layer call's GPU work replayed in one launch.

The device path (``TieredRuntime._begin_device``: every miss read over PCIe by the hit kernel, no host sync) queues
~10-25 kernel launches a layer call: the routing's preparation, the staging plan, per round of transient slots a
copy and the hit kernel's 5-7 launches; the stream-driven split (``_begin_stream`` / ``_finish_stream``) ~30 with
two CUDA host functions, the CPU tier's submit and wait. Each launch costs the host tens of microseconds of Python
and driver work, so on the H200 a 3-layer decode step spent 5.8-6.4 ms of host time in the device path's layer
calls against ~4 ms of GPU expert work (run 10): the step was the host's, not the GPU's. The work depends on the
call's shapes only (the rounds are ``ceil(picks / slots)`` whatever the misses), reads and writes persistent
buffers only, and never waits for the host thread (host functions are graph nodes), so it can be captured once
and replayed.

``DeviceGraphs.run(key, work)``: the first call of a key runs ``work`` eagerly (its kernels compile, exllamav3
autotunes the size); the second runs it eagerly and captures it into a graph; later calls replay the graph. A key
must name everything the captured work's addresses depend on (the caller's buffers, the kernels' scratch); the
caller clears the graphs when any of those is reallocated. A capture that fails raises (``GraphCaptureError``,
chained to the cause): a launch the capture forbids is a bug of the captured work, and a failed capture can leave
PyTorch's caching allocator mid-capture (frees deferred, an assertion at its next cache flush), so the process must
not go on as if nothing happened.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

__all__ = ["CudaGraph", "DeviceGraphs", "Graph", "GraphCaptureError"]

logger = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """A capture of ``DeviceGraphs.run``'s work failed (the cause chained)."""


class Graph(Protocol):
    """One captured piece of work."""

    def capture(self, work: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` captured on a side stream that waits for the current one (thread-local capture
    mode: other threads' CUDA calls, e.g. the CPU tier's host functions, do not invalidate it), its memory from a
    pool shared by the runtime's graphs; replayed on the current stream."""

    def __init__(self, device: torch.device, pool: Any, stream: torch.cuda.Stream) -> None:
        self.device, self.pool, self.stream = device, pool, stream
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, work: Callable[[], None]) -> None:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                work()
            except BaseException:
                with contextlib.suppress(Exception):  # (an invalidated capture's end fails too: the cause is above)
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(self.stream)
        self._graph = graph

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("CudaGraph: replay before capture")
        self._graph.replay()


class DeviceGraphs:
    """Graphs of keyed pieces of work (see the module docstring).

    Parameters
    ----------
    device : the CUDA device (``factory`` None), or any device with a ``factory``.
    max_graphs : graphs kept at most; keys beyond run eagerly, logged once (the runtime sizes it: MoE layers x 16
        decode sizes x graphs per call).
    factory : ``() -> Graph`` (default: ``CudaGraph`` on ``device``); tests inject one.
    """

    def __init__(self, device: torch.device, max_graphs: int = 1024,
                 factory: Callable[[], Graph] | None = None) -> None:  # fmt: skip
        if max_graphs < 1:
            raise ValueError(f"DeviceGraphs: max_graphs must be >= 1, got {max_graphs}")
        self.device = device
        self.max_graphs = max_graphs
        if factory is None:
            if device.type != "cuda":
                raise ValueError(f"DeviceGraphs: CUDA graphs need a CUDA device, got {device}")
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            factory = lambda: CudaGraph(device, pool, stream)  # noqa: E731
        self._factory = factory
        self._graphs: dict[Hashable, Graph] = {}
        self._seen: set[Hashable] = set()
        self._full_logged = False
        self.eager = 0  # calls run eagerly (first and second sightings, keys past max_graphs, graphs off)
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, work: Callable[[], None]) -> str:
        """Run ``work`` for ``key``: "replayed"; "captured" (run eagerly, then captured); "first" (run eagerly, its
        key's first call: captured at the next); "eager" (run eagerly, no room for another graph)."""
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return "replayed"
        work()
        self.eager += 1
        if len(self._graphs) >= self.max_graphs:
            if not self._full_logged:
                self._full_logged = True
                logger.warning("dsv41 tiered: layer_graphs: %d graphs held, the most allowed; the calls of new "
                               "shapes run eagerly", self.max_graphs)  # fmt: skip
            return "eager"
        if key not in self._seen:
            if len(self._seen) >= 4 * self.max_graphs:  # keys that never repeat (e.g. changing addresses)
                self._seen.clear()
            self._seen.add(key)
            return "first"
        graph = self._factory()
        try:
            graph.capture(work)
        except Exception as e:
            raise GraphCaptureError(f"layer_graphs: the capture of a layer call's GPU work failed ({type(e).__name__}: "
                                    f"{e}); serve without layer_graphs (--no-layer-graphs)") from e  # fmt: skip
        self._seen.discard(key)
        self._graphs[key] = graph
        self.captures += 1
        return "captured"

    def clear(self) -> None:
        """Drop every graph (the caller reallocated something they read: buffers, a kernel's scratch). On CUDA the
        device is synchronized first: a replay still queued must not outlive its graph."""
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._seen.clear()
