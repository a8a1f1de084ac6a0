"""The CUDA caching allocator, as the memory-budget planner and the engine see it: its counters, and the one setting
the engine changes (expandable segments, once copies start to leave).

Torch only: no Lightning import.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

_switched = False  # expandable segments were switched on in this process
# Steps that shaped the allocator's cache in a layout of their own (a memory-budget planner's measuring steps and plans
# under trial; the optimizer's state allocated in the first step into room activations had used) can leave it holding
# far more than a step needs: expandable segments are never unmapped but by emptying the cache. Past this multiple of
# the steps' peak allocated memory the cache is emptied once, where the budget (or the process's cap) leaves room for a
# layout mapped afresh to reserve _FRESH_LAYOUT_ROOM x that peak. On an H200 the small-vocab model's 8 GiB budget row
# reserved 7.7 GiB for 6.2 allocated after its trials, 6.7 once emptied; where the budget was close to the peak,
# Llama-1B's kept plans under hard caps at 0.9x and at the floor (5-6% of room) emptied each time then flushed the
# cache in every step (1.10x -> 1.77x `none`'s step time): a layout mapped afresh reached the cap there.
_SETTLED_RESERVED_RATIO = 1.10
_FRESH_LAYOUT_ROOM = 1.15
# Without a memory budget, the engine's installs that read what the steps before them left: the second (the first
# step allocates the optimizer's state after its backward, into room its activations had used) and the third (the
# second step's activations, mapped around that state, are the layout every later step repeats). On an H200 the
# hand-tuned `ac+offload` rows trained under hard caps with 1.01x (Llama-1B) and 1.06x (small-h512) reserved and no
# flush once the allocator had flushed while they warmed up; uncapped they kept 1.22x and 1.15x for good.
_SETTLE_AT_INSTALLS = (2, 3)


class AllocatorCounters(NamedTuple):
    """The CUDA caching allocator's counters at one moment (bytes; flushes since the process began)."""

    allocated: int
    peak: int
    reserved: int
    reserved_peak: int
    alloc_retries: int


def read_counters(device: torch.device) -> AllocatorCounters:
    """One read of the allocator's counters of ``device``.

    ``torch.cuda.memory_allocated`` and its siblings each build and flatten the whole statistics dictionary: ~100 us of
    host time per call on an H200's host, which a host-bound model's step pays in full (the planner reads three to
    five counters a step). The nested dictionary they flatten costs ~12 us; it is read directly where torch has it.
    """
    if not torch.cuda.is_initialized():
        return AllocatorCounters(0, 0, 0, 0, 0)  # nothing allocated yet
    read = getattr(torch._C, "_cuda_memoryStats", None)
    if read is None:
        nested = torch.cuda.memory_stats_as_nested_dict(device)
    else:
        nested = read(device.index if device.index is not None else torch.cuda.current_device())

    def counter(name: str, kind: str) -> int:
        return int(nested.get(name, {}).get("all", {}).get(kind, 0))

    return AllocatorCounters(
        allocated=counter("allocated_bytes", "current"),
        peak=counter("allocated_bytes", "peak"),
        reserved=counter("reserved_bytes", "current"),
        reserved_peak=counter("reserved_bytes", "peak"),
        alloc_retries=int(nested.get("num_alloc_retries", 0)),
    )


