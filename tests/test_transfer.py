"""The transfers: how the streamed one times whole steps for the memory-budget planner's trials, on simulated streams,
and how the sync one orders its copies after the last copy on a reused host buffer."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload.copies import StorageCopy
from lightning_offload.streams import SimulatedStreams
from lightning_offload.transfer import StreamedTransfer, SyncTransfer


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


def test_a_sync_copy_out_waits_for_the_last_copy_on_its_reused_buffer() -> None:
    """The pool is shared by every engine of the process: a buffer a streamed engine gave back (its graph dropped
    while its copy out was still queued) may go next to a sync engine. The sync copy waits for that copy first, or
    the late copy overwrites the bytes just saved (backward then got another step's activations)."""
    sim = SimulatedStreams(lag=None)
    buffer = torch.zeros(64, dtype=torch.uint8)
    sim.copy(buffer, torch.full((64,), 7, dtype=torch.uint8), sim.d2h)  # the streamed engine's copy, still queued
    ready = sim.record(sim.d2h)
    saved = torch.arange(64, dtype=torch.uint8)
    copy = StorageCopy(saved, StorageWeakRef(saved.untyped_storage()), 0, 64, None)
    assert SyncTransfer().copy_out(copy, buffer, ready) is None
    sim.synchronize()  # on a GPU the copy stream runs when it gets there, whatever the host did meanwhile
    assert torch.equal(buffer, saved)


def test_a_backward_that_raised_is_not_timed_into_the_next_one() -> None:
    """A backward that raises never reaches autograd's final callback (its end is never marked): the next backward
    is timed from its own start, not from the failed one's (which would count the optimizer, the next forward and
    whatever ran between them as backward compute, and halve the link model's backward pace)."""
    sim = SimulatedStreams(lag=0)
    transfer = StreamedTransfer(sim, measure_copies=False)
    transfer.backward_started(1 << 20)
    sim.advance(2.0)  # the failed backward ran this far, then raised: no backward_ended
    sim.advance(100.0)  # the user skipped the batch: the next forward and more
    transfer.backward_started(1 << 20)
    sim.advance(3.0)
    transfer.backward_ended()
    assert transfer.backward_ms() == pytest.approx(3.0)
    assert transfer.link.backward_ratio == pytest.approx((1 << 20) / 3.0 / transfer.link_rate)
