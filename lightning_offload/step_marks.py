"""The device's memory read at a planned step's landmarks: the datapath marks them (a measuring step's watermark
passed, backward begun, the head left, backward ended) and the planner reads the marks into the step's observation
as it ends. Nothing here decides anything. Torch only: no Lightning import."""

from __future__ import annotations

from typing import Any


def counter(memory: Any, name: str) -> int:
    """The allocator counter ``name`` of ``memory``; 0 where it has none (a test's fake)."""
    read = getattr(memory, name, None)
    return read() if read is not None else 0


class StepMarks:
    """What the device's memory held at one step's landmarks.

    Args:
        memory: the device's allocator counters (``allocated()``, ``peak()``, ``reset_peak()``; ``reserved()`` and
            ``alloc_retries()`` where it has them).
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self.owns_peaks = True  # the step resets the peak counter itself (not where a caller resets it for it)
        self.watermark: int | None = None  # a measuring step offloads everything once allocated passes this
        self.tripped = False  # the step passed its watermark
        self.reserved_at_start = self.retries_at_start = 0
        self.forward_peak = 0  # the step's peak as its backward began (forward's, the loss's included)
        # The step's backward as it left the head: the head's saved bytes (a measuring step's), the peak so far and
        # what was allocated then; the peak as backward ended; the largest peak seen before a caller's reset.
        self.head_bytes = self.head_peak = self.head_allocated = self.backward_end_peak = self.backward_peak = 0

    def begin(self, held: int, watermark: int | None, owns_peaks: bool) -> None:
        """A step begins (``held``: what the allocator reserved before it emptied its cache for it, 0: not emptied);
        ``watermark``: a measuring step's, or ``None``; ``owns_peaks``: whether the step resets the peak counter."""
        self.owns_peaks = owns_peaks
        self.forward_peak = self.backward_peak = 0
        self.head_bytes = self.head_peak = self.head_allocated = self.backward_end_peak = 0
        # A caller that resets the counters itself still holds the reserved peak from before the cache was emptied.
        self.reserved_at_start = max(counter(self.memory, "reserved"), 0 if self.owns_peaks else held)
        self.retries_at_start = counter(self.memory, "alloc_retries")
        self.watermark, self.tripped = watermark, False

    def passed_watermark(self) -> bool:
        """Whether a measuring step's device memory just passed its watermark (true once per step): from there on the
        step offloads everything it saved and saves."""
        if self.watermark is None or self.memory.allocated() <= self.watermark:
            return False
        self.watermark, self.tripped = None, True
        return True

    def cache_emptied(self) -> None:
        """The allocator emptied its cache as this step began (it switched to expandable segments): the step's peaks
        and reserved bytes count from now, not from the segments just returned."""
        if self.owns_peaks:
            self.memory.reset_peak()
        self.reserved_at_start = counter(self.memory, "reserved")

    def backward_started(self) -> None:
        """Note forward's peak (the loss's transient included) as backward begins."""
        self.forward_peak = self.memory.peak()

    def left_head(self, in_flight: int = 0) -> None:
        """Backward has left the head (the loss's transient is gone): note the peak so far and what is allocated, less
        the ``in_flight`` bytes of sources still held for their copies out (a measuring step offloads the head's own
        bytes too, and the last of those copies may still run)."""
        self.head_peak = self.memory.peak()
        self.head_allocated = max(0, self.memory.allocated() - in_flight)

    def backward_finished(self) -> None:
        """Note the step's peak now, before anyone resets the counters (autograd calls this when backward ends)."""
        self.backward_end_peak = self.memory.peak()
        self.backward_peak = max(self.backward_peak, self.backward_end_peak)

    def peak(self) -> int:
        """The step's peak: the one noted when backward finished, or read now (a caller may reset the counters
        between steps)."""
        return max(self.backward_peak, self.memory.peak())

    def flushed(self) -> bool:
        """Whether the allocator flushed its cache to satisfy an allocation in this step (a hard cap was met)."""
        return counter(self.memory, "alloc_retries") > self.retries_at_start
