"""What passes between the planner and the engine's driver, once per step: the driver's :class:`StepStart` and
:class:`Observation` in, a :class:`Directive` and :class:`Notice` s out; the :class:`StepRecord` of each step kept for
whoever asks how well the model predicts. Plain numbers: bytes and milliseconds."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from lightning_offload.planner.profile import BlockSizes, Plan


class Phase(enum.Enum):
    """Where the current input stands: its steps are measured, its plans timed against each other, or it runs a plan."""

    MEASURING = "measuring"
    TRYING = "trying"
    PLANNED = "planned"


@dataclasses.dataclass(frozen=True)
class Measure:
    """How a measuring step runs.

    Attributes:
        frugal: offload from the first saved tensor (a budget the user gave, or a step before it failed or passed its
            watermark); else keep everything until allocated memory passes ``watermark``.
        one_in_full: checkpoint every block but the second by their parts, and run that one in full (what a block and
            each of its parts save); else every block (``frugal``) or none.
        by_parts: the checkpointed blocks run by their parts, not whole.
        watermark: allocated bytes past which everything saved so far and from now on leaves (0: from the first).
    """

    frugal: bool
    one_in_full: bool
    by_parts: bool
    watermark: int


@dataclasses.dataclass(frozen=True)
class Directive:
    """What the next step runs: a measuring step (``measure``) or a plan (``plan``), and whether the allocator's cache
    is emptied before it (``empty_cache``)."""

    phase: Phase
    plan: Plan | None = None
    measure: Measure | None = None
    empty_cache: bool = False


@dataclasses.dataclass(frozen=True)
class StepStart:
    """The driver's reading as a step begins: ``allocated`` bytes (weights, gradients kept, optimizer state)."""

    allocated: int


@dataclasses.dataclass(frozen=True)
class CopyLimits:
    """The copy queues' configured limits, read by a measuring step (see :class:`StepProfile`)."""

    tail: int = 0
    prefetch_bytes: int = 0
    inflight_cap: int = 512 << 20
    inflight_fixed: bool = False
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Observation:
    """One step as the driver measured it, from its start to the next (bytes and device milliseconds).

    Attributes:
        peak: the step's peak allocated, the optimizer's step included.
        forward_peak: the peak as backward began (forward's and the loss's; 0: not seen).
        head_peak: the peak as backward left the head (0: not seen).
        head_bytes: what forward saved after the last block (a measuring step's head; 0: not seen).
        head_allocated: allocated as backward left the head, less the copies still on their way out.
        backward_peak: the peak as backward ended (0: not seen).
        reserved: the allocator's reserved bytes now; ``reserved_peak`` its peak in the step and ``reserved_at_start``
            what it held as the step began.
        flushed: the allocator flushed its cache to find room in the step (a hard cap pressed it).
        eligible, offloaded: bytes forward saved through the hooks, and of those, bytes that left the device.
        forward_ms, backward_ms: compute time of forward and backward (waits for copies excluded).
        step_ms: device time from this step's start to the next (0: not timed).
        link_bytes_per_ms: the link's measured bandwidth, one direction.
        pinned: the step pinned new host buffers (its timings say nothing of the link).
        tripped: the step passed its watermark (or offloaded from its first saved tensor).
        blocks: what a measuring step's forward saved block by block; ``blocks_ms`` the blocks' compute time.
        limits: the copy queues' configured limits.
        forward_timing: an earlier step's forward compute time, read now: ``(step, ms)``.
        copy_waits: an earlier step's waits for copies, read now: ``(step, ms)``.
        out_of_memory: the step raised an out-of-memory error; ``request`` bytes it failed to allocate (0: unknown).
        raised: the step raised (it did not finish); ``allocated`` is then what was allocated as it raised.
    """

    peak: int = 0
    forward_peak: int = 0
    head_peak: int = 0
    head_bytes: int = 0
    head_allocated: int = 0
    backward_peak: int = 0
    reserved: int = 0
    reserved_peak: int = 0
    reserved_at_start: int = 0
    flushed: bool = False
    eligible: int = 0
    offloaded: int = 0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    step_ms: float = 0.0
    link_bytes_per_ms: float = 0.0
    pinned: bool = False
    tripped: bool = False
    blocks: BlockSizes | None = None
    blocks_ms: float = 0.0
    limits: CopyLimits = CopyLimits()
    forward_timing: tuple[int, float] | None = None
    copy_waits: tuple[int, float] | None = None
    raised: bool = False
    out_of_memory: bool = False
    request: int = 0
    allocated: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Observation:
        """The observation :meth:`as_dict` wrote (a recorded step, for replay)."""
        values = dict(values)
        if values.get("blocks") is not None:
            values["blocks"] = BlockSizes(**values["blocks"])
        values["limits"] = CopyLimits(**values.get("limits") or {})
        for name in ("forward_timing", "copy_waits"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step as the planner saw it (bytes): what it held as each phase ended against what its plan predicted.

    Attributes:
        step: the planner's step number.
        input: the input's key, as text.
        kind: ``"measuring"``, ``"trial"`` (a plan timed against others) or ``"planned"``.
        base: allocated as the step began (weights, gradients kept, optimizer state).
        forward: the step's peak as backward began (forward's and the loss's; 0: not seen, no hooks).
        head: the peak as backward left the head (0: not seen).
        backward: the peak as backward ended (0: not seen).
        peak: the step's peak, the optimizer's step included.
        predicted: the plan's predicted peak (0: a measuring step).
        predicted_phases: the plan's predicted peak of each phase (forward, head, blocks' backward, optimizer), where
            the plan counts them apart.
        budget: the budget the step ran under.
    """

    step: int
    input: str
    kind: str
    base: int
    forward: int
    head: int
    backward: int
    peak: int
    predicted: int
    predicted_phases: tuple[int, ...]
    budget: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, step: int, key: Any, ran: Directive, base: int, obs: Observation, budget: int) -> StepRecord:
        """Step ``step`` of input ``key``, which ``ran`` its directive from ``base`` bytes allocated, as ``obs`` saw."""
        plan = ran.plan
        return cls(
            step=step,
            input=repr(key),
            kind="measuring" if ran.phase is Phase.MEASURING else "trial" if ran.phase is Phase.TRYING else "planned",
            base=base,
            forward=obs.forward_peak,
            head=obs.head_peak,
            backward=obs.backward_peak,
            peak=obs.peak,
            predicted=plan.peak if plan is not None else 0,
            predicted_phases=plan.phases if plan is not None else (),
            budget=budget,
        )


@dataclasses.dataclass(frozen=True)
class Notice:
    """Something the planner says: ``text`` at logging ``level``; ``plan``: it tells a new plan or a trial's outcome."""

    level: int
    text: str
    plan: bool = False
