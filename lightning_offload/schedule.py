"""The pure planner: plain numbers in, a plan out. No streams, no events, no tensors.

Positions are forward's own currency: eligible bytes saved since the engine was made. Forward moves them up;
backward walks them down again. Two questions are answered here:

* When is a device -> host copy done? (:class:`LinkModel`.) Forward saves ``S`` bytes in ``T`` ms (measured on an
  earlier forward) and the link moves ``B`` bytes per ms, so a copy of ``n`` bytes takes as long as forward needs to
  save ``n * (S / T) / B`` more bytes. Copies queue on one stream, so each starts when the one before it ends.
* When must a host -> device copy start? (:func:`plan_prefetch`.) Backward's pace per saved byte is measured like
  forward's (about half of it before any backward was timed), and the way back serves copies one after another in the
  order backward needs them.

The host runs far ahead of the device, so polling a copy's event from the host almost never sees it done before
forward ends; the engine instead lets go of a source at the position where the model says its copy is done, after a
device-side wait (free when the copy is done). These positions are what the model provides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

# Wait a little later than the model says: a wait that comes too early stalls compute, one too late only holds
# memory a moment longer.
SLACK = 1.25
# Before forward was timed, assume it saves bytes 4x faster than the link moves them (a conservative pace for
# transformer layers on PCIe 5): copies are then planned early rather than late.
DEFAULT_RATIO = 4.0
# The least lead of a copy back, in bytes saved during forward, whatever the link model says.
PREFETCH_FLOOR = 64 << 20


class LinkModel:
    """Predicts, per copy, the forward position by which the link will have finished it.

    Attributes:
        ratio: forward's saving rate over the link's rate (``None`` until a forward was measured). Above 1, forward
            saves faster than the link can move bytes out.
        backward_ratio: the same for backward walking the saved bytes down (``None`` until a backward was measured).
    """

    def __init__(self) -> None:
        self.ratio: float | None = None
        self.backward_ratio: float | None = None
        self.frozen = False  # observe nothing (the paces of steps that would mislead the model)
        self._link_free_at = 0.0  # position at which the copy stream will be idle, per the model

    def observe(self, saved_bytes: int, forward_ms: float, link_bytes_per_ms: float) -> None:
        """Fold in one measured forward: ``saved_bytes`` eligible bytes saved in ``forward_ms`` of device time."""
        if saved_bytes <= 0 or forward_ms <= 0 or link_bytes_per_ms <= 0 or self.frozen:
            return
        ratio = (saved_bytes / forward_ms) / link_bytes_per_ms
        # Smooth across steps: one slow forward (a recompile, a logging step) should not swing the schedule.
        self.ratio = ratio if self.ratio is None else 0.5 * (self.ratio + ratio)

    def observe_backward(self, saved_bytes: int, backward_ms: float, link_bytes_per_ms: float) -> None:
        """Fold in one measured backward over ``saved_bytes`` eligible bytes (compute time, waits excluded)."""
        if saved_bytes <= 0 or backward_ms <= 0 or link_bytes_per_ms <= 0 or self.frozen:
            return
        ratio = (saved_bytes / backward_ms) / link_bytes_per_ms
        self.backward_ratio = ratio if self.backward_ratio is None else 0.5 * (self.backward_ratio + ratio)

    def use_pace(self, saved_bytes: int, forward_ms: float, backward_ms: float, link_bytes_per_ms: float) -> None:
        """Take the paces of a measured step (a memory-budget plan's profile) and stop learning.

        Under a plan, a forward's own pace misleads: checkpointed blocks save little and fast while the offloaded
        bytes come from blocks run in full, and the first measuring step's device time includes pinning its host
        buffers (on an H200, 8B LoRA's forward waited 130 ms for copies the link had long finished).
        """
        if saved_bytes > 0 and link_bytes_per_ms > 0:
            if forward_ms > 0:
                self.ratio = (saved_bytes / forward_ms) / link_bytes_per_ms
            if backward_ms > 0:
                self.backward_ratio = (saved_bytes / backward_ms) / link_bytes_per_ms
        self.frozen = True

    def forward_started(self) -> None:
        """A new forward: the link is idle as far as the model knows."""
        self._link_free_at = 0.0

    def deadline(self, position: int, nbytes: int) -> float | None:
        """Position by which a copy of ``nbytes`` issued at ``position`` should be done (``None``: no model yet)."""
        if self.ratio is None:
            return None
        start = max(self._link_free_at, float(position))
        self._link_free_at = start + nbytes * self.ratio
        return position + (self._link_free_at - position) * SLACK

    def backward_lead(self) -> float:
        """Backward positions a host -> device copy needs per byte to arrive before backward reaches it.

        From a measured backward when there is one. Before that, backward is taken to run about twice as long per
        saved byte as forward: true of full fine-tuning, not of a frozen base (LoRA), whose backward is barely slower
        than its forward, which is why it is measured.
        """
        if self.backward_ratio is not None:
            return self.backward_ratio * SLACK
        ratio = self.ratio if self.ratio is not None else DEFAULT_RATIO
        return ratio / 2 * SLACK


def plan_prefetch(
    end_positions: Sequence[float], sizes: Sequence[int], lead: float, floor: int = PREFETCH_FLOOR
) -> list[float]:
    """For copies listed lowest position first, the latest backward position at which each must start back.

    The host -> device stream serves copies in the order backward needs them (highest position first), so a copy
    must start early enough for itself and for every copy queued behind it: a pass from the last-needed copy up
    chains their transfer times. A dead entry (``end_position`` of ``inf``) gets ``inf``: it is dropped as soon as
    the walk reaches it. Starting no earlier than needed keeps prefetched bytes out of the backward peak.

    Args:
        end_positions: each copy's position at the end of its bytes, ascending.
        sizes: each copy's size in bytes.
        lead: backward positions per byte a transfer needs (:meth:`LinkModel.backward_lead`).
        floor: the least lead of any copy, in positions.
    """
    latest_start = float("-inf")
    plan: list[float] = []
    for end, nbytes in zip(end_positions, sizes, strict=True):
        if end == float("inf"):
            plan.append(end)
            continue
        # Done before backward reaches it, and before the copy after it in the queue must start.
        finish = max(end, latest_start)
        latest_start = finish + nbytes * lead
        plan.append(max(latest_start, end + floor))
    return plan


# ---------------------------------------------------------------------------------------------- the memory budget

# The share of forward (and of backward) behind which copies are assumed to hide: the rest of a transfer shows as step
# time. Below 1 because copies share memory bandwidth and start only once tensors exist.
HIDDEN_SHARE = 0.8
# The in-flight and prefetch bounds of the most frugal plan (copies then barely overlap compute), at most this share
# of the budget: a small model's budget (on an H200, small-h512's 2 GiB, where checkpointing alone peaks at 1.84 GiB)
# has no room for 2 x 256 MiB of copies on their way.
FRUGAL_CAP = 256 << 20
FRUGAL_SHARE = 1 / 32
# Copies never get less than this share of the link in the model, whatever a step waited (a host stall, say).
_LEAST_LINK_SHARE = 0.01


def frugal_cap(budget: int) -> int:
    """The in-flight and the prefetch bound of the most frugal step under ``budget`` bytes."""
    return max(1 << 20, min(FRUGAL_CAP, int(budget * FRUGAL_SHARE)))


@dataclass(frozen=True)
class StepProfile:
    """One measured training step, in bytes and milliseconds: what the budget planner plans from.

    Attributes:
        peak: peak allocated device memory of the step.
        resident: eligible saved bytes that stayed on the device in that step (not offloaded).
        eligible: eligible saved bytes of one step with no block checkpointed.
        forward_ms: compute time of forward (device time less waits for copies).
        link_bytes_per_ms: the link's bandwidth, one direction.
        blocks: checkpointable blocks (the model's repeated layers; 0 when none were found).
        block_bytes: eligible bytes one block saves, on average.
        block_input_bytes: the bytes a checkpointed block saves instead (its input).
        split_input_bytes: the bytes a block checkpointed by its parts saves instead (each part's input, and what it
            computes outside its parts; 0: its blocks cannot be checkpointed by parts).
        part_bytes: eligible bytes the largest part of a block saves in full: what a block checkpointed by its parts
            rebuilds at a time in backward (0: not measured).
        block_share: the blocks' share of forward's compute time (0: not measured, taken as all of it); a block's
            recompute under checkpointing costs ``block_share * forward_ms / blocks``.
        backward_ms: compute time of backward (0: not measured, taken as twice forward's).
        tail: eligible bytes at the end of each forward that never leave (``resident_tail_bytes``).
        prefetch_bytes: the most bytes fetched back ahead of need while backward has freed nothing yet.
        inflight_cap: bytes whose copies out may lag behind forward when forward must wait for its copies.
        inflight_fixed: the user fixed ``inflight_cap`` (``max_inflight_bytes``): every plan uses it.
        link_share: the share of the link's bandwidth that copies get beside compute; lowered by planned steps that
            waited for copies longer than the model said (:func:`fit_link_share`).
        forward_peak: the measured step's peak as its backward began (forward's and the loss's; 0: not known).
        unrebuilt_peak: the measured step's own peak where ``peak`` took a rebuilt block off it (0: ``peak`` is the
            step's own). What rose above forward's peak in backward may have been the loss's backward, not the block
            (on an H200, 8B LoRA's frugal step rose 1.9 GiB at the loss's backward, a block being 2.1 GiB): a plan
            that rebuilds no block is counted at this peak, not at ``peak``.
        head_bytes: eligible bytes each forward saves after the last block (the head's and the loss's). Backward runs
            through them first, and fetches nothing ahead until it has (0: not known; nothing is held back then).
        head_peak: the measured step's peak up to where backward left the head: forward's and the loss's backward,
            with nothing fetched ahead and no block rebuilt (0: not measured; plans count one peak then).
        backward_base: allocated bytes as the measured step's backward left the head (the loss's transient gone):
            what the blocks' backward starts from, with the activations that step kept (``resident`` less the
            head's, which backward has used by then).
        rest_peak: the measured step's peak in backward after it left the head, where it rose above ``head_peak``
            (0: it did not, so it is known only to be lower).
        optimizer_peak: the measured step's peak after backward (the optimizer's step), where it rose above
            everything before it (0: it did not). No plan changes it: activations are gone by then.
        copy_ms_per_gib: how much slower forward's compute ran per GiB offloaded in planned steps (copies share the
            device's memory and the host's time with compute), waits excluded; learnt by :class:`BudgetPlanner`.
        correction: bytes planned steps needed beyond their plans' predictions (peaks above them, reserved bytes past
            the budget): added to every plan's peak; learnt by :class:`BudgetPlanner`, only ever higher.
        host_bytes: the most bytes the host pool can hold (its limit, or what the machine's RAM still allows): every
            copy of a forward is on the host at once as it ends, so no plan offloads more than fits there in buffers
            (0: not known, no bound).
        kept_bytes: what a block checkpointed with elementwise recompute keeps on the device besides its input (its
            matrix products' and attention's outputs, out of the engine's reach; 0: not measured, no such plans).
        base: allocated bytes as the measured step began (weights, optimizer state, gradients kept): planned steps
            that begin above it hold that much more in every phase.
        fit_error: the most a planned step of this profile needed beyond its plan's prediction without the model
            being corrected for it (small misses, the allocator's fragments when a hard cap pressed it); learnt by
            :class:`BudgetPlanner`, only ever higher. The fit margin keeps plans at least this far below the budget.
    """

    peak: int
    resident: int
    eligible: int
    forward_ms: float
    link_bytes_per_ms: float
    blocks: int = 0
    block_bytes: int = 0
    block_input_bytes: int = 0
    split_input_bytes: int = 0
    part_bytes: int = 0
    block_share: float = 0.0
    backward_ms: float = 0.0
    tail: int = 0
    prefetch_bytes: int = 0
    inflight_cap: int = 512 << 20
    inflight_fixed: bool = False
    link_share: float = 1.0
    forward_peak: int = 0
    unrebuilt_peak: int = 0
    head_bytes: int = 0
    head_peak: int = 0
    backward_base: int = 0
    rest_peak: int = 0
    optimizer_peak: int = 0
    copy_ms_per_gib: float = 0.0
    correction: int = 0
    host_bytes: int = 0
    kept_bytes: int = 0
    base: int = 0
    fit_error: int = 0

    @property
    def two_peaks(self) -> bool:
        """Whether the step's peak is modelled in two parts (the head's backward, the blocks' backward apart)."""
        return self.head_bytes > 0 and self.head_peak > 0 and self.backward_base > 0

    @property
    def lightenable(self) -> bool:
        """Whether a plan may checkpoint blocks with elementwise recompute (measured, and keeping less than a block)."""
        return self.blocks > 0 and self.kept_bytes > 0 and self.kept_bytes + self.block_input_bytes < self.block_bytes

    @property
    def splittable(self) -> bool:
        """Whether a plan may checkpoint the blocks by their parts (measured, and rebuilding less than a block)."""
        return self.blocks > 0 and 0 < self.part_bytes < self.block_bytes and self.split_input_bytes > 0


@dataclass(frozen=True)
class Plan:
    """How one step runs: what leaves the device, which blocks are checkpointed, and what that should cost.

    Attributes:
        offload_bytes: the first this-many eligible bytes of each forward leave the device (0: the hooks are not
            even installed, so the step costs nothing).
        checkpoint_blocks: how many of the last blocks run under activation checkpointing.
        split: those blocks are checkpointed by their parts (each part's input saved, one part rebuilt at a time), not
            whole: the most frugal plans, for when a block rebuilt whole does not fit.
        peak: the predicted peak allocated bytes.
        extra_ms: the predicted step time over keeping everything (recompute plus copies that do not hide).
        fits: whether ``peak`` is within the budget.
        inflight_cap: the most bytes whose copies out may lag behind forward (``None``: no bound, the copies finish
            behind forward's compute).
        prefetch_cap: the most bytes fetched back ahead of need before backward frees any (``None``: the
            configured ``prefetch_bytes``).
        light_blocks: how many blocks before the checkpointed ones run with elementwise recompute (their matrix
            products and attention kept on the device, everything else recomputed in backward).
        phases: the predicted peak of each phase where the profile counts them apart (forward with the loss's forward,
            the head's backward, the blocks' backward, the optimizer's step); ``peak`` is their largest. Empty where
            the step is modelled as one peak.
    """

    offload_bytes: int
    checkpoint_blocks: int
    peak: int
    extra_ms: float
    fits: bool
    inflight_cap: int | None = None
    prefetch_cap: int | None = None
    split: bool = False
    light_blocks: int = 0
    phases: tuple[int, ...] = ()

    def describe(self, budget: int) -> str:
        gib = float(1 << 30)
        what = []
        if self.light_blocks:
            what.append(f"recompute the elementwise operations of {self.light_blocks} block(s)")
        if self.checkpoint_blocks:
            what.append(f"checkpoint {self.checkpoint_blocks} block(s){' by their parts' if self.split else ''}")
        what.append(
            f"offload {self.offload_bytes / gib:.2f} GiB per forward" if self.offload_bytes else "offload nothing"
        )
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{', '.join(what)}: predicted peak {self.peak / gib:.2f} GiB {verdict} the budget of "
            f"{budget / gib:.2f} GiB, predicted cost {self.extra_ms:.1f} ms per step"
        )


@dataclass(frozen=True)
class OffloadChoice:
    """Offloading ``nbytes`` of a forward: how much lower the peak gets, what it costs, the in-flight bound used.

    ``forward_relief`` is how much lower forward's own peak gets, where it differs from ``relief`` (``None``: it does
    not): copies let go of at the head lower the loss's and the blocks' backward, not a peak forward reached before.
    """

    nbytes: int
    relief: int
    cost_ms: float
    inflight_cap: int | None
    prefetch_cap: int | None = None
    forward_relief: int | None = None


class OffloadModel:
    """What offloading the first bytes of each forward does to the step's peak and time (one profile, ``eligible``
    bytes saved per forward, e.g. after checkpointing some blocks).

    The peak is at the end of forward (where the loss's transient comes on top of every kept activation) or early in
    backward. Two ways to offload:

    * *Unbounded*: copies out lag behind forward as far as they need, so forward never waits for the throttle; what the
      link has not moved by the end of forward (``HIDDEN_SHARE`` of forward's time) is still on the device then.
    * *Throttled* at ``inflight_cap``: forward waits whenever more than the cap lags behind, so only the cap is left
      at the end of forward, at the price of forward waiting for the link while it saves the offloaded bytes.

    With ``released_at_head`` (the profile knows where the head begins), the engine lets go of every copy still in
    flight when forward reaches the head, the compute stream waiting for those the link has not finished: the loss's
    and the blocks' backward hold none of them, and what forward did not hide shows as a wait instead. Without it,
    the relief is net of the bytes fetched ahead as well (one peak, which may be where prefetching runs).

    Either way, backward must bring the bytes back: what its compute cannot hide shows as time, and copies fetched
    ahead of need may be on the device at the peak (up to ``prefetch_bytes``).
    """

    def __init__(
        self, profile: StepProfile, eligible: int, frugal: int = FRUGAL_CAP, released_at_head: bool = False
    ) -> None:
        self.p = profile
        self.eligible = eligible
        self.frugal = frugal  # the in-flight and prefetch bound of the most frugal offload
        self.released_at_head = released_at_head
        self.link = max(profile.link_bytes_per_ms * profile.link_share, 1e-9)
        self.backward_ms = profile.backward_ms or 2 * profile.forward_ms
        self.hidden_out = HIDDEN_SHARE * profile.forward_ms * self.link  # bytes copied out behind forward

    def fetched_ahead(self, nbytes: int, prefetch: int | None = None) -> int:
        """Bytes fetched back ahead of need while backward has freed nothing yet: counted in full (when prefetching
        starts depends on how evenly backward walks the saved bytes, which checkpointed blocks and the loss make
        uneven, and a peak under-predicted fails under a hard cap)."""
        return min(max(0, nbytes), self.p.prefetch_bytes if prefetch is None else prefetch)

    def _way_back_ms(self, nbytes: int) -> float:
        return max(0.0, nbytes / self.link - HIDDEN_SHARE * self.backward_ms)

    def _choice(
        self, nbytes: int, lagging: int, cost_ms: float, cap: int | None, prefetch: int | None = None
    ) -> OffloadChoice:
        """``lagging``: bytes whose copies are still on their way out at the end of forward."""
        if not self.released_at_head:
            relief = nbytes - lagging - self.fetched_ahead(nbytes, prefetch)
            return OffloadChoice(nbytes, relief, cost_ms, cap, prefetch)
        # The compute stream waits at the head for the lagging copies: what the rest of forward did not hide shows.
        return OffloadChoice(nbytes, nbytes, cost_ms + lagging / self.link, cap, prefetch, nbytes - lagging)

    def unbounded(self, nbytes: int) -> OffloadChoice:
        lagging = max(0, nbytes - int(self.hidden_out))
        choice = self._choice(nbytes, lagging, self._way_back_ms(nbytes), None)
        if self.released_at_head:
            # Without a throttle nothing bounds the bytes still on their way out as forward and the loss's forward peak:
            # how many left by then is a guess from timing, and a guess is no fit guarantee (on an H200, through the
            # Lightning callback, plans that counted on it ran out of memory at the loss's logits, 1 GiB past their
            # prediction). Forward's peak is predicted as if none had left; the head's backward still gets it all.
            choice = replace(choice, forward_relief=0)
        return choice

    def throttled(self, nbytes: int, cap: int, prefetch: int | None = None) -> OffloadChoice:
        """``prefetch``: a bound on bytes fetched ahead below the configured one (``None``: the configured one)."""
        # Forward saves the offloaded bytes in its first nbytes/eligible share; the link must keep within the cap.
        saving_ms = self.p.forward_ms * nbytes / max(1, self.eligible)
        waiting_ms = max(0.0, (nbytes - cap) / self.link - saving_ms)
        back_ms = self._way_back_ms(nbytes)
        if prefetch is not None:  # with little fetched ahead, most of the way back waits for the link
            back_ms = max(back_ms, nbytes / self.link - self.backward_ms / 2)
        # The cap's worth still on its way out as forward goes on; the rest of forward hides some of it.
        rest_ms = self.p.forward_ms - saving_ms
        in_flight = min(nbytes, cap)
        if not self.released_at_head:
            return self._choice(nbytes, in_flight, waiting_ms + back_ms, cap, prefetch)
        lagging = max(0, int(in_flight - HIDDEN_SHARE * rest_ms * self.link))
        # Forward's own peak may come before the head, with the whole cap in flight.
        return replace(
            self._choice(nbytes, lagging, waiting_ms + back_ms, cap, prefetch), forward_relief=nbytes - in_flight
        )

    def cheapest(
        self, needed: Sequence[int], movable: int, peak_of: Callable[[OffloadChoice], int], budget: int
    ) -> OffloadChoice | None:
        """The cheapest offload of at most ``movable`` bytes whose ``peak_of`` stays within ``budget``, trying the
        ``needed`` reliefs (each unbounded, and throttled with the cap on top); ``None``: none fits (then
        :meth:`most_frugal`)."""
        choices = []
        cap = self.p.inflight_cap
        for nbytes in needed:
            nbytes = min(movable, max(0, nbytes))
            if not self.p.inflight_fixed:
                choices.append(self.unbounded(nbytes))
            choices.append(self.throttled(min(movable, nbytes + cap), cap))
        fitting = [c for c in choices if peak_of(c) <= budget]
        return min(fitting, key=lambda c: (c.cost_ms, c.nbytes)) if fitting else None

    def most_frugal(self, movable: int) -> OffloadChoice:
        """Everything movable leaves, with little in flight either way: the least peak, whatever it costs."""
        return self.throttled(movable, min(self.p.inflight_cap, self.frugal), min(self.p.prefetch_bytes, self.frugal))


def _forward_relief(choice: OffloadChoice) -> int:
    return choice.relief if choice.forward_relief is None else choice.forward_relief


def plan_for_budget(profile: StepProfile, budget: int) -> Plan:
    """The cheapest plan whose predicted peak stays within ``budget``; the most frugal one if none does (every block
    checkpointed, everything else offloaded).

    The peak of the measured step, less the activations it kept, is what the peak holds besides activations (weights,
    gradients, optimizer state, the loss's transient). Each plan keeps ``eligible(k) - relief`` bytes of activations
    on top of that, where checkpointing ``k`` blocks shrinks what is saved to their inputs (and backward rebuilds one
    block's activations at a time), and offloading lowers the peak by its relief (:class:`OffloadModel`). For every
    ``k`` the cheapest offload that fits is found; the cheapest ``(k, offload)`` by predicted time wins: keeping costs
    nothing, offloading costs what the link cannot hide, each checkpointed block costs its recompute.
    """
    return cheapest_plan(plan_candidates(profile, budget))


def cheapest_plan(candidates: Sequence[Plan]) -> Plan:
    """What :func:`plan_for_budget` chooses from ``candidates`` (:func:`plan_candidates`' list)."""
    fitting = [p for p in candidates if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (p.extra_ms, p.peak))
    # Nothing fits: every block checkpointed and everything else offloaded, copies barely ahead of compute. The peak
    # model cannot rank the frugal plans reliably (its fixed part can hold backward's gradients, which never coexist
    # with forward's activations), and checkpointing moves far fewer bytes: on an H200 it held less than offloading
    # alone. (Light blocks keep their products on the device: never the most frugal.)
    return next((p for p in reversed(candidates) if not p.light_blocks), candidates[-1])


def plan_candidates(profile: StepProfile, budget: int, keep_only: bool = False) -> list[Plan]:
    """For ``k = 0 .. blocks`` checkpointed blocks, the cheapest plan under ``budget`` (the most frugal one where none
    fits); where measured, the same with ``j`` of the other blocks recomputing only their elementwise operations (for
    every ``j`` from 1 up to all of them); and last, where the blocks can be checkpointed by their parts, every block
    so: what :func:`plan_for_budget` chooses from, listed for diagnosis (the ``k``-th is the one with ``k`` blocks
    checkpointed whole and none light; the last without light blocks is the most frugal).

    ``keep_only``: each shape's plan that offloads nothing, not fitting where it passes ``budget`` (no offloading is
    priced: :func:`with_plans_that_keep` takes only those that fit, and pricing the others cost ~7 ms for a 32-block
    profile with light blocks)."""
    candidates = [_candidate(profile, budget, k, keep_only=keep_only) for k in range(profile.blocks + 1)]
    if profile.lightenable:
        candidates += [
            _candidate(profile, budget, k, light=j, keep_only=keep_only)
            for k in range(profile.blocks)
            for j in range(1, profile.blocks - k + 1)
        ]
    if profile.splittable:
        candidates.append(_candidate(profile, budget, profile.blocks, split=True, keep_only=keep_only))
    return candidates


def with_plans_that_keep(candidates: Sequence[Plan], looser: Sequence[Plan]) -> list[Plan]:
    """``candidates`` (:func:`plan_candidates` under one aim), each shape's plan replaced by the same shape's plan in
    ``looser`` (the same under a higher aim) where that one offloads nothing and fits: plans without copies may aim
    higher than plans with them (:attr:`~lightning_offload.budget.BudgetPlanner.keeping_budget`)."""
    keeping = {_shape(p): p for p in looser if p.fits and not p.offload_bytes}
    return [p if p.fits and not p.offload_bytes else keeping.get(_shape(p), p) for p in candidates]


# What running a block with elementwise recompute costs, as a share of what checkpointing it whole costs (recomputing
# its forward). Measured on an H200 with every block so, against every block checkpointed whole: Llama-8B LoRA at
# 8192 tokens 0.45, Llama-1B at 2 x 4096 tokens 0.81 (small kernels: the selective checkpointing's dispatch on the host
# weighs), a 4-layer model of width 512 2.0 (host-bound: slower than recomputing everything). An estimate that only
# ranks plans: plans with light blocks and plans without are timed against each other (:func:`trial_plans`).
ELEMENTWISE_SHARE = 0.5


def _candidate(
    profile: StepProfile, budget: int, k: int, split: bool = False, light: int = 0, keep_only: bool = False
) -> Plan:
    """The cheapest plan under ``budget`` with the last ``k`` blocks checkpointed (``split``: by their parts) and the
    ``light`` blocks before them recomputing their elementwise operations, or the most frugal where none fits
    (``keep_only``: the one that offloads nothing, fitting or not)."""
    per_block_ms = (profile.block_share or 1.0) * profile.forward_ms / profile.blocks if profile.blocks else 0.0
    eligible = _eligible(profile, k, split, light)
    # What light blocks keep on the device: out of the engine's reach, so offloading never relieves it.
    kept = light * profile.kept_bytes
    kept_phases: tuple[int, ...] = ()
    if profile.two_peaks:
        phases = _phase_peaks(profile, k + light, eligible, split and k > 0, kept)
        kept_phases = (phases.forward, phases.head, phases.blocks, profile.optimizer_peak)
        kept_peak = max(kept_phases)
    elif k or light:
        # Backward recomputes one checkpointed block (or part) at a time: its activations exist once more, briefly.
        rebuilt = profile.part_bytes if split else profile.block_bytes
        kept_peak = profile.peak + profile.correction - profile.resident + eligible + kept + rebuilt
    else:
        # Without a rebuilt block, the peak may be the loss's backward, which the profile's peak took for the block.
        kept_peak = max(profile.peak, profile.unrebuilt_peak) + profile.correction - profile.resident + eligible
    recompute_ms = (k + ELEMENTWISE_SHARE * light) * per_block_ms
    excess = kept_peak - budget
    if excess <= 0 or keep_only:
        return Plan(0, k, kept_peak, recompute_ms, excess <= 0, split=split, light_blocks=light, phases=kept_phases)
    model = OffloadModel(profile, eligible, frugal_cap(budget), released_at_head=profile.two_peaks)
    movable = max(0, eligible - profile.tail)
    if profile.host_bytes:
        # What does not fit on the host stays on the device, past the plan's peak (on an H200, Llama-8B LoRA at 40960
        # tokens under 80 GiB chose to offload 431 GiB with nothing checkpointed; the pool held 99 GiB, the rest stayed
        # and the step ran out of memory). The pool's size classes pad a buffer by up to an eighth.
        movable = min(movable, profile.host_bytes * 8 // 9)
    # The least bytes with enough relief: relief grows with the bytes, but fetching ahead can step in on the way.
    needed = [excess, excess + profile.prefetch_bytes]
    if profile.two_peaks:  # only the blocks' backward holds the bytes fetched ahead, past the head's room
        phases_of = _two_peak_offloaded(profile, phases, model, eligible)
        peak_of = _largest(phases_of)
        fetched = max(0, profile.prefetch_bytes - profile.head_bytes)
        needed[1] = max(phases.forward, phases.head, phases.blocks + fetched) - budget
    else:
        phases_of = _no_phases
        peak_of = _one_peak_offloaded(kept_peak)
    choice = model.cheapest(needed, movable, peak_of, budget)
    if choice is None:
        choice = model.most_frugal(movable)
    peak = peak_of(choice)
    cost = recompute_ms + choice.cost_ms + profile.copy_ms_per_gib * choice.nbytes / (1 << 30)
    return Plan(
        choice.nbytes,
        k,
        peak,
        cost,
        peak <= budget,
        choice.inflight_cap,
        choice.prefetch_cap,
        split,
        light,
        phases_of(choice),
    )


# Plans worth timing cost at most this share of a step (forward's and backward's compute) more than the cheapest by
# the model: what the model leaves out (the host's hooks, waits for copies, allocator flushes near a hard cap) was
# measured on an H200 at up to 2.5x a small model's step, and at 8-20% of the Llama workloads'.
TRIAL_BAND = 0.5
# Between the cheapest plan and the cheapest one that offloads nothing, one more is timed halfway where they are this
# many checkpointed blocks apart.
TRIAL_SPREAD = 3


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
    best = min(fitting, key=lambda p: (p.extra_ms, p.peak))
    if not best.offload_bytes and not best.checkpoint_blocks and not best.light_blocks:
        return [best]
    step_ms = profile.forward_ms + (profile.backward_ms or 2 * profile.forward_ms)
    within = [p for p in fitting if p.extra_ms <= best.extra_ms + TRIAL_BAND * step_ms]
    chosen: dict[tuple[int, bool, int], Plan] = {}
    whole = [p for p in within if not p.light_blocks]
    if whole:
        chosen.update(_family_trials(whole))
    light = [p for p in within if p.light_blocks]
    for family in (light, [p for p in light if not p.offload_bytes]):
        if family:
            cheapest = min(family, key=lambda p: (p.extra_ms, p.peak))
            chosen.setdefault(_shape(cheapest), cheapest)
    return sorted(chosen.values(), key=lambda p: (-p.offload_bytes, p.checkpoint_blocks, p.split, p.light_blocks))


def _family_trials(within: Sequence[Plan]) -> dict[tuple[int, bool, int], Plan]:
    """Of plans without light blocks: the cheapest, the cheapest without copies and one halfway between where they
    are far apart, or the one with the fewest copies where every plan offloads."""
    best = min(within, key=lambda p: (p.extra_ms, p.peak))
    chosen = {_shape(best): best}
    keeping = [p for p in within if not p.offload_bytes]
    if keeping:
        plain = min(keeping, key=lambda p: (p.extra_ms, p.peak))
        chosen.setdefault(_shape(plain), plain)
        low, high = sorted((best.checkpoint_blocks, plain.checkpoint_blocks))
        if high - low >= TRIAL_SPREAD:
            halfway = min(within, key=lambda p: (abs(2 * p.checkpoint_blocks - low - high), p.split, p.extra_ms))
            chosen.setdefault(_shape(halfway), halfway)
    else:
        # The fewest copies: blocks checkpointed whole save less than by their parts.
        most = max(within, key=lambda p: (p.checkpoint_blocks, not p.split))
        chosen.setdefault(_shape(most), most)
    return chosen


def _shape(plan: Plan) -> tuple[int, bool, int]:
    """Which blocks a plan checkpoints, and how: one trial per shape."""
    return plan.checkpoint_blocks, plan.split, plan.light_blocks


def _no_phases(choice: OffloadChoice) -> tuple[int, ...]:
    """A step modelled as one peak counts no phases apart."""
    return ()


def _largest(phases_of: Callable[[OffloadChoice], tuple[int, ...]]) -> Callable[[OffloadChoice], int]:
    """The peak of a step whose phases peak at ``phases_of(choice)``: the largest of them."""
    return lambda choice: max(phases_of(choice))


def _one_peak_offloaded(kept_peak: int) -> Callable[[OffloadChoice], int]:
    """The peak of a step modelled as one peak of ``kept_peak`` bytes once ``choice`` is offloaded."""
    return lambda choice: kept_peak - max(0, choice.relief)


def _two_peak_offloaded(
    profile: StepProfile, phases: PhasePeaks, model: OffloadModel, eligible: int
) -> Callable[[OffloadChoice], tuple[int, int, int, int]]:
    """The peaks of the step's phases with ``phases`` once ``choice`` is offloaded (the head's backward apart):
    forward's, the head's backward, the blocks' backward and the optimizer's step.

    Forward's peak and the head's backward are lowered only by bytes saved before the head: the head's own, where
    they leave, come straight back for the loss's backward (on an H200, small-h512's plan offloaded 0.25 GiB of its
    0.5 GiB of log-probabilities and peaked that much above its prediction). The blocks' backward holds the bytes
    fetched ahead. Offloading lowers neither the optimizer's peak (activations are gone by then) nor what stays."""
    before_head = max(0, eligible - profile.head_bytes)

    def phases_of(choice: OffloadChoice) -> tuple[int, int, int, int]:
        # The blocks' backward counts the head's saved bytes as room, used and freed by then: copies fetched ahead
        # into it add nothing; beyond it, they do.
        fetched = max(0, model.fetched_ahead(choice.nbytes, choice.prefetch_cap) - profile.head_bytes)
        return (
            phases.forward - max(0, min(before_head, _forward_relief(choice))),
            phases.head - max(0, min(before_head, choice.relief)),
            phases.blocks + fetched - max(0, choice.relief),
            profile.optimizer_peak,
        )

    return phases_of


# A block rebuilt in the blocks' backward holds its saved bytes again and, while its own backward runs, gradients of
# its intermediates: counted as this share of its saved bytes where that phase is modelled apart (a measured rise
# above the head's peak replaces the estimate).
REBUILD_SHARE = 1.5


@dataclass(frozen=True)
class PhasePeaks:
    """A step's peaks before any offloading, phase by phase (see :func:`_phase_peaks`)."""

    forward: int
    head: int
    blocks: int


def _phase_peaks(
    profile: StepProfile, checkpointed: int, eligible: int, split: bool = False, kept: int = 0
) -> PhasePeaks:
    """The step's peaks before any offloading, with ``eligible`` bytes saved, ``checkpointed`` blocks and ``kept``
    bytes held on the device out of the engine's reach (what light blocks keep; counted whole in every phase):

    * forward's (every activation kept before the head, the loss's forward transient);
    * the head's backward (every kept activation, the loss's transient, nothing fetched ahead, no block rebuilt);
    * the blocks' backward (the loss's transient gone, a block rebuilt when any is checkpointed, or with ``split``
      the largest part of one; bytes fetched ahead are added by the caller). The head's own saved bytes are counted
      here too: what backward frees of them is room the engine fetches into. A measured rise (``rest_peak``) held a
      block rebuilt whole, or is counted as if it had (:class:`~lightning_offload.budget.BudgetPlanner`).

    The measured step had the head's saved bytes on the device at its head's peak whether it kept them or offloaded
    them (the loss's backward needs them first: they come straight back), and made them at its forward's peak (the
    loss's log-probabilities are its output): both peaks hold them once, not again as kept activations. (Counting them
    twice over-predicted Llama-1B's planned peaks by the loss's 4 GiB on an H200.)
    """
    # Activations the measured step held besides the head's, less what planned steps needed beyond the model.
    held = max(0, profile.resident - profile.head_bytes) - profile.correction
    before_head = eligible - profile.head_bytes
    forward = profile.forward_peak - held + before_head + kept if profile.forward_peak else 0
    head = profile.head_peak - held + before_head + kept
    rebuilt = int(REBUILD_SHARE * profile.block_bytes) if checkpointed else 0
    blocks = (profile.rest_peak or profile.backward_base + rebuilt) - held + eligible + kept
    if split and checkpointed:
        blocks -= split_relief(profile)
    return PhasePeaks(forward, head, blocks)


def split_relief(profile: StepProfile) -> int:
    """How much lower the blocks' backward peaks with the blocks checkpointed by their parts than whole: the largest
    part is rebuilt at a time instead of the block."""
    return int(REBUILD_SHARE * max(0, profile.block_bytes - profile.part_bytes)) if profile.part_bytes else 0


def _eligible(profile: StepProfile, checkpointed: int, split: bool = False, light: int = 0) -> int:
    """Eligible bytes one forward saves with the last ``checkpointed`` blocks checkpointed (``split``: by parts) and
    ``light`` blocks recomputing their elementwise operations (they save their input, as a block checkpointed whole)."""
    saved = profile.split_input_bytes if split else profile.block_input_bytes
    cut = checkpointed * max(0, profile.block_bytes - saved) + light * max(
        0, profile.block_bytes - profile.block_input_bytes
    )
    return max(0, profile.eligible - cut)


def offload_cost_ms(profile: StepProfile, plan: Plan) -> float:
    """What ``plan``'s offloading costs per step by the model of ``profile`` (its recompute not included)."""
    if not plan.offload_bytes:
        return 0.0
    eligible = _eligible(profile, plan.checkpoint_blocks, plan.split, plan.light_blocks)
    model = OffloadModel(profile, eligible, released_at_head=profile.two_peaks)
    if plan.inflight_cap is None:
        return model.unbounded(plan.offload_bytes).cost_ms
    return model.throttled(plan.offload_bytes, plan.inflight_cap, plan.prefetch_cap).cost_ms


def fit_link_share(profile: StepProfile, plan: Plan, observed_ms: float) -> float:
    """The largest link share (at most the profile's) at which ``plan``'s offloading costs at least ``observed_ms``,
    the time a step on that plan waited for copies: the model then predicts what was measured."""
    low, high = _LEAST_LINK_SHARE, profile.link_share
    if offload_cost_ms(replace(profile, link_share=high), plan) >= observed_ms:
        return high
    for _ in range(30):  # the cost falls as the share grows: bisect for the largest share still costing enough
        middle = (low + high) / 2
        if offload_cost_ms(replace(profile, link_share=middle), plan) >= observed_ms:
            low = middle
        else:
            high = middle
    return low
