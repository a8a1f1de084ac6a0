"""The simulated copy streams: copies wait in order and run when waited for (or once ``lag`` operations queue)."""

from __future__ import annotations

import torch

from lightning_offload.streams import SimulatedStreams


def test_copy_runs_only_when_waited_for_and_reads_its_source_then() -> None:
    """A queued copy reads its source when it runs, like a device copy: a write queued before that lands in it."""
    sim = SimulatedStreams(lag=None)
    src, dst = torch.ones(4), torch.zeros(4)
    sim.copy(dst, src, sim.d2h)
    done = sim.record(sim.d2h)
    assert not done.query() and torch.equal(dst, torch.zeros(4))
    src.mul_(3)  # the race a device copy would lose
    sim.wait_event(sim.current(), done)  # the host (compute stream) waits: the copy runs now
    assert done.query()
    assert torch.equal(dst, torch.full((4,), 3.0))
    assert sim.log == [("d2h", 16)]


def test_lag_runs_older_operations_as_newer_ones_queue() -> None:
    sim = SimulatedStreams(lag=1)
    dsts = [torch.zeros(2) for _ in range(3)]
    for dst in dsts:
        sim.copy(dst, torch.ones(2), sim.d2h)
    assert [bool(d.sum()) for d in dsts] == [True, True, False]  # one operation may stay queued
    assert sim.max_queued_bytes["d2h"] == 16  # two copies of 8 bytes were queued at once, at most


def test_a_stream_waiting_on_another_runs_after_it() -> None:
    """A host -> device copy that waits for the device -> host copy of the same buffer reads the finished bytes."""
    sim = SimulatedStreams(lag=None)
    src, host, back = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    sim.copy(host, src, sim.d2h)
    out_done = sim.record(sim.d2h)
    sim.wait_event(sim.h2d, out_done)
    sim.copy(back, host, sim.h2d)
    in_done = sim.record(sim.h2d)
    in_done.synchronize()
    assert torch.equal(back, src)
    assert sim.log == [("d2h", 16), ("h2d", 16)]
    assert out_done.query()


def test_clock_advances_with_copies_and_compute() -> None:
    sim = SimulatedStreams(lag=None, bytes_per_ms=8.0)
    begin = sim.record(sim.current(), timing=True)
    sim.advance(2.0)
    sim.copy(torch.zeros(4), torch.ones(4), sim.d2h)  # 16 bytes at 8 per ms: 2 ms once it runs
    end = sim.record(sim.d2h, timing=True)
    assert begin.elapsed_time(end) == 4.0
