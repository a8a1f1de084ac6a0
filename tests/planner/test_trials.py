"""Plans timed against each other: each runs a settling step and three timed ones, the fastest in median is kept,
and a correction towards memory after the trials keeps the fastest plan that still fits or times the ones that do."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_offload.planner.choice import choose_plan
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.trials import TRIAL_STEPS, PlanTrials, plan_kind

GiB = 1 << 30
PROFILE = StepProfile(peak=0, resident=0, eligible=0, forward_ms=100.0, link_bytes_per_ms=1.0, backward_ms=150.0)
# One plan per number of checkpointed blocks, as ``plan_candidates`` lists them: the cheapest by the model offloads,
# the cheapest without copies checkpoints 6 blocks, halfway is 3.
CANDIDATES = [
    Plan(4 * GiB, 0, 10 * GiB, 5.0, True),
    Plan(3 * GiB, 1, 10 * GiB, 10.0, True),
    Plan(2 * GiB, 3, 10 * GiB, 20.0, True),
    Plan(0, 6, 10 * GiB, 30.0, True),
]
STEP_MS = {0: 120.0, 3: 110.0, 6: 100.0}  # what each plan's steps take: the one without copies is fastest


def run_trials(
    trials: PlanTrials,
    step_ms: dict[int, float],
    pinned_steps: set[int] | None = None,
    candidates: list[Plan] = CANDIDATES,
    flushing: set[int] | None = None,
) -> tuple[list[Plan], Plan | None, str]:
    """Choose and run plans until the trials are over: the plans each step ran, in order, then the plan kept and the
    words it was reported with. The steps of plans that checkpoint a number of blocks in ``flushing`` flush the
    allocator's cache."""
    ran = []
    plan, words = trials.choose(PROFILE, candidates, memory=False)
    while trials.trying:
        assert plan is not None
        ran.append(plan)
        pinned = len(ran) in (pinned_steps or set())
        flushed = plan.checkpoint_blocks in (flushing or set())
        if trials.count(plan, step_ms[plan.checkpoint_blocks], pinned, flushed):
            plan, words = trials.choose(PROFILE, candidates, memory=False)
    return ran, plan, words


def test_each_plan_runs_a_settling_step_and_three_timed_ones_the_fastest_is_kept() -> None:
    trials = PlanTrials(enabled=True)
    ran, kept, words = run_trials(trials, STEP_MS)
    assert [p.checkpoint_blocks for p in ran] == [0] * TRIAL_STEPS + [3] * TRIAL_STEPS + [6] * TRIAL_STEPS
    assert trials.done and not trials.trying and kept == CANDIDATES[3]
    assert words == (
        "fastest of 3 plans timed (0 block(s) + 4.00 GiB 120.0 ms; 3 block(s) + 2.00 GiB 110.0 ms; "
        "6 block(s) + 0.00 GiB 100.0 ms): "
    )
    assert sorted(trials.timed_plans()) == [(0, 4 * GiB, 120.0, 0), (3, 2 * GiB, 110.0, 0), (6, 0, 100.0, 0)]
    # Each plan's three counted steps, in the order the plans ran.
    assert trials.timed_steps() == [(0, 4 * GiB, 0, [120.0] * 3), (3, 2 * GiB, 0, [110.0] * 3), (6, 0, 0, [100.0] * 3)]


def test_a_settling_step_and_steps_that_pinned_host_memory_are_not_timed() -> None:
    """Steps 2 and 3 (the first plan's first timed ones) pinned host buffers: the plan runs two steps more, at most
    five in all."""
    trials = PlanTrials(enabled=True)
    ran, _, _ = run_trials(trials, STEP_MS, pinned_steps={2, 3})
    assert [p.checkpoint_blocks for p in ran][:6] == [0, 0, 0, 0, 0, 3]


def test_one_slow_timed_step_does_not_rank_a_plan_behind_an_equally_fast_one() -> None:
    """The fewest-blocks plan's first timed step ran 10% slow (the allocator still settling), its next two as fast as
    the plan of 6 blocks: its median is its pace, and it is kept (a mean of its steps would have ranked it last)."""
    trials = PlanTrials(enabled=True)
    steps = {0: iter([130.0, 110.0, 99.0, 99.0]), 3: iter([110.0] * 4), 6: iter([101.0] * 4)}
    ran = []
    plan, _ = trials.choose(PROFILE, CANDIDATES, memory=False)
    while trials.trying:
        assert plan is not None
        ran.append(plan)
        if trials.count(plan, next(steps[plan.checkpoint_blocks]), pinned=False):
            plan, words = trials.choose(PROFILE, CANDIDATES, memory=False)
    assert plan == CANDIDATES[0]
    assert "0 block(s) + 4.00 GiB 99.0 ms" in words and "6 block(s) + 0.00 GiB 101.0 ms" in words
    assert (0, 4 * GiB, 99.0, 0) in trials.timed_plans()


