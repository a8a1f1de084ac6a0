"""What a measuring step says about a step that checkpoints nothing (:func:`measured_profile`), and the questions asked
of the measuring steps before the next one runs. Plain numbers: bytes and milliseconds."""

from __future__ import annotations

import dataclasses

from lightning_offload.planner.aims import PLAN_MARGIN_SHARE
from lightning_offload.planner.candidates import REBUILD_SHARE
from lightning_offload.planner.profile import BlockSizes, StepProfile
from lightning_offload.planner.steps import Observation


@dataclasses.dataclass(frozen=True)
class Machine:
    """What planned steps taught about the machine, for every input: the link's share beside compute and what copies
    cost forward's compute per GiB (see :class:`StepProfile`)."""

    link_share: float = 1.0
    copy_ms_per_gib: float = 0.0

    def taught(self, profile: StepProfile) -> StepProfile:
        """``profile`` with what the machine learnt: the lesser link share and the larger price of copies."""
        return dataclasses.replace(
            profile,
            link_share=min(profile.link_share, self.link_share),
            copy_ms_per_gib=max(profile.copy_ms_per_gib, self.copy_ms_per_gib),
        )


def measured_profile(
    obs: Observation, full_block: BlockSizes | None, base: int, machine: Machine
) -> tuple[StepProfile, BlockSizes | None]:
    """The profile of the measuring step ``obs`` (which began with ``base`` bytes allocated), and the blocks run in full
    that later measuring steps extrapolate from (``full_block``: an earlier step's).

    Blocks it ran checkpointed saved only their inputs (or their parts' inputs) and recomputed their forward in
    backward: what they would save in full is the block run in full, in this step or the one before, and their
    recompute is taken off backward's time and off the peak (a peak in backward, above forward's, held one rebuilt
    block or part, or the loss's backward: the step's own peak stays in the profile for plans that rebuild no block).
    """
    sizes = obs.blocks or BlockSizes(0, 0, 0, 0)
    if sizes.block_bytes > sizes.input_bytes:
        full_block = sizes
    elif full_block is not None and sizes.checkpointed == sizes.count:  # every block checkpointed
        sizes = dataclasses.replace(
            sizes,
            block_bytes=full_block.block_bytes,
            part_bytes=full_block.part_bytes,
            kept_bytes=full_block.kept_bytes,
            cast_bytes=full_block.cast_bytes,
        )
    block_bytes, input_bytes = sizes.block_bytes, sizes.input_bytes
    whole_input_bytes = sizes.first_input_bytes if sizes.split else input_bytes
    split_input_bytes = input_bytes if sizes.split else 0
    if not split_input_bytes and full_block is not None and full_block.split:
        split_input_bytes = full_block.input_bytes
    peak, eligible, backward_ms = obs.peak, obs.eligible, obs.backward_ms
    unrebuilt_peak = 0
    if sizes.checkpointed and block_bytes > 0:
        eligible += sizes.checkpointed * block_bytes - (sizes.cut_bytes or sizes.checkpointed * input_bytes)
        # Recompute is forward's compute again, one block each; keep at least forward's pace (a LoRA backward is
        # barely slower than its forward).
        per_block_ms = (obs.blocks_ms or obs.forward_ms) / sizes.count
        backward_ms = max(obs.forward_ms, backward_ms - sizes.checkpointed * per_block_ms) if backward_ms else 0.0
        rebuilt = sizes.part_bytes if sizes.split and sizes.part_bytes else block_bytes
        if obs.forward_peak and peak > obs.forward_peak:
            unrebuilt_peak, peak = peak, max(obs.forward_peak, peak - rebuilt)
    limits = obs.limits
    profile = StepProfile(
        **_two_peak_fields(obs, peak, unrebuilt_peak, sizes),
        peak=peak,
        # Past the watermark everything left: no activation counts as kept (what was still in flight at the peak
        # then counts as fixed, which errs on the side of memory by at most the in-flight cap).
        resident=0 if obs.tripped else max(0, eligible - obs.offloaded),
        eligible=eligible,
        forward_ms=obs.forward_ms,
        link_bytes_per_ms=obs.link_bytes_per_ms,
        blocks=sizes.count if block_bytes > whole_input_bytes else 0,
        block_bytes=block_bytes,
        block_input_bytes=whole_input_bytes,
        split_input_bytes=split_input_bytes,
        part_bytes=sizes.part_bytes if sizes.part_bytes < block_bytes else 0,
        kept_bytes=sizes.kept_bytes,
        cast_bytes=sizes.cast_bytes,
        cast_blocks=sizes.count - sizes.checkpointed,
        casts_cached=sizes.casts_cached,
        block_share=min(1.0, obs.blocks_ms / obs.forward_ms) if obs.forward_ms > 0 else 0.0,
        backward_ms=backward_ms,
        link_share=machine.link_share,
        copy_ms_per_gib=machine.copy_ms_per_gib,
        forward_peak=obs.forward_peak,
        unrebuilt_peak=unrebuilt_peak,
        base=base,
        tail=limits.tail,
        prefetch_bytes=limits.prefetch_bytes,
        inflight_cap=limits.inflight_cap,
        inflight_fixed=limits.inflight_fixed,
        host_bytes=limits.host_bytes,
    )
    return profile, full_block


