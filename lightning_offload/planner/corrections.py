"""What a planned step's observation teaches its input's profile: pure functions of the plan, the profile, the
observation and the budget (bytes and milliseconds).

Learning only moves towards memory: a step that peaked past its prediction corrects the profile by the miss, one that
ran out of memory by what it held and failed to get, and a small miss widens the fit margin. What steps teach about
time only ever lowers the compute time the profile counts (a measuring step can be slowed by what only it does).
"""

from __future__ import annotations

import dataclasses

from lightning_offload.planner.aims import REPLAN_SHARE
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.steps import Observation

# A step's forward or backward counts as faster (the profile takes its time) below this share of the profile's.
FASTER_SHARE = 0.9


def after_planned_step(profile: StepProfile, plan: Plan, obs: Observation, budget: int) -> tuple[StepProfile, int]:
    """What a planned step of ``plan`` teaches ``profile`` of memory short of a correction (the optimizer's peak; the
    misses the fit margin covers), and how far it peaked past the plan (:func:`step_error`)."""
    profile = with_optimizer_peak(profile, obs)
    error = step_error(plan, profile, obs)
    missed, pressed = small_miss(error, budget), pressed_error(plan, profile, obs, budget)
    if missed > profile.fit_error or pressed > profile.pressed_error:
        profile = dataclasses.replace(
            profile, fit_error=max(profile.fit_error, missed), pressed_error=max(profile.pressed_error, pressed)
        )
    return profile, error


def with_optimizer_peak(profile: StepProfile, obs: Observation) -> StepProfile:
    """The profile with the peak a planned step reached after its backward (the optimizer's step), where that rose
    above the one measured: no plan moves it (activations are gone by then), so it is learnt as a phase of its own,
    not counted as the plan's miss. A measuring step without an optimizer step (accumulated gradients) measured none."""
    after_backward = obs.peak if obs.backward_peak and obs.peak > obs.backward_peak else 0
    if not profile.two_peaks or after_backward <= profile.optimizer_peak:
        return profile
    return dataclasses.replace(profile, optimizer_peak=after_backward)


def step_error(plan: Plan, profile: StepProfile, obs: Observation) -> int:
    """How far the step peaked past what ``plan`` predicts of it, phase by phase (negative: below): its activations'
    phases (up to the end of backward) against the plan's, and its whole peak against the plan's with the optimizer's
    peak ``profile`` knows now."""
    if not plan.phases or not obs.backward_peak:
        return obs.peak - plan.peak
    return max(obs.backward_peak - max(plan.phases[:3]), obs.peak - max(plan.peak, profile.optimizer_peak))


def heavier_than_planned(error: int, obs: Observation, budget: int) -> int:
    """How many bytes more than its plan the step held (its ``error``, :func:`step_error`), where that is worth
    planning again (0: not): a peak past the prediction by more than ``REPLAN_SHARE`` of the budget, or past the budget
    at all; and reserved memory the step itself took past the budget (no hard cap stopped it; what heavier steps before
    it reserved is the allocator's)."""
    passed = error > budget * REPLAN_SHARE or (error > 0 and obs.peak > budget)
    heavier = max(error, obs.peak - budget) if passed else 0
    if obs.reserved_peak > max(obs.reserved_at_start, budget):
        heavier = max(heavier, obs.reserved_peak - budget)
    return heavier


def small_miss(error: int, budget: int) -> int:
    """What the fit margin must cover of a step that peaked ``error`` bytes past its prediction: the miss below the
    replanning share."""
    return max(0, min(error, int(budget * REPLAN_SHARE)))


def pressed_error(plan: Plan, profile: StepProfile, obs: Observation, budget: int) -> int:
    """Where a hard cap pressed the step's allocator (it flushed its cache), how far its reserved peak passed what
    ``plan`` predicts of the step (with the optimizer's peak ``profile`` knows), plus ``REPLAN_SHARE`` of the
    budget: the cap counts reserved bytes, and the same plan's fragments differ from step to step. A plan whose
    pressed steps kept that share of the budget unreserved keeps fitting; one whose step reserved up to the cap
    does not (on an H200, zoo row 00's plan reserved to within 1 MiB of its cap twice, and the next step ran out
    of memory). 0 where it did not flush."""
    if not obs.flushed:
        return 0
    # A reserved peak that is the cache the step began with counts too (unlike a measuring step's, in
    # :func:`~.measure.pressed_gap`): the step before ran a plan too, mostly this one, whose fragments the cap met.
    return max(0, obs.reserved_peak - max(plan.peak, profile.optimizer_peak) + int(REPLAN_SHARE * budget))


def after_out_of_memory(profile: StepProfile, plan: Plan, obs: Observation, budget: int, margin: int) -> StepProfile:
    """The profile corrected by a step of ``plan`` that ran out of memory: by its peak, the request that failed and the
    fragments held then (which the fit margin keeps from now on)."""
    fragments = max(0, obs.reserved - obs.allocated)
    need = obs.peak + (obs.request or int(budget * REPLAN_SHARE)) + fragments
    heavier = max(0, need - plan.peak - margin) + int(budget * REPLAN_SHARE)
    return dataclasses.replace(
        profile, correction=profile.correction + heavier, fit_error=max(profile.fit_error, fragments)
    )


def with_faster_compute(profile: StepProfile, plan: Plan, obs: Observation) -> StepProfile:
    """The profile with the step's forward and backward compute times where they were faster (a backward that
    recomputed blocks says nothing of the pace)."""
    if 0 < obs.forward_ms < FASTER_SHARE * profile.forward_ms:
        profile = dataclasses.replace(profile, forward_ms=obs.forward_ms)
    recomputes = plan.checkpoint_blocks or plan.light_blocks
    if 0 < obs.backward_ms < FASTER_SHARE * profile.backward_ms and not recomputes:
        profile = dataclasses.replace(profile, backward_ms=obs.backward_ms)
    return profile


def grown_base(profile: StepProfile, allocated: int, budget: int) -> int:
    """How many bytes more than the measured step a planned step begins with (gradients accumulated, the optimizer's
    state, the last step's gradients kept through forward), where that is worth planning again (0: not): the step
    holds that much more in every phase."""
    grown = allocated - profile.base
    return grown if grown > budget * REPLAN_SHARE / 2 else 0
