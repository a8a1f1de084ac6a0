"""What the planner keeps of each input (:class:`InputRecord`), and how input keys compare as shapes.

Inputs whose length changes from batch to batch come back: one met again runs the plan it had, without measuring. A
key that is a tuple of ints, or of such tuples (with names beside them), is read as shapes: a new input no larger in
any dimension than a kept one whose plan keeps everything runs that plan, unmeasured (:func:`no_larger`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lightning_offload.planner.aims import fit_margin
from lightning_offload.planner.measure import MeasuredPeaks
from lightning_offload.planner.profile import BlockSizes, Plan, StepProfile
from lightning_offload.planner.steps import Phase
from lightning_offload.planner.trials import PlanTrials

# Steps of the current plan an input remembers, to tell whether two slow forwards were two of its steps in a row.
PLAN_STEPS_KEPT = 4


@dataclasses.dataclass
class InputRecord:
    """What the planner learnt of one input.

    Attributes:
        trials: its plans timed against each other.
        profile: its measured step (``None``: not measured yet).
        plan: the plan its next step runs (``None`` while it measures).
        measure_left: measuring steps still to run before its first plan.
        measured: measuring steps that ended since it was last forgotten.
        frugal_next: its next measuring step offloads from the first saved tensor (one before it failed, or passed its
            watermark).
        full_block: the blocks of its latest measuring step that ran one block in full.
        peaks: its latest measuring step's base and peaks.
        reserved_gap: what that step's allocator, pressed, reserved past its peak.
        base: allocated as its latest measuring step began.
        settling: its plan's next step is a newly kept plan's first (it checks whether the cache is worth emptying).
        plan_since: the first step that ran its current plan (``None``: none yet).
        plan_steps: its latest steps that ran its current plan.
        slow_forward: its latest planned step whose forward computed slow, and by how much (ms).
        lent: its plan and profile are a larger input's, unmeasured.
    """

    trials: PlanTrials
    profile: StepProfile | None = None
    plan: Plan | None = None
    measure_left: int = 1
    measured: int = 0
    frugal_next: bool = False
    full_block: BlockSizes | None = None
    peaks: MeasuredPeaks = dataclasses.field(default_factory=MeasuredPeaks)
    reserved_gap: int = 0
    base: int = 0
    settling: bool = False
    plan_since: int | None = None
    plan_steps: tuple[int, ...] = ()
    slow_forward: tuple[int, float] | None = None
    lent: bool = False

    @property
    def phase(self) -> Phase:
        if self.profile is None or self.plan is None or self.measure_left > 0:
            return Phase.MEASURING
        return Phase.TRYING if self.trials.trying else Phase.PLANNED

    def fit_margin(self, budget: int) -> int:
        """How far below ``budget`` every plan's predicted peak stays (:func:`~.aims.fit_margin`): the prior, then at
        least the largest errors this input's planned steps showed."""
        p = self.profile
        if p is None:
            return fit_margin(budget, self.base, 0)
        return fit_margin(budget, p.base or self.base, p.fit_error, p.pressed_error)

    def forget(self, measuring_steps: int) -> None:
        """Drop the profile and plan: the next ``measuring_steps`` steps measure (whatever was learnt of the blocks
        run in full too: a new shape saves other bytes per block)."""
        self.profile = self.plan = None
        self.plan_since, self.plan_steps, self.slow_forward = None, (), None
        self.lent = False
        self.measure_left = max(self.measure_left, measuring_steps)
        self.measured = 0
        self.trials.reset()
        self.full_block = None
        self.settling = False

    def ran(self, step: int) -> None:
        """Step ``step`` runs the current plan."""
        if self.plan_since is None:
            self.plan_since = step
        self.plan_steps = (*self.plan_steps[-(PLAN_STEPS_KEPT - 1) :], step)

    def keeps_everything(self) -> bool:
        """Whether its plan fits and neither offloads nor checkpoints: a plan it may lend."""
        plan = self.plan
        return (
            plan is not None
            and self.profile is not None
            and plan.fits
            and not (plan.offload_bytes or plan.checkpoint_blocks or plan.light_blocks)
        )

    def lent_copy(self) -> InputRecord:
        """This record as lent to a smaller input: its plan and profile, nothing of its trials or timings."""
        return dataclasses.replace(
            self,
            trials=PlanTrials(self.trials.enabled),
            full_block=None,
            settling=False,
            plan_since=None,
            plan_steps=(),
            slow_forward=None,
            lent=True,
        )


def no_larger(key: Any, other: Any) -> bool:
    """Whether input ``key`` is at most ``other`` in every dimension: both shapes (tuples of ints, nested alike, such
    as the shapes of a batch's tensors, which may hold their names), no int of ``key`` above its peer in ``other`` and
    the same names. An int key alone (a task's, a loader's number) says nothing of the input's size."""
    return isinstance(key, tuple) and isinstance(other, tuple) and _dims_no_larger(key, other)


def _dims_no_larger(key: Any, other: Any) -> bool:
    if isinstance(key, str) and isinstance(other, str):
        return key == other
    if not (isinstance(key, tuple) and isinstance(other, tuple) and len(key) == len(other)):
        return False
    # Ints are dimensions only in a tuple of ints (a shape): beside a string they number an input (``("loader", 0)``).
    # (A bool is no dimension: ``True`` is an int.)
    ints = [type(d) is int for d in key + other]
    if any(ints):
        return all(ints) and all(a <= b for a, b in zip(key, other, strict=True))
    return all(_dims_no_larger(a, b) for a, b in zip(key, other, strict=True))


def size(key: Any) -> int:
    """The elements of the tensors of shape(s) ``key`` (see :func:`no_larger`; names count nothing)."""
    if isinstance(key, str):
        return 0
    if key and all(isinstance(d, int) for d in key):
        return math.prod(key)
    return sum(size(k) for k in key)
