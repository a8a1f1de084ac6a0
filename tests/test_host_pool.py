"""The host buffer pool: size classes, reuse, the limit, and releasing idle memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_offload import HostMemoryFull, release_host_memory
from lightning_offload.host_pool import HostPool, size_class
from tests.models import make_engine, tanh_chain

KiB = 1 << 10
MiB = 1 << 20
BIG = 1 << 40  # a limit that never binds


def test_size_class_floor_is_64_kib() -> None:
    """Every request up to 64 KiB (zero included) gets the 64 KiB class."""
    for nbytes in (0, 1, 511, 4096, 64 * KiB):
        assert size_class(nbytes) == 64 * KiB


def test_size_classes_monotone_and_padding_bounded() -> None:
    """Classes never shrink as requests grow, always fit the request, and above 64 KiB pad at most 12.5%."""
    sizes = sorted(
        {*range(64 * KiB - 3, 64 * KiB + 5000, 37), *(int(1.0905**i) for i in range(100, 330))}
        | {(1 << p) + d for p in range(16, 36) for d in (-1, 0, 1)}
    )
    previous = 0
    for nbytes in sizes:
        cls = size_class(nbytes)
        assert cls >= nbytes
        assert cls >= previous
        if nbytes > 64 * KiB:
            assert cls - nbytes <= nbytes / 8, (nbytes, cls)
        previous = cls


def test_size_classes_eight_per_octave() -> None:
    """Between 1 MiB and 2 MiB there are exactly 8 classes, the top one being 2 MiB (powers of two are exact)."""
    classes = {size_class(n) for n in range(MiB + 1, 2 * MiB + 1, 997)} | {size_class(2 * MiB)}
    assert len(classes) == 8
    assert max(classes) == 2 * MiB
    assert size_class(4 * MiB) == 4 * MiB


def test_acquire_release_reuses_the_same_buffer() -> None:
    """A released buffer is handed out again for any request of its class; allocations stay flat."""
    pool = HostPool(pinned=False)
    buf, ready = pool.acquire(100 * KiB, BIG)
    assert ready is None
    assert buf.dtype == torch.uint8 and buf.numel() == size_class(100 * KiB)
    assert (pool.allocations, pool.reserved_bytes, pool.in_use_bytes) == (1, buf.numel(), buf.numel())
    pool.release(buf, None)
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == buf.numel()
    again, _ = pool.acquire(size_class(100 * KiB) - 5, BIG)  # same class, different request
    assert again.data_ptr() == buf.data_ptr()
    assert pool.allocations == 1
    other, _ = pool.acquire(100 * KiB, BIG)  # the class's only buffer is in use: a new one
    assert other.data_ptr() != again.data_ptr()
    assert pool.allocations == 2 and pool.in_use_bytes == 2 * buf.numel()


def test_limit_raises_host_memory_full() -> None:
    """A new buffer past the limit raises HostMemoryFull with the numbers; the failed request changes nothing."""
    pool = HostPool(pinned=False)
    pool.acquire(64 * KiB, 128 * KiB)
    pool.acquire(64 * KiB, 128 * KiB)
    with pytest.raises(HostMemoryFull) as info:
        pool.acquire(1, 128 * KiB)
    err = info.value
    assert (err.needed, err.held, err.limit) == (64 * KiB, 128 * KiB, 128 * KiB)
    assert err.available > 0
    assert "host_memory_limit" in str(err)
    assert (pool.allocations, pool.reserved_bytes, pool.in_use_bytes) == (2, 128 * KiB, 128 * KiB)


def test_capacity_is_the_limit_or_what_ram_allows() -> None:
    """What the pool could hold: its limit where RAM allows more, never more than it holds plus the RAM it may still
    take (the machine's available RAM past the headroom)."""
    pool = HostPool(pinned=False)
    pool.acquire(64 * KiB, 1 << 20)
    assert pool.capacity(1 << 20) == 1 << 20
    by_ram = pool.capacity(BIG)
    assert 64 * KiB < by_ram < BIG


def test_host_full_from_a_cpu_pool_says_device_not_gpu() -> None:
    """A pool of plain (CPU test mode) buffers raises HostMemoryFull for the CPU: its messages say "device"."""
    pool = HostPool(pinned=False)
    pool.acquire(64 * KiB, 64 * KiB)
    with pytest.raises(HostMemoryFull) as info:
        pool.acquire(64 * KiB, 64 * KiB)
    err = info.value
    assert err.device_type == "cpu"
    for mode in ("warn", "error"):
        assert "GPU" not in err.message(mode) and "on the device" in err.message(mode), err.message(mode)


@pytest.mark.parametrize(("device_type", "where"), [("cuda", "on the GPU"), ("cpu", "on the device")])
def test_host_full_message_depends_on_the_mode(device_type: str, where: str) -> None:
    """``on_host_full="error"`` (also ``str(err)``) suggests passing ``on_host_full='warn'``; ``"warn"`` says the
    tensors stay where they are and never tells the user to pass what they already passed."""
    err = HostMemoryFull(needed=128 * KiB, held=1 << 20, limit=1 << 20, available=8 << 30, device_type=device_type)
    error, warn = err.message("error"), err.message("warn")
    assert str(err) == error
    for text in (error, warn):
        assert "host_memory_limit=1048576 (1.00 MiB)" in text and "131072 bytes" in text, text
        assert where in text and ("GPU" in text) == (device_type == "cuda"), text
    assert "pass on_host_full='warn'" in error
    assert "pass on_host_full" not in warn and "stay on the" in warn and "on_host_full='warn'" in warn
    assert "raise host_memory_limit" in warn and "offload less" in warn


def test_limit_evicts_idle_buffers_of_other_classes() -> None:
    """When a new class would cross the limit, idle buffers of other classes are dropped to make room."""
    pool = HostPool(pinned=False)
    small, _ = pool.acquire(64 * KiB, 256 * KiB)
    pool.release(small, None)
    big, _ = pool.acquire(200 * KiB, 256 * KiB)  # 208 KiB class: fits only once the idle 64 KiB goes
    assert big.numel() == size_class(200 * KiB)
    assert pool.reserved_bytes == big.numel() == pool.in_use_bytes


def test_clear_drops_idle_buffers_only() -> None:
    """``clear`` frees idle buffers and leaves buffers in use with their owners."""
    pool = HostPool(pinned=False)
    held, _ = pool.acquire(64 * KiB, BIG)
    idle, _ = pool.acquire(128 * KiB, BIG)
    pool.release(idle, None)
    pool.clear()
    assert pool.reserved_bytes == pool.in_use_bytes == held.numel()
    pool.release(held, None)
    pool.clear()
    assert pool.reserved_bytes == 0


def test_release_host_memory_after_training_steps(cpu_pool: HostPool) -> None:
    """After steps finish, ``release_host_memory()`` frees the pool's idle buffers and reports their bytes; the next
    step allocates again."""
    engine = make_engine()
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        with engine:
            loss = tanh_chain(x, 4)[-1].sum()
        loss.backward()
    reserved = cpu_pool.reserved_bytes
    idle = reserved - cpu_pool.in_use_bytes
    assert idle >= 4 * 64 * KiB
    assert release_host_memory() == idle
    assert cpu_pool.reserved_bytes == reserved - idle
    assert release_host_memory() == 0
    with engine:
        loss = tanh_chain(x, 4)[-1].sum()
    loss.backward()
    assert engine.stats.host_allocations == 4


def test_engine_steady_state_allocates_nothing(cpu_pool: HostPool) -> None:
    """Steps of the same shapes reuse pooled buffers: allocations only in the first step, none held in between."""
    engine = make_engine()
    x = torch.randn(64, 64, requires_grad=True)
    allocations = []
    for _ in range(3):
        held = cpu_pool.in_use_bytes
        with engine:
            loss = tanh_chain(x, 5)[-1].sum()
        assert cpu_pool.in_use_bytes == held + 5 * 64 * KiB
        loss.backward()
        assert cpu_pool.in_use_bytes == held
        allocations.append(engine.stats.host_allocations)
    assert allocations == [5, 0, 0]


def test_a_request_that_cannot_fit_evicts_no_idle_buffer() -> None:
    """When even dropping every idle buffer leaves no room under the limit, none is dropped: with
    ``on_host_full="warn"`` a step of fixed shapes that hits the limit would otherwise free a buffer it needs later
    and pin it again, every step."""
    pool = HostPool(pinned=False)
    limit = 256 * KiB
    for _ in range(3):  # one step: 64 KiB, 128 KiB, 128 KiB (does not fit), 64 KiB
        first, _ = pool.acquire(64 * KiB, limit)
        big, _ = pool.acquire(128 * KiB, limit)
        with pytest.raises(HostMemoryFull):
            pool.acquire(128 * KiB, limit)
        last, _ = pool.acquire(64 * KiB, limit)
        for buffer in (first, big, last):
            pool.release(buffer, None)
    assert pool.allocations == 3  # the first step's buffers, reused by the next two
    assert pool.reserved_bytes == limit


def test_at_the_limit_an_idle_larger_buffer_gives_way_to_one_of_the_exact_class() -> None:
    """Where no new buffer fits under the limit, a request does not take an idle buffer of a larger class: that one
    is dropped for a buffer of the request's class, and the bytes it frees take later copies."""
    pool = HostPool(pinned=False)
    limit = MiB
    big, _ = pool.acquire(MiB, limit)
    pool.release(big, None)
    small, _ = pool.acquire(900 * KiB, limit)
    assert small.numel() == size_class(900 * KiB) < MiB
    assert (pool.allocations, pool.reserved_bytes) == (2, small.numel())


def test_host_memory_full_survives_pickling_and_copying() -> None:
    """An exception crosses processes pickled (``multiprocessing``, ``concurrent.futures``) and is copied by tools that
    re-raise it: rebuilt from its message alone, ``HostMemoryFull`` raised ``TypeError`` instead of arriving."""
    import copy
    import pickle

    err = HostMemoryFull(needed=3 << 20, held=1 << 20, limit=2 << 20, available=5 << 30, device_type="cpu")
    for clone in (pickle.loads(pickle.dumps(err)), copy.copy(err)):
        assert isinstance(clone, HostMemoryFull)
        assert (clone.needed, clone.held, clone.limit, clone.available) == (3 << 20, 1 << 20, 2 << 20, 5 << 30)
        assert clone.device_type == "cpu" and str(clone) == str(err)


def test_a_request_borrows_an_idle_buffer_of_up_to_twice_its_class() -> None:
    """With no idle buffer of its class, a request takes the smallest idle one of at most twice the class instead of
    pinning a new buffer; it counts in full while in use and returns to its own class."""
    pool = HostPool(pinned=False)
    larger, _ = pool.acquire(256 * KiB, BIG)
    largest, _ = pool.acquire(512 * KiB, BIG)
    pool.release(larger, None)
    pool.release(largest, None)
    borrowed, _ = pool.acquire(160 * KiB, BIG)
    assert borrowed.data_ptr() == larger.data_ptr()  # the smallest that serves, not the 512 KiB one
    assert (pool.allocations, pool.in_use_bytes) == (2, 256 * KiB)
    own, _ = pool.acquire(100 * KiB, BIG)  # 104 KiB class: 512 KiB is more than twice that, so a new buffer
    assert own.numel() == size_class(100 * KiB) and pool.allocations == 3
    pool.release(borrowed, None)
    again, _ = pool.acquire(256 * KiB, BIG)
    assert again.data_ptr() == larger.data_ptr() and pool.allocations == 3


def test_lending_stops_past_half_the_limit() -> None:
    """A larger buffer is lent only while what the pool holds and has lent, with the loan, stays within half its
    limit: a later request of the larger class then still finds room for a buffer of its own."""
    pool = HostPool(pinned=False)
    limit = 1536 * KiB
    first, _ = pool.acquire(256 * KiB, limit)
    second, _ = pool.acquire(256 * KiB, limit)
    pool.release(first, None)
    pool.release(second, None)
    lent, _ = pool.acquire(200 * KiB, limit)  # 512 held + 256 lent = 768 <= 1536 / 2: lent
    assert lent.numel() == 256 * KiB and pool.allocations == 2
    pool.acquire(512 * KiB, limit)  # 1024 held, 256 lent
    own, _ = pool.acquire(200 * KiB, limit)  # 1024 + 2 x 256 > 768: its own class
    assert own.numel() == size_class(200 * KiB) and pool.allocations == 4


def test_a_shorter_input_reuses_the_host_buffers_of_a_longer_one(cpu_pool: HostPool) -> None:
    """Steps at a shorter length (inputs whose length changes) pin no new host buffers while the longer length's
    idle ones are at most twice their size."""
    engine = make_engine()
    allocations = []
    for rows in (256, 160, 256, 100):
        x = torch.randn(rows, 256, requires_grad=True)  # rows KiB per saved tensor
        with engine:
            loss = tanh_chain(x, 4)[-1].sum()
        loss.backward()
        allocations.append(engine.stats.host_allocations)
    assert allocations == [4, 0, 0, 4]


def test_lending_reads_the_machines_memory_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two lengths that alternate, the shorter borrows at every saved tensor of every step: whether the machine
    has RAM to replace what is lent is read once a second, not at every loan (tens of microseconds each)."""
    from lightning_offload import host_pool

    pool = HostPool(pinned=False)
    buffers = [pool.acquire(256 * KiB, BIG)[0] for _ in range(50)]
    for buffer in buffers:
        pool.release(buffer, None)
    reads: list[int] = []
    spare = host_pool._ram_to_spare

    def counted() -> int:
        reads.append(1)
        return spare()

    monkeypatch.setattr(host_pool, "_ram_to_spare", counted)
    lent = [pool.acquire(200 * KiB, BIG)[0] for _ in range(50)]
    assert {buffer.numel() for buffer in lent} == {256 * KiB} and pool.allocations == 50
    assert len(reads) == 1


def test_lending_counts_what_the_pool_pinned_since_it_last_read_the_machines_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spare RAM read for lending may be up to a second old, but what the pool itself pinned since then is no
    longer spare: a buffer is not lent where the RAM left could not pin its replacement, so a later request of the
    larger class does not fail where buffers of the exact class would have fitted."""
    from lightning_offload import host_pool

    pool = HostPool(pinned=False)
    machine = 992 * KiB  # spare RAM with the pool empty: the pool's buffers take from it
    monkeypatch.setattr(host_pool, "_ram_to_spare", lambda: machine - pool.reserved_bytes)
    monkeypatch.setattr(host_pool, "time", SimpleNamespace(monotonic=lambda: 0.0))  # all within one second
    larger, _ = pool.acquire(256 * KiB, BIG)
    pool.release(larger, None)
    pool.release(pool.acquire(200 * KiB, BIG)[0], None)  # lent (RAM read now: 736 KiB spare)
    pool.acquire(512 * KiB, BIG)  # pinned since: 224 KiB spare, less than a replacement for the 256 KiB buffer
    small, _ = pool.acquire(200 * KiB, BIG)  # its own class (24 KiB spare after it)
    again, _ = pool.acquire(256 * KiB, BIG)  # the idle 256 KiB buffer serves it (lent: HostMemoryFull)
    assert small.numel() == size_class(200 * KiB) and pool.lent_bytes == 0
    assert again.data_ptr() == larger.data_ptr()


def test_past_half_its_limit_the_pool_lends_nothing() -> None:
    """A lent buffer wastes what it holds past the request, so close to the limit a run of requests can find the pool
    full where buffers of their own class would all have fitted (seven 144 KiB requests under 1 MiB, two idle 256 KiB
    buffers). Past half the limit (what it holds and has lent, with the loan) the pool lends nothing."""
    pool = HostPool(pinned=False)
    limit = MiB
    idle = [pool.acquire(256 * KiB, limit)[0] for _ in range(2)]
    for buffer in idle:
        pool.release(buffer, None)
    held = [pool.acquire(144 * KiB, limit)[0] for _ in range(7)]
    assert {buffer.numel() for buffer in held} == {size_class(144 * KiB)}
    assert pool.lent_bytes == 0


def test_a_copy_freed_by_the_garbage_collector_while_the_pool_is_busy_gives_its_buffer_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph caught in a reference cycle (a user's object holding an output whose graph refers back to it) is freed
    only by the garbage collector, which runs at whatever allocation comes next: also one the pool makes while it holds
    its lock. The copy's finalizer then gives its buffer back to the same pool, from the same thread, and must not
    wait forever for the lock that thread holds. The collector is made to run at the pool's bookkeeping allocation in
    :meth:`HostPool.release`, so the finalizer runs there for certain."""
    import gc
    import threading

    from torch.multiprocessing.reductions import StorageWeakRef

    from lightning_offload import host_pool
    from lightning_offload.copies import StorageCopy
    from lightning_offload.host_pool import PoolAccount

    pool = HostPool(pinned=False)
    account = PoolAccount(pool)
    collected: list[int] = []

    class CollectingFree(host_pool._Free):
        def __init__(self, buffer: torch.Tensor, ready: object) -> None:
            super().__init__(buffer, ready)  # type: ignore[arg-type]
            if (
                not collected
            ):  # the collector runs at this allocation, the pool's lock held (once: not in the finalizer)
                collected.append(0)
                collected[0] = gc.collect()

    enabled = gc.isenabled()
    gc.disable()  # no collection before the one forced in the pool
    try:
        saved = torch.zeros(16)
        copy = StorageCopy(saved, StorageWeakRef(saved.untyped_storage()), 0, 64, None)
        copy.host, copy.pool = account.acquire(64 * KiB, BIG)[0], account
        cycle: list[object] = [copy]
        cycle.append(cycle)  # only the garbage collector frees the copy now
        del copy, cycle
        other, _ = pool.acquire(64 * KiB, BIG)
        monkeypatch.setattr(host_pool, "_Free", CollectingFree)
        worker = threading.Thread(target=pool.release, args=(other, None), daemon=True)
        worker.start()
        worker.join(timeout=10)
    finally:
        if enabled:
            gc.enable()
    assert not worker.is_alive(), "the finalizer waited for the lock its own thread held"
    assert collected[0] > 0  # the copy's cycle was found there
    assert pool.in_use_bytes == 0 and account.in_use_bytes == 0
    pool.acquire(64 * KiB, BIG)
    assert pool.allocations == 2  # both buffers came back idle: this one is reused
