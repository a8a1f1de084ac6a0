"""The pure planner: plain numbers in, a plan out. No streams, no events, no tensors.

Positions are forward's own currency: eligible bytes saved since the engine was made. Forward moves them up;
backward walks them down again. Two questions are answered here:

* When is a device -> host copy done? (:class:`LinkModel`.) Forward saves ``S`` bytes in ``T`` ms (measured on an
  earlier forward) and the link moves ``B`` bytes per ms, so a copy of ``n`` bytes takes as long as forward needs to
  save ``n * (S / T) / B`` more bytes. Copies queue on one stream, so each starts when the one before it ends.
* When must a host -> device copy start? (:func:`plan_prefetch`.) Backward runs about twice as long per saved byte
  as forward, and the way back serves copies one after another in the order backward needs them.

The host runs far ahead of the device, so polling a copy's event from the host almost never sees it done before
forward ends; the engine instead lets go of a source at the position where the model says its copy is done, after a
device-side wait (free when the copy is done). These positions are what the model provides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """

    def __init__(self) -> None:
        self.ratio: float | None = None
        self._link_free_at = 0.0  # position at which the copy stream will be idle, per the model

    def observe(self, saved_bytes: int, forward_ms: float, link_bytes_per_ms: float) -> None:
        """Fold in one measured forward: ``saved_bytes`` eligible bytes saved in ``forward_ms`` of device time."""
        if saved_bytes <= 0 or forward_ms <= 0 or link_bytes_per_ms <= 0:
            return
        ratio = (saved_bytes / forward_ms) / link_bytes_per_ms
        # Smooth across steps: one slow forward (a recompile, a logging step) should not swing the schedule.
        self.ratio = ratio if self.ratio is None else 0.5 * (self.ratio + ratio)

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

        Backward runs about twice as long per saved byte as forward (more with checkpoint recompute, which only
        makes this conservative).
        """
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


# ---------------------------------------------------------------------------------------------- the memory budget

# The share of forward (and of backward, twice as long) behind which copies are assumed to hide: the rest of a
# transfer shows as step time. Below 1 because copies share memory bandwidth and start only once tensors exist.
HIDDEN_SHARE = 0.8


@dataclass(frozen=True)
class StepProfile:
    """One measured training step, in bytes and milliseconds: what the budget planner plans from.

    Attributes:
        peak: peak allocated device memory of the step.
        resident: eligible saved bytes that stayed on the device in that step (not offloaded).
        eligible: eligible saved bytes of one step with no block checkpointed.
        forward_ms: compute time of forward (device time less waits for copies).
        link_bytes_per_ms: the link's bandwidth, one direction.
        blocks: checkpointable blocks (the model's repeated layers; 0 when none were found).
        block_bytes: eligible bytes one block saves, on average.
        block_input_bytes: the bytes a checkpointed block saves instead (its input).
        block_ms: compute time of one block's forward, i.e. its recompute under checkpointing (0: not measured, use
            ``forward_ms / blocks``).
        offload_overhead: device bytes offloading holds for itself (copies in flight and fetched ahead).
        tail: eligible bytes at the end of each forward that never leave (``resident_tail_bytes``).
    """

    peak: int
    resident: int
    eligible: int
    forward_ms: float
    link_bytes_per_ms: float
    blocks: int = 0
    block_bytes: int = 0
    block_input_bytes: int = 0
    block_ms: float = 0.0
    offload_overhead: int = 0
    tail: int = 0


@dataclass(frozen=True)
class Plan:
    """How one step runs: what leaves the device, which blocks are checkpointed, and what that should cost.

    Attributes:
        offload_bytes: the first this-many eligible bytes of each forward leave the device (0: the hooks are not
            even installed, so the step costs nothing).
        checkpoint_blocks: how many of the last blocks run under activation checkpointing.
        peak: the predicted peak allocated bytes.
        extra_ms: the predicted step time over keeping everything (recompute plus copies that do not hide).
        fits: whether ``peak`` is within the budget.
    """

    offload_bytes: int
    checkpoint_blocks: int
    peak: int
    extra_ms: float
    fits: bool

    def describe(self, budget: int) -> str:
        gib = float(1 << 30)
        what = []
        if self.checkpoint_blocks:
            what.append(f"checkpoint {self.checkpoint_blocks} block(s)")
        what.append(
            f"offload {self.offload_bytes / gib:.2f} GiB per forward" if self.offload_bytes else "offload nothing"
        )
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{', '.join(what)}: predicted peak {self.peak / gib:.2f} GiB {verdict} the budget of "
            f"{budget / gib:.2f} GiB, predicted cost {self.extra_ms:.1f} ms per step"
        )


def copy_cost_ms(nbytes: int, forward_ms: float, link_bytes_per_ms: float) -> float:
    """Step time that offloading ``nbytes`` adds: each way, the part of the transfer that compute cannot hide."""
    if nbytes <= 0:
        return 0.0
    transfer = nbytes / link_bytes_per_ms
    return max(0.0, transfer - HIDDEN_SHARE * forward_ms) + max(0.0, transfer - HIDDEN_SHARE * 2 * forward_ms)


def plan_for_budget(profile: StepProfile, budget: int) -> Plan:
    """The cheapest plan whose predicted peak stays within ``budget``; the most frugal one if none does.

    The peak of the measured step, less the activations it kept, is what the peak holds besides activations (weights,
    gradients, optimizer state, the loss's transient). Each plan keeps ``eligible(k) - offloaded`` bytes of
    activations on top of that, where checkpointing ``k`` blocks shrinks what is saved to their inputs (and backward
    rebuilds one block's activations at a time). For every
    ``k`` the least offload that fits is found; the cheapest ``(k, offload)`` by predicted time wins: keeping costs
    nothing, offloading costs what the link cannot hide, each checkpointed block costs its recompute.
    """
    fixed = profile.peak - profile.resident
    per_block_ms = profile.block_ms or (profile.forward_ms / profile.blocks if profile.blocks else 0.0)
    saved_per_block = max(0, profile.block_bytes - profile.block_input_bytes)
    candidates = []
    for k in range(profile.blocks + 1):
        eligible = max(0, profile.eligible - k * saved_per_block)
        room = budget - fixed  # activation bytes that may stay
        movable = max(0, eligible - profile.tail)
        need = min(movable, max(0, eligible - room))
        peak = fixed + eligible - need + (min(need, profile.offload_overhead) if need else 0)
        if k:  # backward recomputes one checkpointed block at a time: its activations exist once more, briefly
            peak += profile.block_bytes
        if need and peak > budget:  # the overhead itself: offload that much more, if there is more to offload
            extra = min(movable - need, peak - budget)
            need += extra
            peak -= extra
        cost = k * per_block_ms + copy_cost_ms(need, profile.forward_ms, profile.link_bytes_per_ms)
        candidates.append(Plan(need, k, peak, cost, peak <= budget))
    fitting = [p for p in candidates if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (p.extra_ms, p.peak))
    return min(candidates, key=lambda p: (p.peak, p.extra_ms))
