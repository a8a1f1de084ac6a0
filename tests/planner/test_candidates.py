"""The planner's cost model, as arithmetic: what each plan keeps, offloads and costs, and which plans are timed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_offload.planner.candidates import (
    ELEMENTWISE_SHARE,
    _candidate,
    _phase_peaks,
    held_casts,
    plan_candidates,
    plan_for_budget,
    split_relief,
)
from lightning_offload.planner.offload_model import HIDDEN_SHARE, OffloadModel
from lightning_offload.planner.profile import Plan, StepProfile, eligible_bytes, frugal_cap
from lightning_offload.planner.trials import trial_plans

MiB = 1 << 20
GiB = 1 << 30


def profile(**changes: float) -> StepProfile:
    """A measured step that kept its 10 GiB of activations: 30 GiB peak, of which 20 GiB are not activations.
    Forward takes 100 ms, backward 200 ms; the link moves 50 MiB/ms (~52 GB/s), so forward hides ~3.9 GiB."""
    values: dict = dict(
        peak=30 * GiB,
        resident=10 * GiB,
        eligible=10 * GiB,
        forward_ms=100.0,
        backward_ms=200.0,
        link_bytes_per_ms=50 * MiB,
        blocks=10,
        block_bytes=GiB,
        block_input_bytes=64 * MiB,
        tail=256 * MiB,
        prefetch_bytes=512 * MiB,
        inflight_cap=512 * MiB,
    )
    values.update(changes)
    return StepProfile(**values)


def test_a_model_that_fits_keeps_everything() -> None:
    plan = plan_for_budget(profile(), budget=31 * GiB)
    assert (plan.offload_bytes, plan.checkpoint_blocks, plan.extra_ms, plan.fits) == (0, 0, 0.0, True)
    assert plan.peak == 30 * GiB


def test_offloads_just_what_is_needed_where_it_hides() -> None:
    """3 GiB must leave: the link moves them while forward computes (no bound on the copies in flight), and brings
    them back while backward computes: offloading costs nothing. Copies fetched ahead may be on the device at the
    peak, so that much more leaves."""
    plan = plan_for_budget(profile(), budget=27 * GiB)
    assert plan.checkpoint_blocks == 0
    assert plan.offload_bytes == 3 * GiB + 512 * MiB and plan.inflight_cap is None
    assert plan.peak <= 27 * GiB and plan.fits
    assert plan.extra_ms == 0.0


def test_a_plan_that_rebuilds_no_block_is_counted_at_the_measured_steps_own_peak() -> None:
    """The profile's peak took a rebuilt block off what the frugal measuring step peaked at in backward, but the rise
    may have been the loss's backward, which a plan without checkpointing still has: such plans count the step's own
    peak (on an H200, 8B LoRA's first plan without checkpointing peaked 3.3 GiB above its prediction)."""
    plain = plan_candidates(profile(), 27 * GiB)
    rose = plan_candidates(profile(unrebuilt_peak=31 * GiB), 27 * GiB)
    assert rose[0].peak <= 27 * GiB and rose[0].offload_bytes >= plain[0].offload_bytes + GiB
    assert rose[0].extra_ms > plain[0].extra_ms  # past what forward hides: forward now waits for the link
    assert rose[1:] == plain[1:]  # a rebuilt block is counted on top of the profile's peak already
    assert plan_candidates(profile(unrebuilt_peak=29 * GiB), 27 * GiB) == plain  # never below the profile's peak


def test_with_the_heads_backward_apart_a_checkpointing_plan_counts_no_block_or_prefetch_at_the_losss_peak() -> None:
    """The profile's step peaked in the loss's backward (3 GiB of transient over its 27 GiB as backward left the head):
    there, no block is rebuilt and nothing is fetched ahead (the engine holds copies back until the head is done). So
    a checkpointing plan's peak is the head's, a block and the bytes fetched ahead lower than one peak counts; the
    blocks' backward, with the rebuilt block and the copies fetched ahead, stays below it."""
    one = profile()
    two = profile(head_bytes=256 * MiB, head_peak=30 * GiB, backward_base=27 * GiB - 256 * MiB)
    one_peak, two_peaks = plan_candidates(one, 10 * GiB**2), plan_candidates(two, 10 * GiB**2)  # nothing offloaded
    assert two_peaks[0].peak == one_peak[0].peak == 30 * GiB
    for k in range(1, 11):
        assert two_peaks[k].peak == one_peak[k].peak - GiB  # the head's peak: no rebuilt block
    budget = 22 * GiB
    plan_one, plan_two = plan_for_budget(one, budget), plan_for_budget(two, budget)
    assert plan_two.fits and plan_two.peak <= budget
    assert plan_two.extra_ms < plan_one.extra_ms  # less to offload or fewer blocks to rebuild
    # The blocks' backward: 27 GiB less the 9.75 GiB of activations still held, 1.5 GiB for the rebuilt block, what
    # the plan keeps, and the copies fetched ahead: below the head's peak.
    kept = 10 * GiB - plan_two.checkpoint_blocks * (GiB - 64 * MiB) - plan_two.offload_bytes
    blocks_peak = 27 * GiB - 256 * MiB - (10 * GiB - 256 * MiB) + int(1.5 * GiB) + kept + 512 * MiB
    assert blocks_peak < plan_two.peak


def test_where_the_blocks_backward_is_the_higher_peak_it_counts_the_rebuilt_block_and_the_prefetch() -> None:
    """No loss transient to speak of (a small vocabulary): the blocks' backward, with a block rebuilt (its saved bytes
    and half again for its backward's gradients) and the copies fetched ahead, is the step's peak, and plans count
    it. A measured rise after the head replaces the estimate; the optimizer's peak, which no plan lowers, bounds every
    plan's peak but chooses none: plans fit by what they move, and the planner checks the optimizer's step apart."""
    flat = dict(head_bytes=256 * MiB, head_peak=30 * GiB, backward_base=30 * GiB - 256 * MiB)
    held = 10 * GiB - 256 * MiB  # the activations the measured step still held as backward left the head
    kept = [plan_candidates(profile(**flat), 100 * GiB)[k].peak for k in range(11)]
    for k in range(1, 11):
        eligible = 10 * GiB - k * (GiB - 64 * MiB)
        assert kept[k] == 30 * GiB - 256 * MiB - held + int(1.5 * GiB) + eligible  # above the head's 20 GiB + eligible
    with_transient = plan_for_budget(profile(**{**flat, "backward_base": 27 * GiB}), 22 * GiB)
    plan = plan_for_budget(profile(**flat), 22 * GiB)
    assert plan.fits and plan.extra_ms > with_transient.extra_ms
    measured = plan_candidates(profile(**flat, rest_peak=31 * GiB), 100 * GiB)
    assert all(measured[k].peak == 31 * GiB - held + 10 * GiB - k * (GiB - 64 * MiB) for k in range(11))
    floor = plan_candidates(profile(**flat, optimizer_peak=25 * GiB), 22 * GiB)
    assert all(c.peak == max(25 * GiB, c.activation_peak) and c.phases[3] == 25 * GiB for c in floor)
    assert [c.fits for c in floor] == [c.fits for c in plan_candidates(profile(**flat), 22 * GiB)]
    assert replace(plan_for_budget(profile(**flat, optimizer_peak=25 * GiB), 22 * GiB), peak=0, phases=()) == replace(
        plan, peak=0, phases=()
    )


def test_a_frugal_measuring_step_and_one_that_kept_everything_predict_the_same_plans() -> None:
    """The head's saved bytes (the loss's log-probabilities, 4 GiB) are on the device at the loss's backward whether
    the measured step kept them or offloaded them (they come straight back: the loss's backward needs them first),
    and forward's peak makes them. A step that offloaded everything (nothing resident) and one that kept everything
    measure the same peaks, so they must predict the same: counting the head's bytes again as kept activations
    over-predicted every plan of Llama-1B by the loss's 4 GiB on an H200."""
    head = 4 * GiB
    # Leaving the head, the loss's transient and the head's bytes are gone: 20 GiB of weights and state, and the 6 GiB
    # of activations saved before the head where they were kept.
    kept = profile(peak=34 * GiB, forward_peak=32 * GiB, head_bytes=head, head_peak=34 * GiB, backward_base=26 * GiB)
    # The frugal step: the loss's 4 GiB transient on top of the 4 GiB it fetched back, and nothing else kept.
    frugal = replace(kept, resident=0, peak=28 * GiB, forward_peak=26 * GiB, head_peak=28 * GiB, backward_base=20 * GiB)
    assert plan_candidates(frugal, 100 * GiB) == plan_candidates(kept, 100 * GiB)
    assert plan_candidates(frugal, 100 * GiB)[0].peak == 34 * GiB  # nothing to offload: the kept step's own peak
    for budget in (31 * GiB, 29 * GiB, 25 * GiB):
        assert plan_for_budget(frugal, budget) == plan_for_budget(kept, budget)


def test_copies_let_go_of_at_the_head_relieve_the_backward_peaks_fully_at_the_price_of_a_wait() -> None:
    """Where the head is known, the engine lets go of every copy still in flight as forward reaches it (the compute
    stream waits for the link there): the loss's backward holds none of them. Forward hides ~3.9 GiB, so offloading
    6 GiB unbounded relieves all 6 GiB and costs the ~2.1 GiB the link still had to move when forward reached the
    head. Forward's own peak (the loss's forward among it) is relieved by nothing unbounded: without a throttle, what
    the link moved by then is a guess from timing, not a bound; throttled at a cap, by all but the cap."""
    two = profile(head_bytes=256 * MiB, head_peak=30 * GiB, backward_base=27 * GiB)
    model = OffloadModel(two, eligible=10 * GiB, released_at_head=True)
    hidden = int(HIDDEN_SHARE * 100.0 * 50 * MiB)
    choice = model.unbounded(6 * GiB)
    assert choice.relief == 6 * GiB and choice.forward_relief == 0
    assert choice.cost_ms == pytest.approx((6 * GiB - hidden) / (50 * MiB))
    small = model.unbounded(2 * GiB)
    assert (small.relief, small.forward_relief, small.cost_ms) == (2 * GiB, 0, 0.0)  # hidden: free
    throttled = model.throttled(6 * GiB, 512 * MiB)
    assert throttled.relief == 6 * GiB and throttled.forward_relief == 6 * GiB - 512 * MiB
    # Forward saves the 6 GiB in 60 ms and waits there for all but the cap; the cap's copies hide in the last 40 ms.
    assert throttled.cost_ms == pytest.approx((6 * GiB - 512 * MiB) / (50 * MiB) - 60.0)


def test_offloading_the_heads_own_bytes_does_not_lower_the_losss_backward() -> None:
    """The head's saved bytes (4 of the 10 GiB here) come straight back for the loss's backward where they leave: only
    the 6 GiB saved before the head can lower forward's and the head's peaks. A budget that needs 7 GiB off the head's
    peak is out of reach without checkpointing, whatever leaves (on an H200, small-h512's plan offloaded 0.25 GiB of its
    log-probabilities and peaked that much above its prediction)."""
    two = profile(resident=0, blocks=0, tail=0, head_bytes=4 * GiB, head_peak=24 * GiB, backward_base=20 * GiB)
    # Kept, the head's backward peaks at 24 - 4 + 10 = 30 GiB.
    assert plan_candidates(two, 100 * GiB)[0].peak == 30 * GiB
    fits = plan_for_budget(two, 25 * GiB)
    assert fits.fits and 5 * GiB <= fits.offload_bytes <= 6 * GiB + 512 * MiB
    out_of_reach = plan_for_budget(two, 23 * GiB)
    assert not out_of_reach.fits and out_of_reach.peak >= 24 * GiB  # all 10 GiB left, the head's peak lost only 6


def test_copies_fetched_ahead_into_the_heads_freed_room_add_nothing_to_the_blocks_backward() -> None:
    """The blocks' backward counts the head's saved bytes, which backward has used and freed by then: the engine
    fetches copies ahead into that room, so a prefetch no larger than the head adds nothing there; one larger adds the
    rest."""
    flat = dict(resident=0, head_peak=20 * GiB, backward_base=30 * GiB, prefetch_bytes=2 * GiB)
    large_head = profile(**flat, head_bytes=2 * GiB)
    small_head = profile(**flat, head_bytes=512 * MiB)
    budget = 35 * GiB  # the blocks' backward, at 30 + 1.5 + eligible, is the peak
    for prof, extra in ((large_head, 0), (small_head, 2 * GiB - 512 * MiB)):
        plan = plan_for_budget(prof, budget)
        assert plan.fits and plan.offload_bytes > 0
        kept = eligible_bytes(prof, plan.checkpoint_blocks) - plan.offload_bytes
        rebuilt = int(1.5 * GiB) if plan.checkpoint_blocks else 0
        assert plan.peak == 30 * GiB + rebuilt + kept + extra


def test_forwards_own_peak_bounds_the_plan_where_it_is_the_highest() -> None:
    """A measured forward peak above the loss's backward (a small loss, a large forward transient) is counted with
    every activation kept before the head; offloading lowers it only by what left before it."""
    flat = dict(head_bytes=256 * MiB, head_peak=30 * GiB, backward_base=20 * GiB - 256 * MiB)
    high = profile(**flat, forward_peak=32 * GiB)
    assert plan_candidates(high, 100 * GiB)[0].peak == 32 * GiB
    low = profile(**flat, forward_peak=29 * GiB)
    assert plan_candidates(low, 100 * GiB)[0].peak == 30 * GiB
    plan = plan_for_budget(high, 27 * GiB)
    assert plan.fits and plan.peak <= 27 * GiB
    assert plan_for_budget(low, 27 * GiB).extra_ms <= plan.extra_ms  # 2 GiB more to lower, at no lower cost


def test_checkpoints_the_fewest_blocks_when_offloading_would_stall() -> None:
    """8 GiB must leave: forward hides only ~3.9 GiB, so offloading it all means forward waits for the link; the
    plan checkpoints a few blocks (10 ms each) and offloads what hides."""
    budget = 22 * GiB
    plan = plan_for_budget(profile(), budget)
    assert plan.fits and plan.peak <= budget
    assert 0 < plan.checkpoint_blocks < 10 and plan.offload_bytes > 0
    only_offload = plan_for_budget(profile(blocks=0), budget)
    assert only_offload.fits and only_offload.extra_ms > plan.extra_ms
    assert plan_for_budget(profile(), budget) == plan  # deterministic
    # One block fewer does not hide: the plan is the cheapest, not merely a fitting one.
    assert plan.extra_ms < (plan.checkpoint_blocks - 1) * 10.0 + only_offload.extra_ms


def test_no_plan_offloads_more_than_the_host_can_hold() -> None:
    """3.5 GiB would leave with nothing checkpointed (and hide); a host that holds 2 GiB of buffers takes at most 8/9
    of that in copies (size classes pad by up to an eighth), so the plan checkpoints blocks to make up the rest."""
    budget = 27 * GiB
    unbounded = plan_for_budget(profile(), budget)
    assert unbounded.checkpoint_blocks == 0 and unbounded.offload_bytes > 3 * GiB
    plan = plan_for_budget(profile(host_bytes=2 * GiB), budget)
    assert plan.fits and plan.peak <= budget and plan.checkpoint_blocks > 0
    assert plan.offload_bytes <= 2 * GiB * 8 // 9
    assert all(c.offload_bytes <= 2 * GiB * 8 // 9 for c in plan_candidates(profile(host_bytes=2 * GiB), budget))
    nothing_fits = plan_candidates(profile(host_bytes=2 * GiB, blocks=0), budget)
    assert not nothing_fits[0].fits  # offloading alone cannot get there without the host


def test_no_blocks_means_offload_only_with_forward_waiting_for_the_link() -> None:
    plan = plan_for_budget(profile(blocks=0), budget=22 * GiB)
    assert plan.checkpoint_blocks == 0 and plan.fits
    assert plan.offload_bytes >= 8 * GiB and plan.inflight_cap == 512 * MiB
    assert plan.extra_ms > 0


def test_an_impossible_budget_returns_the_most_frugal_plan_marked_as_not_fitting() -> None:
    """Weights and transients alone (20 GiB) exceed the budget: nothing fits, the plan says so."""
    plan = plan_for_budget(profile(), budget=19 * GiB)
    assert not plan.fits
    # Every block checkpointed (10 inputs of 64 MiB stay saved) and all of that but the tail offloaded.
    assert (plan.checkpoint_blocks, plan.offload_bytes) == (10, 10 * 64 * MiB - 256 * MiB)
    assert (plan.inflight_cap, plan.prefetch_cap) == (256 * MiB, 256 * MiB)  # little in flight either way
    assert plan.peak > 19 * GiB
    assert "does NOT fit" in plan.describe(19 * GiB)


def test_the_most_frugal_plans_bounds_shrink_with_a_small_budget() -> None:
    """Copies on their way count at the peak: under a budget of a few GiB the most frugal plan keeps at most 1/32 of
    it in flight and as much fetched ahead (not the 256 MiB each of a large budget)."""
    assert (frugal_cap(64 * GiB), frugal_cap(2 * GiB), frugal_cap(1 << 20)) == (256 * MiB, 64 * MiB, 1 << 20)
    plan = plan_for_budget(profile(), budget=1 * GiB)
    assert not plan.fits and (plan.inflight_cap, plan.prefetch_cap) == (32 * MiB, 32 * MiB)


def test_a_user_fixed_inflight_bound_is_kept_by_every_plan() -> None:
    plan = plan_for_budget(profile(inflight_fixed=True), budget=27 * GiB)
    assert plan.fits and plan.inflight_cap == 512 * MiB


def test_offload_model_relief_and_cost() -> None:
    """Unbounded copies: the peak drops by what the link moved during forward, at no cost while backward hides the
    way back. Throttled: the peak drops by all but the cap, and forward waits for the link beyond its own pace."""
    model = OffloadModel(profile(), eligible=10 * GiB)
    hidden = int(HIDDEN_SHARE * 100.0 * 50 * MiB)
    small = model.unbounded(2 * GiB)
    assert (small.relief, small.cost_ms, small.inflight_cap) == (2 * GiB - 512 * MiB, 0.0, None)
    assert model.unbounded(6 * GiB).relief <= hidden  # the rest is still on its way out at the peak
    throttled = model.throttled(6 * GiB, 512 * MiB)
    assert throttled.relief == 6 * GiB - 512 * MiB - 512 * MiB  # the cap in flight, and a prefetch at the peak
    # 5.5 GiB over the link take 112.6 ms; forward saves the 6 GiB in 60 ms of its 100: it waits 52.6 ms.
    assert throttled.cost_ms == pytest.approx((6 * GiB - 512 * MiB) / (50 * MiB) - 60.0)
    # Bringing 9 GiB back takes 184 ms, more than backward (200 ms) hides at 80%: 24 ms show.
    assert model.unbounded(9 * GiB).cost_ms == pytest.approx(9 * 1024 / 50 - 160.0)


def _trial_profile(forward_ms: float = 100.0, backward_ms: float = 150.0) -> StepProfile:
    return StepProfile(
        peak=0, resident=0, eligible=0, forward_ms=forward_ms, link_bytes_per_ms=1.0, backward_ms=backward_ms
    )


def _plan(blocks: int, offload_gib: float, extra_ms: float, fits: bool = True) -> Plan:
    return Plan(int(offload_gib * GiB), blocks, 10 * GiB, extra_ms, fits)


def test_trial_plans_compare_the_cheapest_with_the_cheapest_without_copies_and_one_between() -> None:
    """One plan per number of checkpointed blocks, as ``plan_candidates`` lists them: the cheapest by the model
    offloads; the cheapest without copies checkpoints 8 blocks; halfway (4 or 5: the cheaper) is timed too; plans that
    do not fit or cost more than half a step over the cheapest are not; the most bytes offloaded come first."""
    profile = _trial_profile()  # a step of 250 ms: the band is 125 ms over the cheapest
    candidates = [
        _plan(0, 9.0, 20.0, fits=False),
        _plan(1, 7.0, 15.0),
        _plan(2, 6.0, 18.0),
        _plan(4, 3.0, 30.0),
        _plan(5, 2.0, 33.0),
        _plan(8, 0.0, 50.0),
        _plan(9, 0.0, 55.0),
        _plan(16, 0.0, 200.0),
    ]
    chosen = trial_plans(profile, candidates)
    assert [(p.checkpoint_blocks, p.offload_bytes) for p in chosen] == [(1, 7 * GiB), (4, 3 * GiB), (8, 0)]


def test_trial_plans_where_every_plan_offloads_add_the_one_with_the_fewest_copies() -> None:
    profile = _trial_profile()
    candidates = [_plan(0, 4.0, 5.0), _plan(2, 3.0, 20.0), _plan(4, 1.0, 40.0), _plan(6, 0.5, 400.0)]
    chosen = trial_plans(profile, candidates)
    assert [p.checkpoint_blocks for p in chosen] == [0, 4]  # 6 blocks cost more than half a step over the cheapest


def test_trial_plans_compare_nothing_where_keeping_everything_fits_or_nothing_fits() -> None:
    profile = _trial_profile()
    keep = _plan(0, 0.0, 0.0)
    assert trial_plans(profile, [keep, _plan(1, 0.0, 10.0)]) == [keep]
    assert trial_plans(profile, [_plan(0, 1.0, 5.0, fits=False), _plan(4, 0.5, 40.0, fits=False)]) == []


def _small_vocab(**changes: float) -> StepProfile:
    """A long-context step whose blocks' backward is the peak (no loss transient to speak of): 2 GiB of weights and
    state, 10 blocks of 1 GiB, each whole-checkpointed saving 64 MiB; by its parts (attention, MLP, norms) a block
    saves 256 MiB and rebuilds at most its 0.6 GiB MLP."""
    flat = dict(head_bytes=16 * MiB, head_peak=12 * GiB, backward_base=12 * GiB - 16 * MiB)
    values: dict = dict(peak=12 * GiB, split_input_bytes=256 * MiB, part_bytes=int(0.6 * GiB), **flat)
    values.update(changes)
    return profile(**values)


def test_checkpointing_by_parts_is_the_last_candidate_and_rebuilds_one_part_at_a_time() -> None:
    """Whole-block plans rebuild 1.5 GiB (a block and half again for its gradients); by parts, 0.9 GiB (the largest
    part), and each block saves its parts' inputs (more to offload)."""
    p = _small_vocab()
    candidates = plan_candidates(p, 100 * GiB)
    assert len(candidates) == 12 and not any(c.split for c in candidates[:11])
    whole, parts = candidates[10], candidates[11]
    assert (parts.checkpoint_blocks, parts.split, whole.split) == (10, True, False)
    # Kept everything (a generous budget), the blocks' backward is the peak: by parts, each block saves 192 MiB more,
    # and the block rebuilt is 0.4 GiB smaller (half again for its gradients).
    assert eligible_bytes(p, 10, split=True) - eligible_bytes(p, 10) == 10 * 192 * MiB
    assert split_relief(p) == pytest.approx(1.5 * 0.4 * GiB, abs=1)
    assert parts.peak - whole.peak == 10 * 192 * MiB - split_relief(p)
    eligible = eligible_bytes(p, 10)
    assert _phase_peaks(p, 10, eligible).blocks - _phase_peaks(p, 10, eligible, split=True).blocks == split_relief(p)
    assert "by their parts" in parts.describe(100 * GiB)
    assert len(plan_candidates(_small_vocab(part_bytes=0), 100 * GiB)) == 11  # not measured: no such plan
    assert len(plan_candidates(_small_vocab(split_input_bytes=0), 100 * GiB)) == 11


def test_a_budget_only_checkpointing_by_parts_meets_chooses_it() -> None:
    """Every block checkpointed whole and every input offloaded still rebuilds a whole block over the budget: the plan
    checkpoints by parts and offloads their inputs. Where a whole-block plan fits, it is cheaper (fewer copies)."""
    p = _small_vocab()
    whole_floor = plan_candidates(p, 100 * GiB)[10]
    budget = whole_floor.peak - 10 * 64 * MiB  # below even offloading every whole-block input
    plan = plan_for_budget(p, budget)
    assert plan.split and plan.fits and plan.checkpoint_blocks == 10 and plan.peak <= budget
    assert plan.offload_bytes >= 10 * 256 * MiB - p.tail - 512 * MiB
    loose = plan_for_budget(p, whole_floor.peak + GiB)
    assert loose.fits and not loose.split


def test_trial_plans_prefer_whole_blocks_to_parts_for_the_fewest_copies() -> None:
    profile = _trial_profile()
    parts = replace(_plan(6, 1.0, 60.0), split=True)
    candidates = [_plan(0, 4.0, 5.0), _plan(4, 1.0, 40.0), _plan(6, 0.5, 50.0), parts]
    chosen = trial_plans(profile, candidates)
    assert [(p.checkpoint_blocks, p.split) for p in chosen] == [(0, False), (6, False)]
    only_parts = trial_plans(profile, [_plan(6, 0.5, 50.0, fits=False), parts])
    assert only_parts == [parts]


def test_light_blocks_are_candidates_only_where_what_they_keep_was_measured() -> None:
    """Every (checkpointed, light) pair is a candidate once a block's kept bytes are known: 11 whole-block plans (the
    k-th checkpointing k blocks) and, for k checkpointed blocks, 10 - k light counts after them. With nothing under
    the budget, the most frugal plan is every block checkpointed whole, not one with light blocks."""
    assert not any(c.light_blocks for c in plan_candidates(profile(), 26 * GiB))
    candidates = plan_candidates(profile(kept_bytes=384 * MiB), 26 * GiB)
    assert len(candidates) == 11 + sum(10 - k for k in range(10))
    assert [(c.checkpoint_blocks, c.light_blocks) for c in candidates[:11]] == [(k, 0) for k in range(11)]
    assert all(c.light_blocks for c in candidates[11:])
    frugal = plan_for_budget(profile(kept_bytes=384 * MiB), GiB)
    assert not frugal.fits and (frugal.checkpoint_blocks, frugal.light_blocks) == (10, 0)
    # A light block keeps as much as a block less what it can give up, so keeping 1 GiB or more gives no such plan.
    assert not any(c.light_blocks for c in plan_candidates(profile(kept_bytes=GiB - 64 * MiB), 26 * GiB))


def test_light_blocks_hold_what_they_keep_on_the_device_and_cost_a_share_of_their_recompute() -> None:
    """Against the same number of blocks checkpointed whole, light blocks peak higher by what they keep (offloading
    never reaches it) and cost ELEMENTWISE_SHARE of the recompute."""
    p = profile(kept_bytes=384 * MiB)
    for j in (1, 4, 10):
        light = _candidate(p, 100 * GiB, 0, light=j)
        whole = _candidate(p, 100 * GiB, j)
        assert light.peak - whole.peak == j * 384 * MiB
        assert light.extra_ms == pytest.approx(ELEMENTWISE_SHARE * whole.extra_ms)
        assert eligible_bytes(p, 0, light=j) == eligible_bytes(p, j)  # both save their input where offloading sees it
    # Under a budget, the kept bytes stay: offloading must relieve as much as with no light block, plus them.
    tight = _candidate(p, 22 * GiB, 0, light=10)
    assert tight.offload_bytes >= 10 * (64 + 384) * MiB + 20 * GiB - 22 * GiB + GiB - 10 * 384 * MiB - p.tail


def test_a_budget_that_offloading_cannot_meet_cheaply_is_met_by_light_blocks() -> None:
    """A slow link (5 MiB/ms: forward hides ~0.4 GiB) and 4 GiB to save, 5 with the block rebuilt in backward: light
    blocks give up 576 MiB each at 1.5 ms, whole blocks 960 MiB at 10 ms; the plan recomputes the elementwise
    operations of 9 blocks, and the trials time it against the cheapest plan without them."""
    p = profile(kept_bytes=384 * MiB, link_bytes_per_ms=5 * MiB)
    budget = 26 * GiB
    plan = plan_for_budget(p, budget)
    assert plan.fits and plan.peak <= budget
    assert plan.light_blocks == 9 and plan.checkpoint_blocks == 0 and plan.offload_bytes == 0
    assert plan.extra_ms == pytest.approx(9 * ELEMENTWISE_SHARE * 10.0)
    assert "recompute the elementwise operations of 9 block(s)" in plan.describe(budget)
    chosen = trial_plans(p, plan_candidates(p, budget))
    assert plan in chosen and any(not c.light_blocks for c in chosen)


def test_trial_plans_time_the_plans_with_light_blocks_and_those_without_as_two_families() -> None:
    """The cheapest plan and the cheapest without copies of each family (light blocks priced by an estimate that can
    be off by more than the band between them), with the halfway plan of the plans without light blocks."""
    profile = _trial_profile()
    light = [replace(_plan(0, 1.0, 4.0), light_blocks=12), replace(_plan(0, 0.0, 9.0), light_blocks=16)]
    whole = [_plan(1, 7.0, 15.0), _plan(4, 3.0, 30.0), _plan(8, 0.0, 50.0)]
    chosen = trial_plans(profile, [*whole, *light])
    shapes = [(p.checkpoint_blocks, p.light_blocks, p.offload_bytes) for p in chosen]
    assert shapes == [(1, 0, 7 * GiB), (4, 0, 3 * GiB), (0, 12, GiB), (0, 16, 0), (8, 0, 0)]


def test_blocks_run_in_full_hold_their_weight_casts_beyond_those_the_measured_step_held() -> None:
    """A plan's peak holds 200 MiB of weight casts per block it runs in full, less the one block the measured step ran
    in full (its peak held that block's); blocks checkpointed, whole or light, hold none. Under a budget, offloading
    cannot relieve them, so the plan offloads more."""
    casts = 200 * MiB
    plain, cast = profile(kept_bytes=384 * MiB), profile(kept_bytes=384 * MiB, cast_bytes=casts, cast_blocks=1)
    for k, light in ((0, 0), (3, 0), (3, 4), (9, 0), (10, 0), (0, 10)):
        held = max(0, 10 - k - light - 1) * casts
        assert held_casts(cast, k, light) == held
        with_casts, without = _candidate(cast, 100 * GiB, k, light=light), _candidate(plain, 100 * GiB, k, light=light)
        assert with_casts.peak - without.peak == held
    tight, loose = _candidate(cast, 25 * GiB, 2), _candidate(plain, 25 * GiB, 2)
    assert tight.fits and loose.fits and tight.offload_bytes > loose.offload_bytes


def test_autocasts_cache_held_every_cast_through_forward_so_only_later_phases_hold_them_for_blocks_in_full() -> None:
    """With autocast's cache on, the measured forward held every block's casts already: forward's phase is unchanged,
    the head's backward and the blocks' backward hold the casts of the blocks a plan runs in full."""
    two = dict(forward_peak=29 * GiB, head_bytes=256 * MiB, head_peak=30 * GiB, backward_base=27 * GiB)
    base = profile(**two)
    for cached in (False, True):
        cast = profile(**two, cast_bytes=200 * MiB, cast_blocks=1, casts_cached=cached)
        phases = zip(_candidate(cast, 100 * GiB, 0).phases, _candidate(base, 100 * GiB, 0).phases, strict=True)
        extra = [a - b for a, b in phases]
        assert extra == [0 if cached else 9 * 200 * MiB, 9 * 200 * MiB, 9 * 200 * MiB, 0]
