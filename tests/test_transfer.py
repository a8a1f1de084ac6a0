"""How the streamed transfer times whole steps for the memory-budget planner's trials, on simulated streams."""

from __future__ import annotations

import pytest

from lightning_offload.streams import SimulatedStreams
from lightning_offload.transfer import StreamedTransfer


def test_a_step_is_timed_from_its_start_mark_to_the_next_only_when_asked() -> None:
    """Every step marks its start; the step before is timed (start to start, whatever ran in between: compute,
    copies, idle time) only when the planner asks, and a step after a failed one is not timed."""
    sim = SimulatedStreams(lag=0)
    transfer = StreamedTransfer(sim, measure_copies=False)
    assert transfer.step_began(time_last=True) == 0.0  # no step before the first
    sim.advance(12.5)
    assert transfer.step_began(time_last=False) == 0.0  # not asked: no time, no wait
    sim.advance(7.0)
    assert transfer.step_began(time_last=True) == pytest.approx(7.0)
    sim.advance(3.0)
    transfer.discard()  # the step raised: its mark is gone
    assert transfer.step_began(time_last=True) == 0.0
