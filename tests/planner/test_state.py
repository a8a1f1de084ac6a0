"""An input's record carried as plain values (:mod:`lightning_offload.planner.state`): every field is either carried or
restarted, by name, so a field added to the record cannot be left behind silently."""

from __future__ import annotations

import dataclasses
import json

from lightning_offload.planner.inputs import InputRecord
from lightning_offload.planner.measure import MeasuredPeaks
from lightning_offload.planner.profile import BlockSizes, Plan, StepProfile
from lightning_offload.planner.state import RESTARTED, _record_from, _record_state
from lightning_offload.planner.trials import PlanTrials

GiB = 1 << 30


def _record() -> InputRecord:
    """A record that ran a plan after its trials timed two plans, with every field away from its default."""
    plan = Plan(GiB, 3, 5 * GiB, 12.5, True, inflight_cap=GiB // 2, split=True, light_blocks=1, phases=(1, 2, 3, 4))
    other = dataclasses.replace(plan, checkpoint_blocks=5, offload_bytes=0)
    profile = StepProfile(peak=6 * GiB, resident=GiB, eligible=2 * GiB, forward_ms=20.0, link_bytes_per_ms=1e7)
    trials = PlanTrials(enabled=True)
    for timed in (plan, other):  # each timed in turn, one step flushing the cache
        assert trials.choose(profile, [plan, other], memory=False)[0] == timed
        for ms in (30.0, 21.0, 22.0, 23.0 if timed is plan else 19.0):
            trials.count(timed, ms, pinned=False, flushed=ms == 23.0)
    assert trials.choose(profile, [plan, other], memory=False)[0] == other and trials.done
    assert not trials.count(other, 20.0, pinned=False, flushed=True)  # the kept plan's first planned step
    return InputRecord(
        trials,
        profile=StepProfile(
            peak=6 * GiB, resident=GiB, eligible=2 * GiB, forward_ms=20.0, link_bytes_per_ms=1e7, base=7
        ),
        plan=plan,
        measure_left=1,
        measured=2,
        frugal_next=True,
        full_block=BlockSizes(8, 7, GiB, GiB // 8, split=True, part_bytes=GiB // 2),
        peaks=MeasuredPeaks(base=1, peak=2, backward_peak=3, frugal=True),
        reserved_gap=123,
        base=456,
        settling=False,
        plan_since=9,
        plan_steps=(9, 10),
        slow_forward=(10, 3.5),
        lent=False,
    )


def test_every_field_of_an_input_record_is_carried_or_restarted_by_name() -> None:
    rec = _record()
    rec.measure_left = 0  # (a record still measuring is not carried)
    state = _record_state(rec)
    assert state is not None
    fields = {f.name for f in dataclasses.fields(InputRecord)}
    assert set(state) | set(RESTARTED) == fields and not set(state) & set(RESTARTED)

    back = _record_from(json.loads(json.dumps(state)), trials_enabled=True)
    for name in fields - set(RESTARTED) - {"trials"}:
        assert getattr(back, name) == getattr(rec, name), name
    # Every attribute of trials that ended comes back: one added to PlanTrials but not to its state fails here.
    assert rec.trials.done and vars(back.trials) == vars(rec.trials)
    for name, value in RESTARTED.items():
        assert getattr(back, name) == value, name


def test_a_record_still_measuring_or_lent_is_not_carried() -> None:
    rec = _record()
    assert _record_state(rec) is None  # one measuring step left
    rec.measure_left = 0
    assert _record_state(dataclasses.replace(rec, lent=True)) is None
