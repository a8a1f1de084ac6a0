"""The allocator's cache emptied once where the first steps left it holding far more than a step needs, on the CPU with
counters faked (the GPU tests check the engine's on an H200)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_offload import OffloadEngine, OffloadOptions
from lightning_offload.device_memory import SettledCache, cache_worth_emptying

GiB = 1 << 30


class Counters:
    """Allocator counters a test sets by hand; ``release_cache`` returns what is reserved past what is allocated."""

    def __init__(self, peak: int, reserved: int, limit: int | None = 100 * GiB, allocated: int = 0) -> None:
        self.peak_bytes, self.reserved_bytes, self.allocated_bytes = peak, reserved, allocated
        self._limit = limit
        self.releases = 0

    def peak(self) -> int:
        return self.peak_bytes

    def reserved(self) -> int:
        return self.reserved_bytes

    def total(self) -> int:
        return 100 * GiB

    def limit(self) -> int:
        assert self._limit is not None
        return self._limit

    def release_cache(self) -> None:
        self.releases += 1
        self.reserved_bytes = self.allocated_bytes


@pytest.mark.parametrize(
    ("reserved", "room", "expected"),
    [(12 * GiB, 100 * GiB, True), (11 * GiB, 100 * GiB, False), (12 * GiB, 11 * GiB, False), (12 * GiB, 0, False)],
)
def test_the_cache_is_worth_emptying_only_past_a_tenth_above_the_peak_and_with_room_for_a_fresh_layout(
    reserved: int, room: int, expected: bool
) -> None:
    """10 GiB peak: 12 GiB reserved is past 1.10x, 11 is not; a room of 11 GiB cannot hold a layout mapped afresh
    (1.15x the peak), and emptying there would make every step flush to fit."""
    assert cache_worth_emptying(reserved, 10 * GiB, room) is expected
    assert not cache_worth_emptying(reserved, 0, room)  # no peak read: nothing to compare with


def test_the_second_and_third_installs_empty_the_cache_where_the_steps_before_left_it_holding_far_more() -> None:
    """The first step peaks at 10 GiB (a caller resets the counters after it, so the check keeps what its backward
    ended with); 13 GiB stay reserved: the second install empties the cache. The second step leaves 13 GiB again: the
    third empties it too. Later installs never read the counters, whatever they hold."""
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    settling = SettledCache(memory)
    assert not settling.step_begins()
    settling.backward_finished()
    memory.peak_bytes = 4 * GiB  # the caller's reset after the step
    assert settling.step_begins() and memory.releases == 1
    memory.reserved_bytes = 13 * GiB
    assert settling.step_begins() and memory.releases == 2 and settling.settled
    memory.reserved_bytes = 20 * GiB
    for _ in range(3):
        assert not settling.step_begins()
    assert memory.releases == settling.releases == 2


def test_a_layout_that_settled_after_the_first_step_is_emptied_only_once() -> None:
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    settling = SettledCache(memory)
    assert [settling.step_begins() for _ in range(2)] == [False, True]
    memory.reserved_bytes = int(10.5 * GiB)  # the second step mapped what it needed, no more
    assert [settling.step_begins() for _ in range(3)] == [False] * 3
    assert memory.releases == 1


@pytest.mark.parametrize(("reserved", "limit"), [(10.5, 100), (13, 11)])
def test_the_cache_is_left_alone_where_it_holds_little_more_than_the_peak_or_the_cap_has_no_room(
    reserved: float, limit: int
) -> None:
    memory = Counters(peak=10 * GiB, reserved=int(reserved * GiB), limit=limit * GiB)
    settling = SettledCache(memory)
    assert [settling.step_begins() for _ in range(4)] == [False] * 4
    assert memory.releases == settling.releases == 0


def test_counters_without_a_cache_to_empty_are_left_alone() -> None:
    class PeakOnly:
        def peak(self) -> int:
            return GiB

        def total(self) -> int:
            return 100 * GiB

    settling = SettledCache(PeakOnly())
    assert [settling.step_begins() for _ in range(4)] == [False] * 4


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"memory_budget": None}, [0, 1, 1, 1, 1]),
        ({"memory_budget": None, "mode": "off"}, [0] * 5),
        ({"memory_budget": 50 * GiB}, [0, 0, 0, 1, 1]),
    ],
)
def test_an_engine_without_a_budget_empties_the_cache_after_its_first_step(options: dict, expected: list[int]) -> None:
    """Hand-tuned offloading (no memory budget) empties the cache as its second step begins where the first left it
    holding far more than it peaked at (and would again as the third begins, had the second too); counting only
    (``mode="off"``) leaves the allocator alone, and under a budget the planner decides: once, after its two measuring
    steps and its kept plan's first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    memory.allocated = lambda: memory.allocated_bytes  # type: ignore[attr-defined]
    memory.reset_peak = lambda: None  # type: ignore[attr-defined]
    memory.alloc_retries = lambda: 0  # type: ignore[attr-defined]
    engine = OffloadEngine(
        OffloadOptions.create("test", compute_device="cpu", min_tensor_bytes=0, **options), model=model, memory=memory
    )
    released = []
    for _ in range(5):
        with engine:
            loss = model(torch.randn(8, 64)).sum()
        loss.backward()
        released.append(memory.releases)
    assert released == expected
