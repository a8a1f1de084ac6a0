"""The pure planner: plain numbers in, a plan out. No streams, no events, no tensors.

Positions are forward's own currency: eligible bytes saved since the engine was made. Forward moves them up;
backward walks them down again. Two questions are answered here:

* When is a device -> host copy done? (:class:`LinkModel`.) Forward saves ``S`` bytes in ``T`` ms (measured on an
  earlier forward) and the link moves ``B`` bytes per ms, so a copy of ``n`` bytes takes as long as forward needs to
  save ``n * (S / T) / B`` more bytes. Copies queue on one stream, so each starts when the one before it ends.
* When must a host -> device copy start? (:func:`plan_prefetch`.) Backward's pace per saved byte is measured like
  forward's (about half of it before any backward was timed), and the way back serves copies one after another in the
  order backward needs them.

The host runs far ahead of the device, so polling a copy's event from the host almost never sees it done before
forward ends; the engine instead lets go of a source at the position where the model says its copy is done, after a
device-side wait (free when the copy is done). These positions are what the model provides.
"""

from __future__ import annotations

from collections.abc import Sequence

# Wait a little later than the model says: a wait that comes too early stalls compute, one too late only holds
# memory a moment longer.
SLACK = 1.25
# Before forward was timed, assume it saves bytes 4x faster than the link moves them (a conservative pace for
# transformer layers on PCIe 5): copies are then planned early rather than late.
DEFAULT_RATIO = 4.0
# The least lead of a copy back, in bytes saved during forward, whatever the link model says.
PREFETCH_FLOOR = 64 << 20


class LinkModel:
    """Predicts, per copy, the forward position by which the link will have finished it.

    Attributes:
        ratio: forward's saving rate over the link's rate (``None`` until a forward was measured). Above 1, forward
            saves faster than the link can move bytes out.
        backward_ratio: the same for backward walking the saved bytes down (``None`` until a backward was measured).
    """

    def __init__(self) -> None:
        self.ratio: float | None = None
        self.backward_ratio: float | None = None
        self.frozen = False  # observe nothing (the paces of steps that would mislead the model)
        self._link_free_at = 0.0  # position at which the copy stream will be idle, per the model

    def observe(self, saved_bytes: int, forward_ms: float, link_bytes_per_ms: float) -> None:
        """Fold in one measured forward: ``saved_bytes`` eligible bytes saved in ``forward_ms`` of device time."""
        if saved_bytes <= 0 or forward_ms <= 0 or link_bytes_per_ms <= 0 or self.frozen:
            return
        ratio = (saved_bytes / forward_ms) / link_bytes_per_ms
        # Smooth across steps: one slow forward (a recompile, a logging step) should not swing the schedule.
        self.ratio = ratio if self.ratio is None else 0.5 * (self.ratio + ratio)

    def observe_backward(self, saved_bytes: int, backward_ms: float, link_bytes_per_ms: float) -> None:
        """Fold in one measured backward over ``saved_bytes`` eligible bytes (compute time, waits excluded)."""
        if saved_bytes <= 0 or backward_ms <= 0 or link_bytes_per_ms <= 0 or self.frozen:
            return
        ratio = (saved_bytes / backward_ms) / link_bytes_per_ms
        self.backward_ratio = ratio if self.backward_ratio is None else 0.5 * (self.backward_ratio + ratio)

    def use_pace(self, saved_bytes: int, forward_ms: float, backward_ms: float, link_bytes_per_ms: float) -> None:
        """Take the paces of a measured step (a memory-budget plan's profile) and stop learning.

        Under a plan, a forward's own pace misleads: checkpointed blocks save little and fast while the offloaded
        bytes come from blocks run in full, and the first measuring step's device time includes pinning its host
        buffers (on an H200, 8B LoRA's forward waited 130 ms for copies the link had long finished).
        """
        if saved_bytes > 0 and link_bytes_per_ms > 0:
            if forward_ms > 0:
                self.ratio = (saved_bytes / forward_ms) / link_bytes_per_ms
            if backward_ms > 0:
                self.backward_ratio = (saved_bytes / backward_ms) / link_bytes_per_ms
        self.frozen = True

    def forward_started(self) -> None:
        """A new forward: the link is idle as far as the model knows."""
        self._link_free_at = 0.0

    def deadline(self, position: int, nbytes: int) -> float | None:
        """Position by which a copy of ``nbytes`` issued at ``position`` should be done (``None``: no model yet)."""
        if self.ratio is None:
            return None
        start = max(self._link_free_at, float(position))
        self._link_free_at = start + nbytes * self.ratio
        return position + (self._link_free_at - position) * SLACK

    def backward_lead(self) -> float:
        """Backward positions a host -> device copy needs per byte to arrive before backward reaches it.

        From a measured backward when there is one. Before that, backward is taken to run about twice as long per
        saved byte as forward: true of full fine-tuning, not of a frozen base (LoRA), whose backward is barely slower
        than its forward, which is why it is measured.
        """
        if self.backward_ratio is not None:
            return self.backward_ratio * SLACK
        ratio = self.ratio if self.ratio is not None else DEFAULT_RATIO
        return ratio / 2 * SLACK


def plan_prefetch(
    end_positions: Sequence[float], sizes: Sequence[int], lead: float, floor: int = PREFETCH_FLOOR
) -> list[float]:
    """For copies listed lowest position first, the latest backward position at which each must start back.

    The host -> device stream serves copies in the order backward needs them (highest position first), so a copy
    must start early enough for itself and for every copy queued behind it: a pass from the last-needed copy up
    chains their transfer times. A dead entry (``end_position`` of ``inf``) gets ``inf``: it is dropped as soon as
    the walk reaches it. Starting no earlier than needed keeps prefetched bytes out of the backward peak.

    Args:
        end_positions: each copy's position at the end of its bytes, ascending.
        sizes: each copy's size in bytes.
        lead: backward positions per byte a transfer needs (:meth:`LinkModel.backward_lead`).
        floor: the least lead of any copy, in positions.
    """
    latest_start = float("-inf")
    plan: list[float] = []
    for end, nbytes in zip(end_positions, sizes, strict=True):
        if end == float("inf"):
            plan.append(end)
            continue
        # Done before backward reaches it, and before the copy after it in the queue must start.
        finish = max(end, latest_start)
        latest_start = finish + nbytes * lead
        plan.append(max(latest_start, end + floor))
    return plan
