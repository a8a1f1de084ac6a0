"""Where copies run: CUDA copy streams and events, or a simulation of them on the CPU.

The streamed transfer speaks to a :class:`StreamBackend`: the current (compute) stream, one copy stream per
direction, events, device-side waits and asynchronous copies. :class:`CudaStreams` is the real thing. Streams are
created once per device and process (creating them per step grows reserved memory), lazily, so objects that hold
an engine can still be pickled (``ddp_spawn``); one stream per direction, since several in one direction add no
PCIe bandwidth. :class:`SimulatedStreams` runs the same bookkeeping on CPU tensors: a copy is queued and runs only
later (when something waits for it, or once ``lag`` operations queue behind it), so a test sees every ordering
mistake the GPU would make: a copy that reads its source after an in-place write, a buffer reused too early.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

_CUDA_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_CUDA_BANDWIDTH: dict[int, float] = {}  # device index -> measured device -> host bytes per ms
_LOCK = threading.Lock()
_CALIBRATION_BYTES = 64 << 20


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...


class StreamBackend(Protocol):
    """What the streamed transfer needs of a device's streams."""

    d2h: Any  # the device -> host copy stream
    h2d: Any  # the host -> device copy stream

    def current(self) -> Any: ...
    def record(self, stream: Any, timing: bool = False) -> Event: ...
    def wait_event(self, stream: Any, event: Event) -> None: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...
    def link_bytes_per_ms(self) -> float: ...
    def synchronize(self) -> None: ...


class CudaStreams:
    """The two copy streams of one CUDA device and its current stream."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with _LOCK:
            streams = _CUDA_STREAMS.get(index)
            if streams is None:
                with torch.cuda.device(index):
                    streams = _CUDA_STREAMS[index] = (torch.cuda.Stream(), torch.cuda.Stream())
        self.d2h, self.h2d = streams

    def current(self) -> torch.cuda.Stream:
        # Asked at every call, never cached: checkpoint recompute, FSDP and custom Functions run on other streams.
        return torch.cuda.current_stream(self.device)

    def record(self, stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def link_bytes_per_ms(self) -> float:
        """Pinned device -> host bandwidth, measured once per process (one short synchronizing copy)."""
        index = self.device.index
        rate = _CUDA_BANDWIDTH.get(index)
        if rate is None:
            with torch.cuda.device(index):
                src = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, device=self.device)
                dst = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, pin_memory=True)
                dst.copy_(src, non_blocking=True)  # warm-up
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(3):
                    dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                rate = _CUDA_BANDWIDTH[index] = 3 * _CALIBRATION_BYTES / max(begin.elapsed_time(end), 1e-3)
        return rate

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()


class SimulatedStream:
    """A queue of operations that run in order, later: the CPU's stand-in for a CUDA copy stream."""

    def __init__(self, sim: SimulatedStreams, name: str) -> None:
        self.sim, self.name = sim, name
        self.ops: deque[Callable[[], None]] = deque()
        self.queued = 0  # operations ever queued
        self.done = 0  # operations ever run

    def push(self, op: Callable[[], None]) -> int:
        self.ops.append(op)
        self.queued += 1
        ticket = self.queued
        self.sim.progress(self)
        return ticket

    def run_until(self, ticket: int) -> None:
        while self.done < ticket:
            op = self.ops.popleft()
            self.done += 1
            op()


class SimulatedEvent:
    """Done once its stream ran every operation queued before it; its time is the simulated clock then."""

    def __init__(self, stream: SimulatedStream | None, time_ms: float = 0.0) -> None:
        self.stream = stream
        self.ticket = 0
        self.time_ms = time_ms

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.ticket

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.ticket)

    def elapsed_time(self, end: SimulatedEvent) -> float:
        self.synchronize()
        end.synchronize()
        return end.time_ms - self.time_ms


