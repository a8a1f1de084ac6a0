"""Which plan the next step runs (:func:`choose_plan`): the model's cheapest, the next plan its trials time, the
fastest they timed, or, untimed, the kind of plan trials kept before (another input's, or this input's own before a
correction towards memory). Plain plans in, a plan out; :class:`~lightning_offload.planner.trials.PlanTrials` holds
the timings."""

from __future__ import annotations

from lightning_offload.planner import words
from lightning_offload.planner.candidates import cheapest_plan, cost_order
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.trials import PlanKind, PlanTrials, plan_kind, trial_plans


def choose_plan(
    trials: PlanTrials,
    profile: StepProfile,
    candidates: list[Plan],
    lesson: PlanKind | None,
    memory: bool,
    trials_elsewhere: bool = False,
) -> tuple[Plan, str, PlanKind | None] | None:
    """The next step's plan among ``candidates``: the model's cheapest, or while plans are under trial the next to
    time, then the fastest timed; what the trials say of it; and the kind of plan (:func:`plan_kind`) the latest trials
    that timed more than one plan kept (``lesson``).

    What the model misprices (the host's cost per copy, waits for copies, light blocks' recompute) is the model's and
    the machine's, not the input's: where another input's trials kept a plan of one kind, a new input whose trials
    would time a plan of that kind runs the cheapest such plan by the model, untimed. (Timed again, every length of a
    run whose lengths change from batch to batch would spend some 20 steps on trials.) While another input's trials
    are under way (``trials_elsewhere``) and nothing taught a kind yet, a new input runs the model's cheapest plan and
    begins no trials of its own: lengths drawn at random all come before the first input's trials end, and would each
    time their plans. Once plans were timed, only a correction towards ``memory`` chooses again, the fastest timed plan
    that still fits, or the plans that fit now timed in turn, or a kept plan that flushes the allocator's cache where
    its timed steps did not (:meth:`PlanTrials.flushes_where_kept`), the next fastest timed plan (``None``: the plan
    stays)."""
    if lesson is not None and not trials.timed:
        taught = _taught_plan(trials, profile, candidates, lesson)
        if taught is not None:
            return taught, words.taught_by_other_trials(lesson), lesson
    plan = cheapest_plan(candidates)
    if trials_elsewhere and trials.not_begun:
        return plan, words.trials_elsewhere(), lesson
    if trials.done and trials.timed:
        if not memory:
            # The plan kept flushes the cache where its timed steps did not: the next fastest timed plan runs.
            other, trial = trials.instead_of_flushing(candidates) if trials.flushes_where_kept() else (None, "")
            return (other, trial, plan_kind(other)) if other is not None else None
        fastest = trials.after_correction(candidates)
        # No plan timed fits the corrected model: the kind of plan the trials kept is the machine's lesson, as for
        # another input (on an H100 a zoo row timed 5 plans again for 20 steps and kept the cheapest of that kind).
        kind = trials.kept_kind() if fastest is None else None
        taught = _taught_plan(trials, profile, candidates, kind) if kind is not None else None
        if kind is not None and taught is not None:
            return taught, words.taught_before_correction(kind), lesson
        plan = fastest or plan
    chosen, trial = trials.choose(profile, candidates, memory)
    if trials.done and chosen is not None and len(trials.timed_plans()) > 1:
        lesson = plan_kind(chosen)
    return chosen or plan, trial, lesson


def _taught_plan(trials: PlanTrials, profile: StepProfile, candidates: list[Plan], kind: PlanKind) -> Plan | None:
    """The model's cheapest plan of ``kind`` among those the trials would time, run untimed (the trials settle); or
    ``None`` where they would time none of that kind."""
    taught = [p for p in trial_plans(profile, candidates) if plan_kind(p) == kind]
    if not taught:
        return None
    trials.settle()
    return min(taught, key=cost_order)
