"""A pool of host buffers reused across steps, so the steady state allocates (and pins) nothing.

Pinning host memory costs ~0.4 s/GiB and can synchronize the device, so buffers are kept for the life of the
process and handed out again by size class. A buffer comes back with the event of the last copy that touched it;
the next user makes its copy stream wait on that event (a device-side wait, never a host synchronization).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil
import torch

from lightning_offload.units import GiB

# Size classes: 8 per power of two (so at most 12.5% of a buffer is padding), never below 64 KiB.
_MIN_CLASS = 64 << 10
_STEPS_PER_OCTAVE = 8
# Host RAM the pool never takes, so the rest of the process (and the OS) can still allocate.
_RAM_HEADROOM_FRACTION = 0.10
_RAM_HEADROOM_MAX = 8 * GiB
# How old a reading of the machine's spare RAM may be where it only decides whether an idle buffer may be lent.
_RAM_READ_EVERY_S = 1.0


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool size class."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (nbytes - 1).bit_length()
    step = top // (2 * _STEPS_PER_OCTAVE)
    return -(-nbytes // step) * step


class HostMemoryFull(RuntimeError):
    """Raised when a host buffer would exceed the pool's limit or the machine's free RAM.

    ``str(err)`` is the message for ``on_host_full="error"``; :meth:`message` gives the one for either mode.

    Args:
        needed: bytes of the buffer that did not fit.
        held: bytes the pool held at the time.
        limit: the pool's limit in bytes.
        available: RAM the machine had available, in bytes.
        device_type: the compute device's type (``"cuda"``, ``"cpu"``): where tensors stay when they do not fit.
    """

    def __init__(self, needed: int, held: int, limit: int, available: int, device_type: str = "cuda") -> None:
        self.needed, self.held, self.limit, self.available = needed, held, limit, available
        self.device_type = device_type
        super().__init__(self.message("error"))

    def __reduce__(self) -> tuple[type[HostMemoryFull], tuple[int, int, int, int, str]]:
        # Rebuilt from the figures: the default rebuilds from ``args`` (the message alone), which ``__init__`` refuses,
        # so pickling across processes or ``copy.copy`` raised ``TypeError`` in place of this error.
        return type(self), (self.needed, self.held, self.limit, self.available, self.device_type)

    def message(self, on_host_full: str) -> str:
        """What happened and what to change, for the ``on_host_full`` mode in effect (``"warn"`` or ``"error"``)."""
        device = "GPU" if self.device_type == "cuda" else "device"
        what = (
            f"offloading needs {_size(self.needed)} more host memory; the pool holds {_size(self.held)}, its limit "
            f"is host_memory_limit={self.limit} ({_size(self.limit)}) and the machine has {_size(self.available)} "
            "of RAM available."
        )
        less = "offload less (resident_tail_bytes, min_tensor_bytes, max_offload_bytes)"
        if on_host_full == "warn":
            return (
                f"{what} Tensors that do not fit stay on the {device} (on_host_full='warn'; this warning is shown "
                f"once). To offload them, raise host_memory_limit (if RAM allows); to silence this, {less}."
            )
        return (
            f"{what} Raise host_memory_limit (if RAM allows), {less}, or pass on_host_full='warn' to keep tensors "
            f"that do not fit on the {device}."
        )


def _size(nbytes: int) -> str:
    """Bytes in the unit that keeps small numbers readable (a 1 MiB limit is not '0.00 GiB')."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes} bytes"


@dataclass
class _Free:
    buffer: torch.Tensor
    ready: torch.cuda.Event | None  # the last copy that used the buffer; None when nothing is pending


