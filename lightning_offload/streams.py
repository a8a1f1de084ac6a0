"""The two copy streams per CUDA device, and reusable timing events.

Streams are created once per device and process (creating them per step grows reserved memory), lazily, so
objects that hold an engine can still be pickled (``ddp_spawn``). One stream per direction: several streams in
one direction add no PCIe bandwidth.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_LOCK = threading.Lock()


def copy_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """``(device_to_host, host_to_device)`` streams of ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _STREAMS.get(index)
    if streams is None:
        with _LOCK:
            streams = _STREAMS.get(index)
            if streams is None:
                with torch.cuda.device(index):
                    streams = (torch.cuda.Stream(), torch.cuda.Stream())
                _STREAMS[index] = streams
    return streams


class TimingEvents:
    """Pairs of timing events, recycled: creating CUDA events is the expensive part, recording them is cheap."""

    def __init__(self) -> None:
        self._idle: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._recorded: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        if self._idle:
            pair = self._idle.pop()
        else:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record(stream)
        self._recorded.append(pair)
        return pair

    def collect_ms(self, wait: bool = True) -> float:
        """Sum of the recorded intervals, then recycle their events.

        Args:
            wait: wait for intervals still running; ``False`` takes only the finished ones (no host sync).
        """
        total = 0.0
        pending = []
        for begin, end in self._recorded:
            if not wait and not end.query():
                pending.append((begin, end))
                continue
            end.synchronize()
            total += begin.elapsed_time(end)
            self._idle.append((begin, end))
        self._recorded = pending
        return total

    def discard(self) -> None:
        self._recorded = []


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A ``record_function`` range while a profiler runs (so traces show the copies), else nothing at all."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return nullcontext()