def test_a_plan_whose_timed_steps_flushed_the_cache_is_ranked_by_their_mean() -> None:
    """The plan without copies flushed the allocator's cache in one of its three timed steps (a cost it pays every
    other step or so near a hard cap): its mean, 93 ms, counts, not its median of 80, so the plan of 3 blocks that
    runs a steady 85 ms is kept."""
    trials = PlanTrials(enabled=True)
    steps = {0: iter([120.0] * 4), 3: iter([85.0] * 4), 6: iter([80.0, 80.0, 120.0, 80.0])}
    flushes = {0: iter([False] * 4), 3: iter([False] * 4), 6: iter([False, False, True, False])}
    plan, words = trials.choose(PROFILE, CANDIDATES, memory=False)
    while trials.trying:
        assert plan is not None
        key = plan.checkpoint_blocks
        if trials.count(plan, next(steps[key]), pinned=False, flushed=next(flushes[key])):
            plan, words = trials.choose(PROFILE, CANDIDATES, memory=False)
    assert plan == CANDIDATES[2]
    assert "6 block(s) + 0.00 GiB 93.3 ms (the allocator flushed its cache in 1 of 3 steps)" in words
    assert (6, 0, pytest.approx(93.333, abs=0.01), 0) in trials.timed_plans()


def test_the_fastest_is_kept_and_a_new_profile_times_again() -> None:
    trials = PlanTrials(enabled=True)
    run_trials(trials, STEP_MS)
    trials.reset()
    assert not trials.done and not trials.timed
    _, kept, _ = run_trials(trials, {0: 90.0, 3: 110.0, 6: 100.0})
    assert kept == CANDIDATES[0]


def test_disabled_or_nothing_to_compare_times_nothing() -> None:
    off = PlanTrials(enabled=False)
    assert off.done and off.choose(PROFILE, CANDIDATES, memory=False) == (None, "")
    keep = PlanTrials(enabled=True)
    keeps_everything = [Plan(0, 0, 10 * GiB, 0.0, True)]
    assert keep.choose(PROFILE, keeps_everything, memory=False) == (None, "") and keep.done and not keep.trying


def test_after_a_correction_the_fastest_timed_plan_that_fits_or_the_plans_that_fit_now_timed() -> None:
    trials = PlanTrials(enabled=True)
    run_trials(trials, STEP_MS)
    # The plan without copies no longer fits; the one halfway still does as it was timed.
    corrected = [*CANDIDATES[:3], replace(CANDIDATES[3], fits=False)]
    assert trials.after_correction(corrected) == CANDIDATES[2] and trials.done
    # No timed plan fits as it was timed (each offloads a GiB more): the plans that fit now are timed in turn, here
    # the cheapest and the one with the fewest copies (every plan offloads).
    moved = [replace(p, offload_bytes=p.offload_bytes + GiB) for p in CANDIDATES]
    assert trials.after_correction(moved) is None and not trials.done
    plan, words = trials.choose(PROFILE, moved, memory=True)
    assert plan == moved[0] and trials.trying and words == "timing plan 1 of 2: "