class HostPool:
    """Host buffers by size class, pinned when the compute device is CUDA.

    Args:
        pinned: allocate page-locked memory (CUDA) or plain memory (CPU test mode).
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: dict[int, list[_Free]] = {}
        # Re-entrant: a copy freed by the garbage collector (its graph caught in a reference cycle) gives its buffer
        # back from its finalizer, which runs at any allocation of the thread, also one made here with the lock held
        # (a list, psutil's readings); a plain lock then waited forever for itself.
        self._lock = threading.RLock()
        self._registered: list[torch.Tensor] = []
        self.reserved_bytes = 0  # every buffer the pool owns
        self.in_use_bytes = 0  # buffers handed out and not yet given back
        self.allocations = 0  # buffers ever allocated: flat in steady state
        self.lent_bytes = 0  # buffers in use that serve requests of a smaller class (counted in in_use_bytes too)
        self._lent: dict[int, int] = {}  # data pointer -> size of each of those
        self._ram_read_at, self._ram_read = -float("inf"), 0  # the machine's spare RAM, as read last (see lending)
        self._pinned_since_read = 0  # bytes of buffers allocated since: no longer spare

    def acquire(self, nbytes: int, limit: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A buffer of at least ``nbytes`` bytes and the event to wait on before writing it.

        Raises:
            HostMemoryFull: a new buffer would take the pool past ``limit`` or the machine's RAM headroom.
        """
        buffer, ready, _ = self.acquire_counted(nbytes, limit)
        return buffer, ready

    def acquire_counted(self, nbytes: int, limit: int) -> tuple[torch.Tensor, torch.cuda.Event | None, bool]:
        """:meth:`acquire`, and whether the buffer is a new one (allocated, and pinned on CUDA, for this call)."""
        cls = size_class(nbytes)
        with self._lock:
            bucket = self._free.get(cls) or self._larger_to_lend(cls, limit)
            if bucket:
                item = bucket.pop()
                size = item.buffer.numel()
                if size != cls:
                    self._lent[item.buffer.data_ptr()] = size
                    self.lent_bytes += size
                self.in_use_bytes += size
                return item.buffer, item.ready, False
            self._make_room(cls, limit)
            self.reserved_bytes += cls
            self.in_use_bytes += cls
            self.allocations += 1
            self._pinned_since_read += cls
        try:
            return self._allocate(cls), None, True
        except BaseException:
            with self._lock:
                self.reserved_bytes -= cls
                self.in_use_bytes -= cls
                self.allocations -= 1
                self._pinned_since_read = max(0, self._pinned_since_read - cls)
            raise

    def release(self, buffer: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Give ``buffer`` back; it is reused only after ``ready`` (device-side wait)."""
        with self._lock:
            self.lent_bytes -= self._lent.pop(buffer.data_ptr(), 0)
            self._free.setdefault(buffer.numel(), []).append(_Free(buffer, ready))
            self.in_use_bytes -= buffer.numel()

    def clear(self) -> None:
        """Drop every idle buffer (after their copies finish). Buffers still in use stay with their owners."""
        with self._lock:
            idle = [item for bucket in self._free.values() for item in bucket]
            self._free.clear()
            for item in idle:
                if item.ready is not None:
                    item.ready.synchronize()
                self._forget(item.buffer)
                self.reserved_bytes -= item.buffer.numel()

    def _larger_to_lend(self, cls: int, limit: int) -> list[_Free] | None:
        """The idle buffers of the smallest class above ``cls`` (at most twice it) that may serve a ``cls`` request.

        Inputs whose length changes need new classes at every length; a shorter one borrowing a longer one's idle
        buffers pins nothing (pinning costs ~0.4 s/GiB). But a lent buffer wastes what it holds past the request, so
        close to the limit a run of requests could find the pool full where buffers of their own classes would all
        have fitted (plans that offload close to what the pool may hold, as capacity searches do). So the pool lends
        only while what it holds and has lent, with the loan, stays within half its limit, and while the machine's
        RAM could pin a replacement for every buffer lent.
        """
        larger = [c for c, bucket in self._free.items() if bucket and cls < c <= 2 * cls]
        if not larger:
            return None
        size = min(larger)
        spare = self.lent_bytes + size
        if 2 * (self.reserved_bytes + spare) > limit or self._recent_ram_to_spare() < spare:
            return None
        return self._free[size]

    def _recent_ram_to_spare(self) -> int:
        """:func:`_ram_to_spare`, read at most once a second: with two lengths that alternate, the shorter borrows at
        every saved tensor of every step, and reading the machine's memory costs tens of microseconds each time.
        What the pool pinned since the reading is taken off it (a step that pins new buffers and lends others does so
        within the second: the reading before the pinning would lend where no replacement could be pinned)."""
        now = time.monotonic()
        if now - self._ram_read_at > _RAM_READ_EVERY_S:
            self._ram_read_at, self._ram_read, self._pinned_since_read = now, _ram_to_spare(), 0
        return self._ram_read - self._pinned_since_read

    def _make_room(self, nbytes: int, limit: int) -> None:
        # Idle buffers of other sizes are dropped before giving up: shapes change (new sequence length) and the
        # old classes would otherwise hold the budget forever. None is dropped where dropping them all would not
        # make room: a step of fixed shapes that hits the limit would free a buffer it needs later, and pin it again
        # in every step.
        idle = self.reserved_bytes - self.in_use_bytes
        could_fit = self.in_use_bytes + nbytes <= limit and _ram_to_spare() + idle >= nbytes
        while could_fit and self.reserved_bytes - self.in_use_bytes > 0 and not self._fits(nbytes, limit):
            cls = max((c for c, b in self._free.items() if b), default=None)
            if cls is None:
                break
            item = self._free[cls].pop()
            if item.ready is not None:
                item.ready.synchronize()
            self._forget(item.buffer)
            self.reserved_bytes -= cls
        if not self._fits(nbytes, limit):
            raise HostMemoryFull(
                nbytes,
                self.reserved_bytes,
                limit,
                psutil.virtual_memory().available,
                device_type="cuda" if self.pinned else "cpu",
            )

    def capacity(self, limit: int) -> int:
        """The most bytes of buffers the pool could hold now under ``limit``: what it holds, and what the machine's
        available RAM allows past its headroom."""
        return max(0, min(limit, self.reserved_bytes + _ram_to_spare()))

    def _fits(self, nbytes: int, limit: int) -> bool:
        return self.reserved_bytes + nbytes <= limit and _ram_to_spare() >= nbytes

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Registering plain memory pins exactly nbytes; torch's pinned allocator would round up to a power of two
        # (up to 2x the RAM for the same data). Fall back to it when registration is refused.
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
            self._registered.append(buffer)
            return buffer
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _forget(self, buffer: torch.Tensor) -> None:
        for i, registered in enumerate(self._registered):
            if registered is buffer:
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
                del self._registered[i]
                return


class PoolAccount:
    """One engine's account with the process's pool: the buffers it holds and the new ones it had allocated.

    Engines of one process (two models in one loop, each with its own) share the pool; each one's figures must be its
    own. It hands buffers out and takes them back as the pool does, counting them.

    Args:
        pool: the process's pool for the engine's device.
    """

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.in_use_bytes = 0  # this engine's buffers handed out and not yet given back
        self.allocations = 0  # new buffers allocated for this engine, ever
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        """Every buffer the pool owns (the process's, not this engine's alone: idle buffers belong to no engine)."""
        return self.pool.reserved_bytes

    def acquire(self, nbytes: int, limit: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """:meth:`HostPool.acquire`, counted."""
        buffer, ready, new = self.pool.acquire_counted(nbytes, limit)
        with self._lock:
            self.in_use_bytes += buffer.numel()
            self.allocations += int(new)
        return buffer, ready

    def release(self, buffer: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """:meth:`HostPool.release`, counted."""
        self.pool.release(buffer, ready)
        with self._lock:
            self.in_use_bytes -= buffer.numel()

    def capacity(self, limit: int) -> int:
        """:meth:`HostPool.capacity`: the pool's, under ``limit``."""
        return self.pool.capacity(limit)


def _ram_to_spare() -> int:
    """The machine's available RAM past the headroom the pool never takes (may be negative)."""
    memory = psutil.virtual_memory()
    return memory.available - min(int(memory.total * _RAM_HEADROOM_FRACTION), _RAM_HEADROOM_MAX)


_POOLS: dict[str, HostPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(device: torch.device) -> HostPool:
    """The process-wide pool for ``device``'s type: engines entered step after step share one pool."""
    with _POOLS_LOCK:
        pool = _POOLS.get(device.type)
        if pool is None:
            pool = _POOLS[device.type] = HostPool(pinned=device.type == "cuda")
        return pool


def release_host_memory() -> int:
    """Free every idle pooled host buffer; returns the bytes released."""
    released = 0
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            before = pool.reserved_bytes
            pool.clear()
            released += before - pool.reserved_bytes
    return released


# The default host limit takes this share of the RAM available when the engine first copies, split between the
# processes of this machine (each rank has its own pool).
_DEFAULT_HOST_SHARE = 0.8


def host_limit(configured: int | None, pool: HostPool | PoolAccount, local_processes: int | None) -> int:
    """Bytes ``pool`` may hold: ``configured``, or a share of the RAM available now split between the processes.

    ``local_processes`` ``None``: read ``LOCAL_WORLD_SIZE`` (torchrun sets it; Lightning's launchers pass the count).
    """
    if configured is not None:
        return configured
    try:
        ranks = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    except ValueError:
        ranks = 1
    return pool.reserved_bytes + int(psutil.virtual_memory().available * _DEFAULT_HOST_SHARE / max(1, ranks))