def _two_peak_fields(obs: Observation, peak: int, unrebuilt_peak: int, sizes: BlockSizes) -> dict[str, int]:
    """What the measuring step said of its backward's two parts (:class:`StepProfile`'s ``head_*``, ``backward_base``,
    ``rest_peak`` and ``optimizer_peak``); none where backward never left the head the driver knew of."""
    if not (obs.head_bytes and obs.head_peak):
        return {}
    rest = obs.backward_peak if obs.backward_peak > obs.head_peak else 0
    if rest and not sizes.checkpointed:  # it rebuilt no block: a plan that checkpoints rebuilds one on top
        rest += int(REBUILD_SHARE * sizes.block_bytes)
    elif rest and sizes.split and 0 < sizes.part_bytes < sizes.block_bytes:
        # It rebuilt a part at a time: counted as a block rebuilt whole, as plans count it.
        rest += int(REBUILD_SHARE * (sizes.block_bytes - sizes.part_bytes))
    step_peak = max(peak, unrebuilt_peak)
    return {
        "head_bytes": obs.head_bytes,
        "head_peak": obs.head_peak,
        "backward_base": obs.head_allocated,
        "rest_peak": rest,
        "optimizer_peak": step_peak if step_peak > max(obs.head_peak, obs.backward_peak) else 0,
    }


def pressed_gap(obs: Observation, budget: int) -> int:
    """What the measuring step ``obs`` reserved past its peak where its allocator was pressed for room (it flushed its
    cache, or reserved past what plans aim for at the least margin); 0 elsewhere: the gap is then what the allocator
    cached because the budget left room, which a flush under a hard cap would free."""
    # A step that never reserved past what it began with peaked at a cache an earlier step left (on an H100 an 8B
    # model's second measuring step began with 78 GiB its first had cached, flushed them, and ended holding 0.3 GiB past
    # its 27 GiB peak): what it holds as it ends is what its own allocations left reserved.
    reserved = obs.reserved if 0 < obs.reserved_peak <= obs.reserved_at_start else obs.reserved_peak
    if not obs.flushed and reserved <= budget * (1 - PLAN_MARGIN_SHARE):
        return 0
    return max(0, reserved - obs.peak)


@dataclasses.dataclass(frozen=True)
class MeasuredPeaks:
    """The latest measuring step's base and peaks (bytes), and whether it offloaded from its first saved tensor."""

    base: int = 0
    peak: int = 0
    backward_peak: int = 0
    frugal: bool = False

    def rebuilt_whole(self, full_block: BlockSizes | None, allocated: int) -> int | None:
        """What the next measuring step would peak at with its blocks checkpointed whole, not by their parts, now that
        ``allocated`` bytes are (``None``: the blocks were not measured by parts). Errs on memory: the block's larger
        rebuild goes on top of backward's peak, and the optimizer's state allocated since on top of all."""
        if full_block is None or not full_block.split or not 0 < full_block.part_bytes < full_block.block_bytes:
            return None
        rebuilt_more = int(REBUILD_SHARE * (full_block.block_bytes - full_block.part_bytes))
        whole = max(self.peak, (self.backward_peak or self.peak) + rebuilt_more)
        return whole + max(0, allocated - self.base)

    def next_frugal_peak(self, allocated: int) -> int:
        """What a frugal measuring step after this one should peak at, ``allocated`` bytes allocated as it begins: what
        this one held up to the end of its backward, plus the optimizer's state allocated since (0: not frugal)."""
        if not (self.frugal and self.peak):
            return 0
        return max(self.peak, (self.backward_peak or self.peak) + max(0, allocated - self.base))
