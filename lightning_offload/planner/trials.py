"""Plans under a memory budget timed against each other: which one runs next, and which one ran fastest.

The budget planner's model prices recompute and the link, not the host's cost per saved tensor, copies slowing
compute, or the allocator flushing its cache near a hard cap. So the few plans worth comparing
(:func:`trial_plans`) each run ``TRIAL_STEPS`` steps, timed on the device from step start
to step start, and the fastest is kept. This module holds that bookkeeping: plain plans and milliseconds in, a plan
out; :class:`~lightning_offload.budget.BudgetPlanner` feeds it each step's time.

Torch only: no Lightning import.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from lightning_offload.planner import words
from lightning_offload.planner.candidates import cost_order, shape
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.units import GiB

# Plans worth timing cost at most this share of a step (forward's and backward's compute) more than the cheapest by
# the model: what the model leaves out (the host's hooks, waits for copies, allocator flushes near a hard cap) was
# measured on an H200 at up to 2.5x a small model's step, and at 8-20% of the Llama workloads'.
TRIAL_BAND = 0.5
# Between the cheapest plan and the cheapest one that offloads nothing, one more is timed halfway where they are this
# many checkpointed blocks apart.
TRIAL_SPREAD = 3

# Steps each plan under trial runs: the first settles (it may pin host buffers, 0.4 s per GiB on an H200, and the
# allocator reshapes its cache for the new plan), the median of the others counts. The median, not the mean: in three
# of 26 trials on an H200 the first timed step still ran 2-10% slow while the next two agreed within 1% (8B LoRA's 23
# light blocks: 1211, 1101, 1097 ms), and a mean of 1136 ms then ranked an equal plan ahead of it. But where any timed
# step made the allocator flush its cache, the mean: near a hard cap a plan may flush every other step, a cost it pays
# for good, which a median of three steps hides when one of them flushed (see also ``FLUSH_STEP_DOWN``).
TRIAL_STEPS = 4
# A plan under trial runs at most this many steps while its steps pin host buffers (those say nothing of its pace).
_TRIAL_MAX_STEPS = 5
# Trials begun per profile: a correction towards memory that leaves no timed plan fitting times those that fit (at
# most this many times in all; then the model's cheapest plan runs).
_TRIAL_ROUNDS = 3
# Where the fastest plan's timed steps made the allocator flush its cache (a hard cap, or the device, was full) in at
# least half of them, one more plan is timed: the model's cheapest of the same family predicted to peak at least this
# share lower. (On an H200, Llama-1B's plan of 6 checkpointed blocks under a 28.9 GiB cap ran 209 ms a step with one
# flush each step, 188 ms in another run without; plans a block apart are priced within the trials' band of each
# other, so the next one down was not among those timed.)
FLUSH_STEP_DOWN = 0.025


class PlanTrials:
    """The trials of one profile (:meth:`reset` for a new one).

    Args:
        enabled: time plans at all (``False``: :attr:`done` from the start, the model's cheapest plan runs).

    Attributes:
        trying: the plan chosen last is under trial.
        done: the plans were compared (or nothing was to compare).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        """Forget every timing: a new profile (a new input shape) compares its own plans."""
        self.trying = False
        self.done = not self.enabled
        self._runs: dict[tuple[int, bool, int, int], int] = {}  # plans under trial (``timing_key``): steps run
        self._ms: dict[tuple[int, bool, int, int], list[float]] = {}  # ... the device time of the steps that count
        self._flushed: dict[tuple[int, bool, int, int], int] = {}  # ... and how many of those flushed the cache
        self._compared: list[Plan] | None = None  # the plans under trial (chosen anew only by a memory correction)
        self._stepped_down = False  # a plan below a flushing fastest one was added to this round
        self._rounds = 0  # trials begun (a correction may make the timed plans unfit)
        self._kept: tuple[int, bool, int, int] | None = None  # the timed plan the trials kept
        self._kept_flushes: list[bool] = []  # whether each of its first planned steps flushed the cache
        self._rechosen = False  # it flushed where its timed steps did not, and another timed plan was chosen

    @property
    def not_begun(self) -> bool:
        """Whether the trials have neither begun nor ended (an input that ran the model's plan while another input's
        trials were under way): its plan is chosen again as it comes back."""
        return not (self.done or self.trying or self.timed)

    def settle(self) -> None:
        """Nothing to time: the plan chosen runs as kept (another input's trials taught which kind of plan wins)."""
        self.trying, self.done, self._compared = False, True, None

    def as_state(self) -> dict[str, Any]:
        """The trials as plain values (:meth:`from_state` reads them back)."""

        def table(values: dict[Any, Any]) -> list[list[Any]]:
            return [[list(key), value] for key, value in values.items()]

        return {
            "done": self.done,
            "runs": table(self._runs),
            "ms": table(self._ms),
            "flushed": table(self._flushed),
            "compared": None if self._compared is None else [dataclasses.asdict(p) for p in self._compared],
            "stepped_down": self._stepped_down,
            "rounds": self._rounds,
            "kept": None if self._kept is None else list(self._kept),
            "kept_flushes": list(self._kept_flushes),
            "rechosen": self._rechosen,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], enabled: bool) -> PlanTrials:
        """The trials :meth:`as_state` wrote; a trial in progress starts its plan's steps over (the first settles)."""
        trials = cls(enabled)
        if not enabled:
            return trials
        trials.done = state["done"]
        trials._runs = {tuple(k): v for k, v in state["runs"]} if state["done"] else {}
        trials._ms = {tuple(k): list(v) for k, v in state["ms"]}
        trials._flushed = {tuple(k): v for k, v in state["flushed"]}
        if state["compared"] is not None:
            trials._compared = [Plan(**{**p, "phases": tuple(p["phases"])}) for p in state["compared"]]
        trials._stepped_down = state["stepped_down"]
        trials._rounds = state["rounds"]
        kept = state.get("kept")  # (absent from the plans of an earlier version)
        trials._kept = None if kept is None else tuple(kept)  # type: ignore[assignment]
        trials._kept_flushes = list(state.get("kept_flushes", ()))
        trials._rechosen = state.get("rechosen", False)
        return trials

    @property
    def timed(self) -> bool:
        """Whether any plan was timed."""
        return any(self._ms.values())

    def timed_plans(self) -> list[tuple[int, int, float, int]]:
        """The plans timed: blocks checkpointed, bytes offloaded per forward, device milliseconds per step (the median,
        or the mean where a step flushed the allocator's cache), blocks recomputing their elementwise operations."""
        timed = [key for key, steps in self._ms.items() if steps]
        return [(k, nbytes, self._pace((k, split, nbytes, light)), light) for k, split, nbytes, light in timed]

    def kept_kind(self) -> PlanKind | None:
        """The kind of plan (:func:`plan_kind`) the fastest of the plans timed is, where more than one was timed."""
        timed = self.timed_plans()
        if len(timed) < 2:
            return None
        _, nbytes, _, light = min(timed, key=lambda t: t[2])
        return bool(nbytes), bool(light)

    def timed_steps(self) -> list[tuple[int, int, int, list[float]]]:
        """Each timed plan's steps in the order the plans ran: blocks checkpointed, bytes offloaded per forward, blocks
        recomputing their elementwise operations, and the device milliseconds of every step that counted (to tell a
        plan's pace from the noise between steps)."""
        return [(k, nbytes, light, list(ms)) for (k, _, nbytes, light), ms in self._ms.items() if ms]

    def count(self, plan: Plan, step_ms: float, pinned: bool, flushed: bool = False) -> bool:
        """A step of ``plan`` ended after ``step_ms`` (0: not timed; ``pinned``: it pinned host buffers, so its time
        says nothing of the plan's pace; ``flushed``: the allocator flushed its cache in it). Whether the plan's trial
        is now over (``False`` when none runs), or, for a step of the plan the trials kept, whether it flushes the
        cache where its timed steps did not (:meth:`flushes_where_kept`)."""
        if not self.trying:
            if self.done and self._kept == timing_key(plan) and len(self._kept_flushes) < TRIAL_STEPS:
                self._kept_flushes.append(flushed)
            return self.flushes_where_kept()
        key = timing_key(plan)
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        if runs > 1 and step_ms > 0 and not pinned:
            self._ms.setdefault(key, []).append(step_ms)
            self._flushed[key] = self._flushed.get(key, 0) + flushed
        return self._over(plan)

    def choose(self, profile: StepProfile, candidates: Sequence[Plan], memory: bool) -> tuple[Plan | None, str]:
        """The plan for the next step while trials run, and the words to report it with.

        Which plans are compared is settled as the trials begin (what a faster step teaches about time must not swap
        them midway); a correction towards ``memory`` settles it anew, and starts trials again where the earlier ones
        timed nothing (they had one plan to offer, keeping everything, say: the plans that fit the corrected model are
        not that one). Returns the next plan to time; once every plan was, the fastest and the trials' outcome (``None``
        and no words where nothing was timed: the caller's plan).
        """
        if self.done:
            if not (memory and not self.timed and self._rounds < _TRIAL_ROUNDS):
                return None, ""
            self.done, self._compared = False, None
        if memory or self._compared is None:
            self._rounds += self._compared is None
            self._compared = trial_plans(profile, candidates)
            self._stepped_down = False
        compared = self._compared
        waiting = [p for p in compared if not self._over(p)]
        if not waiting and len(compared) > 1 and not self._stepped_down:
            below = self._below_flushing(compared, candidates)
            self._stepped_down = True
            if below is not None:
                compared.append(below)
                waiting = [below]
        if len(compared) > 1 and waiting:
            self.trying = True
            return waiting[0], f"timing plan {compared.index(waiting[0]) + 1} of {len(compared)}: "
        self.trying, self.done = False, True
        fastest = self.fastest(compared)
        self._keep(fastest)
        return (fastest, self._summary(compared)) if fastest is not None else (None, "")

    def after_correction(self, candidates: Sequence[Plan]) -> Plan | None:
        """After the trials, the model was corrected towards memory: the fastest timed plan among ``candidates`` that
        fits, or ``None``, in which case the plans that fit now are timed (within the rounds allowed)."""
        self.trying = False
        fastest = self.fastest([p for p in candidates if p.fits])
        if fastest is None and self._rounds < _TRIAL_ROUNDS:
            self.done, self._compared = False, None
        self._keep(fastest)
        return fastest

    def _keep(self, plan: Plan | None) -> None:
        """``plan`` (timed) is kept: its first planned steps are watched for flushes its timed steps did not have."""
        self._kept, self._kept_flushes = (timing_key(plan) if plan is not None else None), []

    def _flushes(self, key: tuple[int, bool, int, int]) -> bool:
        """Whether the timed steps of the plan ``key`` flushed the allocator's cache in at least half of them."""
        return 2 * self._flushed.get(key, 0) >= len(self._ms.get(key, ()))

    def flushes_where_kept(self) -> bool:
        """Whether the plan the trials kept flushed the allocator's cache in at least half of its planned steps after
        the first (which settles, as a trial's does), ``TRIAL_STEPS - 1`` of them, where its timed steps flushed in
        fewer than half: it was timed in the cache the plan timed before it left, and runs in another (on an H100,
        Llama-1B's 5 blocks and 1.3 GiB offloaded under 0.9x of its peak timed 203 ms a step without a flush, and
        kept, flushed in every step at 223 ms). Asked once: :meth:`instead_of_flushing` answers it."""
        watched = self._kept_flushes[1:]
        if self._rechosen or self._kept is None or len(watched) < TRIAL_STEPS - 1 or self._flushes(self._kept):
            return False
        return 2 * sum(watched) >= len(watched)

    def instead_of_flushing(self, candidates: Sequence[Plan]) -> tuple[Plan | None, str]:
        """Where :meth:`flushes_where_kept`: the fastest other plan timed among ``candidates`` that fits and whose
        timed steps did not flush the cache, and the words to report it with (``None``: no such plan; the kept plan
        stays). Once per profile."""
        self._rechosen = True
        kept = self._kept
        # (A plan never timed counts as flushing: :meth:`fastest` would leave it out anyway.)
        other = self.fastest(
            [p for p in candidates if p.fits and timing_key(p) != kept and not self._flushes(timing_key(p))]
        )
        if other is None or kept is None:
            return None, ""
        text = words.kept_plan_flushed(self._pace(kept), self._pace(timing_key(other)))
        self._keep(other)
        return other, text

    def _below_flushing(self, compared: list[Plan], candidates: Sequence[Plan]) -> Plan | None:
        """A plan to time below the fastest of ``compared`` where that one's timed steps flushed the allocator's cache
        in at least half of them: the model's cheapest of its family (with or without light blocks) that fits,
        predicted to peak :data:`FLUSH_STEP_DOWN` lower, and not timed yet; ``None``: no such plan or no need."""
        fastest = self.fastest(compared)
        if fastest is None:
            return None
        if not self._flushes(timing_key(fastest)):
            return None
        shapes = {timing_key(p) for p in compared}
        lower = [
            p
            for p in candidates
            if p.fits
            and bool(p.light_blocks) == bool(fastest.light_blocks)
            and p.peak <= (1 - FLUSH_STEP_DOWN) * fastest.peak
            and timing_key(p) not in shapes
            and timing_key(p) not in self._ms  # timed in an earlier round: its timing stands
        ]
        return min(lower, key=lambda p: (p.extra_ms, -p.peak)) if lower else None

    def fastest(self, plans: Sequence[Plan]) -> Plan | None:
        """The plan of ``plans`` whose timed steps ran fastest (their median, or their mean where one flushed the
        allocator's cache; ``None``: none was timed)."""
        timed = [p for p in plans if self._ms.get(timing_key(p))]
        return min(timed, key=lambda p: (self._pace(timing_key(p)), p.peak)) if timed else None

    def _over(self, plan: Plan) -> bool:
        key = timing_key(plan)
        return len(self._ms.get(key, [])) >= TRIAL_STEPS - 1 or self._runs.get(key, 0) >= _TRIAL_MAX_STEPS

    def _pace(self, key: tuple[int, bool, int, int]) -> float:
        """A timed plan's milliseconds per step: the median of its timed steps, their mean where any flushed."""
        steps = self._ms[key]
        return statistics.fmean(steps) if self._flushed.get(key) else statistics.median(steps)

    def _summary(self, compared: list[Plan]) -> str:
        """The trials' outcome in words: each plan's step (median, or mean where a step flushed)."""
        times = []
        for p in compared:
            light = f"{p.light_blocks} elementwise + " if p.light_blocks else ""
            parts = " by parts" if p.split else ""
            what = f"{light}{p.checkpoint_blocks} block(s){parts} + {p.offload_bytes / GiB:.2f} GiB"
            key = timing_key(p)
            if not self._ms.get(key):
                times.append(f"{what} not timed")
                continue
            flushed = self._flushed.get(key, 0)
            flushes = (
                f" (the allocator flushed its cache in {flushed} of {len(self._ms[key])} steps)" if flushed else ""
            )
            times.append(f"{what} {self._pace(key):.1f} ms{flushes}")
        return f"fastest of {len(compared)} plans timed ({'; '.join(times)}): "


