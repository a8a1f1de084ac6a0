"""How bytes cross the link, one strategy per mode: ``copy_out`` to a host buffer, ``copy_in`` back to the device.

:class:`SyncTransfer` copies on the compute stream, when a tensor leaves and when backward needs it: simple, slow,
the reference for debugging. :class:`StreamedTransfer` is the only code that touches streams and events: copies run
on one copy stream per direction, overlapped with compute, ordered by device-side waits, never by a host
synchronization; it also times forward, for the link model and for the memory-budget planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lightning_offload.copies import StorageCopy
from lightning_offload.schedule import LinkModel
from lightning_offload.stats import OffloadStats
from lightning_offload.streams import Event, StreamBackend, TimingEvents
from lightning_offload.tracing import trace_range


class SyncTransfer:
    """Copies on the compute stream: done when the call returns (the host waits for each one)."""

    overlapped = False

    def copy_out(self, copy: StorageCopy, target: torch.Tensor, ready: Event | None) -> Event | None:
        with trace_range("offload::d2h"):
            if ready is not None:
                # The pooled buffer's last copy ran on a streamed engine's copy stream (the pool is the process's),
                # and nothing orders this stream after it: the host waits, as it does for every copy here.
                ready.synchronize()
            target.copy_(copy.src)  # type: ignore[arg-type]
        return None

    def copy_in(self, copy: StorageCopy, device: torch.device) -> torch.Tensor:
        assert copy.host is not None
        with trace_range("offload::h2d"):
            span = torch.empty(copy.nbytes, dtype=torch.uint8, device=device)
            span.copy_(copy.host[: copy.nbytes])
        return span

    def await_arrival(self, copy: StorageCopy) -> None:
        pass

    def wait(self, event: Event) -> None:
        pass

    def forward_started(self) -> None:
        pass

    def forward_ended(self, saved_bytes: int) -> None:
        pass

    def backward_started(self, saved_bytes: int) -> None:
        pass

    def backward_ended(self) -> None:
        pass

    def collect(self, stats: OffloadStats, wait: bool) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def discard(self) -> None:
        pass


@dataclass
class TimedPass:
    """One forward or backward being timed: its begin and end on the compute stream, and its waits for copies.

    A wait for a copy that is not done yet stalls compute; subtracting those stalls gives the pass's own compute time,
    which is what a plan's cost depends on (a measuring step that offloads everything is mostly such stalls).
    """

    begin: Event
    waits: list[tuple[Event, Event]] = field(default_factory=list)
    end: Event | None = None
    saved: int = 0
    step: int = 0  # the step it belongs to (:attr:`StreamedTransfer.step`)

    def stalled_ms(self, first: int = 0, last: int | None = None) -> float:
        return sum(begin.elapsed_time(end) for begin, end in self.waits[first:last])

    def finished(self) -> bool:
        """Whether the pass ended and its end event is done (its timing can be read without waiting)."""
        return self.end is not None and self.end.query()

    def compute_ms(self) -> float:
        assert self.end is not None
        return max(0.0, self.begin.elapsed_time(self.end) - self.stalled_ms())

    def wait(self, streams: StreamBackend, stream: Any, event: Event) -> None:
        """``stream`` waits for ``event``; the time it waits counts as a stall of this pass."""
        begin = streams.record(stream, timing=True)
        streams.wait_event(stream, event)
        self.waits.append((begin, streams.record(stream, timing=True)))


@dataclass(frozen=True)
class Mark:
    """A point of a timed forward (see :meth:`StreamedTransfer.mark`)."""

    forward: TimedPass | None  # None: before the forward's first saved tensor (no wait for a copy yet)
    event: Event
    waits: int  # the forward's waits before this point


class StreamedTransfer:
    """Copies on the copy streams of ``streams``, overlapped with compute.

    Attributes:
        link: the link model, fed with forward's measured pace.
        last_forward_ms: device time of the latest timed forward.
        last_compute_ms: the same less the time compute waited for copies in it.
        last_backward_ms: compute time of the latest timed backward (waits for copies excluded; 0: none timed).
        last_stalls: the step of the latest timed forward and backward, when both belong to one step, and the time
            compute waited for copies in them (``None``: not known yet).
        last_forward: the step of the latest timed forward and its compute time (``None``: none timed yet).
        step: a number for the steps that start from now on (the memory-budget planner counts its steps); timings
            carry it, so a timing read late is not taken for a later step's.
    """

    overlapped = True

    def __init__(self, streams: StreamBackend, measure_copies: bool) -> None:
        self.streams = streams
        self.link = LinkModel()
        self._measure = measure_copies
        self.link_rate = streams.link_bytes_per_ms()
        self.last_forward_ms = 0.0
        self.last_compute_ms = 0.0
        self._stall = TimingEvents(streams)
        self._d2h_timer = TimingEvents(streams)
        self._h2d_timer = TimingEvents(streams)
        self._forward: TimedPass | None = None  # an ended forward whose timing was not read yet
        self._open: TimedPass | None = None  # the forward being timed now
        self.last_backward_ms = 0.0
        self._backward: TimedPass | None = None  # a backward being timed, or ended and not read yet
        self.step = 0
        self.last_stalls: tuple[int, float] | None = None
        self.last_forward: tuple[int, float] | None = None
        self._step_mark: Event | None = None  # where the latest step began on the compute stream

    def copy_out(self, copy: StorageCopy, target: torch.Tensor, ready: Event | None) -> Event:
        streams, d2h = self.streams, self.streams.d2h
        with trace_range("offload::d2h"):
            streams.wait_stream(d2h, copy.producer)  # the source is complete once its producer got this far
            if ready is not None:
                streams.wait_event(d2h, ready)  # the buffer's previous copy has finished with it
            end = self._d2h_timer.start(d2h) if self._measure else None
            streams.copy(target, copy.src, d2h)  # type: ignore[arg-type]
            done = streams.record(d2h)
            if end is not None:
                end(d2h)
        return done

    def copy_in(self, copy: StorageCopy, device: torch.device) -> torch.Tensor:
        assert copy.host is not None
        streams, h2d = self.streams, self.streams.h2d
        with trace_range("offload::h2d"):
            span = torch.empty(copy.nbytes, dtype=torch.uint8, device=device)
            # ``span`` was allocated on the compute stream; its block may still be read by kernels queued there, and
            # the host bytes may still be arriving from the device -> host stream.
            streams.wait_stream(h2d, streams.current())
            if copy.d2h_done is not None:
                streams.wait_event(h2d, copy.d2h_done)
            end = self._h2d_timer.start(h2d) if self._measure else None
            streams.copy(span, copy.host[: copy.nbytes], h2d)
            done = streams.record(h2d)
            if end is not None:
                end(h2d)
        copy.h2d_done = copy.last_use = done
        # No ``record_stream`` on the span: backward waits for ``done`` before it reads the span (``await_arrival``),
        # so the compute stream may reuse its block once autograd lets go of it. Only a span let go of unread needs
        # that wait first (the guard). With ``record_stream`` every span freed in backward stayed unusable until the
        # copy stream had drained the prefetches queued behind it, and the allocator reserved fresh memory meanwhile.
        copy.fetch_guard = partial(self._order_after, done)
        return span

    def _order_after(self, event: Event) -> None:
        self.streams.wait_event(self.streams.current(), event)

    def await_arrival(self, copy: StorageCopy) -> None:
        """Make the compute stream wait for ``copy``'s way back; the time it waits is the stall."""
        streams, done = self.streams, copy.h2d_done
        assert done is not None
        copy.fetch_guard = None  # the compute stream waits for the copy below: the span's block is safe to reuse
        consumer = streams.current()
        if done.query():
            streams.wait_event(consumer, done)
            return
        with trace_range("offload::stall"):
            end = self._stall.start(consumer)
            timed = self._backward
            if timed is not None and timed.end is None:
                timed.wait(streams, consumer, done)
            else:
                streams.wait_event(consumer, done)
            end(consumer)

    def wait(self, event: Event) -> None:
        """Order everything the compute stream runs from now on after ``event`` (a device-side wait)."""
        streams, consumer, timed = self.streams, self.streams.current(), self._open
        if timed is None or event.query():
            streams.wait_event(consumer, event)
        else:
            timed.wait(streams, consumer, event)

    def forward_started(self) -> None:
        self._read_forward_timing()
        self.link.forward_started()
        if self._forward is None:  # otherwise an earlier forward's timing is still running: measure a later one
            self._open = TimedPass(self.streams.record(self.streams.current(), timing=True), step=self.step)

    def forward_ended(self, saved_bytes: int) -> None:
        """Mark forward's end; its timing is read (without waiting) at a later forward."""
        timed, self._open = self._open, None
        if timed is not None and saved_bytes:
            timed.end, timed.saved = self.streams.record(self.streams.current(), timing=True), saved_bytes
            self._forward = timed

    def backward_started(self, saved_bytes: int) -> None:
        """Backward of a forward that saved ``saved_bytes`` begins: time it (unless one is being timed)."""
        timed = self._backward
        if timed is not None and timed.end is None:
            # A backward whose end was never marked raised (autograd runs no final callback then; a forward cannot
            # open, so no new backward can start, while one of ours runs): drop it, or it would end at this one's end.
            self._backward = None
        self._read_backward_timing()
        if self._backward is None and saved_bytes:
            self._backward = TimedPass(
                self.streams.record(self.streams.current(), timing=True), saved=saved_bytes, step=self.step
            )

    def backward_ended(self) -> None:
        """Backward is done (autograd's final callback); its timing is read (without waiting) later."""
        timed = self._backward
        if timed is not None and timed.end is None:
            timed.end = self.streams.record(self.streams.current(), timing=True)

    def _read_backward_timing(self) -> None:
        timed = self._backward
        if timed is None or not timed.finished():
            return
        self._backward = None
        self.last_backward_ms = timed.compute_ms()
        forward = self.last_forward
        if forward is not None and forward[0] == timed.step:
            self.last_stalls = (timed.step, self.last_forward_ms - forward[1] + timed.stalled_ms())
        self.link.observe_backward(timed.saved, self.last_backward_ms, self.link_rate)

    def backward_ms(self) -> float:
        """Compute time of the latest timed backward, waiting for its end if it has one (a host sync: use rarely)."""
        if self._backward is not None and self._backward.end is not None:
            self._backward.end.synchronize()
            self._read_backward_timing()
        return self.last_backward_ms

    def configure(self, step: int, pace: tuple[int, float, float] | None) -> None:
        """Number the steps from now on ``step``, and run the link model on ``pace`` (a memory-budget plan's profile:
        eligible bytes, forward's and backward's compute ms), frozen; ``None``: the link model learns from each step."""
        self.step = step
        if pace is not None:
            self.link.use_pace(*pace, self.link_rate)
        else:
            self.link.frozen = False

    def step_began(self, time_last: bool) -> float:
        """Mark where a step begins on the compute stream; with ``time_last``, return the device time of the step
        before it, from its mark to this one (a host sync: it waits for that step's work), else 0.

        Device time between two marks is the step's whole cost on the device: forward, backward, the optimizer, and
        the idle time while the host was behind (its hooks, the data), which is what plans are compared by."""
        event = self.streams.record(self.streams.current(), timing=True)
        previous, self._step_mark = self._step_mark, event
        if not time_last or previous is None:
            return 0.0
        event.synchronize()
        return previous.elapsed_time(event)

    def mark(self) -> Mark | None:
        """A point of a forward, for :meth:`compute_ms_between` (``None`` where the forward's waits are not timed)."""
        timed = self._open
        if timed is None and self._forward is not None:
            return None  # an earlier forward's timing is still unread: this one is not timed
        event = self.streams.record(self.streams.current(), timing=True)
        return Mark(timed, event, len(timed.waits) if timed is not None else 0)

    @staticmethod
    def compute_ms_between(first: Mark, last: Mark) -> float:
        """Compute time between two marks of one forward: device time less the waits for copies (a host sync)."""
        last.event.synchronize()
        elapsed = first.event.elapsed_time(last.event)
        stalled = 0.0
        if last.forward is not None:
            stalled = last.forward.stalled_ms(first.waits if first.forward is last.forward else 0, last.waits)
        return max(0.0, elapsed - stalled)

    def forward_ms(self) -> float:
        """Compute time of the latest timed forward (waits for copies excluded), waiting for its end if needed (a
        host sync: use rarely)."""
        if self._forward is not None:
            self._forward.end.synchronize()  # type: ignore[union-attr]
            self._read_forward_timing()
        return self.last_compute_ms

    def _read_forward_timing(self) -> None:
        timed = self._forward
        if timed is None or not timed.finished():
            return
        self._forward = None
        self.last_forward_ms = timed.begin.elapsed_time(timed.end)  # type: ignore[arg-type]
        self.last_compute_ms = timed.compute_ms()
        self.last_forward = (timed.step, self.last_compute_ms)
        # Compute's pace, not one slowed by waits for earlier copies: a forward that waited would otherwise teach
        # the model that copies finish early, place the next waits earlier still, and wait more (measured on an
        # H200: 16 GiB of 8B LoRA's forward hide behind its 420 ms, yet forward waited 130 ms).
        self.link.observe(timed.saved, self.last_compute_ms, self.link_rate)

    def collect(self, stats: OffloadStats, wait: bool) -> None:
        stats.stall_ms += self._stall.collect_ms(wait)
        stats.d2h_ms += self._d2h_timer.collect_ms(wait)
        stats.h2d_ms += self._h2d_timer.collect_ms(wait)

    def synchronize(self) -> None:
        self.streams.synchronize()

    def discard(self) -> None:
        """Forget timings of a step that raised."""
        for timer in (self._stall, self._d2h_timer, self._h2d_timer):
            timer.discard()
        self._forward = self._open = self._backward = None
        self._step_mark = None


Transfer = SyncTransfer | StreamedTransfer


def producer_stream(transfer: Any) -> Any:
    """The stream a copy must wait for before reading its source: the current one, under streamed transfers."""
    return transfer.streams.current() if isinstance(transfer, StreamedTransfer) else None
