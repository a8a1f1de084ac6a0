"""What the planner plans from and what it chooses: a measured step (:class:`StepProfile`), one measuring step's
blocks (:class:`BlockSizes`) and a plan (:class:`Plan`). Plain numbers: bytes and milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

# The in-flight and prefetch bounds of the most frugal plan (copies then barely overlap compute), at most this share
# of the budget: a small model's budget (on an H200, small-h512's 2 GiB, where checkpointing alone peaks at 1.84 GiB)
# has no room for 2 x 256 MiB of copies on their way.
FRUGAL_CAP = 256 << 20
FRUGAL_SHARE = 1 / 32


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
        cast_bytes: the weight casts a block run in full holds until its backward, out of the engine's reach (see
            :class:`BlockSizes`); ``cast_blocks`` blocks held theirs in the measured step, so its peaks hold them.
        casts_cached: autocast's cache held every block's casts through forward, checkpointed or not: only the
            phases after forward hold a block's casts for running it in full.
        base: allocated bytes as the measured step began (weights, optimizer state, gradients kept): planned steps
            that begin above it hold that much more in every phase.
        fit_error: the most a planned step of this profile needed beyond its plan's prediction without the model
            being corrected for it (a small miss; after an out-of-memory error, the allocator's fragments then);
            learnt by :class:`BudgetPlanner`, only ever higher. The fit margin keeps plans at least this far below the
            budget.
        pressed_error: the most a planned step's reserved bytes passed its plan's prediction where a hard cap pressed
            the allocator (it flushed its cache), plus the replanning share of the budget: what the cap counts there,
            and room for the fragments to differ from step to step. A plan whose pressed steps kept that share
            unreserved keeps fitting; only ever higher.
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
    pressed_error: int = 0
    cast_bytes: int = 0
    cast_blocks: int = 0
    casts_cached: bool = False

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
        fits: whether the plan is within the budget: ``activation_peak`` (a prediction) with the fit margin below it,
            and ``peak`` (the optimizer's step, measured) at all.
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

    @property
    def activation_peak(self) -> int:
        """The predicted peak up to the end of backward: what the plan moves (the optimizer's step, measured apart, is
        the same for every plan)."""
        return max(self.phases[:3]) if self.phases else self.peak

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
class BlockSizes:
    """What one measuring step's forward saved per block.

    Attributes:
        count: blocks that ran.
        checkpointed: how many of them ran checkpointed.
        block_bytes: eligible bytes a block run in full saves, on average.
        input_bytes: what a checkpointed block saves instead: measured where blocks ran checkpointed, else the size
            of a block's first input.
        split: the checkpointed blocks ran by their parts (``input_bytes`` is then what such a block saves).
        first_input_bytes: the size of a block's first input, on average (what a block checkpointed whole saves).
        part_bytes: eligible bytes the largest part of a block run in full saved (0: not measured).
        cut_bytes: what the checkpointed blocks saved in all (``input_bytes`` is its average, rounded down).
        kept_bytes: what a block checkpointed with elementwise recompute would keep on the device besides its input:
            the outputs of its matrix products and attention, counted over the second block run in full (0: not
            measured, or the block writes into one of them in place, which elementwise recompute refuses).
        cast_bytes: the weight casts a block run in full saved (autocast's copies of its float32 weights), on
            average: held on the device out of the engine's reach until the block's backward (0: none, or not
            measured; :mod:`~lightning_offload.weight_casts`).
        casts_cached: the forward ran under autocast with its cache of casts on: every block's casts then lived
            until autocast exited, checkpointed or not.
    """

    count: int
    checkpointed: int
    block_bytes: int
    input_bytes: int
    split: bool = False
    first_input_bytes: int = 0
    part_bytes: int = 0
    cut_bytes: int = 0
    kept_bytes: int = 0
    cast_bytes: int = 0
    casts_cached: bool = False


def eligible_bytes(profile: StepProfile, checkpointed: int, split: bool = False, light: int = 0) -> int:
    """Eligible bytes one forward saves with the last ``checkpointed`` blocks checkpointed (``split``: by parts) and
    ``light`` blocks recomputing their elementwise operations (they save their input, as a block checkpointed whole)."""
    saved = profile.split_input_bytes if split else profile.block_input_bytes
    cut = checkpointed * max(0, profile.block_bytes - saved) + light * max(
        0, profile.block_bytes - profile.block_input_bytes
    )
    return max(0, profile.eligible - cut)
