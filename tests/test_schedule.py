"""The link model and the prefetch plan, as arithmetic (no streams needed): when copies must start and end."""

from __future__ import annotations

import itertools
import weakref

import pytest

from lightning_offload import offload_activations
from lightning_offload.copies import State
from lightning_offload.schedule import _SLACK, CopySchedule

MiB = 1 << 20
GiB = 1 << 30


class FakeCopy:
    """What the plan reads of a ``StorageCopy``: its position, size and whether it still needs fetching."""

    def __init__(self, end_pos: int, nbytes: int) -> None:
        self.end_pos, self.nbytes = end_pos, nbytes
        self.state, self.device, self.src = State.OFFLOADED, None, None


def _plan(copies: list[FakeCopy], ratio: float | None) -> list[float]:
    engine = offload_activations(compute_device="cpu")
    engine._schedule.ratio = ratio
    engine._fetch_queue = [weakref.ref(c) for c in copies]  # type: ignore[misc]
    engine._plan_prefetch()
    return engine._fetch_at


def test_plan_chains_copies_in_need_order() -> None:
    """A contiguous run of offloaded copies must start coming back early enough for the *last* of them: the copy
    stream serves them one after another. (The first version took ``min`` where ``max`` belongs and planned each copy
    as if the link were idle: budget-4G stalled 44 ms in backward on the H200.)"""
    n = 80 * MiB
    copies = [FakeCopy((i + 1) * n, n) for i in range(50)]  # 4 GB offloaded at the start of forward
    ratio = 4.0
    plan = _plan(copies, ratio)
    lead = ratio / 2 * _SLACK
    # The lowest copy needs only its own transfer time; each higher one adds the ones queued after it.
    assert plan[0] == pytest.approx(copies[0].end_pos + max(n * lead, 64 * MiB))
    assert plan[-1] == pytest.approx(copies[0].end_pos + sum(c.nbytes for c in copies) * lead)
    assert plan[-1] > 2 * copies[-1].end_pos  # far above the copy itself: the whole run must be under way
    assert all(a <= b for a, b in itertools.pairwise(plan))  # never asks a lower copy to start first


def test_plan_leaves_isolated_copies_for_late() -> None:
    """Copies far apart each need only their own lead (the floor or their transfer), not the others'."""
    n = 16 * MiB
    copies = [FakeCopy(i * GiB + n, n) for i in range(4)]
    plan = _plan(copies, ratio=2.0)
    for copy, start in zip(copies, plan, strict=True):
        assert start == pytest.approx(copy.end_pos + 64 * MiB)  # the floor dominates a 16 MiB copy


def test_plan_without_measurement_assumes_a_conservative_pace() -> None:
    """Before forward was timed, the plan still exists (pace assumed 4x the link), so nothing waits for a profile."""
    n = 64 * MiB
    plan = _plan([FakeCopy(n, n), FakeCopy(2 * n, n)], ratio=None)
    assert plan[1] == pytest.approx(n + 2 * n * 4.0 / 2 * _SLACK)


def test_prefetch_respects_the_plan_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies start in need order once backward reaches their planned start, and never more than ``prefetch_bytes``
    ahead of what backward used."""
    engine = offload_activations(compute_device="cpu", prefetch_bytes=200 * MiB)
    engine._cuda = True  # exercise the streamed path's bookkeeping; the fetch itself is stubbed
    fetched: list[int] = []

    def fake_fetch(copy: FakeCopy, on_demand: bool) -> object:
        fetched.append(copy.end_pos)
        copy.device = object()
        return copy.device

    monkeypatch.setattr(engine, "_fetch", fake_fetch)
    n = 80 * MiB
    copies = [FakeCopy((i + 1) * n, n) for i in range(10)]
    engine._schedule.ratio = 4.0
    engine._fetch_queue = [weakref.ref(c) for c in copies]  # type: ignore[misc]
    engine._plan_prefetch()
    engine._backward_pos = 100 * GiB  # backward far above: nothing due yet
    engine._prefetch()
    assert fetched == []
    engine._backward_pos = int(engine._fetch_at[-1])  # backward reached the top copy's planned start only
    engine._prefetch()
    assert fetched == [copies[-1].end_pos]
    engine._backward_pos = int(engine._fetch_at[-3])  # two more are due now, but the cap holds one back
    engine._prefetch()
    assert fetched == [copies[-1].end_pos, copies[-2].end_pos]  # 160 MiB ahead; a third would be 240 > 200
    copies[-1].device = None  # backward used the first one
    engine._prefetch()
    assert fetched == [copies[-1].end_pos, copies[-2].end_pos, copies[-3].end_pos]


def test_deadline_queues_copies_behind_each_other() -> None:
    """The link model: a copy issued while the link is busy finishes after the ones before it."""
    schedule = CopySchedule()
    assert schedule.deadline(0, MiB) is None  # no measurement yet: no deadline, the byte bound applies
    schedule.ratio = 3.0
    first = schedule.deadline(100 * MiB, 10 * MiB)
    second = schedule.deadline(101 * MiB, 10 * MiB)  # issued before the first is done
    assert first == pytest.approx(100 * MiB + 30 * MiB * _SLACK)
    assert second == pytest.approx(101 * MiB + (100 * MiB + 60 * MiB - 101 * MiB) * _SLACK)
    assert second > first
