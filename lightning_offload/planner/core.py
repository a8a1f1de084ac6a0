"""The planner as one state machine: a step begins (:meth:`Planner.begin` returns its :class:`Directive`), it ends or
raises (:meth:`Planner.observe` learns from its :class:`Observation`), and between steps the input may change
(:meth:`Planner.input_changed`) or the model (:meth:`Planner.replan`). Each input moves through
:class:`~lightning_offload.planner.steps.Phase`: measured (its first steps), its plans timed against each other, then
planned. Plain numbers in, plans and notices out: the engine's driver reads the device and applies the directive.

Learning only moves towards memory: a planned step that peaked past its prediction corrects the model and plans again
(a plan relaxed on a lighter step can pass a hard cap on the next), and a step that begins above the measured base is
planned again before it runs. What planned steps teach about time (faster compute, slower copies) moves plans towards
checkpointing only, and once plans were timed, the timings decide instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Hashable
from typing import Any

from lightning_offload.planner import words
from lightning_offload.planner.aims import cache_worth_emptying, plan_aim
from lightning_offload.planner.book import NO_INPUT, InputBook
from lightning_offload.planner.candidates import plan_candidates
from lightning_offload.planner.choice import choose_plan
from lightning_offload.planner.corrections import (
    after_out_of_memory,
    after_planned_step,
    grown_base,
    heavier_than_planned,
    with_faster_compute,
)
from lightning_offload.planner.inputs import InputRecord
from lightning_offload.planner.learning import (
    RecentSteps,
    learn_from_copy_waits,
    learn_from_slow_forward,
    record_that_ran,
)
from lightning_offload.planner.measure import Machine
from lightning_offload.planner.measuring import MEASURED_STEPS, measured, next_measure
from lightning_offload.planner.profile import Plan
from lightning_offload.planner.steps import Directive, Notice, Observation, Phase, StepRecord, StepStart
from lightning_offload.planner.trace import Trace
from lightning_offload.planner.trials import PlanKind, PlanTrials, timing_key

_RECORDED_STEPS = 512


def keeps_margin(plan: Plan, budget: int, margin: int) -> bool:
    """Whether ``plan``'s predicted peak up to the end of backward stays ``margin`` below ``budget``, and the
    optimizer's step (measured, the same for every plan) within it."""
    return plan.activation_peak + margin <= budget and plan.peak <= budget


