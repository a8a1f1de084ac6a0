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
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from lightning_offload.planner.aims import REPLAN_SHARE, cache_worth_emptying, fit_margin, keeping_aim, plan_aim
from lightning_offload.planner.candidates import cheapest_plan, plan_candidates, with_plans_that_keep
from lightning_offload.planner.inputs import InputRecord, no_larger, size
from lightning_offload.planner.learning import learn_from_copy_waits, learn_from_slow_forward
from lightning_offload.planner.measure import Machine, MeasuredPeaks, measured_profile, pressed_gap
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.steps import Directive, Measure, Notice, Observation, Phase, StepRecord, StepStart
from lightning_offload.planner.trials import PlanTrials, timing_key
from lightning_offload.units import GiB

# Steps measured before the first plan: the first runs before the optimizer has its state (Adam's moments are
# allocated at the first step), so the second is the one every later step looks like.
MEASURED_STEPS = 2
# Under the device's own budget, measuring steps keep everything until allocated memory passes the budget less this
# share of it: a model that uses most of the device but fits is measured without offloading.
_WATERMARK_SHARE = 0.10
REMEMBERED_INPUTS = 32  # inputs whose records are kept while others run
_MISLED_INPUTS = 4096  # inputs a lent plan misled: they are never lent one again
_RECORDED_STEPS = 512
NO_INPUT: Any = object()  # no input named yet


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
        self.trials_enabled = trials
        self.rec = InputRecord(PlanTrials(trials), measure_left=MEASURED_STEPS, frugal_next=frugal_first)
        self.key: Hashable = NO_INPUT
        self.remembered: OrderedDict[Hashable, InputRecord] = OrderedDict()  # other inputs, least recently run first
        self.misled: OrderedDict[Hashable, None] = OrderedDict()
        self.machine = Machine()
        self.copies_lost = False  # the latest trials that compared plans with copies and without kept one without
        self.step = 0
        self.open: Directive | None = None  # the step in progress
        self.expandable = False
        self.records: deque[StepRecord] = deque(maxlen=_RECORDED_STEPS)
        self.notices: list[Notice] = []
        self._release_cache = False  # empty the allocator's cache before the next step
        self._start = StepStart(0)
        self._pinning_steps: set[int] = set()

    # ------------------------------------------------------------------------------------------------ what it holds

    @property
    def plan(self) -> Plan | None:
        return self.rec.plan

    @property
    def profile(self) -> StepProfile | None:
        return self.rec.profile

    @property
    def fit_margin(self) -> int:
        """How far below the budget every plan's predicted peak stays (:func:`~.aims.fit_margin`)."""
        p = self.rec.profile
        base = p.base if p is not None and p.base else self.rec.base
        return fit_margin(self.budget, base, p.fit_error if p is not None else 0)

    @property
    def plan_budget(self) -> int:
        return plan_aim(self.budget, self.fit_margin, self.rec.reserved_gap)

    @property
    def keeping_budget(self) -> int:
        return keeping_aim(self.budget, self.fit_margin, self.plan_budget, self.expandable)

    def candidates(self) -> list[Plan]:
        """The plans the profile offers under :attr:`plan_budget`, each replaced by the plan of the same blocks that
        offloads nothing where that one fits :attr:`keeping_budget`."""
        assert self.rec.profile is not None
        candidates = plan_candidates(self.rec.profile, self.plan_budget)
        if self.keeping_budget <= self.plan_budget:
            return candidates
        return with_plans_that_keep(candidates, plan_candidates(self.rec.profile, self.keeping_budget, keep_only=True))

    @property
    def empties_cache(self) -> bool:
        """Whether the allocator's cache is to be emptied before the next step begins (its directive says so too)."""
        return self._release_cache

    def take_notices(self) -> list[Notice]:
        notices, self.notices = self.notices, []
        return notices

    def _say(self, level: int, text: str, plan: bool = False) -> None:
        self.notices.append(Notice(level, text, plan))

    # ------------------------------------------------------------------------------------------------ the step

    def begin(self, start: StepStart) -> Directive:
        """A step begins with ``start.allocated`` bytes allocated: what it runs."""
        self.step += 1
        self._start, self.expandable = start, start.expandable
        empty, self._release_cache = self._release_cache, False
        rec = self.rec
        if rec.phase is not Phase.MEASURING:
            self._follow_base(start.allocated)
            rec.ran(self.step)
            self.open = Directive(rec.phase, rec.plan, empty_cache=empty)
            return self.open
        frugal = rec.frugal_next
        by_parts = frugal and self._measure_by_parts(start.allocated)  # (against the measuring step before it)
        in_full = frugal and rec.full_block is None
        watermark = 0 if frugal else self.budget - int(self.budget * _WATERMARK_SHARE)
        measure = Measure(frugal, one_in_full=in_full, by_parts=by_parts or in_full, watermark=watermark)
        rec.base, rec.frugal_next = start.allocated, False
        if frugal and rec.full_block is not None:
            self._warn_frugal_step(start.allocated)
        if rec.base >= self.budget and rec.profile is None:
            self._say(
                logging.WARNING,
                f"memory_budget={self.budget / GiB:.2f} GiB: {rec.base / GiB:.2f} GiB are allocated before the step "
                "begins (weights, gradients, optimizer state): no plan can keep the step within the budget",
            )
        self.open = Directive(Phase.MEASURING, measure=measure, empty_cache=empty)
        return self.open

    def observe(self, obs: Observation) -> None:
        """The step that :meth:`begin` started ended (or raised: ``obs.raised``); learn from it."""
        d, self.open = self.open, None
        if d is None:
            return
        if obs.raised:
            self._abandoned(d, obs)
            return
        if obs.pinned:
            self._pinning_steps.add(self.step)
            if len(self._pinning_steps) > 64:
                self._pinning_steps = set(sorted(self._pinning_steps)[-32:])
        self._record(d, obs)
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
        rec = self.rec
        assert d.measure is not None
        rec.measure_left -= 1
        rec.measured += 1
        rec.reserved_gap = pressed_gap(obs, self.budget)
        rec.peaks = MeasuredPeaks(rec.base, obs.peak, obs.backward_peak, d.measure.frugal)
        rec.frugal_next = obs.tripped  # a step that passed its watermark peaked there: the next is frugal
        rec.profile, rec.full_block = measured_profile(obs, rec.full_block, rec.base, self.machine)
        if rec.measure_left <= 0 and rec.measured == 1 and obs.pinned:
            # A single measuring step that pinned new host buffers timed the pinning as compute (0.4 s per GiB on an
            # H200): a forward that slow hides any copy. Its buffers exist now: measured once more.
            rec.measure_left = 1
        if rec.measure_left <= 0:
            self._choose()
            rec.settling = True  # the measuring steps left the cache shaped by their own allocations

    def _planned(self, d: Directive, obs: Observation) -> None:
        rec = self.rec
        plan, p = rec.plan, rec.profile
        assert plan is not None and p is not None
        timed = rec.trials.count(plan, obs.step_ms, pinned=obs.pinned, flushed=obs.flushed)
        # The prediction counts what the step held as the model does, so a step that peaked where predicted moves
        # nothing; only a rise moves the plan, towards memory.
        error = obs.peak - plan.peak
        self._learn_fit_error(error, obs)
        p = rec.profile
        assert p is not None
        passed = error > self.budget * REPLAN_SHARE or (error > 0 and obs.peak > self.budget)
        heavier = max(error, obs.peak - self.budget) if passed else 0
        # A step that reserved past the budget (no hard cap stopped it) counts as that much heavier; only what the step
        # itself reserved: the allocator keeps what heavier steps before it reserved.
        if obs.reserved_peak > max(obs.reserved_at_start, self.budget):
            heavier = max(heavier, obs.reserved_peak - self.budget)
        if heavier > 0 and rec.lent:
            self._say(
                logging.INFO,
                f"memory_budget: a step of input {self.key} peaked {heavier / GiB:.2f} GiB past a "
                "larger input's plan; measuring it",
            )
            self._misled_by_lent_plan(frugal=False)
            return
        if heavier > 0:
            rec.profile = dataclasses.replace(p, correction=p.correction + heavier)
            self._choose(memory=True)
            return
        if rec.settling and d.phase is not Phase.TRYING:
            rec.settling = False
            self._release_cache = self.cache_worth_emptying(max(obs.peak, plan.peak), obs.reserved)
        changed = timed
        # Compute time only falls: a measuring step can be slowed by what only it does (pinning host memory).
        if 0 < obs.forward_ms < 0.9 * p.forward_ms:
            rec.profile = p = dataclasses.replace(p, forward_ms=obs.forward_ms)
            changed = True
        recomputes = plan.checkpoint_blocks or plan.light_blocks
        if 0 < obs.backward_ms < 0.9 * p.backward_ms and not recomputes:  # recompute is not pace
            rec.profile = dataclasses.replace(p, backward_ms=obs.backward_ms)
            changed = True
        if changed:
            self._choose()

    def _abandoned(self, d: Directive, obs: Observation) -> None:
        """A measuring step that raised is measured again (frugally, where it ran out of memory); a planned step that
        ran out of memory corrects the plan by its peak, the request that failed and the fragments held then."""
        rec = self.rec
        if d.measure is not None:
            rec.frugal_next = rec.frugal_next or d.measure.frugal or obs.tripped or obs.out_of_memory
            return
        if not obs.out_of_memory or rec.plan is None or rec.profile is None:
            return
        if rec.lent:
            self._say(
                logging.INFO,
                f"memory_budget: a step of input {self.key} ran out of memory under a larger "
                "input's plan; measuring it",
            )
            self._misled_by_lent_plan(frugal=True)
            return
        fragments = max(0, obs.reserved - obs.allocated)
        need = obs.peak + (obs.request or int(self.budget * REPLAN_SHARE)) + fragments
        heavier = max(0, need - rec.plan.peak - self.fit_margin) + int(self.budget * REPLAN_SHARE)
        p = rec.profile
        rec.profile = dataclasses.replace(p, correction=p.correction + heavier, fit_error=max(p.fit_error, fragments))
        self._choose(memory=True)

    def _learn_fit_error(self, error: int, obs: Observation) -> None:
        """Fold a planned step's small miss (below the replanning share) and, where the allocator flushed its cache, the
        fragments it reserved past its peak into the fit margin; plan again where the plan now sits within it."""
        rec = self.rec
        assert rec.profile is not None and rec.plan is not None
        missed = max(0, min(error, int(self.budget * REPLAN_SHARE)))
        if obs.flushed:
            missed += max(0, obs.reserved_peak - obs.peak)
        if missed <= rec.profile.fit_error:
            return
        rec.profile = dataclasses.replace(rec.profile, fit_error=missed)
        if rec.plan.peak + self.fit_margin > self.budget:
            self._choose(memory=True)

    def _follow_base(self, allocated: int) -> None:
        """A planned step that begins with more allocated than the measured one (gradients accumulated, the optimizer's
        state, the last step's gradients kept through forward) holds that much more in every phase: plan again first."""
        p = self.rec.profile
        assert p is not None
        grown = allocated - p.base
        if grown <= self.budget * REPLAN_SHARE / 2:
            return
        self._say(
            logging.INFO,
            f"memory_budget={self.budget / GiB:.2f} GiB: the step begins with {grown / GiB:.2f} "
            "GiB more allocated than the measured one (gradients, optimizer state); planning again",
        )
        self.rec.profile = dataclasses.replace(p, base=allocated, correction=p.correction + grown)
        self._choose(memory=True)

    def _late(self, learn: Any, step: int, ms: float) -> None:
        """An earlier step's timing, read now: it teaches the record that ran it (the current input's or a kept one's)
        and the machine; the current input plans again where its profile changed."""
        rec = self._record_of(step)
        if rec is None:
            return
        machine = learn(rec, self.machine, step, ms, self.notices)
        if machine == self.machine:
            return
        self.machine = machine
        p = self.rec.profile
        if p is None:
            return
        updated = dataclasses.replace(
            p,
            link_share=min(p.link_share, machine.link_share),
            copy_ms_per_gib=max(p.copy_ms_per_gib, machine.copy_ms_per_gib),
        )
        if updated != p:
            self.rec.profile = updated
            self._choose()

    def _record_of(self, step: int) -> InputRecord | None:
        """The record whose plan step ``step`` ran, where that plan offloads (``None``: its timing says nothing of the
        copies: it pinned host buffers, or ran no copies)."""
        if step in self._pinning_steps:
            return None
        rec = self.rec
        if rec.plan is not None and rec.profile is not None and rec.plan_since is not None and step >= rec.plan_since:
            return rec if rec.plan.offload_bytes > 0 else None
        for kept in self.remembered.values():
            if step in kept.plan_steps and kept.plan is not None and kept.profile is not None:
                return kept if kept.plan.offload_bytes > 0 else None
        return None

    # ------------------------------------------------------------------------------------------------ inputs

    @property
    def input_key(self) -> Hashable:
        return None if self.key is NO_INPUT else self.key

    def runs_input(self, key: Hashable) -> bool:
        return self.key is not NO_INPUT and key == self.key

    def input_changed(self, key: Hashable) -> bool:
        """The next step's input is ``key``. A new input is measured; one met before runs its plan (its trials go on
        where they stopped); a new input no larger in any dimension than a kept one whose plan keeps everything runs
        that plan, unmeasured. The input left is kept. Returns whether the next step measures."""
        if self.runs_input(key):
            return self.rec.phase is Phase.MEASURING
        previous, self.key = self.key, key
        if previous is NO_INPUT and self.step == 0:
            return True  # the first steps measure anyway
        self.abandon()
        # Taken out before the input left is kept: kept first, the list could run one over and forget the one coming
        # back. An input none of whose measuring steps ended is kept where its next must be frugal, or a lent plan
        # misled it.
        kept = self.remembered.pop(key, None)
        rec = self.rec
        if previous is not NO_INPUT and (rec.profile is not None or rec.frugal_next or previous in self.misled):
            if rec.measure_left > 0:
                rec.plan = None
            self.remembered[previous] = rec
            while len(self.remembered) > REMEMBERED_INPUTS:
                self.remembered.popitem(last=False)
        if key not in self.misled and (kept is None or (kept.plan is None and not kept.frugal_next)):
            kept = self._lender(key) or kept
        if kept is None or kept.profile is None:
            frugal = kept.frugal_next if kept is not None else rec.frugal_next
            self.rec = InputRecord(
                PlanTrials(self.trials_enabled),
                measure_left=max(1, rec.measure_left),
                frugal_next=frugal,
                base=rec.base,
            )
            return True
        # What planned steps of other inputs taught about the machine counts here too.
        profile = kept.profile
        kept.profile = dataclasses.replace(
            profile,
            link_share=min(profile.link_share, self.machine.link_share),
            copy_ms_per_gib=max(profile.copy_ms_per_gib, self.machine.copy_ms_per_gib),
        )
        kept.plan_since = None  # the steps since it last ran ran other plans
        self.rec = kept
        if kept.measure_left > 0:
            return True
        if kept.profile != profile:
            self._choose()
        return False

    def replan(self, measuring_steps: int = 1) -> None:
        """Measure again at the next ``measuring_steps`` steps; other inputs' records are forgotten (the model or the
        optimizer changed)."""
        self.abandon()
        self.remembered.clear()
        self.misled.clear()
        self.copies_lost = False
        self.rec.forget(measuring_steps)

    def _lender(self, key: Hashable) -> InputRecord | None:
        """A kept input at least as large as ``key`` in every dimension whose plan keeps everything (the smallest such),
        lent to ``key``: it installs no hooks and costs nothing, and an input no larger saves no more. A step that peaks
        past it, or runs out of memory, says the shape misled: the input is measured, and never lent a plan again."""
        lenders = [(name, r) for name, r in self.remembered.items() if r.keeps_everything() and no_larger(key, name)]
        if not lenders:
            return None
        name, lender = min(lenders, key=lambda item: size(item[0]))
        self._say(logging.DEBUG, f"memory_budget: input {key} runs the plan of input {name}, which keeps everything")
        return lender.lent_copy()

    def _misled_by_lent_plan(self, frugal: bool) -> None:
        self.rec.forget(1)
        self.rec.frugal_next = self.rec.frugal_next or frugal
        self.misled[self.key] = None
        self.misled.move_to_end(self.key)
        while len(self.misled) > _MISLED_INPUTS:
            self.misled.popitem(last=False)

    # ------------------------------------------------------------------------------------------------ choosing

    def _choose(self, memory: bool = False) -> None:
        """Choose the next step's plan: the model's cheapest, or while plans are under trial the next to time, then
        the fastest timed. Once plans were timed, only a correction towards ``memory`` chooses again (the fastest timed
        plan that still fits, or the plans that fit now timed in turn)."""
        rec = self.rec
        assert rec.profile is not None
        candidates, trials = self.candidates(), rec.trials
        if self.copies_lost and not trials.timed:
            # Another input's trials kept a plan without copies over plans with: the model misprices copies for this
            # model on this machine. Where a plan without copies fits, plans with are not timed for a new input.
            keeping = [p for p in candidates if not p.offload_bytes]
            if any(p.fits for p in keeping):
                candidates = keeping
        plan = cheapest_plan(candidates)
        if trials.done and trials.timed:
            if not memory:
                return
            plan = trials.after_correction(candidates) or plan
        chosen, trial = trials.choose(rec.profile, candidates, memory)
        if trials.done and chosen is not None and any(nbytes for _, nbytes, _, _ in trials.timed_plans()):
            self.copies_lost = not chosen.offload_bytes
        plan = chosen or plan
        plan = dataclasses.replace(plan, fits=plan.peak + self.fit_margin <= self.budget)
        previous, changed = rec.plan, plan != rec.plan
        rec.plan = plan
        if changed:
            rec.plan_since, rec.plan_steps = None, ()
        # Trials just ended, or a plan that runs other blocks or bytes follows a kept one: its first step says whether
        # the cache the steps before it left is worth emptying.
        if trials.done and (trial or (previous is not None and timing_key(plan) != timing_key(previous))):
            rec.settling = True
        if changed or trial:
            self._tell(plan, trial)

    def _tell(self, plan: Plan, trial: str) -> None:
        """Say the plan chosen: a warning where it does not fit (under a hard cap the next step runs out of memory)."""
        p = self.rec.profile
        assert p is not None
        text = f"memory_budget={self.budget / GiB:.2f} GiB: {trial}{plan.describe(self.budget)}"
        if not plan.fits:
            fixed = p.peak + p.correction - p.resident
            text += (
                f", within the fit margin of {self.fit_margin / GiB:.2f} GiB below it (what this model's predictions "
                "and the allocator's fragments may miss by): the step may run out of memory under a hard limit. Even "
                f"the most frugal plan needs {plan.peak / GiB:.2f} GiB: weights, gradients and optimizer state take "
                f"{self.rec.base / GiB:.2f} GiB and the step's other transients (the loss and logits among them) "
                f"{(fixed - self.rec.base) / GiB:.2f} GiB"
            )
        self._say(logging.INFO if plan.fits else logging.WARNING, text, plan=True)

    # ------------------------------------------------------------------------------------------------ measuring

    def _measure_by_parts(self, allocated: int) -> bool:
        """Whether the next measuring step checkpoints its blocks by their parts, as the one before did: where a block
        rebuilt whole would take it past what plans aim for. Elsewhere it checkpoints them whole, as most plans do."""
        whole = self.rec.peaks.rebuilt_whole(self.rec.full_block, allocated)
        return whole is not None and whole > self.plan_budget

    def _warn_frugal_step(self, allocated: int) -> None:
        """Say so before a frugal measuring step that is expected to pass the budget: it is as frugal as any plan."""
        rec = self.rec
        expected = rec.peaks.next_frugal_peak(allocated)
        if expected <= self.budget:
            return
        held = rec.peaks.backward_peak or rec.peaks.peak
        self._say(
            logging.WARNING,
            f"memory_budget={self.budget / GiB:.2f} GiB: the next step, measuring and as frugal as any plan, should "
            f"need about {expected / GiB:.2f} GiB: the one before it peaked at {held / GiB:.2f} GiB by the end of its "
            f"backward, and {max(0, allocated - rec.peaks.base) / GiB:.2f} GiB more are allocated now (the optimizer's "
            f"state). Weights, gradients and optimizer state take {rec.base / GiB:.2f} GiB; the step's other "
            f"transients (the loss and logits among them; every activation leaves) {(expected - rec.base) / GiB:.2f} "
            "GiB. If this is a hard limit, the model does not train at this input size within it: a shorter sequence "
            "or a smaller batch, or a budget above that",
        )

    def cache_worth_emptying(self, peak: int, reserved: int) -> bool:
        """Whether a kept plan's first step, which peaked at ``peak`` bytes allocated, left the allocator holding
        ``reserved`` bytes, far more than that and than the plans of the other inputs kept predict, while the budget
        has room for a layout mapped afresh: the cache is then emptied once, before the next step."""
        peak = max([peak] + [kept.plan.peak for kept in self.remembered.values() if kept.plan is not None])
        if not cache_worth_emptying(reserved, peak, self.budget):
            return False
        self._say(
            logging.DEBUG,
            f"memory_budget={self.budget / GiB:.2f} GiB: the kept plan's first step found "
            f"{reserved / GiB:.2f} GiB reserved for a {peak / GiB:.2f} GiB peak; emptying the cache once",
        )
        return True

    def _record(self, d: Directive, obs: Observation) -> None:
        plan = d.plan
        self.records.append(
            StepRecord(
                step=self.step,
                input=repr(self.input_key),
                kind="measuring" if d.phase is Phase.MEASURING else "trial" if d.phase is Phase.TRYING else "planned",
                base=self._start.allocated,
                forward=obs.forward_peak,
                head=obs.head_peak,
                backward=obs.backward_peak,
                peak=obs.peak,
                predicted=plan.peak if plan is not None else 0,
                predicted_phases=plan.phases if plan is not None else (),
                budget=self.budget,
            )
        )