class DeviceMemory:
    """The allocator's counters of a CUDA device (tests pass an object with the same methods)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def allocated(self) -> int:
        return read_counters(self.device).allocated

    def peak(self) -> int:
        return read_counters(self.device).peak

    def reserved(self) -> int:
        return read_counters(self.device).reserved

    def reserved_peak(self) -> int:
        return read_counters(self.device).reserved_peak

    def alloc_retries(self) -> int:
        """How often an allocation found the device (or the process's cap) full and the allocator freed its cached
        blocks to try again: a slow path (it synchronizes the device), and the last one before out of memory."""
        return read_counters(self.device).alloc_retries

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def limit(self) -> int:
        """Bytes the process may reserve: the device's total, or less under a hard cap
        (``torch.cuda.set_per_process_memory_fraction``)."""
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        share = fraction(self.device) if fraction is not None else 1.0
        return int(self.total() * min(1.0, share))

    def expandable(self) -> bool:
        """Whether the allocator maps expandable segments (:func:`expandable_segments`)."""
        return expandable_segments()

    def release_cache(self) -> None:
        """Return the allocator's cached, unused memory to the device (never while a CUDA graph is being captured)."""
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.empty_cache()


def use_expandable_segments(device: torch.device | None = None) -> bool:
    """Switch the CUDA caching allocator to expandable segments, unless the user configured the allocator.

    Offloading frees and reallocates activations of many sizes in a different order than plain training; with fixed
    segments the freed blocks fragment, so memory *reserved* grows far past memory *allocated* (1.57x measured on an
    H200) and a budget in allocated bytes would not fit a hard cap. Expandable segments map memory into one growing
    range instead. It applies to segments allocated from now on (activations; weights allocated earlier stay where
    they are), so the cache is emptied as it switches: fixed segments cached but unused would otherwise take the next
    allocations (the optimizer's state, the loss's transient) and leave holes that no flush can return while anything
    else lives in them (on an H200, 209 MiB of a 2 GiB cap). Off-switch: set ``PYTORCH_CUDA_ALLOC_CONF`` (e.g.
    ``expandable_segments:False``), and it is left alone.

    Args:
        device: the device offloading runs on; anything but CUDA is left alone (``None``: CUDA).

    Returns:
        Whether the setting was switched on here (once per process: it is the process's allocator).
    """
    global _switched
    if _switched or (device is not None and device.type != "cuda"):
        return False
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    # Newer torch moved the setting to the accelerator API (the CUDA one warns that it is deprecated there).
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )
    if setting is None:
        return False
    try:
        setting("expandable_segments:True")
    except RuntimeError:  # a backend without the setting
        return False
    _switched = True
    # (A no-op where CUDA was never initialized; never while a CUDA graph is being captured, where it would fail.)
    if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        torch.cuda.empty_cache()
    return True


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator maps expandable segments in this process: switched on by an engine here
    (:func:`use_expandable_segments`), or asked for in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``. A process
    keeps the setting, so plain training that runs after an offloading engine in it has them too."""
    if _switched:
        return True
    settings = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return any(item.strip().lower() == "expandable_segments:true" for item in settings.split(","))


def cache_worth_emptying(reserved: int, peak: int, room: int) -> bool:
    """Whether an allocator holding ``reserved`` bytes, after steps that peaked at ``peak`` bytes allocated, holds far
    more than a step needs (over ``_SETTLED_RESERVED_RATIO`` x the peak) while ``room`` bytes (a budget, a cap) hold a
    layout mapped afresh (``_FRESH_LAYOUT_ROOM`` x the peak): then emptying the cache once returns memory for good."""
    return peak > 0 and room >= _FRESH_LAYOUT_ROOM * peak and reserved > _SETTLED_RESERVED_RATIO * peak


class SettledCache:
    """For an engine without a memory budget: empties the allocator's cache as the engine's second and third steps
    begin, each time the steps before left far more reserved than they peaked at (:func:`cache_worth_emptying`, with
    the device's limit, or the process's cap, as the room); never later.

    Args:
        memory: the allocator's counters (:class:`DeviceMemory`, or a test's object with ``peak``, ``reserved``,
            ``total`` and ``release_cache``; ``limit`` where it has one).
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self._installs = 0
        self._peak = 0  # the highest peak the earlier steps' backward passes ended with
        self.releases = 0

    @property
    def settled(self) -> bool:
        return self._installs >= _SETTLE_AT_INSTALLS[-1]

    def backward_finished(self) -> None:
        """Note the peak as a backward before the last check ends (a caller may reset the counters between steps)."""
        if not self.settled:
            self._peak = max(self._peak, self.memory.peak())

    def step_begins(self) -> bool:
        """The engine installs for a step; at the second and third, empty the cache if it is worth it. Returns whether
        it was."""
        if self.settled:
            return False
        self._installs += 1
        if self._installs not in _SETTLE_AT_INSTALLS:
            return False
        reserved, release = getattr(self.memory, "reserved", None), getattr(self.memory, "release_cache", None)
        if reserved is None or release is None:  # counters that cannot say (a test's fake)
            return False
        peak = max(self._peak, self.memory.peak())
        limit = getattr(self.memory, "limit", None)
        room = limit() if limit is not None else self.memory.total()
        if not cache_worth_emptying(reserved(), peak, room):
            return False
        release()
        self.releases += 1
        return True
