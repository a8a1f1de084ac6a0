"""The CUDA caching allocator, as the memory-budget planner and the engine see it: its counters, and the one setting
the engine changes (expandable segments, once copies start to leave).

Torch only: no Lightning import.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_offload.planner.aims import cache_worth_emptying

_switched = False  # expandable segments were switched on in this process
# Without a memory-budget planner, the engine reads what the steps before left cached as it installs after each of the
# first this-many optimizer steps: the first allocates the optimizer's state, after its backward, into room the
# activations had used; the second step's activations, mapped around that state, are the layout every later step
# repeats. On an H200, emptying the cache as the second and third steps began took Llama-1B's hand-tuned `ac+offload`
# from 1.22x to 1.14x reserved per allocated (small-h512's stayed at 1.15x, as AC's own); checked as the second began
# only, nothing changed.
_SETTLE_AFTER_OPTIMIZER_STEPS = 2


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

    def capacity(self) -> int:
        """What the process may use of the device's memory: its total under the process's memory fraction
        (``torch.cuda.set_per_process_memory_fraction``, where torch can say; 1.0 unless set)."""
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        share = fraction(self.device) if fraction is not None else 1.0
        return int(self.total() * min(1.0, share))

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
        """Bytes the process may hold: what the device has free plus what this process reserved, and no more than a
        hard cap (``torch.cuda.set_per_process_memory_fraction``, where torch can say)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        limit = free + self.reserved()
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            limit = min(limit, int(self.total() * fraction(self.device)))
        return limit

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


class SettledCache:
    """For an engine that does not plan: empties the allocator's cache as the engine installs after each of its first
    two optimizer steps, where the steps before left it holding far more than they peaked at
    (:func:`cache_worth_emptying`; the room is the device's limit, or the budget given, if lower).

    Optimizer steps are seen through torch's global optimizer hook (every ``torch.optim.Optimizer``), so gradient
    accumulation's many installs per step count once; a loop without a torch optimizer is never checked. The peak
    counter is reset once, at the first install (the planner resets it at every step): earlier work in the process
    (a baseline step, loading weights) would otherwise stand for the engine's own peak.

    Args:
        memory: the allocator's counters (:class:`DeviceMemory`, or a test's object with ``peak``, ``reserved``,
            ``total``, ``reset_peak`` and ``release_cache``; ``limit`` where it has one).
        budget: a ``memory_budget`` given without planning (manual overrides): the room is no more than that.
    """

    def __init__(self, memory: Any, budget: int | None = None) -> None:
        self.memory = memory
        self.budget = budget
        self._started = False
        self._optimizer_steps = 0
        self._armed = False  # an optimizer step ended since the last install: the next install checks
        self._peak = 0  # the highest peak the backward passes since the first install ended with
        self.releases = 0
        self._hook: Any = None

    @property
    def settled(self) -> bool:
        return self._optimizer_steps >= _SETTLE_AFTER_OPTIMIZER_STEPS and not self._armed

    def optimizer_stepped(self) -> None:
        """An optimizer step ended (torch's global hook calls this while the cache is not settled)."""
        if self._started and self._optimizer_steps < _SETTLE_AFTER_OPTIMIZER_STEPS:
            self._optimizer_steps += 1
            self._armed = True

    def backward_finished(self) -> None:
        """Note the peak as a backward ends (a caller may reset the counters between steps)."""
        if self._started and not self.settled:
            self._peak = max(self._peak, self.memory.peak())

    def step_begins(self) -> bool:
        """The engine installs for a step; after an optimizer step of the first two, empty the cache if it is worth
        it. Returns whether it was."""
        if not self._started:
            self._started = True
            reset = getattr(self.memory, "reset_peak", None)
            if reset is not None:
                reset()
            self._hook = _optimizer_step_hook(self)
            return False
        if not self._armed:
            return False
        self._armed = False
        if self.settled:
            self.close()
        reserved, release = getattr(self.memory, "reserved", None), getattr(self.memory, "release_cache", None)
        if reserved is None or release is None:  # counters that cannot say (a test's fake)
            return False
        peak = max(self._peak, self.memory.peak())
        limit = getattr(self.memory, "limit", None)
        room = limit() if limit is not None else self.memory.total()
        if self.budget is not None:
            room = min(room, self.budget)
        if not cache_worth_emptying(reserved(), peak, room):
            return False
        release()
        self.releases += 1
        return True

    def close(self) -> None:
        """Stop listening to optimizer steps."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()


def _optimizer_step_hook(settling: SettledCache) -> Any:
    """Register torch's global optimizer step post-hook for ``settling``, held weakly (a dropped engine leaves a hook
    that does nothing until the process ends or it is removed)."""
    ref = weakref.ref(settling)

    def stepped(*_: Any) -> None:
        target = ref()
        if target is not None:
            target.optimizer_stepped()

    return register_optimizer_step_post_hook(stepped)