class Planner:
    """Plans each step under ``budget`` bytes.

    Args:
        budget: bytes a step's peak may reach.
        trials: time the plans worth comparing and keep the fastest (``False``: the model's cheapest plan).
        frugal_first: the first measuring step offloads from its first saved tensor (a budget the user gave is often a
            hard limit, and what the loss and backward add on top of forward is not known yet).
    """

    def __init__(self, budget: int, trials: bool = True, frugal_first: bool = True) -> None:
        self.budget = budget
        self.rec = InputRecord(PlanTrials(trials), measure_left=MEASURED_STEPS, frugal_next=frugal_first)
        self.book = InputBook()  # the current input's key and the other inputs' records
        self.trace = Trace(budget, trials, frugal_first)
        self.machine = Machine()
        self.lesson: PlanKind | None = None  # the kind of plan the latest trials that compared plans kept
        self.step = 0
        self.open: Directive | None = None  # the step in progress
        self.records: deque[StepRecord] = deque(maxlen=_RECORDED_STEPS)
        self.notices: list[Notice] = []
        self._release_cache = False  # empty the allocator's cache before the next step
        self._start = StepStart(0)
        self._pinning_steps = RecentSteps()  # steps that pinned host buffers: their timings say nothing of copies
        self.eased = False  # the step that ran out of memory made the next more frugal: running it again may fit

    # ------------------------------------------------------------------------------------------------ what it holds

    plan = property(lambda self: self.rec.plan)  # the current input's plan (``None`` while it measures)
    profile = property(lambda self: self.rec.profile)  # the current input's measured step, as corrected
    empties_cache = property(lambda self: self._release_cache)  # before the next step (its directive says so too)

    fit_margin = property(lambda self: self.rec.fit_margin(self.budget))  # how far below the budget plans stay

    plan_budget = property(lambda self: plan_aim(self.budget, self.fit_margin, self.rec.reserved_gap))

    def candidates(self) -> list[Plan]:
        """The plans the profile offers under the aim (:func:`~.candidates.plan_candidates`)."""
        assert self.rec.profile is not None
        return plan_candidates(self.rec.profile, self.plan_budget)

    def take_notices(self) -> list[Notice]:
        notices, self.notices = self.notices, []
        return notices

    def _say(self, level: int, text: str, plan: bool = False) -> None:
        self.notices.append(Notice(level, text, plan))

    # ------------------------------------------------------------------------------------------------ the step

    def begin(self, start: StepStart) -> Directive:
        """A step begins with ``start.allocated`` bytes allocated: what it runs."""
        self.step += 1
        self._start, self.eased = start, False
        empty, self._release_cache = self._release_cache, False
        rec = self.rec
        if rec.phase is not Phase.MEASURING:
            self._follow_base(start.allocated)
            rec.ran(self.step)
            self.open = Directive(rec.phase, rec.plan, empty_cache=empty)
        else:
            measure, warnings = next_measure(rec, self.budget, self.plan_budget, start.allocated)
            for text in warnings:
                self._say(logging.WARNING, text)
            self.open = Directive(Phase.MEASURING, measure=measure, empty_cache=empty)
        self.trace.begin(start, self.open)
        return self.open

    def observe(self, obs: Observation) -> None:
        """The step that :meth:`begin` started ended (or raised: ``obs.raised``); learn from it."""
        d, self.open = self.open, None
        if d is None:
            return
        self.trace.observe(obs)
        if obs.raised:
            self._abandoned(d, obs)
            return
        if obs.pinned:
            self._pinning_steps.add(self.step)
        self.records.append(StepRecord.of(self.step, self.input_key, d, self._start.allocated, obs, self.budget))
        if d.phase is Phase.MEASURING:
            self._measured(d, obs)
        elif self.rec.plan is not None and self.rec.profile is not None:
            self._planned(d, obs)
        if obs.forward_timing is not None:
            self._late(learn_from_slow_forward, *obs.forward_timing)
        if obs.copy_waits is not None:
            self._late(learn_from_copy_waits, *obs.copy_waits)

    def abandon(self) -> None:
        """The step in progress is dropped (a replan, a new input, a step that raised): it teaches nothing."""
        self.observe(Observation(raised=True))

    def _measured(self, d: Directive, obs: Observation) -> None:
        assert d.measure is not None
        if measured(self.rec, d.measure, obs, self.budget, self.machine):
            self._choose()
            self.rec.settling = True  # the measuring steps left the cache shaped by their own allocations

    def _planned(self, d: Directive, obs: Observation) -> None:
        rec = self.rec
        plan, p = rec.plan, rec.profile
        assert plan is not None and p is not None
        # The plan's trial is over, or the plan the trials kept flushes the cache where its timed steps did not.
        rechoose = rec.trials.count(plan, obs.step_ms, pinned=obs.pinned, flushed=obs.flushed)
        # A step that peaked where predicted moves nothing; only a rise moves the plan, towards memory.
        p, error = after_planned_step(p, plan, obs, self.budget)
        rec.profile = p
        # Plans hold the optimizer's peak as learnt now: choose again where it passed the plan's, or the margin grew.
        if p.optimizer_peak > plan.peak or (plan.fits and not keeps_margin(plan, self.budget, self.fit_margin)):
            self._choose(memory=True)
        heavier = heavier_than_planned(error, obs, self.budget)
        if heavier > 0:  # a lent plan that misled the input: it measures; else the model corrects by the miss
            if not self._misled_if_lent(heavier):
                rec.profile = dataclasses.replace(rec.profile, correction=rec.profile.correction + heavier)
                self._choose(memory=True)
            return
        if rec.settling and d.phase is not Phase.TRYING:
            rec.settling = False
            self._release_cache = self.cache_worth_emptying(max(obs.peak, plan.peak), obs.reserved)
        faster = with_faster_compute(rec.profile, plan, obs)
        if faster != rec.profile or rechoose:
            rec.profile = faster
            self._choose()

    def _abandoned(self, d: Directive, obs: Observation) -> None:
        """A measuring step that raised is measured again (frugally, where it ran out of memory); a planned step that
        ran out of memory corrects the plan by its peak, the request that failed and the fragments held then. Each
        correction raises every plan's predicted peak: a plan replaced never comes back (:attr:`eased`)."""
        rec, failed = self.rec, self.rec.plan
        if d.measure is not None:
            rec.frugal_next = rec.frugal_next or d.measure.frugal or obs.tripped or obs.out_of_memory
            self.eased = obs.out_of_memory and not d.measure.frugal
        elif obs.out_of_memory and failed is not None and rec.profile is not None:
            if self._misled_if_lent(None):  # it measures, frugally
                self.eased = True
                return
            rec.profile = after_out_of_memory(rec.profile, failed, obs, self.budget, self.fit_margin)
            self._choose(memory=True)
            self.eased = timing_key(rec.plan) != timing_key(failed)

    def _follow_base(self, allocated: int) -> None:
        """A planned step that begins above the measured base (:func:`~.corrections.grown_base`) plans again first."""
        p = self.rec.profile
        assert p is not None
        if grown := grown_base(p, allocated, self.budget):
            self._say(logging.INFO, words.base_grew(self.budget, grown))
            self.rec.profile = dataclasses.replace(p, base=allocated, correction=p.correction + grown)
            self._choose(memory=True)

    def _late(self, learn: Any, step: int, ms: float) -> None:
        """An earlier step's timing, read now: it teaches the record that ran it (the current input's or a kept one's)
        and the machine; the current input plans again where its profile changed."""
        rec = None if step in self._pinning_steps else record_that_ran(step, self.rec, self.book)
        machine = learn(rec, self.machine, step, ms, self.notices) if rec is not None else self.machine
        if machine == self.machine:
            return
        self.machine, p = machine, self.rec.profile
        if p is not None and machine.taught(p) != p:
            self.rec.profile = machine.taught(p)
            self._choose()

    # ------------------------------------------------------------------------------------------------ inputs

    input_key = property(lambda self: None if self.book.key is NO_INPUT else self.book.key)  # the current input's

    def runs_input(self, key: Hashable) -> bool:
        return self.book.runs(key)

    def input_changed(self, key: Hashable) -> bool:
        """The next step's input is ``key``. A new input is measured; one met before runs its plan (its trials go on
        where they stopped); a new input no larger in any dimension than a kept one whose plan keeps everything runs
        that plan, unmeasured. The input left is kept. Returns whether the next step measures."""
        self.trace.input(key)
        if self.book.runs(key):
            return self.rec.phase is Phase.MEASURING
        if self.book.key is NO_INPUT and self.step == 0 and not self.book.holds(key):
            self.book.key = key
            return True  # the first steps measure anyway (unless a restored plan is this input's)
        self.abandon()
        self.rec, relearnt = self.book.switch(key, self.rec, self.machine, self.notices)
        if self.rec.measure_left > 0:
            return True
        if relearnt or self.rec.trials.not_begun:  # it waited for another input's trials: they may have ended
            self._choose()
        return False

    def replan(self, measuring_steps: int = 1) -> None:
        """Measure again at the next ``measuring_steps`` steps; other inputs' records are forgotten (a new model)."""
        self.trace.add("replan", measuring_steps)
        self.abandon()
        self.book.clear()
        self.lesson = None
        self.rec.forget(measuring_steps)

    def _misled_if_lent(self, heavier: int | None) -> bool:
        """Whether the input runs a lent plan, which then misled it (its step peaked ``heavier`` bytes past it;
        ``None``: ran out of memory): it measures, frugally after an out-of-memory error, and is lent no plan again."""
        if not self.rec.lent:
            return False
        self._say(logging.INFO, words.lent_plan_misled(self.input_key, heavier))
        self.rec.forget(1)
        self.rec.frugal_next = self.rec.frugal_next or heavier is None
        self.book.misled(self.book.key)
        return True

    # ------------------------------------------------------------------------------------------------ choosing

    def _choose(self, memory: bool = False) -> None:
        """Choose the next step's plan: the model's cheapest, or while plans are under trial the next to time, then
        the fastest timed. Once plans were timed, only a correction towards ``memory`` chooses again (the fastest timed
        plan that still fits, or the plans that fit now timed in turn)."""
        rec = self.rec
        assert rec.profile is not None
        elsewhere = self.book.trials_elsewhere()
        choice = choose_plan(rec.trials, rec.profile, self.candidates(), self.lesson, memory, elsewhere)
        self.book.trials_run(rec.trials.trying)
        if choice is None:
            return
        plan, trial, self.lesson = choice
        plan = dataclasses.replace(plan, fits=keeps_margin(plan, self.budget, self.fit_margin))
        previous, changed = rec.plan, plan != rec.plan
        rec.plan = plan
        if changed:
            rec.plan_since, rec.plan_steps = None, ()
        # Trials just ended, or a plan that runs other blocks or bytes follows a kept one: its first step says whether
        # the cache the steps before it left is worth emptying.
        if rec.trials.done and (trial or (previous is not None and timing_key(plan) != timing_key(previous))):
            rec.settling = True
        # Said where the plan changed or a trial moved on; a plan left untimed again (another input's trials, or their
        # lesson) is not said at every step that chooses it. A warning where it does not fit: under a hard cap the
        # next step runs out of memory.
        if changed or (trial and not words.untimed(trial)):
            text = words.plan_chosen(self.budget, trial, plan, self.fit_margin, rec.base, rec.profile)
            self._say(logging.INFO if plan.fits else logging.WARNING, text, plan=True)

    def cache_worth_emptying(self, peak: int, reserved: int) -> bool:
        """Whether a kept plan's first step, which peaked at ``peak`` bytes, left the allocator holding ``reserved``,
        worth emptying once (:func:`~.aims.cache_worth_emptying`, against the other inputs' kept plans too)."""
        peak = max([peak, *self.book.peaks()])
        worth = cache_worth_emptying(reserved, peak, self.budget)
        if worth:
            self._say(logging.DEBUG, words.emptying_cache(self.budget, reserved, peak))
        return worth
