"""The memory budget: measure a step, then run every step on the cheapest plan that keeps its peak under budget.

The first two steps (and the first of each new input, :meth:`BudgetPlanner.input_changed`, unless it is no larger than
one whose plan keeps everything, or after :meth:`BudgetPlanner.replan`) are measuring steps: each counts what forward
saves block by block and times forward's and backward's compute (waits for copies excluded). Under a budget the user
gave, they offload everything from the first saved tensor and checkpoint every repeated block, but the first of them
runs the second block in full (what a block saves, and what each of its parts saves): the most frugal steps there are,
and their peaks are the step's own (weights, optimizer state, the loss's transient); the profile is extrapolated to no
checkpointing from the block run in full. The first checkpoints the other blocks by their parts
(:mod:`~lightning_offload.planned_blocks`: one part rebuilt at a time in backward, not a whole block); the second
checkpoints them whole, where the first step's numbers say a block rebuilt whole fits, else by parts again. Under the
device's own budget they keep everything unless memory passes a watermark, so a model that fits is measured at no cost.
Two, because the optimizer allocates its state in the first step. From that profile
:func:`~.planner.candidates.plan_candidates` prices how many bytes leave and how many blocks are checkpointed;
the engine applies the plan chosen. A plan that offloads nothing does not even install the hooks, so a model that fits
pays nothing. Where the model's cheapest plan is not that one, the few plans worth comparing
(:func:`~.planner.trials.trial_plans`: the cheapest by the model, the cheapest without copies, one between)
each run a few steps (:mod:`~.planner.trials`), timed on the device from step start to step start, and the
fastest is kept: the model prices recompute and the link, not the host's hooks, copies slowing compute or the allocator
flushing its cache near a hard cap, and a few steps of a long run measure what it cannot. A step whose peak passes the
budget anyway corrects the model and plans again (only towards memory: a plan relaxed on a lighter step can pass a hard
cap on the next), keeping the fastest timed plan that still fits; a step whose compute ran faster than measured corrects
the timing; a step that waited for copies clearly longer than its plan predicted lowers the link's share in the model,
and two steps in a row whose forward computed clearly slower with copies teach a cost per GiB offloaded (both only one
way: towards checkpointing; once plans were timed, what was measured decides instead); a step whose allocator reserved
past the budget counts as that much heavier.

The measuring steps also note where backward leaves the head (the loss's and the head's saved bytes, used first): the
peak up to there and what is allocated then. Plans then count the step's peaks apart (forward's, the loss's backward,
the blocks' backward); planned steps let go of every copy still on its way out as forward reaches the head, and fetch
nothing ahead while backward is in the head.

Torch only: no Lightning import.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from lightning_offload.device_memory import DeviceMemory, cache_worth_emptying
from lightning_offload.inbound import InboundQueue
from lightning_offload.options import DEFAULT_MAX_INFLIGHT_BYTES, OffloadOptions
from lightning_offload.outbound import OutboundQueue
from lightning_offload.planned_blocks import PlannedBlocks
from lightning_offload.planner.candidates import REBUILD_SHARE, cheapest_plan, plan_candidates, with_plans_that_keep
from lightning_offload.planner.offload_model import fit_link_share, offload_cost_ms
from lightning_offload.planner.profile import BlockSizes, Plan, StepProfile, frugal_cap
from lightning_offload.planner.trials import PlanTrials, timing_key
from lightning_offload.stats import OffloadStats
from lightning_offload.transfer import StreamedTransfer
from lightning_offload.units import GiB

_log = logging.getLogger("lightning_offload")
# The device's allocator never gets all of its memory (CUDA context, fragmentation, other libraries): the default
# budget leaves this share of the total (at least _MIN_MARGIN) unplanned.
_MARGIN_SHARE = 0.08
_MIN_MARGIN = 3 * GiB
# Plans aim this far below the budget, or further where the measuring step's allocator, pressed for room, reserved more
# than this margin past its peak, by this multiple of what it reserved: a hard cap counts reserved bytes, and a small
# budget's large transients (on an H200, small-h512's 500 MiB of logits' gradient under a 2.03 GiB cap) need whole pages
# mapped while partly used ones stay (86 MiB there). Its measuring step reserved 0.11 GiB past its peak, 5.4% of the
# budget, up to the cap; its plan, aimed 5% below, peaked 1.5% above its prediction and ran out of memory. Pressed: the
# allocator flushed its cache to find room, or reserved past what plans aim for. Otherwise the gap is only what it
# cached because the budget left room, and a flush frees it: Llama-1B's frugal step under 28.9 GiB reserved ~4.3 GiB
# (15%) past its peak, far below the budget, and counting that made its plan checkpoint 12 blocks, not ~6 (1.17x
# `none`'s step time, not 1.09x); bounding the margin at 10% of the budget instead brought small-h512's error back.
# Where the gap counts, the aim also leaves room for the misprediction a planned step is allowed before it replans
# (``_REPLAN_SHARE``): small-h512's plans under its floor's 2.02 GiB cap, aimed 1.5 gaps below it, peaked 1.1-1.6%
# above their predictions and reserved 1.99 GiB in a fresh process, and ran out of memory in two of five benchmark runs.
_PLAN_MARGIN_SHARE = 0.05
_RESERVED_GAP_FACTOR = 1.5
# The fit margin (see BudgetPlanner.fit_margin): no plan runs whose predicted peak comes within it of the budget. It is
# at least this share of the room the budget leaves above the step's base (weights, optimizer state, gradients: what the
# model cannot get wrong), before any planned step was seen and after, and at least _FIT_ERROR_FACTOR x the largest
# error planned steps of the input showed. Why a share of the room: the model's errors and the allocator's fragments
# come from what it predicts (activations, the loss's transients, their layout), not from the weights. On an H200 a
# model zoo's planned steps peaked up to 0.22 GiB above their predictions, and a hard cap that failed a 1000 MiB request
# found 0.27 GiB of fragments reserved (a 6.01 GiB cap over a 1.96 GiB base: 8.6% of the room together).
_FIT_ROOM_SHARE = 0.10
_FIT_ERROR_FACTOR = 1.25
# Steps measured before the first plan: the first runs before the optimizer has its state (Adam's moments are
# allocated at the first step), so the second is the one every later step looks like.
_MEASURED_STEPS = 2
# A planned step replans when its peak passes its plan's prediction by more than this share of the budget (smaller
# misses are noise: allocator rounding, a different loss value's kernels).
_REPLAN_SHARE = 0.02
# With expandable segments, plans that offload nothing aim at most the margin and the replanning share below the
# budget, whatever the measuring step's gap: that gap was reserved by frugal steps whose copies come and go (after a
# first step that ran a block in full), while a plan without copies allocates as the model with checkpointing does.
# On an H200, small-h512's 4 blocks checkpointed whole with nothing offloaded (AC's pattern) reserved 1.91-1.93 GiB for
# 1.836 allocated (4-5% of its 2.02-2.03 GiB budgets) and trained under those hard caps wherever it ran with expandable
# segments (as the planner's plan in v53-v55, as AC in v79-v84), while the gap-based aim (11% below the budget) left it
# out for the same blocks plus 12 MiB offloaded, whose hooks cost this host-bound model 7% of its step. The plans that
# ran out of memory under those caps (v53, v62) offloaded 0.3-0.4 GiB, and AC with fixed segments did (v51, v83): both
# keep the gap-based aim.
_KEEPING_MARGIN_SHARE = _PLAN_MARGIN_SHARE + _REPLAN_SHARE
# A tail no forward reaches: the measuring step keeps every saved tensor pending (on the device) until the watermark.
_KEEP_ALL = 1 << 62
# The device's own budget ("auto", itself a margin below the device's total): measuring steps keep everything until
# allocated memory passes the budget less this share of it, so a model that uses most of the GPU but fits is measured
# without offloading (and without pinning host memory). Llama-8B LoRA at 8k tokens reaches 98 GiB of a 131 GiB
# budget in forward: a quarter made it trip, and a step that tripped late plans far too much offloading.
_AUTO_RESERVE_SHARE = 0.10
# A planned step's waits for copies count as a misprediction beyond this much (the larger of the two): copies and
# compute share memory bandwidth, and single steps vary.
_WAIT_NOISE_MS = 10.0
_WAIT_NOISE_SHARE = 0.05


_CAPACITY_ROUNDING = 1 << 20
# Inputs whose plans are kept while other inputs run (see BudgetPlanner.input_changed): lengths that change from batch
# to batch (padded to each batch's longest, or bucketed) come back, and one met again runs its plan without measuring.
_REMEMBERED_INPUTS = 32
# Inputs that a larger input's lent plan misled (see BudgetPlanner._keeping_lender), remembered past the plans kept:
# forgotten with its state, such an input borrowed again, and under a hard cap ran out of memory at every return.
_MISLED_INPUTS = 4096
# Steps of the current plan an input remembers, to tell whether two slow forwards were two of its steps in a row.
_PLAN_STEPS_KEPT = 4
_NO_INPUT: Any = object()  # no input named yet


_OBSERVED_STEPS = 512


@dataclasses.dataclass(frozen=True)
class StepObservation:
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


@dataclasses.dataclass
class _InputState:
    """What the planner learnt of one input: its measured profile, the plan it chose and the trials that led there, or
    how far its measuring got (``profile`` ``None``: no measuring step of it ended, but one failed after passing its
    watermark or out of memory, so its next is frugal: ``tripped``)."""

    profile: StepProfile | None
    plan: Plan | None
    trials: PlanTrials
    full_block: BlockSizes | None
    measured_peaks: tuple[int, int, int, bool]
    reserved_gap: int
    base: int
    measure_left: int
    measured: int
    tripped: bool
    settling: bool  # its plan's next step is a newly kept plan's first (see BudgetPlanner._cache_worth_emptying)
    plan_steps: tuple[int, ...]  # its latest steps that ran its plan (see BudgetPlanner.forward_computed)
    slow_forward: tuple[int, float] | None  # its latest planned step whose forward computed slow
    borrowed: bool  # its plan and profile are a larger input's (see BudgetPlanner._keeping_lender): never measured


def _no_larger(key: Any, other: Any) -> bool:
    """Whether input ``key`` is at most ``other`` in every dimension: both shapes (tuples of ints, nested alike, such
    as the shapes of a batch's tensors, which may hold their names), no int of ``key`` above its peer in ``other`` and
    the same names."""
    # Only a tuple is read as shapes, as the engine's input_changed documents: an int key (a task's, a data loader's or
    # a bucket's number) says nothing of the input's size, and read as one, input 0 ran input 1's plan unmeasured.
    return isinstance(key, tuple) and isinstance(other, tuple) and _dims_no_larger(key, other)


def _dims_no_larger(key: Any, other: Any) -> bool:
    """:func:`_no_larger` of two shapes, or of two tuples of shapes or of named shapes (a bool is no dimension:
    ``True`` is an int); a string beside them is a name (a tensor's, as the callback's keys hold them), which must be
    the same."""
    if isinstance(key, str) and isinstance(other, str):
        return key == other
    if not (isinstance(key, tuple) and isinstance(other, tuple) and len(key) == len(other)):
        return False
    # Ints are dimensions only in a tuple of ints (a shape): beside a string they number an input, and read as a
    # dimension, input ("loader", 0) ran the plan of input ("loader", 1) unmeasured.
    ints = [type(d) is int for d in key + other]
    if any(ints):
        return all(ints) and all(a <= b for a, b in zip(key, other, strict=True))
    return all(_dims_no_larger(a, b) for a, b in zip(key, other, strict=True))


def _size(key: Any) -> int:
    """The elements of the tensors of shape(s) ``key`` (see :func:`_no_larger`; names count nothing)."""
    if isinstance(key, str):
        return 0
    if key and all(isinstance(d, int) for d in key):
        return math.prod(key)
    return sum(_size(k) for k in key)


def default_budget(total: int) -> int:
    """What the device can hold for training: ``total`` (what the process may use of the device's memory) less a
    margin, at most half of it (``_MIN_MARGIN`` alone would leave nothing of a device of 3 GiB)."""
    return total - min(max(_MIN_MARGIN, int(total * _MARGIN_SHARE)), total // 2)


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


class BudgetPlanner:
    """Measures a step, then chooses and applies each step's plan under ``budget`` bytes.

    Args:
        budget: bytes the step's peak may reach; ``None``: :func:`default_budget` of the device.
        memory: the device's allocator counters.
        model: its repeated blocks may be checkpointed (selectively) when offloading alone would cost more.
        clock: times the blocks' compute in a measuring step (``mark()`` and ``compute_ms_between()`` of
            :class:`~lightning_offload.transfer.StreamedTransfer`); ``None``: a block's cost is forward's over the
            number of blocks.
        owns_peaks: reset the peak counter at every step (``False`` when a caller such as the Lightning callback
            resets it at its own step boundaries).
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
        # A process capped with ``torch.cuda.set_per_process_memory_fraction`` (a shared GPU) may not use the device's
        # total: the default budget is what it may use, and a budget above that is only ever met by out of memory.
        capacity = process_capacity(memory)
        if budget is None:
            assert capacity is not None, "the default budget needs the device's memory (capacity() or total())"
            self.budget = default_budget(capacity)
        else:
            self.budget = budget
        # (With room for the rounding of a fraction set to give exactly the budget: a cap of 24 GiB read back.)
        if budget is not None and capacity is not None and budget > capacity + _CAPACITY_ROUNDING:
            _log.warning(
                "memory_budget=%.2f GiB is more than the %.2f GiB this process may use of the device (its total "
                "memory, under the process's memory fraction): plans aim at memory there is not",
                budget / GiB,
                capacity / GiB,
            )
        self._reserve = int(self.budget * _AUTO_RESERVE_SHARE)
        self.owns_peaks = owns_peaks
        self.plan: Plan | None = None
        self.profile: StepProfile | None = None
        self.watermark: int | None = None  # measuring step: offload everything once allocated passes this
        self.on_plan: Callable[[str], None] | None = None  # told each new plan, in words
        self._blocks = PlannedBlocks(model, clock)
        self._measuring = False
        self._measure_left = _MEASURED_STEPS  # steps still to measure before the first plan
        # The measuring step passed its watermark and began offloading. A budget the user gives is often a hard limit
        # (a shared GPU, a cap) and what the loss and backward add on top of forward is not known yet (on an H200, a
        # small model's logits took 1.5 of a 2 GiB budget): its measuring steps offload from the first saved tensor.
        self.tripped = budget is not None
        self._stepping = False
        self._backward_peak = 0
        self._base = 0
        self.step = 0  # steps begun
        self._link_share = 1.0  # what planned steps taught (see waited_for_copies)
        self._copy_ms_per_gib = 0.0  # what planned steps taught (see forward_computed)
        # The latest trials that timed plans copying against plans without kept one without: see _choose.
        self._copies_lost = False
        # The latest planned step whose forward computed slow, and by how much (see forward_computed).
        self._slow_forward: tuple[int, float] | None = None
        # The current input's latest steps that ran its current plan (with inputs that alternate, not consecutive;
        # a few, as a forward's timing is read when it has finished, a step or so later).
        self._plan_steps: tuple[int, ...] = ()
        self._pinning_steps: set[int] = set()  # planned steps that pinned new host buffers
        self._plan_since: int | None = None  # the first step that ran the current plan
        self.forward_peak = 0  # the latest step's peak when its backward began (forward's, the loss's included)
        # The latest step's backward as it left the head (the loss's and the head's saved bytes, run first): the head's
        # bytes, the peak so far and the bytes allocated then; the peak as backward ended.
        self._head_bytes = self._head_peak = self._head_allocated = self._backward_end_peak = 0
        self._reserved_at_start = 0  # the allocator's reserved bytes as the step began
        self._full_block: BlockSizes | None = None  # a measuring step's blocks, one run in full, since the last replan
        self._reserved_gap = 0  # what the latest measuring step's allocator, pressed, reserved past its peak allocated
        self._retries_at_start = 0  # the allocator's cache flushes (alloc_retries) as the step began
        self._frugal = False  # the current measuring step offloads from its first saved tensor
        # The latest measuring step's base, peak, peak as its backward ended (see _measure_by_parts), and whether it
        # offloaded from its first saved tensor (see _warn_frugal_step).
        self._measured_peaks: tuple[int, int, int, bool] = (0, 0, 0, False)
        self._trials = PlanTrials(trials)  # the current profile's plans timed against each other
        # The next planned step that times no plan is a newly kept plan's first: see _cache_worth_emptying.
        self._settling = False
        self._release_cache = False  # ... and it found the cache worth emptying before the step after it
        self._input: Any = _NO_INPUT  # the input the current profile is of (see input_changed)
        self._remembered: OrderedDict[Hashable, _InputState] = OrderedDict()  # other inputs' plans, oldest first
        self._measured = 0  # measuring steps ended since the last replan or new input
        self._borrowed = False  # the current input runs a larger input's plan, unmeasured (see _keeping_lender)
        # Inputs a lent plan misled (peaked past it, ran out of memory): they measure, and never borrow again.
        self._misled_inputs: OrderedDict[Hashable, None] = OrderedDict()  # (up to _MISLED_INPUTS)
        # What each step held, phase by phase, against what its plan predicted (the latest _OBSERVED_STEPS steps): the
        # planner's own error, read by the fit margin and by whoever asks how well the model predicts.
        self.observations: deque[StepObservation] = deque(maxlen=_OBSERVED_STEPS)
        self._step_base = 0  # allocated bytes as the step began
        self._seen_head_peak = 0  # the step's peak as its backward left the head (any step with hooks)

    @property
    def measuring(self) -> bool:
        return self._measuring

    @property
    def trying(self) -> bool:
        """Whether the current plan is being timed against others (:class:`PlanTrials`)."""
        return self._trials.trying

    @property
    def timed_plans(self) -> list[tuple[int, int, float, int]]:
        """The plans timed against each other for the current profile: blocks checkpointed, bytes offloaded per
        forward, and the median of their timed steps (device milliseconds, start to start)."""
        return self._trials.timed_plans()

    @property
    def trial_steps(self) -> list[tuple[int, int, int, list[float]]]:
        """The timed steps of each plan under trial, in the order they ran (:meth:`PlanTrials.timed_steps`)."""
        return self._trials.timed_steps()

    @property
    def fit_margin(self) -> int:
        """How far below the budget every plan's predicted peak stays (bytes): the guarantee that a plan fits.

        At least ``_FIT_ROOM_SHARE`` of the room the budget leaves above the step's base (a conservative prior, in force
        from the first planned step on) and ``_FIT_ERROR_FACTOR`` times the largest error planned steps of this input
        showed (:attr:`StepProfile.fit_error`: peaks above their predictions, fragments a pressed allocator held, the
        request that failed). It never shrinks for an input: a plan relaxed towards the budget after lighter steps can
        pass a hard cap at the next."""
        p = self.profile
        base = p.base if p is not None and p.base else self._base
        margin = int(_FIT_ROOM_SHARE * max(0, self.budget - base))
        if p is not None:
            margin = max(margin, int(_FIT_ERROR_FACTOR * p.fit_error))
        return margin

    @property
    def plan_budget(self) -> int:
        """What plans aim for: the budget less :attr:`fit_margin`, and at least a little less than the budget (the
        allocator rounds blocks up, and a hard cap counts reserved bytes), or less again where the measuring step's
        allocator, pressed, reserved far past its peak: by one and a half times that gap and the misprediction a planned
        step may have before it replans."""
        margin = max(int(self.budget * _PLAN_MARGIN_SHARE), self.fit_margin)
        if self._reserved_gap:
            margin = max(margin, int(_RESERVED_GAP_FACTOR * self._reserved_gap + _REPLAN_SHARE * self.budget))
        return self.budget - margin

    @property
    def keeping_budget(self) -> int:
        """What plans that offload nothing aim for: :attr:`plan_budget`, or, where the allocator maps expandable
        segments, at most the margin and the replanning share below the budget (see ``_KEEPING_MARGIN_SHARE``), and
        never within :attr:`fit_margin` of it."""
        aim = self.plan_budget
        if not self._expandable():
            return aim
        return max(aim, self.budget - max(int(self.budget * _KEEPING_MARGIN_SHARE), self.fit_margin))

    def candidates(self) -> list[Plan]:
        """The plans the current profile offers (:func:`~lightning_offload.planner.candidates.plan_candidates`): under
        :attr:`plan_budget`, each replaced by the plan of the same blocks that offloads nothing where that one fits
        :attr:`keeping_budget`."""
        assert self.profile is not None
        candidates = plan_candidates(self.profile, self.plan_budget)
        keeping = self.keeping_budget
        if keeping <= self.plan_budget:
            return candidates
        return with_plans_that_keep(candidates, plan_candidates(self.profile, keeping, keep_only=True))

    def _expandable(self) -> bool:
        """Whether the allocator maps expandable segments (``False`` where the memory object cannot say)."""
        read = getattr(self.memory, "expandable", None)
        return bool(read()) if read is not None else False

    def passed_watermark(self) -> bool:
        """Whether a measuring step's device memory just passed its watermark (true once per step): from there on
        the step offloads everything it saved and saves."""
        if self.watermark is None or self.memory.allocated() <= self.watermark:
            return False
        self.watermark, self.tripped = None, True
        return True

    def out_of_memory(self) -> str:
        """Why a step ran out of memory under this budget, in numbers (the step that raised did not finish)."""
        if self._measuring:
            frugal = self.tripped or self._frugal
            what = "a measuring step, the most frugal step there is" if frugal else "the first measuring step"
            if self._blocks.checkpointed:
                what += f" ({len(self._blocks.checkpointed)} of {len(self._blocks)} blocks checkpointed"
                what += " by their parts" if self._blocks.split else ""
                what += ", every activation offloaded)" if frugal else ")"
        else:
            what = f"a planned step ({self.plan.describe(self.budget)})" if self.plan is not None else "a step"
        return (
            f"memory_budget={self.budget / GiB:.2f} GiB: out of memory in {what}. Weights, gradients and optimizer "
            f"state took {self._base / GiB:.2f} GiB as it began; its peak before the failure was "
            f"{self.memory.peak() / GiB:.2f} GiB. If this is a hard limit, the model does not train at this input "
            "size within it: a shorter sequence or a smaller batch, or a budget above that peak"
        )

    def backward_started(self) -> None:
        """Note forward's peak (the loss's transient included) as backward begins."""
        self.forward_peak = self.memory.peak()

    def backward_finished(self) -> None:
        """Note the step's peak now, before anyone resets the counters (autograd calls this when backward ends)."""
        self._backward_end_peak = self.memory.peak()
        self._backward_peak = max(self._backward_peak, self._backward_end_peak)

    def head_start(self, forward_start: int, forward_end: int) -> int | None:
        """The position where the head's saved bytes begin in the forward that saved ``[forward_start, forward_end)``
        (backward fetches nothing ahead above it); ``None``: nothing is held back.

        A measuring step reads it from where its last block ended (in this forward: a step that ran forward twice
        before its backward holds nothing back); a planned step from its profile, when the plan was made with the
        head's backward apart (:attr:`StepProfile.two_peaks`)."""
        if self._measuring:
            end = self._blocks.last_end()
            self._head_bytes = forward_end - end if forward_start < end < forward_end else 0
            return end if self._head_bytes else None
        p = self.profile
        if self.plan is None or p is None or not p.two_peaks:
            return None
        return forward_end - p.head_bytes

    def left_head(self, in_flight: int = 0) -> None:
        """Backward has left the head (the loss's transient is gone): note the peak so far and what is allocated,
        less the ``in_flight`` bytes of sources still held for their copies out. (A measuring step offloads the head's
        own bytes too, and the last of those copies, the loss's 4 GiB of log-probabilities on Llama, is still running
        as backward leaves the head; a plan keeps the head and lets go of every copy before it. Counted, they made
        what backward starts from vary by 4 GiB between two H200 runs of one model.)"""
        if self._measuring:
            self._head_peak = self.memory.peak()
            self._head_allocated = max(0, self.memory.allocated() - in_flight)
        self._seen_head_peak = self.memory.peak()

    def replan(self, measuring_steps: int = 1) -> None:
        """Measure again at the next ``measuring_steps`` steps (the model changed, or the optimizer: 2 when the
        optimizer is new, as it allocates its state in its first step; a new input is :meth:`input_changed`'s). The
        plans of other inputs that :meth:`input_changed` kept are forgotten too: what changed may be the model."""
        check_measuring_steps(measuring_steps)
        # A step still open (it ends at the next step's start) belongs to the old input: it must not count for the new.
        self.abandon_step()
        self._remembered.clear()
        self._misled_inputs.clear()
        self._copies_lost = False  # learnt of the model as it was
        self._forget_input(measuring_steps)

    @property
    def input_key(self) -> Hashable:
        """The input named by the latest :meth:`input_changed` (``None`` before any)."""
        return None if self._input is _NO_INPUT else self._input

    def runs_input(self, key: Hashable) -> bool:
        """Whether ``key`` is the input named by the latest :meth:`input_changed` (``None`` is a key like any other:
        before any call, no key is)."""
        return self._input is not _NO_INPUT and key == self._input

    def input_changed(self, key: Hashable) -> bool:
        """The next step's input is ``key`` (its tensors' shapes, say). A new input is measured at the next step, as
        after :meth:`replan`; one met before runs the plan it had then (its trials go on where they stopped), without
        measuring: inputs whose length changes from batch to batch would otherwise measure at every step, and a
        measuring step is the most frugal there is. A new input no larger in any dimension than a kept one whose plan
        keeps everything runs that plan without measuring (a key that is a tuple of ints, or of such tuples, is read
        as shapes: see :meth:`_keeping_lender`). The plan of the input left is kept (up to ``_REMEMBERED_INPUTS``
        inputs, the least recently run forgotten first) where it had one.

        Call it between steps, after the step of the old input was closed (the engine's ``end_step``): that step
        counts for the old input. The first call before any step only names the input.

        Returns:
            Whether the next step measures.
        """
        if self.runs_input(key):
            return self.profile is None or self._measure_left > 0
        previous, self._input = self._input, key
        if previous is _NO_INPUT and self.step == 0:
            return True  # the first steps measure anyway
        self.abandon_step()  # (a step still open here ran the old input, and its caller did not close it)
        # Taken out before the input left is kept: kept first, the list ran one over and forgot its least recently run
        # input, which with inputs taken in turn is the one coming back (every input then measured at every return).
        kept = self._remembered.pop(key, None)
        # An input none of whose measuring steps ended is kept where the next must be frugal: its step ran out of
        # memory (or passed its watermark) keeping its activations, and another input's state taken up in between
        # (one that never tripped) would have its next measuring step keep them again, and fail the same way.
        # So is one a lent plan misled (it measures next, as it would have measured itself).
        misled = previous in self._misled_inputs
        if previous is not _NO_INPUT and (self.profile is not None or self.tripped or misled):
            self._remembered[previous] = _InputState(
                self.profile,
                self.plan if self._measure_left <= 0 else None,
                self._trials,
                self._full_block,
                self._measured_peaks,
                self._reserved_gap,
                self._base,
                self._measure_left,
                self._measured,
                self.tripped,
                self._settling,
                self._plan_steps,
                self._slow_forward,
                self._borrowed,
            )
            self._remembered.move_to_end(previous)
            while len(self._remembered) > _REMEMBERED_INPUTS:
                self._remembered.popitem(last=False)
        # (One whose step failed measures, frugally; one that a lent plan misled measures.)
        if key not in self._misled_inputs and (kept is None or (kept.plan is None and not kept.tripped)):
            kept = self._keeping_lender(key) or kept
        if kept is None or kept.profile is None:
            self._trials = PlanTrials(self._trials.enabled)  # the old input's trials stay with it
            self._forget_input(1)
            if kept is not None:
                self.tripped = kept.tripped  # its measuring steps failed: the next is frugal
            return True
        # What planned steps of other inputs taught about the machine counts here too (as in a new measurement).
        self.profile = dataclasses.replace(
            kept.profile,
            link_share=min(kept.profile.link_share, self._link_share),
            copy_ms_per_gib=max(kept.profile.copy_ms_per_gib, self._copy_ms_per_gib),
        )
        self.plan, self._trials, self._full_block = kept.plan, kept.trials, kept.full_block
        self._measured_peaks, self._reserved_gap, self._base = kept.measured_peaks, kept.reserved_gap, kept.base
        self._measure_left, self._measured, self.tripped = kept.measure_left, kept.measured, kept.tripped
        self._plan_since = None  # the steps since it last ran ran other plans
        self._plan_steps, self._slow_forward = kept.plan_steps, kept.slow_forward
        self._borrowed = kept.borrowed
        # Its plan's first step checks the cache where it has not yet (with inputs that alternate, measuring ends as
        # another input's step begins). A cache found worth emptying is emptied before the next step all the same:
        # it is the process's, not the input's. (Both were dropped here: with lengths that change from batch to batch,
        # the cache the measuring steps shaped was never emptied.)
        self._settling = kept.settling
        if self._measure_left > 0:
            return True  # its measuring goes on
        if self.profile != kept.profile:
            self._choose()
        return False

    def _keeping_lender(self, key: Hashable) -> _InputState | None:
        """For a new input ``key`` (or one whose measuring is not over): the state of a kept input at least as large in
        every dimension whose plan keeps everything (the smallest such), to run as its own, or ``None``.

        Such a plan installs no hooks and costs nothing, and an input no larger in any dimension saves no more, so it
        fits too, with nothing to measure. (Under the device's budget, where a model fits, a new length's measuring
        step cost 0.03-0.12 s more than a step without the engine on an H200: 17 new lengths in 48 steps ran 1.17x
        the time, with the cache emptied at each length's first planned step.) The prediction kept is the larger
        input's: a step that peaks past it, or runs out of memory, says the shape misled, and the input is measured
        when it next runs (from its first saved tensor after running out of memory)."""
        lenders = [
            (name, state)
            for name, state in self._remembered.items()
            if state.plan is not None  # (kept only once its measuring was over)
            and state.profile is not None
            and state.plan.fits
            and not (state.plan.offload_bytes or state.plan.checkpoint_blocks or state.plan.light_blocks)
            and _no_larger(key, name)
        ]
        if not lenders:
            return None
        name, state = min(lenders, key=lambda item: _size(item[0]))
        _log.debug("memory_budget: input %s runs the plan of input %s, which keeps everything", key, name)
        return dataclasses.replace(
            state,
            trials=PlanTrials(self._trials.enabled),
            full_block=None,
            settling=False,
            plan_steps=(),
            slow_forward=None,
            borrowed=True,
        )

    def _note_misled(self) -> None:
        """The current input's lent plan misled it: it measures, and is never lent a plan again."""
        self._misled_inputs[self._input] = None
        self._misled_inputs.move_to_end(self._input)
        while len(self._misled_inputs) > _MISLED_INPUTS:
            self._misled_inputs.popitem(last=False)

    def _forget_input(self, measuring_steps: int) -> None:
        """Drop the current input's profile and plan: the next ``measuring_steps`` steps measure."""
        self.profile = None
        # The plan held is the old input's: steps from here on (measuring ones first) did not run it, even where the
        # new profile leads to an equal plan (kept unchanged then, so nothing else would restart its first step).
        self._plan_since = None
        self._plan_steps, self._slow_forward = (), None
        self._borrowed = False
        self._measure_left = max(self._measure_left, measuring_steps)
        self._measured = 0
        self._trials.reset()
        self._full_block = None  # a new input shape saves other bytes per block
        self._settling = False  # (a cache found worth emptying still is, before the next step: see input_changed)

    def begin_step(self, position: Callable[[], int]) -> Plan | None:
        """Start a step; returns its plan, or ``None`` for a measuring step (keep everything up to the watermark)."""
        held = 0  # what the allocator held before emptying its cache as this step begins (0: not emptied)
        if self._release_cache:
            self._release_cache = False
            release = getattr(self.memory, "release_cache", None)
            if release is not None:
                held = self._counter("reserved")
                release()
        if self.owns_peaks:
            self.memory.reset_peak()
        self._stepping = True
        self._backward_peak = 0
        self.forward_peak = 0  # unknown until backward begins (a step without hooks never says)
        self._head_bytes = self._head_peak = self._head_allocated = self._backward_end_peak = 0
        self._seen_head_peak = 0
        self._step_base = self.memory.allocated()
        self._reserved_at_start = self._counter("reserved")
        if not self.owns_peaks:
            # The caller's counters still hold the reserved peak from before the cache was emptied: that is not this
            # step reserving past the budget.
            self._reserved_at_start = max(self._reserved_at_start, held)
        # Whether the step flushes the allocator's cache: a plan under trial is timed with it, and a pressed allocator's
        # fragments count in the fit margin.
        self._retries_at_start = self._counter("alloc_retries")
        self.step += 1
        if self._measure_left <= 0 and self.profile is not None and self.plan is not None:
            self._follow_base()
            self._blocks.checkpoint_last(self.plan.checkpoint_blocks, self.plan.split, self.plan.light_blocks)
            if self._plan_since is None:
                self._plan_since = self.step
            self._plan_steps = (*self._plan_steps[-(_PLAN_STEPS_KEPT - 1) :], self.step)
            return self.plan
        self._measuring = True
        # A frugal measuring step (below) also checkpoints every block but one, by their parts: the least the step can
        # hold (at long sequences, offloading every block's activations would pin more host memory than the machine
        # has, and a block rebuilt whole in backward is the peak), and the block run in full says what a block and
        # each of its parts save when not checkpointed. Once a measuring step did (the first, before the optimizer has
        # its state), the next checkpoints every block: a block run in full was the frugal step's peak above
        # checkpointing everything (on an H200, small-h512's second measuring step ran out of memory under a hard cap
        # 10% above checkpointing and offloading everything).
        if self.tripped and self._full_block is not None:
            self._blocks.checkpoint_last(len(self._blocks), split=self._measure_by_parts())
        elif self.tripped:
            self._blocks.checkpoint_all_but_one(split=True)
        else:
            self._blocks.checkpoint_last(0)
        self._base = self.memory.allocated()
        self._retries_at_start = self._counter("alloc_retries")
        self._frugal = self.tripped
        if self.tripped and self._full_block is not None:
            self._warn_frugal_step()
        if self._base >= self.budget and self.profile is None:
            _log.warning(
                "memory_budget=%.2f GiB: %.2f GiB are allocated before the step begins (weights, gradients, optimizer "
                "state): no plan can keep the step within the budget",
                self.budget / GiB,
                self._base / GiB,
            )
        # A step that passed its watermark peaked there, before its activations left, so what its peak holds besides
        # activations is unknown (on an H200, Llama-8B LoRA's "fixed" part read 35 GiB for a true ~27). The next
        # measuring step offloads from its first saved tensor: its peak is then the step's own (weights, optimizer
        # state, the loss's transient, little in flight), and it is the most frugal step there is.
        self.watermark = 0 if self.tripped else self.budget - self._reserve
        self.tripped = False
        self._blocks.watch(position)
        return None

    def _follow_base(self) -> None:
        """A planned step that begins with more allocated than the step its profile was measured from holds that much
        more in every phase: the plan is corrected before the step runs, not after it failed. Gradients accumulate over
        micro-batches, the optimizer allocates its state at its first step (which measuring steps of micro-batches never
        reach), Lightning keeps the last step's gradients through the next forward, an evaluation leaves tensors: on an
        H200, a zoo's configurations with gradient accumulation ran out of memory at their first optimizer step's
        next step, planned from micro-batches measured without the optimizer's state."""
        p = self.profile
        assert p is not None
        grown = self._step_base - p.base
        if grown <= self.budget * _REPLAN_SHARE / 2:
            return
        _log.info(
            "memory_budget=%.2f GiB: the step begins with %.2f GiB more allocated than the measured one (gradients, "
            "optimizer state); planning again",
            self.budget / GiB,
            grown / GiB,
        )
        self.profile = dataclasses.replace(p, base=self._step_base, correction=p.correction + grown)
        self._choose(memory=True)

    def abandon_step(self, out_of_memory: bool = False, request: int = 0) -> None:
        """The step :meth:`begin_step` started raised (the engine dropped what it held), or is dropped by a replan.
        A measuring step is measured again, and its failure is not counted as ended: counted, it took one of a replan's
        measuring steps (on an H200 the capacity search's next probe, Llama-1B at 10240 tokens under 24 GiB, planned
        from a single step taken before its new optimizer had its state, and ran out of memory). Where it ran
        ``out_of_memory`` the next measuring step is frugal (it offloads from the first saved tensor). A planned step
        that ran out of memory corrects the plan towards memory by what it peaked past its prediction, and at least
        ``_REPLAN_SHARE`` of the budget (the allocation that failed is not in the peak): a loop that skips the batch and
        goes on does not meet the same plan again."""
        if not self._stepping:
            return
        self._stepping = False
        if self._measuring:
            self._measuring = False
            self.watermark = None
            self._blocks.unwatch()
            self.tripped = self.tripped or self._frugal or out_of_memory
            return
        plan, profile = self.plan, self.profile
        if out_of_memory and self._borrowed:
            # The lent profile is not this input's: measure it, from its first saved tensor (the most frugal step).
            _log.info(
                "memory_budget: a step of input %s ran out of memory under a larger input's plan; measuring it",
                self._input,
            )
            self._forget_input(1)
            self.tripped = True
            self._note_misled()
            return
        if out_of_memory and plan is not None and profile is not None:
            # What the step needed: its peak before the failure and the request that failed (``request``, read from
            # the error; at least the replanning share where unknown), plus the fragments the allocator held then.
            fragments = max(0, self._counter("reserved") - self.memory.allocated())
            need = self.memory.peak() + (request or int(self.budget * _REPLAN_SHARE)) + fragments
            heavier = max(0, need - plan.peak - self.fit_margin) + int(self.budget * _REPLAN_SHARE)
            self.profile = dataclasses.replace(
                profile, correction=profile.correction + heavier, fit_error=max(profile.fit_error, fragments)
            )
            self._choose(memory=True)

    def cache_emptied(self) -> None:
        """The allocator emptied its cache as this step began (it switched to expandable segments): the step's peaks and
        the reserved bytes it started from count from now, not from the segments just returned (a reserved peak left
        over from them would read as an allocator pressed for room, and lower what plans aim for)."""
        if self.owns_peaks:
            self.memory.reset_peak()
        self._reserved_at_start = self._counter("reserved")

    def end_step(
        self,
        eligible: int,
        offloaded: int,
        forward_ms: float,
        link_bytes_per_ms: float,
        extra: dict,
        backward_ms: float = 0.0,
        step_ms: float = 0.0,
    ) -> None:
        """The step that :meth:`begin_step` started is over (backward included): learn from its peak and timing;
        ``step_ms``: its device time, start to start (0: not timed; it is asked for while :attr:`trying`)."""
        if not self._stepping:
            return
        self._stepping = False
        # The peak noted when backward finished, or read now: a caller may reset the counters between steps (a
        # benchmark, a logger), and the optimizer may allocate its state after backward.
        peak, self._backward_peak = max(self._backward_peak, self.memory.peak()), 0
        self._observe(peak)
        if self._measuring:
            self._measuring = False
            self._measure_left -= 1
            self._measured += 1
            self.watermark = None
            self._blocks.unwatch()
            self._reserved_gap = self._pressed_gap(peak)
            self._measured_peaks = (self._base, peak, self._backward_end_peak, self._frugal)
            self.profile = self._measured_profile(
                peak, eligible, offloaded, forward_ms, backward_ms, link_bytes_per_ms, extra
            )
            if self._measure_left <= 0 and self._measured == 1 and self.step in self._pinning_steps:
                # A single measuring step (a new input's, a replan's) that pinned new host buffers for its copies
                # (0.4 s per GiB on an H200, the device idle meanwhile) timed the pinning as compute: a forward that
                # slow hides any copy, and the plan offloads everything. On an H200 the small-vocab model's new lengths
                # planned 10-20 GiB offloaded, no block checkpointed, at 0.6-8 s per step, where one length measured
                # twice kept 1.6 GiB and ran at 0.21 s. Its memory counts; the input is measured once more (its
                # buffers exist now).
                self._measure_left = 1
            if self._measure_left <= 0:
                self._choose()
                # The measuring steps (the first ones, or a replan's) left the cache shaped by their own allocations.
                self._settling = True
        elif self.plan is not None and self.profile is not None:
            p, plan = self.profile, self.plan
            trying = self._trials.trying  # this step timed a plan (the trials may end as it is counted)
            # (Each read of the allocator's counters costs a copy of all of them: one per step, read for the trials'
            # timing and the fit margin's fragments alike.)
            flushed = self._counter("alloc_retries") > self._retries_at_start
            timed = self._trials.count(plan, step_ms, pinned=self.step in self._pinning_steps, flushed=flushed)
            # How far this step's peak passed the plan's prediction: the model's error, put into the part of the peak
            # that is not activations. The prediction counts what the step held as the model does (a checkpointed
            # block rebuilt in backward, copies in flight and fetched ahead), so a step that peaked where predicted
            # moves nothing (comparing with the kept activations alone read a recomputed block as a heavier step and
            # replanned towards full offload: on an H200, the small-vocab model went from 1.6 to 3.1 s per step).
            # Only a rise moves the plan (towards memory): a plan relaxed on a lighter step can pass a hard cap on the
            # next (measured on an H200), so plans approach the budget from below only.
            error = peak - plan.peak
            self._learn_fit_error(error, flushed)
            p = self.profile
            # (A plan that predicted more than it measured learns nothing here, even past the budget: it was known
            # not to fit.)
            passed = error > self.budget * _REPLAN_SHARE or (error > 0 and peak > self.budget)
            heavier = max(error, peak - self.budget) if passed else 0
            # The budget holds the allocator's reserved bytes too: a step that reserved past it (no hard cap stopped
            # it) counts as that much heavier. Only what the step itself reserved: the allocator keeps what heavier
            # steps before it reserved. (Counting reserved bytes past what plans aim for, 5% below the budget, made
            # the plans of Llama-8B LoRA on an H200 aim 8.6 GiB lower than needed: the first planned step reserves
            # 1.04x its peak while its activations change shape, then never again.)
            reserved_peak = self._counter("reserved_peak")
            if reserved_peak > max(self._reserved_at_start, self.budget):
                heavier = max(heavier, reserved_peak - self.budget)
            if heavier > 0 and self._borrowed:
                # The step held more than the larger input whose plan it ran: its shape said it needs no more, and
                # the lent profile is not this input's. It is measured next time it runs.
                _log.info(
                    "memory_budget: a step of input %s peaked %.2f GiB past a larger input's plan; measuring it",
                    self._input,
                    heavier / GiB,
                )
                self._forget_input(1)
                self._note_misled()
                return
            if heavier > 0:
                self.profile = p = dataclasses.replace(p, correction=p.correction + heavier)
                self._choose(memory=True)
                return
            if self._settling and not trying:  # (counting a step never starts trials: only _choose does)
                self._settling = False
                # (The plan's prediction too: a step without hooks never notes its backward's peak, and a caller that
                # resets the counters between steps leaves only what came after.)
                self._release_cache = self._cache_worth_emptying(max(peak, plan.peak))
            changed = timed
            # Compute time only falls: a measuring step can be slowed by what only it does (pinning host memory
            # for its copies, starting after a host synchronization), so a later, faster step is the truer pace.
            if 0 < forward_ms < 0.9 * p.forward_ms:
                self.profile = p = dataclasses.replace(p, forward_ms=forward_ms)
                changed = True
            recomputes = self.plan.checkpoint_blocks or self.plan.light_blocks
            if 0 < backward_ms < 0.9 * p.backward_ms and not recomputes:  # recompute is not pace
                self.profile = p = dataclasses.replace(p, backward_ms=backward_ms)
                changed = True
            if changed:
                self._choose()

    def _learn_fit_error(self, error: int, flushed: bool) -> None:
        """Fold a planned step's miss into the fit margin: what it peaked above its prediction (small misses, which do
        not correct the model) and, where the allocator flushed its cache to find room (a hard cap pressing it), the
        fragments it reserved past its peak allocated. Where the margin grows past where the plan sits, plan again."""
        p = self.profile
        assert p is not None and self.plan is not None
        missed = max(0, min(error, int(self.budget * _REPLAN_SHARE)))
        if flushed:
            missed += max(0, self._counter("reserved_peak") - self.memory.peak())
        if missed <= p.fit_error:
            return
        self.profile = dataclasses.replace(p, fit_error=missed)
        if self.plan.peak + self.fit_margin > self.budget:
            self._choose(memory=True)

    def _observe(self, peak: int) -> None:
        """Keep what the step that ends held, phase by phase, with what its plan predicted."""
        plan = None if self._measuring else self.plan
        self.observations.append(
            StepObservation(
                step=self.step,
                input=repr(self.input_key),
                kind="measuring" if self._measuring else "trial" if self._trials.trying else "planned",
                base=self._step_base,
                forward=self.forward_peak,
                head=self._seen_head_peak,
                backward=self._backward_end_peak,
                peak=peak,
                predicted=plan.peak if plan is not None else 0,
                predicted_phases=plan.phases if plan is not None else (),
                budget=self.budget,
            )
        )

    def _cache_worth_emptying(self, peak: int) -> bool:
        """Whether a kept plan's first step, which peaked at ``peak`` bytes allocated, left the allocator holding far
        more than that (and than the plans of the other inputs kept predict) while the budget has room for a layout
        mapped afresh
        (:func:`~lightning_offload.device_memory.cache_worth_emptying`): the cache is then emptied once, before the
        next step. (On an H200 the small-vocab model's 8 GiB row reserved 7.7 GiB for 6.2 allocated after its measuring
        steps and trials, 6.7 once emptied.)"""
        reserved = self._counter("reserved")
        # With lengths that change from batch to batch the allocator holds what the longest input kept needs:
        # emptying it for a shorter one returns memory only until the longer comes back and maps it again (on an H200,
        # the default budget with 17 lengths, up to 0.27 s more in the step after each emptying).
        peak = max([peak] + [kept.plan.peak for kept in self._remembered.values() if kept.plan is not None])
        if not cache_worth_emptying(reserved, peak, self.budget):
            return False
        _log.debug(
            "memory_budget=%.2f GiB: the kept plan's first step found %.2f GiB reserved for a %.2f GiB peak (cached by "
            "the steps before it); the allocator's cache is emptied once, before the next step",
            self.budget / GiB,
            reserved / GiB,
            peak / GiB,
        )
        return True

    def _warn_frugal_step(self) -> None:
        """Say so before a frugal measuring step that follows another is expected to pass the budget: it is as frugal
        as any plan, and it holds what the one before it held plus the optimizer's state allocated since (on an H200,
        small-h512's second measuring step ran out of memory under a 2.02 GiB cap at the loss's 500 MiB gradient)."""
        base, peak, backward_end_peak, frugal = self._measured_peaks
        grown = max(0, self._base - base)
        # Up to the end of its backward the step held no optimizer state; its peak after (the optimizer's step) did.
        expected = max(peak, (backward_end_peak or peak) + grown)
        if not (frugal and peak) or expected <= self.budget:
            return
        _log.warning(
            "memory_budget=%.2f GiB: the next step, measuring and as frugal as any plan, should need about %.2f GiB: "
            "the one before it peaked at %.2f GiB by the end of its backward, and %.2f GiB more are allocated now "
            "(the optimizer's state). Weights, gradients and optimizer state take %.2f GiB; the step's other "
            "transients (the loss and logits among them; every activation leaves) %.2f GiB. If this is a hard limit, "
            "the model does not train at this input size within it: a shorter sequence or a smaller batch, or a "
            "budget above that",
            self.budget / GiB,
            expected / GiB,
            (backward_end_peak or peak) / GiB,
            grown / GiB,
            self._base / GiB,
            (expected - self._base) / GiB,
        )

    def _measure_by_parts(self) -> bool:
        """Whether the second measuring step checkpoints the blocks by their parts, as the first did: where, by the
        first step's numbers, a block rebuilt whole would take the second past what plans aim for. Where it fits, the
        second checkpoints them whole, as most plans do: its peaks then measure theirs (a plan by parts is estimated
        from them), and the other way round where it does not.

        The estimate errs on memory: the block's larger rebuild (``REBUILD_SHARE`` of what the block saves beyond its
        largest part) goes on top of backward's peak (the loss's, where the blocks' own was lower), and the optimizer's
        state allocated since the first step began goes on top of all (even where the first step's peak was the
        optimizer's step, which held it already)."""
        first = self._full_block
        if first is None or not first.split or not 0 < first.part_bytes < first.block_bytes:
            return False
        base, peak, backward_end_peak, _ = self._measured_peaks
        rebuilt_more = int(REBUILD_SHARE * (first.block_bytes - first.part_bytes))
        whole = max(peak, (backward_end_peak or peak) + rebuilt_more) + max(0, self.memory.allocated() - base)
        return whole > self.plan_budget

    def _pressed_gap(self, peak: int) -> int:
        """What the measuring step that peaked at ``peak`` reserved past it, where its allocator was pressed for room
        (it flushed its cache, or reserved past what plans aim for at the least margin); 0 elsewhere: the gap is then
        what the allocator cached because the budget left room, which a flush under a hard cap would free."""
        reserved_peak = self._counter("reserved_peak")
        flushed = self._counter("alloc_retries") > self._retries_at_start
        if not flushed and reserved_peak <= self.budget * (1 - _PLAN_MARGIN_SHARE):
            return 0
        return max(0, reserved_peak - peak)

    def _counter(self, name: str) -> int:
        """The allocator counter ``name`` (``reserved``, ``reserved_peak``, ``alloc_retries``); 0 where the memory
        object has none (a test's fake)."""
        read = getattr(self.memory, name, None)
        return read() if read is not None else 0

    def _measured_profile(
        self,
        peak: int,
        eligible: int,
        offloaded: int,
        forward_ms: float,
        backward_ms: float,
        link_bytes_per_ms: float,
        extra: dict,
    ) -> StepProfile:
        """What the measuring step says about a step that checkpoints nothing.

        Blocks it ran checkpointed saved only their inputs (or their parts' inputs) and recomputed their forward in
        backward: what they would save in full is the block run in full (the second) on average, in this step or,
        where it checkpointed every block, in the measuring step before it, and their recompute is taken off
        backward's time and off the peak (a peak in backward, above forward's, held one recomputed block or part, or
        the loss's backward: the step's own peak stays in the profile for plans that rebuild no block).
        """
        sizes = self._blocks.sizes()
        if sizes.block_bytes > sizes.input_bytes:
            self._full_block = sizes
        elif self._full_block is not None and sizes.checkpointed == sizes.count:  # every block checkpointed
            full = self._full_block
            sizes = dataclasses.replace(
                sizes, block_bytes=full.block_bytes, part_bytes=full.part_bytes, kept_bytes=full.kept_bytes
            )
        block_bytes, input_bytes = sizes.block_bytes, sizes.input_bytes
        # What a block checkpointed whole saves, and by its parts: measured where this step or the one before ran so.
        whole_input_bytes = sizes.first_input_bytes if sizes.split else input_bytes
        split_input_bytes = input_bytes if sizes.split else 0
        if not split_input_bytes and self._full_block is not None and self._full_block.split:
            split_input_bytes = self._full_block.input_bytes
        blocks_ms = self._blocks.compute_ms()
        unrebuilt_peak = 0
        if sizes.checkpointed and block_bytes > 0:
            eligible += sizes.checkpointed * block_bytes - (sizes.cut_bytes or sizes.checkpointed * input_bytes)
            # Recompute is forward's compute again, one block each; keep at least forward's pace (a LoRA backward is
            # barely slower than its forward).
            per_block_ms = (blocks_ms or forward_ms) / sizes.count
            backward_ms = max(forward_ms, backward_ms - sizes.checkpointed * per_block_ms) if backward_ms else 0.0
            rebuilt = sizes.part_bytes if sizes.split and sizes.part_bytes else block_bytes
            if self.forward_peak and peak > self.forward_peak:
                unrebuilt_peak, peak = peak, max(self.forward_peak, peak - rebuilt)
        return StepProfile(
            **self._two_peak_fields(peak, unrebuilt_peak, sizes),
            peak=peak,
            # Past the watermark everything left, the compute stream waiting whenever more than the in-flight
            # cap lagged behind: count no activation as kept (what was still in flight at the peak then counts
            # as fixed, which errs on the side of memory by at most that cap).
            resident=0 if self.tripped else max(0, eligible - offloaded),
            eligible=eligible,
            forward_ms=forward_ms,
            link_bytes_per_ms=link_bytes_per_ms,
            blocks=sizes.count if block_bytes > whole_input_bytes else 0,
            block_bytes=block_bytes,
            block_input_bytes=whole_input_bytes,
            split_input_bytes=split_input_bytes,
            part_bytes=sizes.part_bytes if sizes.part_bytes < block_bytes else 0,
            kept_bytes=sizes.kept_bytes,
            block_share=min(1.0, blocks_ms / forward_ms) if forward_ms > 0 else 0.0,
            backward_ms=backward_ms,
            link_share=self._link_share,
            copy_ms_per_gib=self._copy_ms_per_gib,
            forward_peak=self.forward_peak,
            unrebuilt_peak=unrebuilt_peak,
            base=self._base,
            **extra,
        )

    def _two_peak_fields(self, peak: int, unrebuilt_peak: int, sizes: BlockSizes) -> dict[str, int]:
        """What the measuring step said of its backward's two parts (:class:`StepProfile`'s ``head_*``, ``rest_peak``
        and ``optimizer_peak``); none where backward never left the head the engine knew of."""
        if not (self._head_bytes and self._head_peak):
            return {}
        rest = self._backward_end_peak if self._backward_end_peak > self._head_peak else 0
        if rest and not sizes.checkpointed:  # it rebuilt no block: a plan that checkpoints rebuilds one on top
            rest += int(REBUILD_SHARE * sizes.block_bytes)
        elif rest and sizes.split and 0 < sizes.part_bytes < sizes.block_bytes:
            # It rebuilt a part at a time: counted as a block rebuilt whole, as plans count it (plans by parts take the
            # difference off again).
            rest += int(REBUILD_SHARE * (sizes.block_bytes - sizes.part_bytes))
        step_peak = max(peak, unrebuilt_peak)
        return {
            "head_bytes": self._head_bytes,
            "head_peak": self._head_peak,
            "backward_base": self._head_allocated,
            "rest_peak": rest,
            "optimizer_peak": step_peak if step_peak > max(self._head_peak, self._backward_end_peak) else 0,
        }

    def pinned_host_memory(self, step: int) -> None:
        """Step ``step`` pinned new host buffers (0.4 s per GiB on an H200): its waits for copies say nothing about
        the link."""
        self._pinning_steps.add(step)
        if len(self._pinning_steps) > 64:
            self._pinning_steps = set(sorted(self._pinning_steps)[-32:])

    def _ran_current_offload(self, step: int) -> bool:
        """Whether step ``step`` ran the current plan, and that plan offloads: what such a step's timing says is
        the copies' doing. A step that pinned host buffers says nothing (pinning delays the copies behind it, 0.4 s
        per GiB on an H200)."""
        if self.plan is None or self.profile is None or self._plan_since is None or step < self._plan_since:
            return False
        return step not in self._pinning_steps and self.plan.offload_bytes > 0

    def _offload_step(self, step: int) -> tuple[Plan, StepProfile, _InputState | None] | None:
        """The plan that step ``step`` ran, where it offloads, with its input's profile and, for an input kept for
        later, that input's state (``None``: the current input's). A forward's timing is read once it has finished, a
        step or so later: with inputs that alternate, by then another input runs. ``None``: its timing says nothing
        of the copies (see :meth:`_ran_current_offload`)."""
        if self._ran_current_offload(step):
            assert self.plan is not None and self.profile is not None
            return self.plan, self.profile, None
        if step in self._pinning_steps:
            return None
        for kept in self._remembered.values():
            if step in kept.plan_steps and kept.plan is not None and kept.profile is not None:
                return (kept.plan, kept.profile, kept) if kept.plan.offload_bytes > 0 else None
        return None

    def forward_computed(self, step: int, compute_ms: float) -> None:
        """Step ``step``'s forward computed for ``compute_ms`` (its waits for copies excluded). Where it and its
        input's step before it ran that input's plan, offloaded bytes and computed clearly slower than the measured
        forward, copies slowed compute (memory bandwidth, the host's hooks): learn that cost per GiB and plan again
        (only ever higher, so plans move towards checkpointing and never back and forth). On an H200, Llama-1B's
        forward took 83 ms instead of 57 with 2.2 GiB of copies that the link model called hidden. A step of an input
        kept for later teaches the cost too (a property of the machine): that input plans with it when it comes
        back."""
        ran = self._offload_step(step)
        if ran is None:
            return
        plan, profile, kept = ran
        plan_steps, earlier = (
            (self._plan_steps, self._slow_forward) if kept is None else (kept.plan_steps, kept.slow_forward)
        )
        slower = compute_ms - profile.forward_ms
        if slower <= max(_WAIT_NOISE_MS, _WAIT_NOISE_SHARE * profile.forward_ms):
            return
        # Two planned steps in a row, and the lesser of them: one slow forward (a host hiccup, a step after another
        # row's allocations) taught 16 ms per GiB on 8B LoRA on an H200, and moved a 1.08x plan to checkpointing.
        # In a row for the input: with inputs that alternate, its own latest steps of this plan.
        if kept is None:
            self._slow_forward = (step, slower)
        else:
            kept.slow_forward = (step, slower)
        if earlier is None or (earlier[0], step) not in itertools.pairwise(plan_steps):
            return
        per_gib = min(slower, earlier[1]) / (plan.offload_bytes / GiB)
        if per_gib <= max(profile.copy_ms_per_gib, self._copy_ms_per_gib) * (1 + _WAIT_NOISE_SHARE):
            return
        _log.info(
            "memory_budget: a planned step's forward computed %.1f ms slower than measured with %.2f GiB offloaded: "
            "copies cost %.1f ms per GiB beside compute; planning again",
            slower,
            plan.offload_bytes / GiB,
            per_gib,
        )
        self._copy_ms_per_gib = per_gib  # kept for later measurements and inputs, like the link's share
        if self.profile is not None and per_gib > self.profile.copy_ms_per_gib:
            self.profile = dataclasses.replace(self.profile, copy_ms_per_gib=per_gib)
            self._choose()

    def waited_for_copies(self, step: int, waited_ms: float) -> None:
        """Step ``step`` waited ``waited_ms`` for copies (forward and backward). Where it ran its input's plan and
        waited clearly longer than that plan's offloading was predicted to cost, copies beside compute get less of
        the link than measured alone: lower the link's share in the model to what explains the wait, and plan again
        (only ever lower, so plans move towards checkpointing and never back and forth). A step of an input kept for
        later teaches the share too (see :meth:`forward_computed`)."""
        ran = self._offload_step(step)
        if ran is None:
            return
        plan, profile, _ = ran
        predicted = offload_cost_ms(profile, plan)
        noise = max(_WAIT_NOISE_MS, _WAIT_NOISE_SHARE * (profile.forward_ms + (profile.backward_ms or 0.0)))
        if waited_ms <= predicted + noise:
            return
        share = fit_link_share(profile, plan, waited_ms)
        if share < min(profile.link_share, self._link_share) - 0.01:
            _log.info(
                "memory_budget: a planned step waited %.1f ms for copies (predicted %.1f ms): copies get %.0f%% of "
                "the link beside compute, not %.0f%%; planning again",
                waited_ms,
                predicted,
                100 * share,
                100 * profile.link_share,
            )
            self._link_share = share  # kept for later measurements (a new input shape): a property of the machine
            if self.profile is not None and share < self.profile.link_share:
                self.profile = dataclasses.replace(self.profile, link_share=share)
                self._choose()

    def _choose(self, memory: bool = False) -> None:
        """Choose the plan for the next step from the profile: the model's cheapest, or, while plans are under
        trial, the next to time, then the fastest timed (:class:`PlanTrials`). Once plans were timed, only a
        correction towards ``memory`` chooses again (the fastest timed plan that still fits, or the plans that fit now
        timed in turn): what later steps teach about time is what the trials measured."""
        assert self.profile is not None
        candidates = self.candidates()
        if self._copies_lost and not self._trials.timed:
            # Another input's trials timed plans that copy against plans without, and kept one without: the model
            # misprices copies there (the host's cost per saved tensor, copies slowing compute), for this model on
            # this machine as much as for that input. Where a plan without copies fits, plans with are not run for a
            # new input: with lengths that change, each new length would otherwise time them anew (on an H200, 4
            # steps each of 0.32 s against the 0.22 s of the plan kept in the end). An input's own trials, once
            # begun, go by what they timed (a correction towards memory may time plans that copy again).
            keeping = [p for p in candidates if not p.offload_bytes]
            if any(p.fits for p in keeping):
                candidates = keeping
        plan, trials = cheapest_plan(candidates), self._trials
        if trials.done and trials.timed:
            if not memory:
                return
            plan = trials.after_correction(candidates) or plan
        chosen, trial = trials.choose(self.profile, candidates, memory)
        if trials.done and chosen is not None and any(nbytes for _, nbytes, _, _ in trials.timed_plans()):
            self._copies_lost = not chosen.offload_bytes  # the latest trials that compared copies decide
        plan = chosen or plan
        plan = dataclasses.replace(plan, fits=plan.peak + self.fit_margin <= self.budget)
        changed, previous = plan != self.plan, self.plan
        self.plan = plan
        if changed:
            self._plan_since = None
            self._plan_steps = ()
        # Trials just ended, or a plan that runs other blocks or bytes follows a kept one (not a new prediction alone):
        # its first step says whether the cache the steps before it left is worth emptying. (The first plan after
        # measuring steps is armed where they end.)
        if trials.done and (trial or (previous is not None and timing_key(plan) != timing_key(previous))):
            self._settling = True
        if changed or trial:  # the trials' outcome is told even where the last plan timed was the fastest
            text = f"memory_budget={self.budget / GiB:.2f} GiB: {trial}{plan.describe(self.budget)}"
            if not plan.fits:
                fixed = self.profile.peak + self.profile.correction - self.profile.resident
                text += (
                    f", within the fit margin of {self.fit_margin / GiB:.2f} GiB below it (what this model's "
                    "predictions and the allocator's fragments may miss by): the step may run out of memory under a "
                    "hard limit"
                    f". Even the most frugal plan needs {plan.peak / GiB:.2f} GiB: weights, gradients and optimizer "
                    f"state take {self._base / GiB:.2f} GiB and the step's other transients (the loss and logits "
                    f"among them) {(fixed - self._base) / GiB:.2f} GiB"
                )
            # A plan that does not fit is a warning: under a hard cap the next step runs out of memory, and INFO is not
            # shown where nothing set logging up (a plain PyTorch loop), so nothing would have said so before.
            _log.log(logging.INFO if plan.fits else logging.WARNING, text)
            if self.on_plan is not None:
                self.on_plan(text)

    def at_head(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` as each forward of the steps from now on reaches the head (its last block returned);
        ``None``: stop."""
        self._blocks.after_last_block(callback)

    def remove(self) -> None:
        """Leave the model as it was: drop this planner's checkpointing and hooks."""
        self._blocks.remove()


def planner_for(
    options: OffloadOptions, device: torch.device, transfer: Any, model: nn.Module | None, memory: Any = None
) -> BudgetPlanner | None:
    """The planner an engine with these options needs, or ``None`` (no budget, a manual override, no streams, or no
    allocator counters: ``memory`` or CUDA's)."""
    if memory is None and device.type == "cuda":
        memory = DeviceMemory(device)
    if not options.plans or memory is None or not isinstance(transfer, StreamedTransfer):
        return None
    return BudgetPlanner(options.budget_bytes(), memory, model, clock=transfer, trials=options.plan_trials)


def close_step(planner: BudgetPlanner, transfer: Any, outbound: OutboundQueue, stats: OffloadStats) -> None:
    """End the planner's open step (``stats`` describe it): it learns from its peak and timings, and the next step's
    device time counts from here. :func:`plan_step` calls it as a step begins; the engine's ``end_step`` earlier,
    where a batch runs without it or validation runs (their peak and time are not the step's before them). A step
    ends once: called again before the next begins, the planner finds none open."""
    assert isinstance(transfer, StreamedTransfer)
    configured_cap = outbound.configured_inflight_cap
    if planner.measuring:
        extra = {
            "tail": outbound.default_tail,
            "prefetch_bytes": outbound.prefetch_cap,
            "inflight_cap": configured_cap or DEFAULT_MAX_INFLIGHT_BYTES,
            "inflight_fixed": outbound.inflight_fixed,
            "host_bytes": outbound.host_capacity(),
        }
        forward_ms, backward_ms = transfer.forward_ms(), transfer.backward_ms()
    else:
        extra = {}
        forward_ms, backward_ms = transfer.last_compute_ms, transfer.last_backward_ms
    if stats.host_allocations:
        planner.pinned_host_memory(planner.step)
    step_ms = transfer.step_began(planner.trying)  # a host sync, only while plans are timed
    planner.end_step(
        stats.eligible_bytes, stats.offloaded_bytes, forward_ms, transfer.link_rate, extra, backward_ms, step_ms
    )
    if transfer.last_forward is not None:
        planner.forward_computed(*transfer.last_forward)
    if transfer.last_stalls is not None:
        planner.waited_for_copies(*transfer.last_stalls)


def plan_step(
    planner: BudgetPlanner,
    transfer: Any,
    outbound: OutboundQueue | None,
    inbound: InboundQueue | None,
    stats: OffloadStats,
    position: Callable[[], int],
) -> int | None:
    """Close the planner's previous step (``stats`` describe it) and set the copy queues up for the next one.

    Returns:
        The step's offload limit (0: keep everything, do not install the hooks; ``None``: no limit, a measuring
        step, which offloads once :meth:`BudgetPlanner.passed_watermark`).
    """
    assert isinstance(transfer, StreamedTransfer) and outbound is not None and inbound is not None
    close_step(planner, transfer, outbound, stats)
    configured_cap = outbound.configured_inflight_cap
    plan = planner.begin_step(position)
    transfer.step = planner.step
    profile = planner.profile
    # Plans with the head's backward apart count no copy in flight there: the engine lets go of them as forward
    # reaches the head (on an H200, 8B LoRA's forward ended 3.2 GiB above its plan, holding copies the link had
    # finished but whose deadlines lay past forward's end).
    planner.at_head(outbound.let_go_all if plan is not None and profile is not None and profile.two_peaks else None)
    if plan is not None and profile is not None:
        # The link model runs on the profile's paces (the planner's own, corrected by faster later steps).
        transfer.link.use_pace(profile.eligible, profile.forward_ms, profile.backward_ms, transfer.link_rate)
    else:
        transfer.link.frozen = False
    if plan is None:
        # Measuring: keep everything, unless memory passes the watermark; from there on the step must be frugal (the
        # model may not fit), so copies barely run ahead of compute either way.
        outbound.tail = _KEEP_ALL
        frugal = frugal_cap(planner.budget)
        outbound.inflight_cap = min(configured_cap or DEFAULT_MAX_INFLIGHT_BYTES, frugal)
        inbound.cap = min(outbound.prefetch_cap, frugal)
        return None
    outbound.tail = outbound.default_tail
    outbound.inflight_cap = plan.inflight_cap
    inbound.cap = plan.prefetch_cap if plan.prefetch_cap is not None else outbound.prefetch_cap
    return plan.offload_bytes
