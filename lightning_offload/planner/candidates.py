"""The plans a measured step offers under a budget: for every number of blocks checkpointed (whole, by their parts,
or recomputing only their elementwise operations), the cheapest offload that keeps the predicted peak within it.
Plain numbers: bytes and milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_offload.planner.offload_model import OffloadChoice, OffloadModel, forward_relief
from lightning_offload.planner.profile import Plan, StepProfile, eligible_bytes, frugal_cap


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


def cost_order(plan: Plan) -> tuple[float, bool, int]:
    """How plans rank by the model: predicted cost, then, at equal cost, blocks checkpointed whole before by their
    parts (fewer regions to rebuild: host work the model does not price; on an H100 a 4-layer model's plan by parts
    ran 1.17x checkpointing the same blocks whole, which tied with it and was never timed), then the lower peak."""
    return plan.extra_ms, plan.split, plan.peak


def cheapest_plan(candidates: Sequence[Plan]) -> Plan:
    """What :func:`plan_for_budget` chooses from ``candidates`` (:func:`plan_candidates`' list)."""
    fitting = [p for p in candidates if p.fits]
    if fitting:
        return min(fitting, key=cost_order)
    # Nothing fits: every block checkpointed and everything else offloaded, copies barely ahead of compute. The peak
    # model cannot rank the frugal plans reliably (its fixed part can hold backward's gradients, which never coexist
    # with forward's activations), and checkpointing moves far fewer bytes: on an H200 it held less than offloading
    # alone. (Light blocks keep their products on the device: never the most frugal.)
    return next((p for p in reversed(candidates) if not p.light_blocks), candidates[-1])


def plan_candidates(profile: StepProfile, budget: int) -> list[Plan]:
    """For ``k = 0 .. blocks`` checkpointed blocks, the cheapest plan under ``budget`` (the most frugal one where none
    fits); where measured, the same with ``j`` of the other blocks recomputing only their elementwise operations (for
    every ``j`` from 1 up to all of them); and last, where the blocks can be checkpointed by their parts, every block
    so: what :func:`plan_for_budget` chooses from, listed for diagnosis (the ``k``-th is the one with ``k`` blocks
    checkpointed whole and none light; the last without light blocks is the most frugal)."""
    candidates = [_candidate(profile, budget, k) for k in range(profile.blocks + 1)]
    if profile.lightenable:
        candidates += [
            _candidate(profile, budget, k, light=j)
            for k in range(profile.blocks)
            for j in range(1, profile.blocks - k + 1)
        ]
    if profile.splittable:
        candidates.append(_candidate(profile, budget, profile.blocks, split=True))
    return candidates


# What running a block with elementwise recompute costs, as a share of what checkpointing it whole costs (recomputing
# its forward). Measured on an H200 with every block so, against every block checkpointed whole: Llama-8B LoRA at
# 8192 tokens 0.45, Llama-1B at 2 x 4096 tokens 0.81 (small kernels: the selective checkpointing's dispatch on the host
# weighs), a 4-layer model of width 512 2.0 (host-bound: slower than recomputing everything). An estimate that only
# ranks plans: plans with light blocks and plans without are timed against each other (:func:`trial_plans`).
ELEMENTWISE_SHARE = 0.5


def _candidate(profile: StepProfile, budget: int, k: int, split: bool = False, light: int = 0) -> Plan:
    """The cheapest plan under ``budget`` with the last ``k`` blocks checkpointed (``split``: by their parts) and the
    ``light`` blocks before them recomputing their elementwise operations, or the most frugal where none fits."""
    per_block_ms = (profile.block_share or 1.0) * profile.forward_ms / profile.blocks if profile.blocks else 0.0
    eligible = eligible_bytes(profile, k, split, light)
    # What light blocks keep on the device, and the weight casts of the blocks run in full beyond those the measured
    # step held: out of the engine's reach, so offloading never relieves it.
    casts = held_casts(profile, k, light)
    kept = light * profile.kept_bytes + casts
    kept_phases: tuple[int, ...] = ()
    if profile.two_peaks:
        forward_kept = kept - casts if profile.casts_cached else kept
        phases = _phase_peaks(profile, k + light, eligible, split and k > 0, kept, forward_kept)
        kept_phases = (phases.forward, phases.head, phases.blocks, profile.optimizer_peak)
        kept_peak = max(kept_phases[:3])  # what plans move; the optimizer's measured peak is theirs alike
    elif k or light:
        # Backward recomputes one checkpointed block (or part) at a time: its activations exist once more, briefly.
        rebuilt = profile.part_bytes if split else profile.block_bytes
        kept_peak = profile.peak + profile.correction - profile.resident + eligible + kept + rebuilt
    else:
        # Without a rebuilt block, the peak may be the loss's backward, which the profile's peak took for the block.
        kept_peak = max(profile.peak, profile.unrebuilt_peak) + profile.correction - profile.resident + eligible + kept
    recompute_ms = (k + ELEMENTWISE_SHARE * light) * per_block_ms
    excess = kept_peak - budget
    if excess <= 0:
        peak = max(kept_peak, profile.optimizer_peak) if kept_phases else kept_peak
        return Plan(0, k, peak, recompute_ms, excess <= 0, split=split, light_blocks=light, phases=kept_phases)
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
    moved_peak = peak_of(choice)
    cost = recompute_ms + choice.cost_ms + profile.copy_ms_per_gib * choice.nbytes / (1 << 30)
    return Plan(
        choice.nbytes,
        k,
        max(moved_peak, profile.optimizer_peak) if profile.two_peaks else moved_peak,
        cost,
        moved_peak <= budget,
        choice.inflight_cap,
        choice.prefetch_cap,
        split,
        light,
        phases_of(choice),
    )


def held_casts(profile: StepProfile, checkpointed: int, light: int) -> int:
    """The weight casts that the blocks a plan runs in full hold until their backward, beyond those of the blocks
    the measured step ran in full (its peaks hold those): none for blocks checkpointed, whole or light (their
    recompute casts again)."""
    in_full = profile.blocks - checkpointed - light
    return max(0, in_full - profile.cast_blocks) * profile.cast_bytes


def shape(plan: Plan) -> tuple[int, bool, int]:
    """Which blocks a plan checkpoints, and how: one trial per shape."""
    return plan.checkpoint_blocks, plan.split, plan.light_blocks


def _no_phases(choice: OffloadChoice) -> tuple[int, ...]:
    """A step modelled as one peak counts no phases apart."""
    return ()


def _largest(phases_of: Callable[[OffloadChoice], tuple[int, ...]]) -> Callable[[OffloadChoice], int]:
    """The peak a plan moves of a step whose phases peak at ``phases_of(choice)``: the largest up to the end of
    backward (the optimizer's, last, is the same for every plan)."""
    return lambda choice: max(phases_of(choice)[:3])


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
            phases.forward - max(0, min(before_head, forward_relief(choice))),
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
    profile: StepProfile,
    checkpointed: int,
    eligible: int,
    split: bool = False,
    kept: int = 0,
    forward_kept: int | None = None,
) -> PhasePeaks:
    """The step's peaks before any offloading, with ``eligible`` bytes saved, ``checkpointed`` blocks and ``kept``
    bytes held on the device out of the engine's reach (what light blocks keep, weight casts; counted whole in every
    phase, but forward's where ``forward_kept`` says otherwise: autocast's cache held the casts there anyway):

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
    forward_kept = kept if forward_kept is None else forward_kept
    forward = profile.forward_peak - held + before_head + forward_kept if profile.forward_peak else 0
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
