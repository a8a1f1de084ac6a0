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


def heavier_than_planned(plan: Plan, obs: Observation, budget: int) -> int:
    """How many bytes more than ``plan`` the step held, where that is worth planning again (0: not): a peak past the
    prediction by more than ``REPLAN_SHARE`` of the budget, or past the budget at all; and reserved memory the step
    itself took past the budget (no hard cap stopped it; what heavier steps before it reserved is the allocator's)."""
    error = obs.peak - plan.peak
    passed = error > budget * REPLAN_SHARE or (error > 0 and obs.peak > budget)
    heavier = max(error, obs.peak - budget) if passed else 0
    if obs.reserved_peak > max(obs.reserved_at_start, budget):
        heavier = max(heavier, obs.reserved_peak - budget)
    return heavier


def small_miss(plan: Plan, obs: Observation, budget: int) -> int:
    """What the fit margin must cover of this step: its miss below the replanning share and, where the allocator
    flushed its cache, the fragments it reserved past its peak."""
    missed = max(0, min(obs.peak - plan.peak, int(budget * REPLAN_SHARE)))
    if obs.flushed:
        missed += max(0, obs.reserved_peak - obs.peak)
    return missed


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
