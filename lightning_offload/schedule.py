"""When a device -> host copy will have finished, in forward's own currency: bytes saved since it started.

The allocator frees memory on the host's timeline, and the host runs far ahead of the device: polling a copy's
event from the host almost never sees it done before forward ends, so sources polled that way stay allocated
through the forward peak. Instead, the engine lets go of a source at the point of forward where its copy should
be done, after making the compute stream wait for it there (a device-side wait, free if the copy is done).

That point comes from a model of the link: forward saves ``S`` bytes in ``T`` ms (measured with events on the
previous forward) and the link moves ``B`` bytes per ms (measured once per device), so a copy of ``n`` bytes takes
as long as forward needs to save ``n * (S / T) / B`` more bytes. Copies queue on one stream, so each starts when
the one before it ends.
"""

from __future__ import annotations

import torch

# Wait a little later than the model says: a wait that comes too early stalls compute, one too late only holds
# memory a moment longer.
_SLACK = 1.25
_CALIBRATION_BYTES = 64 << 20
_BANDWIDTH: dict[int, float] = {}  # device index -> measured device -> host bytes per ms


def link_bytes_per_ms(device: torch.device) -> float:
    """Pinned device -> host bandwidth of ``device``, measured once per process (one short synchronizing copy)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _BANDWIDTH.get(index)
    if rate is None:
        with torch.cuda.device(index):
            src = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, device=device)
            dst = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, pin_memory=True)
            dst.copy_(src, non_blocking=True)  # warm-up
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rate = _BANDWIDTH[index] = 3 * _CALIBRATION_BYTES / max(begin.elapsed_time(end), 1e-3)
    return rate


class CopySchedule:
    """Predicts, per copy, the forward position (bytes saved) by which the link will have finished it."""

    def __init__(self) -> None:
        self.ratio: float | None = None  # forward's saving rate over the link's rate; None until measured
        self._link_free_at = 0.0  # position at which the copy stream will be idle, per the model
        self._begin: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._timed_bytes = 0
        self._begun = False
        self._link_rate = 1.0

    def deadline(self, position: int, nbytes: int) -> float | None:
        """Position by which a copy of ``nbytes`` issued at ``position`` should be done (``None``: no model yet)."""
        if self.ratio is None:
            return None
        start = max(self._link_free_at, float(position))
        self._link_free_at = start + nbytes * self.ratio
        return position + (self._link_free_at - position) * _SLACK

    def backward_lead(self) -> float:
        """Backward positions a host -> device copy needs per byte, to arrive before backward reaches it.

        Backward runs about twice as long per saved byte as forward (more with checkpoint recompute, which only
        makes this conservative). Without a measurement, assume forward saves 4x faster than the link moves.
        """
        ratio = self.ratio if self.ratio is not None else 4.0
        return ratio / 2 * _SLACK

    def forward_started(self, stream: torch.cuda.Stream) -> None:
        self._link_free_at = 0.0
        self._update()
        if self._timed_bytes:
            return  # an earlier forward's timing is still running; measure a later one
        if self._begin is None:
            self._begin, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._begin.record(stream)
        self._begun = True

    def forward_ended(self, stream: torch.cuda.Stream, saved_bytes: int, link_rate: float) -> None:
        """Mark forward's end; the timing is read (without waiting) at a later call."""
        if self._begun and saved_bytes:
            assert self._end is not None
            self._end.record(stream)
            self._timed_bytes = saved_bytes
            self._link_rate = link_rate
        self._begun = False

    def _update(self) -> None:
        if not self._timed_bytes or self._end is None or not self._end.query():
            return
        assert self._begin is not None
        ms = self._begin.elapsed_time(self._end)
        if ms > 0:
            ratio = (self._timed_bytes / ms) / self._link_rate
            # Smooth across steps: one slow forward (a recompile, a logging step) should not swing the schedule.
            self.ratio = ratio if self.ratio is None else 0.5 * (self.ratio + ratio)
        self._timed_bytes = 0
