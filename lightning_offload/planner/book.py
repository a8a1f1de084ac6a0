"""The inputs the planner keeps while another runs (:class:`InputBook`): lengths that change from batch to batch come
back, and one met again runs its plan without measuring; a new input no larger than a kept one whose plan keeps
everything borrows that plan, unmeasured, unless a lent plan misled it before."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any

from lightning_offload.planner import words
from lightning_offload.planner.inputs import InputRecord, no_larger, size
from lightning_offload.planner.measure import Machine
from lightning_offload.planner.steps import Notice
from lightning_offload.planner.trials import PlanTrials

REMEMBERED_INPUTS = 32  # inputs whose records are kept while others run (the least recently run forgotten first)
_MISLED_INPUTS = 4096  # inputs a lent plan misled: they are never lent one again
NO_INPUT: Any = object()  # no input named yet


class InputBook:
    """The current input's key and the records of the inputs kept, least recently run first."""

    def __init__(self) -> None:
        self.key: Hashable = NO_INPUT
        self.trials_owner: Hashable = NO_INPUT  # the input whose plans are under trial (one input at a time)
        self._kept: OrderedDict[Hashable, InputRecord] = OrderedDict()
        self._misled: OrderedDict[Hashable, None] = OrderedDict()

    def runs(self, key: Hashable) -> bool:
        """Whether ``key`` names the current input (``None`` is a key like any other; before any, none does)."""
        return self.key is not NO_INPUT and key == self.key

    def trials_elsewhere(self) -> bool:
        """Whether a kept input (not the current one) has its plans under trial."""
        owner = self.trials_owner
        return owner is not NO_INPUT and not self.runs(owner) and self.holds(owner)

    def trials_run(self, trying: bool) -> None:
        """The current input's plan was chosen: it owns the trials while its plans are ``trying``; else the trials end
        where they were its own, or no longer run elsewhere (they ended, or their input was forgotten)."""
        if trying:
            self.trials_owner = self.key
        elif self.runs(self.trials_owner) or not self.trials_elsewhere():
            self.trials_owner = NO_INPUT

    def holds(self, key: Hashable) -> bool:
        """Whether a record of ``key`` is kept."""
        return key in self._kept

    def records(self) -> Iterator[tuple[Hashable, InputRecord]]:
        return iter(self._kept.items())

    def leave(self, rec: InputRecord) -> None:
        """The current input is left: its record is kept where it learnt anything (a profile, a measuring step that
        failed so that its next must be frugal, a lent plan that misled it)."""
        key = self.key
        if key is NO_INPUT or not (rec.profile is not None or rec.frugal_next or key in self._misled):
            return
        if rec.measure_left > 0:
            rec.plan = None  # its measuring goes on when it comes back
        self._kept[key] = rec
        while len(self._kept) > REMEMBERED_INPUTS:
            self._kept.popitem(last=False)

    def switch(
        self, key: Hashable, left: InputRecord, machine: Machine, notices: list[Notice]
    ) -> tuple[InputRecord, bool]:
        """The input ``key`` follows the current one, whose record ``left`` is kept: ``key``'s record, kept or lent (a
        larger input's, said in ``notices``) or new (it measures), and whether what the ``machine`` learnt on other
        inputs changed its profile (it chooses its plan again)."""
        # Taken out before the input left is kept: kept first, the book could run one over and forget the one coming
        # back.
        kept = self.take(key)
        self.leave(left)
        self.key = key
        if kept is None or (kept.plan is None and not kept.frugal_next):
            lent = self.lend(key)
            if lent is not None:
                notices.append(Notice(logging.DEBUG, words.lent_plan(key, lent[0])))
                kept = lent[1]
        if kept is None or kept.profile is None:
            frugal = kept.frugal_next if kept is not None else left.frugal_next
            trials, measure_left = PlanTrials(left.trials.enabled), max(1, left.measure_left)
            fresh = InputRecord(trials, measure_left=measure_left, frugal_next=frugal, base=left.base)
            return fresh, False
        profile = kept.profile
        kept.profile = machine.taught(profile)
        kept.plan_since = None  # the steps since it last ran ran other plans
        return kept, kept.profile != profile

    def take(self, key: Hashable) -> InputRecord | None:
        """The kept record of ``key``, taken out (``None``: none kept)."""
        return self._kept.pop(key, None)

    def keep(self, key: Hashable, rec: InputRecord) -> None:
        """Keep ``rec`` for ``key`` (a record restored from a saved state)."""
        self._kept[key] = rec

    def lend(self, key: Hashable) -> tuple[Hashable, InputRecord] | None:
        """For a new input ``key``: the smallest kept input at least as large in every dimension whose plan keeps
        everything, and a lent copy of its record (``None``: none, or a lent plan misled ``key`` before). Such a plan
        installs no hooks and an input no larger saves no more; a step that peaks past it says the shape misled."""
        if key in self._misled:
            return None
        lenders = [(name, r) for name, r in self._kept.items() if r.keeps_everything() and no_larger(key, name)]
        if not lenders:
            return None
        name, lender = min(lenders, key=lambda item: size(item[0]))
        return name, lender.lent_copy()

    def misled(self, key: Hashable) -> None:
        """A lent plan misled ``key``: it is never lent one again."""
        self._misled[key] = None
        self._misled.move_to_end(key)
        while len(self._misled) > _MISLED_INPUTS:
            self._misled.popitem(last=False)

    def clear(self) -> None:
        """Forget every kept input (the model or the optimizer changed)."""
        self._kept.clear()
        self._misled.clear()
        self.trials_owner = NO_INPUT

    def ran(self, step: int) -> InputRecord | None:
        """The kept record whose plan ran step ``step``, where that plan offloads."""
        for rec in self._kept.values():
            if step in rec.plan_steps and rec.plan is not None and rec.profile is not None:
                return rec if rec.plan.offload_bytes > 0 else None
        return None

    def peaks(self) -> list[int]:
        """The predicted peaks of the kept inputs' plans."""
        return [rec.plan.peak for rec in self._kept.values() if rec.plan is not None]
