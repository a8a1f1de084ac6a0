"""The memory budget: measure a step, then run every step on the cheapest plan that keeps its peak under budget.

This module is the engine's side of the planner (:mod:`lightning_offload.planner`, pure): :class:`BudgetPlanner`
reads the device's allocator counters and the model's blocks through a step, hands the pure core one
:class:`~lightning_offload.planner.steps.Observation` as the step ends, and applies the
:class:`~lightning_offload.planner.steps.Directive` it returns as the next begins (through
:mod:`lightning_offload.step_driver`): which blocks run checkpointed, how far the copies may run ahead, and, for a
measuring step, the watermark past which everything offloads. What the core says goes out through one channel: the
``lightning_offload`` logger, and :attr:`BudgetPlanner.on_plan` for plans.

A measuring step counts what forward saves block by block and times forward's and backward's compute; under a budget
the user gave it offloads everything from the first saved tensor and checkpoints every repeated block but one (run in
full: what a block and each of its parts save), the most frugal step there is. Under the device's own budget it keeps
everything unless memory passes a watermark, so a model that fits is measured at no cost. A plan that offloads nothing
does not even install the hooks.

Torch only: no Lightning import.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from lightning_offload.planned_blocks import PlannedBlocks
from lightning_offload.planner.aims import default_budget
from lightning_offload.planner.core import Planner
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.steps import CopyLimits, Observation, Phase, StepRecord, StepStart
from lightning_offload.stats import OffloadStats
from lightning_offload.step_marks import StepMarks, counter
from lightning_offload.units import GiB

__all__ = ["BudgetPlanner", "check_measuring_steps", "default_budget"]

_log = logging.getLogger("lightning_offload")
_CAPACITY_ROUNDING = 1 << 20  # a fraction set to give exactly the budget reads back a little under it
KEEP_ALL = 1 << 62  # a tail no forward reaches: a measuring step keeps every saved tensor until its watermark


def process_capacity(memory: Any) -> int | None:
    """What the process may use of the device's memory: :meth:`DeviceMemory.capacity` (the total under the process's
    memory fraction), or the total where the counters cannot say that; ``None`` where they say neither."""
    read = getattr(memory, "capacity", None) or getattr(memory, "total", None)
    return int(read()) if read is not None else None


def check_measuring_steps(measuring_steps: Any) -> None:
    """Refuse a ``replan(measuring_steps=...)`` that is not a count of steps, naming it."""
    # A bool is an int to Python, and a float would count down past 0 (1.5 measured two steps): neither is a count.
    if isinstance(measuring_steps, bool) or not isinstance(measuring_steps, int) or measuring_steps < 1:
        raise ValueError(f"replan(measuring_steps={measuring_steps!r}): expected an int >= 1")


def _checked_budget(budget: int | None, memory: Any) -> int:
    """The budget to plan under: ``budget``, or :func:`default_budget` of what the process may use of the device."""
    # A process capped with ``torch.cuda.set_per_process_memory_fraction`` may not use the device's total: the
    # default budget is what it may use, and a budget above that is only ever met by out of memory.
    capacity = process_capacity(memory)
    if budget is None:
        assert capacity is not None, "the default budget needs the device's memory (capacity() or total())"
        return default_budget(capacity)
    if capacity is not None and budget > capacity + _CAPACITY_ROUNDING:
        _log.warning(
            "memory_budget=%.2f GiB is more than the %.2f GiB this process may use of the device (its total "
            "memory, under the process's memory fraction): plans aim at memory there is not",
            budget / GiB,
            capacity / GiB,
        )
    return budget


def _hint_checkpointing(plan: Plan | None) -> bool:
    """Say that the model would let the planner checkpoint instead, where ``plan`` offloads; whether it was said."""
    if plan is None or not plan.offload_bytes:
        return False
    _log.warning(
        "offload_activations(): the plan offloads %.2f GiB per forward, predicted to add %.0f ms per step. "
        "Without model= the planner cannot checkpoint the model's repeated blocks instead, which often costs "
        "less: pass offload_activations(model=model, ...)",
        plan.offload_bytes / GiB,
        plan.extra_ms,
    )
    return True


class BudgetPlanner:
    """Reads a step's memory and blocks for the pure planner, and applies its plans, under ``budget`` bytes.

    Args:
        budget: bytes the step's peak may reach; ``None``: :func:`default_budget` of the device.
        memory: the device's allocator counters.
        model: its repeated blocks may be checkpointed (selectively) when offloading alone would cost more.
        owns_peaks: reset the peak counter at every step (``False`` when a caller such as the Lightning callback
            resets it at its own step boundaries).
        clock: times the blocks' compute in a measuring step (``mark()`` and ``compute_ms_between()`` of
            :class:`~lightning_offload.transfer.StreamedTransfer`); ``None``: a block's cost is forward's over the
            number of blocks.
        trials: time the plans worth comparing and keep the fastest (``False``: the model's cheapest plan).
    """

    def __init__(
        self,
        budget: int | None,
        memory: Any,
        model: nn.Module | None = None,
        owns_peaks: bool = True,
        clock: Any = None,
        trials: bool = True,
    ) -> None:
        self.memory = memory
        self.core = Planner(_checked_budget(budget, memory), trials, frugal_first=budget is not None)
        self.on_plan: Callable[[str], None] | None = None  # told each new plan, in words
        self.owns_peaks = owns_peaks
        self.marks = StepMarks(memory)  # what the datapath marks through the step
        self._blocks = PlannedBlocks(model, clock)
        # Without the model no block can be checkpointed: a plan that must offload then says once what would cost less.
        self._hint_model = model is None

    # What the core holds, for the engine, the callback and the benchmarks.
    budget = property(lambda self: self.core.budget)
    plan = property(lambda self: self.core.plan)
    step = property(lambda self: self.core.step)
    fit_margin = property(lambda self: self.core.fit_margin)
    plan_budget = property(lambda self: self.core.plan_budget)
    input_key = property(lambda self: self.core.input_key)

    @property
    def profile(self) -> StepProfile | None:
        """The current input's measured step, as corrected by later steps."""
        return self.core.profile

    @profile.setter
    def profile(self, profile: StepProfile | None) -> None:
        self.core.rec.profile = profile

    @property
    def measuring(self) -> bool:
        """Whether the step in progress (or the one just ended, until the next begins) is a measuring step."""
        return self.core.open is not None and self.core.open.phase is Phase.MEASURING

    @property
    def trying(self) -> bool:
        """Whether the current plan is being timed against others."""
        return self.core.rec.trials.trying

    @property
    def timed_plans(self) -> list[tuple[int, int, float, int]]:
        """The plans timed for the current input: blocks checkpointed, bytes offloaded, median ms, light blocks."""
        return self.core.rec.trials.timed_plans()

    trial_steps = property(lambda self: self.core.rec.trials.timed_steps())  # each timed plan's step times

    @property
    def observations(self) -> deque[StepRecord]:
        """What each recent step held, phase by phase, against what its plan predicted."""
        return self.core.records

    def candidates(self) -> list[Plan]:
        return self.core.candidates()

    def input_changed(self, key: Hashable) -> bool:
        """The next step's input is ``key`` (:meth:`Planner.input_changed`); call it between steps. Returns whether the
        next step measures."""
        if not self.core.runs_input(key):
            self.abandon_step()
        measures = self.core.input_changed(key)
        self._say()
        return measures

    def replan(self, measuring_steps: int = 1) -> None:
        """Measure again at the next ``measuring_steps`` steps (the model changed, or the optimizer: 2 when the
        optimizer is new, as it allocates its state in its first step); other inputs' plans are forgotten too."""
        check_measuring_steps(measuring_steps)
        self.abandon_step()
        self.core.replan(measuring_steps)

    # ------------------------------------------------------------------------------------------------ the step

    def begin_step(self, position: Callable[[], int], casts: Callable[[], int] | None = None) -> Plan | None:
        """Start a step; returns its plan, or ``None`` for a measuring step (keep everything up to the watermark).
        ``position``: the bytes saved so far; ``casts``: the bytes of weight casts saved so far (a measuring step's
        blocks are watched through both)."""
        held = 0  # what the allocator held before emptying its cache (0: not emptied)
        release = getattr(self.memory, "release_cache", None)
        # The first step also begins in an emptied cache: what the process cached before this planner (another model,
        # a validation loop, an earlier engine) is not this model's layout, and a measuring step that found it would
        # count it as its own fragments. (A fresh process emptied it already, as it switched to expandable segments.)
        if (self.core.empties_cache or self.core.step == 0) and release is not None:
            held = counter(self.memory, "reserved")
            release()
        if self.owns_peaks:
            self.memory.reset_peak()
        directive = self.core.begin(StepStart(self.memory.allocated()))
        measure = directive.measure
        self.marks.begin(held, measure.watermark if measure is not None else None, self.owns_peaks)
        self._say()
        if directive.plan is not None:
            plan = directive.plan
            self._blocks.checkpoint_last(plan.checkpoint_blocks, plan.split, plan.light_blocks)
            return plan
        assert measure is not None
        if measure.one_in_full:
            self._blocks.checkpoint_all_but_one(split=True)
        else:
            self._blocks.checkpoint_last(len(self._blocks) if measure.frugal else 0, split=measure.by_parts)
        self._blocks.watch(position, casts)
        return None

    def head_start(self, forward_start: int, forward_end: int) -> int | None:
        """The position where the head's saved bytes begin in the forward that saved ``[forward_start, forward_end)``
        (backward fetches nothing ahead above it); ``None``: nothing is held back. A measuring step reads it from where
        its last block ended; a planned step from its profile, where the plan counts the head's backward apart."""
        if self.measuring:
            end = self._blocks.last_end()
            self.marks.head_bytes = forward_end - end if forward_start < end < forward_end else 0
            return end if self.marks.head_bytes else None
        p = self.profile
        if self.plan is None or p is None or not p.two_peaks:
            return None
        return forward_end - p.head_bytes

    def end_step(
        self,
        stats: OffloadStats,
        forward_ms: float = 0.0,
        backward_ms: float = 0.0,
        step_ms: float = 0.0,
        link_bytes_per_ms: float = 0.0,
        limits: CopyLimits | None = None,
        forward_timing: tuple[int, float] | None = None,
        copy_waits: tuple[int, float] | None = None,
    ) -> None:
        """The step that :meth:`begin_step` started is over (``stats`` describe it): the core learns from it."""
        if self.core.open is None:
            return
        measuring, marks = self.measuring, self.marks
        self._stop_watching()
        obs = Observation(
            peak=marks.peak(),
            forward_peak=marks.forward_peak,
            head_peak=marks.head_peak,
            head_bytes=marks.head_bytes,
            head_allocated=marks.head_allocated,
            backward_peak=marks.backward_end_peak,
            reserved=counter(self.memory, "reserved"),
            reserved_peak=counter(self.memory, "reserved_peak"),
            reserved_at_start=marks.reserved_at_start,
            flushed=marks.flushed(),
            eligible=stats.eligible_bytes,
            offloaded=stats.offloaded_bytes,
            forward_ms=forward_ms,
            backward_ms=backward_ms,
            step_ms=step_ms,
            link_bytes_per_ms=link_bytes_per_ms,
            pinned=stats.host_allocations > 0,
            tripped=marks.tripped,
            blocks=self._blocks.sizes() if measuring else None,
            blocks_ms=self._blocks.compute_ms() if measuring else 0.0,
            limits=limits or CopyLimits(),
            forward_timing=forward_timing,
            copy_waits=copy_waits,
        )
        self.core.observe(obs)
        self._say()

    def abandon_step(self, out_of_memory: bool = False, request: int = 0) -> None:
        """The step :meth:`begin_step` started raised (the engine dropped what it held), or is dropped by a replan or a
        new input. Where it ran ``out_of_memory`` (``request``: the bytes it failed to allocate), the core corrects."""
        if self.core.open is None:
            return
        self._stop_watching()
        obs = Observation(raised=True, out_of_memory=out_of_memory, tripped=self.marks.tripped)
        if out_of_memory:
            obs = Observation(
                raised=True,
                out_of_memory=True,
                tripped=self.marks.tripped,
                request=request,
                peak=self.memory.peak(),
                reserved=counter(self.memory, "reserved"),
                allocated=self.memory.allocated(),
            )
        self.core.observe(obs)
        self._say()

    def out_of_memory(self) -> str:
        """Why a step ran out of memory under this budget, in numbers (the step that raised did not finish)."""
        open_step, blocks = self.core.open, self._blocks
        if open_step is not None and open_step.measure is not None:
            frugal = open_step.measure.frugal or self.marks.tripped
            what = "a measuring step, the most frugal step there is" if frugal else "the first measuring step"
            if blocks.checkpointed:
                what += f" ({len(blocks.checkpointed)} of {len(blocks)} blocks checkpointed"
                what += " by their parts" if blocks.split else ""
                what += ", every activation offloaded)" if frugal else ")"
        else:
            what = f"a planned step ({self.plan.describe(self.budget)})" if self.plan is not None else "a step"
        return (
            f"memory_budget={self.budget / GiB:.2f} GiB: out of memory in {what}. Weights, gradients and optimizer "
            f"state took {self.core.rec.base / GiB:.2f} GiB as it began; its peak before the failure was "
            f"{self.memory.peak() / GiB:.2f} GiB. If this is a hard limit, the model does not train at this input "
            "size within it: a shorter sequence or a smaller batch, or a budget above that peak"
        )

    def at_head(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` as each forward from now on reaches the head (its last block returned); ``None``: stop."""
        self._blocks.after_last_block(callback)

    def remove(self) -> None:
        """Leave the model as it was: drop this planner's checkpointing and hooks."""
        self._blocks.remove()

    def _stop_watching(self) -> None:
        """A measuring step ends (or raised): its watermark and its watch over the blocks end with it."""
        if self.measuring:
            self.marks.watermark = None
            self._blocks.unwatch()

    def _say(self) -> None:
        """The core's notices, out through the one channel: the logger, and :attr:`on_plan` for plans."""
        for notice in self.core.take_notices():
            _log.log(notice.level, notice.text)
            if notice.plan and self.on_plan is not None:
                self.on_plan(notice.text)
        if self._hint_model and not self.trying and _hint_checkpointing(self.core.plan):
            self._hint_model = False
