"""Streams, events, copies and launches: the real CUDA device and a timed fake one for CPU tests.

The staging ring and the prefill runner talk to a ``Device``. ``CudaDevice`` maps each call onto torch CUDA
streams and events. ``FakeDevice`` queues the same calls and replays them with the semantics of CUDA streams
(FIFO per stream; ``wait`` blocks on the *latest record issued before it*, or not at all if there is none),
giving every copy a duration of ``bytes / copy rate`` and every launch its ``cost``. The replay checks that no
staging-slot row is overwritten while a launch that reads it runs, and that every launch reads the rows it
expects; the op intervals give busy fractions exactly like the CUDA timing events do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["CudaDevice", "Device", "FakeDevice", "FakeOp", "RowTag"]

#: ``(slot, row, (layer, expert))``: which expert record a copy writes into / a launch reads from a slot row.
RowTag = tuple[int, int, tuple[int, int]]


class Device(Protocol):
    """What the ring and the runner need from a device."""

    def alloc(self, nbytes: int) -> torch.Tensor: ...

    def new_stream(self, name: str) -> Any: ...

    def current_stream(self) -> Any: ...

    def new_event(self, timing: bool = False) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, *, writes: Sequence[RowTag] = ()) -> None: ...

    def launch(
        self,
        stream: Any,
        fn: Callable[[], None] | None,
        *,
        reads: Sequence[RowTag] = (),
        label: str = "",
        cost: float = 0.0,
    ) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def synchronize(self) -> None: ...


class CudaDevice:
    """The real thing: torch CUDA streams and events on ``device``."""

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice: CUDA is not available")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaDevice needs a cuda device, got {self.device}")

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def copy(
        self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, *, writes: Sequence[RowTag] = ()
    ) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def launch(
        self,
        stream: torch.cuda.Stream,
        fn: Callable[[], None] | None,
        *,
        reads: Sequence[RowTag] = (),
        label: str = "",
        cost: float = 0.0,
    ) -> None:
        if fn is not None:
            with torch.cuda.stream(stream):
                fn()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------------------ fake


@dataclasses.dataclass(eq=False)
class FakeStream:
    name: str
    queue: list[FakeOp] = dataclasses.field(default_factory=list)
    time: float = 0.0


@dataclasses.dataclass(eq=False)
class FakeEvent:
    last: FakeOp | None = None  # the latest record issued on the host


@dataclasses.dataclass(eq=False)
class FakeOp:
    """One queued operation; ``start``/``end`` (seconds) are set when the replay runs it."""

    kind: str  # "copy" | "launch" | "record" | "wait"
    stream: str
    label: str = ""
    duration: float = 0.0
    fn: Callable[[], None] | None = None
    dep: FakeOp | None = None  # for "wait": the record it waits on
    writes: Sequence[RowTag] = ()
    reads: Sequence[RowTag] = ()
    nbytes: int = 0
    start: float | None = None
    end: float | None = None


class FakeDevice:
    """A deterministic, timed stand-in for a GPU with one copy engine and one compute engine.

    Parameters
    ----------
    copy_gbps : copy rate in GB/s (1e9 bytes per second).
    launch_cost : cost (seconds) of a launch given without ``cost``: a number, or a function of its label.
    """

    def __init__(self, copy_gbps: float = 25.0, launch_cost: float | Callable[[str], float] = 0.0) -> None:
        if copy_gbps <= 0:
            raise ValueError(f"copy_gbps must be positive, got {copy_gbps}")
        self.copy_gbps = copy_gbps
        self.launch_cost = launch_cost
        self.streams: dict[str, FakeStream] = {}
        self._default = self.new_stream("compute")
        self.trace: list[FakeOp] = []
        self.violations: list[str] = []
        self._row_state: dict[tuple[int, int], tuple[tuple[int, int], float]] = {}
        self._row_last_read_end: dict[tuple[int, int], float] = {}
        self._host_time = 0.0

    # ------------------------------------------------------------------ Device API

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # poison: stale bytes never look like data

    def new_stream(self, name: str) -> FakeStream:
        if name in self.streams:
            name = f"{name}#{len(self.streams)}"
        s = FakeStream(name)
        self.streams[name] = s
        return s

    def current_stream(self) -> FakeStream:
        return self._default

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent()

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        op = FakeOp("record", stream.name)
        event.last = op
        stream.queue.append(op)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        stream.queue.append(FakeOp("wait", stream.name, dep=event.last))

    def copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor, *, writes: Sequence[RowTag] = ()) -> None:
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise ValueError(f"copy size mismatch: dst {tuple(dst.shape)} src {tuple(src.shape)}")
        nbytes = src.numel() * src.element_size()

        def fn() -> None:
            dst.copy_(src)

        stream.queue.append(
            FakeOp(
                "copy",
                stream.name,
                duration=nbytes / (self.copy_gbps * 1e9),
                fn=fn,
                writes=tuple(writes),
                nbytes=nbytes,
            )
        )

    def launch(
        self,
        stream: FakeStream,
        fn: Callable[[], None] | None,
        *,
        reads: Sequence[RowTag] = (),
        label: str = "",
        cost: float | None = None,
    ) -> None:
        stream.queue.append(
            FakeOp(
                "launch", stream.name, label=label, duration=self._cost(label) if cost is None else cost, fn=fn,
                reads=tuple(reads),
            )
        )  # fmt: skip

    def _cost(self, label: str) -> float:
        return self.launch_cost(label) if callable(self.launch_cost) else float(self.launch_cost)

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        if start.last is None or end.last is None or start.last.end is None or end.last.end is None:
            raise RuntimeError("elapsed_ms: an event was not recorded or not yet replayed (call synchronize)")
        return (end.last.end - start.last.end) * 1e3

    def synchronize(self, stream: FakeStream | None = None) -> None:
        """Replay every queued op in time order (the earliest possible start first).

        The host then continues at the end of ``stream`` (like ``cudaStreamSynchronize``), or of the whole
        device when ``stream`` is None: later ops start no earlier than that.
        """
        while True:
            best: tuple[float, str, FakeStream] | None = None
            for s in self.streams.values():
                if not s.queue:
                    continue
                op = s.queue[0]
                start = max(s.time, self._host_time)
                if op.kind == "wait" and op.dep is not None:
                    if op.dep.end is None:
                        continue  # the record it waits on has not run yet
                    start = max(start, op.dep.end)
                if best is None or (start, s.name) < best[:2]:
                    best = (start, s.name, s)
            if best is None:
                stuck = {s.name: s.queue[0].kind for s in self.streams.values() if s.queue}
                if stuck:
                    raise RuntimeError(f"FakeDevice deadlock: streams blocked at {stuck}")
                break
            start, _, s = best
            op = s.queue.pop(0)
            self._run(op, start)
            s.time = op.end  # type: ignore[assignment]
        ends = [s.time for s in self.streams.values()] if stream is None else [stream.time]
        self._host_time = max([self._host_time, *ends])

    # ------------------------------------------------------------------ replay

    def _run(self, op: FakeOp, start: float) -> None:
        op.start = start
        op.end = start + op.duration
        for slot, row, tag in op.writes:
            last_read = self._row_last_read_end.get((slot, row), float("-inf"))
            if last_read > start:
                self.violations.append(
                    f"copy of {tag} into slot {slot} row {row} starts at {start:.6f}s while a launch reads it "
                    f"until {last_read:.6f}s"
                )
        for slot, row, tag in op.reads:
            have = self._row_state.get((slot, row))
            if have is None or have[0] != tag:
                self.violations.append(
                    f"launch {op.label!r} expects {tag} in slot {slot} row {row}, finds {have[0] if have else None}"
                )
            elif have[1] > start:
                self.violations.append(
                    f"launch {op.label!r} reads slot {slot} row {row} at {start:.6f}s before its copy ends at "
                    f"{have[1]:.6f}s"
                )
            self._row_last_read_end[(slot, row)] = max(self._row_last_read_end.get((slot, row), 0.0), op.end)
        for slot, row, tag in op.writes:
            self._row_state[(slot, row)] = (tag, op.end)
        if op.fn is not None:
            op.fn()
        self.trace.append(op)

    # ------------------------------------------------------------------ analysis

    def busy(self, kind: str, since: float = 0.0) -> float:
        """Seconds the ops of ``kind`` ("copy" or "launch") ran after ``since`` (one engine each: no overlap)."""
        return sum(
            op.end - max(op.start, since)
            for op in self.trace
            if op.kind == kind and op.start is not None and op.end is not None and op.end > since
        )

    @property
    def now(self) -> float:
        return self._host_time