# As CANDIDATES, with peaks that fall as blocks are checkpointed, and one more plan, a block below the cheapest without
# copies, which the trials leave out (the model prices it above that one).
STEPPED = [replace(p, peak=p.peak - p.checkpoint_blocks * GiB // 10) for p in CANDIDATES] + [
    Plan(0, 7, 9 * GiB, 35.0, True)
]


def test_a_fastest_plan_whose_steps_flushed_the_allocators_cache_is_timed_against_the_next_plan_down() -> None:
    """The plan without copies ran fastest but flushed the allocator's cache in its timed steps (a full hard cap):
    the model's cheapest plan predicted to peak lower by the step-down is timed too, and kept where faster."""
    trials = PlanTrials(enabled=True)
    ran, kept, words = run_trials(trials, {**STEP_MS, 7: 95.0}, candidates=STEPPED, flushing={6})
    assert [p.checkpoint_blocks for p in ran] == [0] * TRIAL_STEPS + [3] * TRIAL_STEPS + [6, 6, 6, 6, 7, 7, 7, 7]
    assert kept == STEPPED[4] and trials.done
    assert "6 block(s) + 0.00 GiB 100.0 ms (the allocator flushed its cache in 3 of 3 steps); " in words
    assert "7 block(s) + 0.00 GiB 95.0 ms)" in words
    # Slower below: the flushing plan stays.
    _, kept, _ = run_trials(PlanTrials(enabled=True), {**STEP_MS, 7: 105.0}, candidates=STEPPED, flushing={6})
    assert kept == STEPPED[3]


def test_no_plan_is_added_where_the_fastest_did_not_flush_or_nothing_peaks_lower() -> None:
    # Flushes in a slower plan's steps only, and in one of the fastest's three: nothing is added.
    ran, kept, _ = run_trials(PlanTrials(enabled=True), STEP_MS, candidates=STEPPED, flushing={0, 3})
    assert [p.checkpoint_blocks for p in ran] == [0] * TRIAL_STEPS + [3] * TRIAL_STEPS + [6] * TRIAL_STEPS
    assert kept == STEPPED[3]
    # The fastest flushed, but no plan of its family peaks low enough.
    ran, kept, _ = run_trials(PlanTrials(enabled=True), STEP_MS, candidates=STEPPED[:4], flushing={6})
    assert len(ran) == 3 * TRIAL_STEPS and kept == STEPPED[3]


def test_a_step_down_is_timed_once_per_round() -> None:
    """The plan added below flushed as well: no further plan is added (the fastest of the round is kept)."""
    lower = Plan(0, 8, 8 * GiB, 40.0, True)
    ran, kept, _ = run_trials(
        PlanTrials(enabled=True), {**STEP_MS, 7: 95.0, 8: 90.0}, candidates=[*STEPPED, lower], flushing={6, 7}
    )
    assert [p.checkpoint_blocks for p in ran][-TRIAL_STEPS:] == [7] * TRIAL_STEPS
    assert kept == STEPPED[4]


def _kept_then_planned(flushes: list[bool], flushing_in_trials: set[int] | None = None) -> PlanTrials:
    """Trials keep the plan without copies (6 blocks, 100 ms; 3 blocks next at 110 ms); its planned steps then flush
    the allocator's cache as ``flushes`` says."""
    trials = PlanTrials(enabled=True)
    _, kept, _ = run_trials(trials, STEP_MS, flushing=flushing_in_trials)
    assert kept == CANDIDATES[3]
    for flushed in flushes:
        trials.count(kept, 0.0, pinned=False, flushed=flushed)  # planned steps are not timed
    return trials


def test_a_kept_plan_that_flushes_where_its_timed_steps_did_not_gives_way_to_the_next_fastest() -> None:
    """Timed without a flush, kept, it flushed the cache in at least half of its planned steps after the first (it ran
    in the cache another plan left): the next fastest plan timed runs, once."""
    trials = _kept_then_planned([False, True, True, False])
    assert trials.flushes_where_kept()
    choice = choose_plan(trials, PROFILE, CANDIDATES, lesson=None, memory=False)
    assert choice is not None
    other, words, lesson = choice
    assert other == CANDIDATES[2] and lesson == (True, False)
    assert words.startswith("the plan the trials kept (100.0 ms a step as timed) flushed the allocator's cache")
    assert "the next fastest plan timed (110.0 ms) runs instead: " in words
    assert not trials.flushes_where_kept()  # once: the plan chosen instead is not watched for a second swap
    for flushed in [True] * TRIAL_STEPS:
        assert not trials.count(other, 0.0, pinned=False, flushed=flushed)
    assert choose_plan(trials, PROFILE, CANDIDATES, lesson=None, memory=False) is None


@pytest.mark.parametrize(
    ("flushes", "flushing_in_trials"),
    [
        ([True, False, False, True], None),  # the first step settles: one flush in three is not half
        ([False, True, True], None),  # two planned steps after the first are too few to tell
        ([False, True, True, True], {6}),  # its timed steps flushed too: their timing counted the flushes
    ],
)
def test_a_kept_plan_stays_where_its_flushes_do_not_differ_from_its_timed_steps(
    flushes: list[bool], flushing_in_trials: set[int] | None
) -> None:
    trials = _kept_then_planned(flushes, flushing_in_trials)
    assert not trials.flushes_where_kept()
    assert choose_plan(trials, PROFILE, CANDIDATES, lesson=None, memory=False) is None


def test_no_other_timed_plan_without_flushes_leaves_the_flushing_kept_plan() -> None:
    trials = _kept_then_planned([False, True, True, True], flushing_in_trials={0, 3})
    assert trials.flushes_where_kept()
    assert choose_plan(trials, PROFILE, CANDIDATES, lesson=None, memory=False) is None  # the others flushed, timed
    assert not trials.flushes_where_kept()


def _choose_until_kept(
    trials: PlanTrials, lesson: tuple[bool, bool] | None
) -> tuple[list[Plan], Plan, tuple[bool, bool] | None]:
    """Choose through ``choose_plan`` as the planner does after each step, until no plan is under trial: the plans
    the steps ran, the plan kept and the lesson after."""
    ran: list[Plan] = []
    choice = choose_plan(trials, PROFILE, CANDIDATES, lesson, memory=False)
    assert choice is not None
    plan, _, lesson = choice
    while trials.trying:
        ran.append(plan)
        if trials.count(plan, STEP_MS[plan.checkpoint_blocks], pinned=False):
            choice = choose_plan(trials, PROFILE, CANDIDATES, lesson, memory=False)
            assert choice is not None
            plan, _, lesson = choice
    return ran, plan, lesson


def test_trials_that_compared_plans_teach_the_kind_kept_and_a_new_input_runs_that_kind_untimed() -> None:
    """The first input's trials time three plans and keep the one without copies: the lesson is that kind. A new
    input (a new profile, nothing timed) then runs the cheapest plan without copies of those its trials would time,
    without timing any; it says so."""
    first = PlanTrials(enabled=True)
    ran, kept, lesson = _choose_until_kept(first, None)
    assert len(ran) == 3 * TRIAL_STEPS and kept == CANDIDATES[3]
    assert lesson == plan_kind(kept) == (False, False)
    second = PlanTrials(enabled=True)
    choice = choose_plan(second, PROFILE, CANDIDATES, lesson, memory=False)
    assert choice is not None
    plan, words, after = choice
    assert plan == CANDIDATES[3] and after == lesson
    assert second.done and not second.trying and not second.timed
    assert words.startswith("not timed (another input's trials kept a plan that offloads nothing")
    # Later choices (a faster step taught, a correction towards memory) keep to the lesson while nothing was timed.
    assert choose_plan(second, PROFILE, CANDIDATES, lesson, memory=True)[0] == CANDIDATES[3]  # type: ignore[index]


def test_an_offloading_lesson_picks_the_cheapest_offloading_plan_the_trials_would_time() -> None:
    """Where copies won, a new input runs the cheapest plan that offloads among those its trials would time."""
    trials = PlanTrials(enabled=True)
    plan, _, lesson = choose_plan(trials, PROFILE, CANDIDATES, (True, False), memory=False)  # type: ignore[misc]
    assert plan == CANDIDATES[0] and lesson == (True, False) and not trials.trying


def test_a_lesson_of_a_kind_the_trials_would_not_time_or_no_lesson_times_plans() -> None:
    """No plan of the lesson's kind among those worth timing (here none recomputes elementwise operations), or no
    lesson at all: the input's own trials run, and a plan that keeps everything is never displaced by a lesson."""
    for lesson in (None, (False, True)):
        trials = PlanTrials(enabled=True)
        choice = choose_plan(trials, PROFILE, CANDIDATES, lesson, memory=False)
        assert choice is not None and trials.trying and choice[0] == CANDIDATES[0], lesson
    keeping = [Plan(0, 0, 10 * GiB, 0.0, True), *CANDIDATES]
    trials = PlanTrials(enabled=True)
    choice = choose_plan(trials, PROFILE, keeping, (True, False), memory=False)
    assert choice is not None and choice[0] == keeping[0] and not trials.trying


def test_while_another_inputs_plans_are_under_trial_a_new_input_runs_the_models_plan_and_waits() -> None:
    """No lesson yet and another input's trials under way: the model's cheapest plan runs, no trial begins, and the
    input's trials have not begun (it chooses again when it comes back). Once a lesson exists, it decides."""
    trials = PlanTrials(enabled=True)
    choice = choose_plan(trials, PROFILE, CANDIDATES, None, memory=False, trials_elsewhere=True)
    assert choice is not None
    plan, words, lesson = choice
    assert plan == CANDIDATES[0] and lesson is None and not trials.trying and trials.not_begun
    assert words.startswith("not timed (another input's plans are under trial")
    choice = choose_plan(trials, PROFILE, CANDIDATES, (False, False), memory=False, trials_elsewhere=False)
    assert choice is not None and choice[0] == CANDIDATES[3] and not trials.not_begun
    # No trials elsewhere and no lesson: this input times its own plans.
    own = PlanTrials(enabled=True)
    assert choose_plan(own, PROFILE, CANDIDATES, None, memory=False) is not None and own.trying