class SimulatedStreams:
    """Copy streams simulated on the CPU, for tests and CI: the streamed bookkeeping without a GPU.

    The compute stream is the host itself (its work is done when queued). Copy-stream operations wait in a queue
    and run when something waits for them, or once more than ``lag`` operations are queued behind them on the same
    stream (``lag=None``: only when waited for). A copy advances a simulated clock by its bytes over
    ``bytes_per_ms`` (unless ``copies_take_time=False``: a link that runs beside compute); :meth:`advance` moves it
    for simulated compute.

    Attributes:
        log: ``(stream name, bytes)`` of every copy, in the order the copies ran.
        max_queued_bytes: per copy stream, the most bytes of copies queued and not yet run.
    """

    compute = None  # the compute stream: the host

    def __init__(
        self, lag: int | None = 4, bytes_per_ms: float = float(1 << 20), copies_take_time: bool = True
    ) -> None:
        self.lag = lag
        self.bytes_per_ms = bytes_per_ms
        self.copies_take_time = copies_take_time
        self.clock_ms = 0.0
        self.d2h = SimulatedStream(self, "d2h")
        self.h2d = SimulatedStream(self, "h2d")
        self.log: list[tuple[str, int]] = []
        self._queued_bytes = {"d2h": 0, "h2d": 0}
        self.max_queued_bytes = {"d2h": 0, "h2d": 0}

    def advance(self, ms: float) -> None:
        """Simulated compute time passes."""
        self.clock_ms += ms

    def progress(self, stream: SimulatedStream) -> None:
        if self.lag is not None:
            stream.run_until(stream.queued - self.lag)

    def current(self) -> None:
        return self.compute

    def record(self, stream: SimulatedStream | None, timing: bool = False) -> SimulatedEvent:
        event = SimulatedEvent(stream, self.clock_ms)
        if stream is not None:

            def mark() -> None:
                event.time_ms = self.clock_ms

            event.ticket = stream.queued + 1  # the mark itself: done once everything before it ran
            stream.push(mark)
        return event

    def wait_event(self, stream: SimulatedStream | None, event: SimulatedEvent) -> None:
        if stream is None:
            event.synchronize()  # the host waits: the device runs everything up to the event now
        elif event.stream is not None and event.stream is not stream:
            stream.push(event.synchronize)  # a later operation of this stream starts only after the event

    def wait_stream(self, stream: SimulatedStream | None, other: SimulatedStream | None) -> None:
        if other is not None and other is not stream:
            self.wait_event(stream, self.record(other))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimulatedStream) -> None:
        nbytes = src.numel() * src.element_size()
        queued = self._queued_bytes
        queued[stream.name] += nbytes
        self.max_queued_bytes[stream.name] = max(self.max_queued_bytes[stream.name], queued[stream.name])

        def run() -> None:
            dst.copy_(src)  # reads the source now, as the device would: a write queued before this lands in it
            queued[stream.name] -= nbytes
            if self.copies_take_time:
                self.clock_ms += nbytes / self.bytes_per_ms
            self.log.append((stream.name, nbytes))

        stream.push(run)

    def link_bytes_per_ms(self) -> float:
        return self.bytes_per_ms

    def synchronize(self) -> None:
        for stream in (self.d2h, self.h2d):
            stream.run_until(stream.queued)


class TimingEvents:
    """Intervals measured with timing events, read without a host synchronization where possible."""

    def __init__(self, streams: StreamBackend) -> None:
        self._streams = streams
        self._recorded: list[tuple[Event, Event]] = []

    def start(self, stream: Any) -> Callable[[Any], None]:
        """Begin an interval on ``stream``; call the returned function with a stream to end it there."""
        begin = self._streams.record(stream, timing=True)

        def end(on: Any) -> None:
            self._recorded.append((begin, self._streams.record(on, timing=True)))

        return end

    def collect_ms(self, wait: bool = True) -> float:
        """Sum of the finished intervals; with ``wait=False`` intervals still running are left for a later call."""
        total = 0.0
        pending = []
        for begin, end in self._recorded:
            if not wait and not end.query():
                pending.append((begin, end))
                continue
            end.synchronize()
            total += begin.elapsed_time(end)
        self._recorded = pending
        return total

    def discard(self) -> None:
        self._recorded = []