def timing_key(plan: Plan) -> tuple[int, bool, int, int]:
    """What a timing belongs to: the blocks checkpointed (whole or by parts), the bytes offloaded (a plan that
    checkpoints as many blocks but offloads more after a correction is another plan) and the blocks recomputing their
    elementwise operations."""
    return plan.checkpoint_blocks, plan.split, plan.offload_bytes, plan.light_blocks


def trial_plans(profile: StepProfile, candidates: Sequence[Plan]) -> list[Plan]:
    """The plans under the budget worth timing against each other, most bytes offloaded first (the first pins the
    host buffers the others reuse); one plan, or none, where nothing is worth comparing.

    The model prices recompute well and copies only by the link: it leaves out the host's cost per saved tensor, the
    waits of copies beside compute and the allocator flushing its cache near a hard cap. So along with the cheapest
    plan by the model it offers the cheapest that offloads nothing (no hooks, no copies), one halfway between them
    where they are far apart, and, where every plan offloads, the one that checkpoints the most (the fewest copies):
    each within ``TRIAL_BAND`` of a step of the cheapest. Plans with light blocks are priced by an estimate
    (``ELEMENTWISE_SHARE``) that is off by far more than that between models, so they are a family of their own: its
    cheapest and its cheapest without copies are timed beside those of the plans without. A plan that keeps
    everything costs nothing: no other is timed.

    Args:
        profile: the measured step the candidates were planned from.
        candidates: :func:`plan_candidates`' list.
    """
    fitting = [p for p in candidates if p.fits]
    if not fitting:
        return []
    best = min(fitting, key=cost_order)
    if not best.offload_bytes and not best.checkpoint_blocks and not best.light_blocks:
        return [best]
    step_ms = profile.forward_ms + (profile.backward_ms or 2 * profile.forward_ms)
    within = [p for p in fitting if p.extra_ms <= best.extra_ms + TRIAL_BAND * step_ms]
    chosen: dict[tuple[int, bool, int], Plan] = {}
    whole = [p for p in within if not p.light_blocks]
    if whole:
        chosen.update(family_trials(whole))
    light = [p for p in within if p.light_blocks]
    for family in (light, [p for p in light if not p.offload_bytes]):
        if family:
            cheapest = min(family, key=cost_order)
            chosen.setdefault(shape(cheapest), cheapest)
    return sorted(chosen.values(), key=lambda p: (-p.offload_bytes, p.checkpoint_blocks, p.split, p.light_blocks))


