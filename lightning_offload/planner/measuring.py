"""An input's measuring steps: how the next one runs (:func:`next_measure`) and what one that ended leaves in the
input's record (:func:`measured`). Plain numbers: bytes and milliseconds."""

from __future__ import annotations

from lightning_offload.planner import words
from lightning_offload.planner.inputs import InputRecord
from lightning_offload.planner.measure import Machine, MeasuredPeaks, measured_profile, pressed_gap
from lightning_offload.planner.steps import Measure, Observation

# Steps measured before the first plan: the first runs before the optimizer has its state (Adam's moments are
# allocated at the first step), so the second is the one every later step looks like.
MEASURED_STEPS = 2
# Under the device's own budget, measuring steps keep everything until allocated memory passes the budget less this
# share of it: a model that uses most of the device but fits is measured without offloading.
WATERMARK_SHARE = 0.10


def next_measure(rec: InputRecord, budget: int, plan_budget: int, allocated: int) -> tuple[Measure, list[str]]:
    """How ``rec``'s next measuring step runs, ``allocated`` bytes allocated as it begins (the record takes that as its
    base), and the warnings to say before it. A frugal step checkpoints its blocks by their parts where a block rebuilt
    whole would take it past ``plan_budget``, as the one before did; elsewhere whole, as most plans do."""
    frugal = rec.frugal_next
    whole = rec.peaks.rebuilt_whole(rec.full_block, allocated) if frugal else None
    by_parts = whole is not None and whole > plan_budget
    in_full = frugal and rec.full_block is None
    watermark = 0 if frugal else budget - int(budget * WATERMARK_SHARE)
    measure = Measure(frugal, one_in_full=in_full, by_parts=by_parts or in_full, watermark=watermark)
    rec.base, rec.frugal_next = allocated, False
    warnings = []
    expected = rec.peaks.next_frugal_peak(allocated) if frugal and rec.full_block is not None else 0
    # As frugal as any plan, and expected past what plans aim for: no plan keeps the fit margin (under a hard cap the
    # allocator's fragments take such a step past the budget), so it is said before the step, not after it fails.
    if expected > plan_budget:
        held = rec.peaks.backward_peak or rec.peaks.peak
        grown = max(0, allocated - rec.peaks.base)
        warnings.append(words.frugal_step_passes(budget, expected, held, grown, rec.base, plan_budget))
    if rec.base >= budget and rec.profile is None:
        warnings.append(words.budget_taken(budget, rec.base))
    return measure, warnings


def measured(rec: InputRecord, measure: Measure, obs: Observation, budget: int, machine: Machine) -> bool:
    """``rec``'s measuring step ``obs``, run as ``measure``, ended: its profile is the step's. Returns whether the
    input's measuring is over (its first plan is to be chosen)."""
    rec.measure_left -= 1
    rec.measured += 1
    rec.reserved_gap = pressed_gap(obs, budget)
    rec.peaks = MeasuredPeaks(rec.base, obs.peak, obs.backward_peak, measure.frugal)
    rec.frugal_next = obs.tripped  # a step that passed its watermark peaked there: the next is frugal
    rec.profile, rec.full_block = measured_profile(obs, rec.full_block, rec.base, machine)
    if rec.measure_left <= 0 and rec.measured == 1 and obs.pinned:
        # A single measuring step that pinned new host buffers timed the pinning as compute (0.4 s per GiB on an
        # H200): a forward that slow hides any copy. Its buffers exist now: measured once more.
        rec.measure_left = 1
    return rec.measure_left <= 0
