"""The copy schedule: the link model and the prefetch plan, as arithmetic (plain numbers in, a plan out)."""

from __future__ import annotations

import itertools

import pytest

from lightning_offload.schedule import DEFAULT_RATIO, PREFETCH_FLOOR, SLACK, LinkModel, plan_prefetch

MiB = 1 << 20
GiB = 1 << 30


def test_plan_chains_copies_in_need_order() -> None:
    """A contiguous run of offloaded copies must start coming back early enough for the *last* of them: the copy
    stream serves them one after another. (Taking ``min`` where ``max`` belongs plans each copy as if the link were
    idle: backward then stalls on every copy after the first.)"""
    n = 80 * MiB
    ends = [(i + 1) * n for i in range(50)]  # 4 GB offloaded at the start of forward
    lead = 4.0 / 2 * SLACK
    plan = plan_prefetch(ends, [n] * 50, lead)
    # The lowest copy needs only its own transfer time; each higher one adds the ones queued after it.
    assert plan[0] == pytest.approx(ends[0] + max(n * lead, PREFETCH_FLOOR))
    assert plan[-1] == pytest.approx(ends[0] + 50 * n * lead)
    assert plan[-1] > 2 * ends[-1]  # far above the copy itself: the whole run must be under way
    assert all(a <= b for a, b in itertools.pairwise(plan))  # never asks a lower copy to start first


def test_plan_leaves_isolated_copies_for_late() -> None:
    """Copies far apart each need only their own lead (the floor or their transfer), not the others'."""
    n = 16 * MiB
    ends = [i * GiB + n for i in range(4)]
    plan = plan_prefetch(ends, [n] * 4, lead=2.0 / 2 * SLACK)
    assert plan == pytest.approx([end + PREFETCH_FLOOR for end in ends])  # the floor dominates a 16 MiB copy


def test_plan_skips_dead_copies() -> None:
    """A copy whose graph is gone plans to start at once (dropped when reached) and delays no other copy."""
    n = 64 * MiB
    plan = plan_prefetch([n, float("inf"), 3 * n], [n, 0, n], lead=1.0)
    assert plan[1] == float("inf")
    assert plan[0] == pytest.approx(n + max(n, PREFETCH_FLOOR))
    assert plan[2] == pytest.approx(3 * n + max(n, PREFETCH_FLOOR))


def test_link_model_without_measurement_assumes_a_conservative_pace() -> None:
    """Before forward was timed there are no deadlines (the byte bound applies) and the lead is the default's."""
    link = LinkModel()
    assert link.ratio is None
    assert link.deadline(0, MiB) is None
    assert link.backward_lead() == pytest.approx(DEFAULT_RATIO / 2 * SLACK)


def test_link_model_measures_and_smooths_the_pace() -> None:
    """The ratio is forward's saving rate over the link's, averaged with the previous measurement."""
    link = LinkModel()
    link.observe(saved_bytes=300 * MiB, forward_ms=10.0, link_bytes_per_ms=10 * MiB)
    assert link.ratio == pytest.approx(3.0)
    link.observe(saved_bytes=100 * MiB, forward_ms=10.0, link_bytes_per_ms=10 * MiB)
    assert link.ratio == pytest.approx(2.0)
    link.observe(saved_bytes=0, forward_ms=10.0, link_bytes_per_ms=10 * MiB)  # nothing saved: no information
    link.observe(saved_bytes=MiB, forward_ms=0.0, link_bytes_per_ms=10 * MiB)  # no time: no information
    assert link.ratio == pytest.approx(2.0)


def test_deadline_queues_copies_behind_each_other() -> None:
    """A copy issued while the link is busy finishes after the ones before it; a new forward finds the link idle."""
    link = LinkModel()
    link.ratio = 3.0
    first = link.deadline(100 * MiB, 10 * MiB)
    second = link.deadline(101 * MiB, 10 * MiB)  # issued before the first is done
    assert first == pytest.approx(100 * MiB + 30 * MiB * SLACK)
    assert second == pytest.approx(101 * MiB + (100 * MiB + 60 * MiB - 101 * MiB) * SLACK)
    assert second > first
    link.forward_started()
    assert link.deadline(0, 10 * MiB) == pytest.approx(30 * MiB * SLACK)


def test_a_plan_pace_replaces_what_the_link_model_learnt_and_stops_learning() -> None:
    """Under a memory-budget plan the link model runs on the measured step's paces: a forward with checkpointed
    blocks (or one slowed by pinning host memory) would otherwise teach it deadlines that come too early."""
    link = LinkModel()
    link.observe(saved_bytes=100 * MiB, forward_ms=1000.0, link_bytes_per_ms=10 * MiB)  # a slow first step
    link.use_pace(saved_bytes=400 * MiB, forward_ms=10.0, backward_ms=20.0, link_bytes_per_ms=10 * MiB)
    assert link.ratio == pytest.approx(4.0) and link.backward_ratio == pytest.approx(2.0)
    assert link.backward_lead() == pytest.approx(2.0 * SLACK)
    link.observe(saved_bytes=100 * MiB, forward_ms=100.0, link_bytes_per_ms=10 * MiB)
    link.observe_backward(saved_bytes=100 * MiB, backward_ms=100.0, link_bytes_per_ms=10 * MiB)
    assert link.ratio == pytest.approx(4.0) and link.backward_ratio == pytest.approx(2.0)  # frozen