def family_trials(within: Sequence[Plan]) -> dict[tuple[int, bool, int], Plan]:
    """Of plans without light blocks: the cheapest, the cheapest without copies and one halfway between where they
    are far apart, or the one with the fewest copies where every plan offloads."""
    best = min(within, key=cost_order)
    chosen = {shape(best): best}
    keeping = [p for p in within if not p.offload_bytes]
    if keeping:
        plain = min(keeping, key=cost_order)
        chosen.setdefault(shape(plain), plain)
        low, high = sorted((best.checkpoint_blocks, plain.checkpoint_blocks))
        if high - low >= TRIAL_SPREAD:
            halfway = min(within, key=lambda p: (abs(2 * p.checkpoint_blocks - low - high), p.split, p.extra_ms))
            chosen.setdefault(shape(halfway), halfway)
    else:
        # The fewest copies: blocks checkpointed whole save less than by their parts.
        most = max(within, key=lambda p: (p.checkpoint_blocks, not p.split))
        chosen.setdefault(shape(most), most)
    return chosen


PlanKind = tuple[
    bool, bool
]  # what a plan does besides checkpointing: it offloads, it recomputes elementwise operations


def plan_kind(plan: Plan) -> PlanKind:
    """Whether ``plan`` offloads and whether it recomputes elementwise operations (light blocks): the two costs the
    model misprices, by copies and by ``ELEMENTWISE_SHARE``."""
    return bool(plan.offload_bytes), bool(plan.light_blocks)
