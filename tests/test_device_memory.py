"""The allocator's cache emptied once where the first steps left it holding far more than a step needs, on the CPU with
counters faked (the GPU tests check the engine's on an H200)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_offload import OffloadEngine, OffloadOptions
from lightning_offload.device_memory import DeviceMemory, SettledCache, cache_worth_emptying

GiB = 1 << 30


class Counters:
    """Allocator counters a test sets by hand; ``release_cache`` returns what is reserved past what is allocated."""

    def __init__(self, peak: int, reserved: int, limit: int | None = 100 * GiB, allocated: int = 0) -> None:
        self.peak_bytes, self.reserved_bytes, self.allocated_bytes = peak, reserved, allocated
        self._limit = limit
        self.releases = self.resets = 0

    def peak(self) -> int:
        return self.peak_bytes

    def reserved(self) -> int:
        return self.reserved_bytes

    def total(self) -> int:
        return 100 * GiB

    def limit(self) -> int:
        assert self._limit is not None
        return self._limit

    def reset_peak(self) -> None:
        self.resets += 1

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


def _steps(settling: SettledCache, memory: Counters, count: int, optimizer: bool = True) -> list[bool]:
    """``count`` steps of an engine: an install (whether it emptied the cache), a backward, an optimizer step."""
    emptied = []
    for _ in range(count):
        emptied.append(settling.step_begins())
        settling.backward_finished()
        if optimizer:
            settling.optimizer_stepped()
    return emptied


def test_the_installs_after_the_first_two_optimizer_steps_empty_the_cache_where_far_more_is_held() -> None:
    """The first step peaks at 10 GiB and leaves 13 GiB reserved: the install after its optimizer step empties the
    cache. The second leaves 13 GiB again: the next install empties it too. Later installs never read the counters,
    whatever they hold; the first install reset the peak counter (earlier work must not stand for the engine's peak)."""
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    settling = SettledCache(memory)
    assert _steps(settling, memory, 2) == [False, True]
    assert memory.resets == 1 and memory.releases == 1
    memory.reserved_bytes = 13 * GiB
    memory.peak_bytes = 4 * GiB  # a caller's reset after the backward: the peak its backward ended with still counts
    assert _steps(settling, memory, 1) == [True] and settling.settled
    memory.reserved_bytes = 20 * GiB
    assert _steps(settling, memory, 3) == [False] * 3
    assert memory.releases == settling.releases == 2


def test_gradient_accumulation_is_checked_after_the_optimizer_steps_not_after_each_micro_batch() -> None:
    """Four micro-batches per optimizer step: the installs before the first optimizer step never read the counters
    (the optimizer's state, which shapes the layout, is not there yet); the first install after it does."""
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    settling = SettledCache(memory)
    emptied = []
    for _ in range(3):
        emptied += _steps(settling, memory, 3, optimizer=False)
        emptied += _steps(settling, memory, 1)
        memory.reserved_bytes = 13 * GiB
    assert emptied == [False] * 4 + [True] + [False] * 3 + [True] + [False] * 3
    assert settling.settled


def test_a_layout_that_settled_after_the_first_step_is_emptied_only_once() -> None:
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    settling = SettledCache(memory)
    assert _steps(settling, memory, 2) == [False, True]
    memory.reserved_bytes = int(10.5 * GiB)  # the second step mapped what it needed, no more
    assert _steps(settling, memory, 3) == [False] * 3
    assert memory.releases == 1


def test_a_loop_without_a_torch_optimizer_is_never_checked() -> None:
    memory = Counters(peak=10 * GiB, reserved=13 * GiB)
    settling = SettledCache(memory)
    assert _steps(settling, memory, 5, optimizer=False) == [False] * 5 and memory.releases == 0


@pytest.mark.parametrize(("reserved", "limit", "budget"), [(10.5, 100, None), (13, 11, None), (13, 100, 11)])
def test_the_cache_is_left_alone_where_it_holds_little_more_than_the_peak_or_there_is_no_room(
    reserved: float, limit: int, budget: int | None
) -> None:
    """10.5 GiB reserved for a 10 GiB peak is not worth it; an 11 GiB cap, or an 11 GiB budget given without planning,
    leaves no room for a layout mapped afresh."""
    memory = Counters(peak=10 * GiB, reserved=int(reserved * GiB), limit=limit * GiB)
    settling = SettledCache(memory, budget * GiB if budget is not None else None)
    assert _steps(settling, memory, 4) == [False] * 4
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
    ("options", "optimizer", "expected"),
    [
        ({"memory_budget": None}, True, [0, 1, 1, 1, 1]),
        ({"memory_budget": None}, False, [0] * 5),
        ({"memory_budget": None, "mode": "off"}, True, [0] * 5),
        ({"memory_budget": 50 * GiB}, True, [1, 1, 1, 1, 1]),
    ],
)
def test_an_engine_that_does_not_plan_empties_the_cache_after_its_first_optimizer_step(
    options: dict, optimizer: bool, expected: list[int]
) -> None:
    """Hand-tuned offloading (no memory budget) empties the cache as it installs after its first optimizer step, where
    the step before left it holding far more than it peaked at (and would again after the second, had that one too).
    Without a torch optimizer it never reads the counters; counting only (``mode="off"``) leaves the allocator alone;
    under a budget the planner decides: its first step begins in an emptied cache (what the process cached before is
    not its layout), and these counters stay where that left them, so its kept plan's first step finds nothing to
    empty."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    memory.allocated = lambda: memory.allocated_bytes  # type: ignore[attr-defined]
    memory.alloc_retries = lambda: 0  # type: ignore[attr-defined]
    engine = OffloadEngine(
        # No resident tail: this small model's forward would otherwise stay wholly on the device (and be said to).
        OffloadOptions.create("test", compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0, **options),
        model=model,
        memory=memory,
    )
    released = []
    for _ in range(5):
        with engine:
            loss = model(torch.randn(8, 64)).sum()
        loss.backward()
        if optimizer:
            sgd.step()
        released.append(memory.releases)
    engine.close()
    assert released == expected


def test_a_compiled_model_under_a_budget_given_empties_the_cache_only_where_the_budget_has_room() -> None:
    """A compiled model is not planned, and under a budget the user gave it offloads without planning, as a manual
    override does: that budget still bounds the room for a layout mapped afresh. 10 GiB peak, 13 GiB reserved, an
    11 GiB budget: no room, the cache is left alone (with a 50 GiB budget it is emptied)."""
    torch._dynamo.reset()
    released = {}
    try:
        for budget in (11, 50):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
            model.compile(backend="eager")
            sgd = torch.optim.SGD(model.parameters(), lr=0.0)
            memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
            memory.allocated = lambda memory=memory: memory.allocated_bytes  # type: ignore[attr-defined, misc]
            given = budget * GiB
            options = OffloadOptions.create("test", compute_device="cpu", min_tensor_bytes=0, memory_budget=given)
            engine = OffloadEngine(options, model=model, memory=memory)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                for _ in range(3):
                    with engine:
                        loss = model(torch.randn(8, 64)).sum()
                    loss.backward()
                    sgd.step()
            engine.close()
            assert engine.planner is None and any("the model is compiled" in str(w.message) for w in said)
            released[budget] = memory.releases
    finally:
        torch._dynamo.reset()
    assert released[11] == 0
    assert released[50] > 0


def test_a_closed_engine_stops_listening_to_optimizer_steps() -> None:
    model = nn.Linear(64, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    memory = Counters(peak=10 * GiB, reserved=13 * GiB, allocated=4 * GiB)
    memory.allocated = lambda: memory.allocated_bytes  # type: ignore[attr-defined]
    engine = OffloadEngine(
        OffloadOptions.create(
            "test", compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0, memory_budget=None
        ),
        model=model,
        memory=memory,
    )
    with engine:
        loss = model(torch.randn(8, 64)).sum()
    loss.backward()
    engine.close()
    sgd.step()  # after close: not counted
    with engine:
        loss = model(torch.randn(8, 64)).sum()
    loss.backward()
    assert memory.releases == 0


def test_capacity_is_the_devices_total_under_the_process_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read without a GPU: the device's total and the fraction torch reports (1.0 unless the process set one)."""

    class Properties:
        total_memory = 80 * (1 << 30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.25, raising=False)
    assert DeviceMemory(torch.device("cuda", 0)).capacity() == 20 * (1 << 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert DeviceMemory(torch.device("cuda", 0)).capacity() == 80 * (1 << 30)
