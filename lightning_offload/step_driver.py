"""Where the engine meets its planner at the edges of a step: whether steps are planned at all (:func:`planner_for`),
a step's end read into the planner (:func:`close_step`) and the next step's directive applied to the copy queues and
the transfer through their own ``configure`` calls (:func:`plan_step`). Torch only: no Lightning import."""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_offload.budget import KEEP_ALL, BudgetPlanner
from lightning_offload.device_memory import DeviceMemory, SettledCache
from lightning_offload.options import DEFAULT_MAX_INFLIGHT_BYTES, OffloadOptions, size_in_bytes
from lightning_offload.planner.profile import frugal_cap
from lightning_offload.planner.steps import CopyLimits
from lightning_offload.resting_floor import floor_over
from lightning_offload.transfer import StreamedTransfer

if TYPE_CHECKING:
    from lightning_offload.datapath import Datapath

_log = logging.getLogger("lightning_offload")


def planner_for(
    options: OffloadOptions,
    device: torch.device,
    transfer: Any,
    model: nn.Module | None,
    memory: Any = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> BudgetPlanner | None:
    """The planner an engine with these options needs, or ``None`` (no budget, a manual override, no streams, or no
    allocator counters: ``memory`` or CUDA's). This is the one place that decides whether steps are planned. Where
    ``optimizers`` are given, it says before the first step whether the weights, their gradients and the optimizers'
    state to come pass the budget (:func:`~lightning_offload.resting_floor.floor_over`)."""
    if memory is None and device.type == "cuda":
        memory = DeviceMemory(device)
    if not options.plans or memory is None or not isinstance(transfer, StreamedTransfer):
        return None
    planner = BudgetPlanner(options.budget_bytes(), memory, model, clock=transfer, trials=options.plan_trials)
    params = model.parameters() if model is not None else ()
    text = floor_over(planner.budget, memory.allocated(), device, optimizers, params) if optimizers else None
    if text is not None:
        _log.warning(text)
    return planner


def settling_for(options: OffloadOptions, device: torch.device, memory: Any, budget: int | None) -> SettledCache | None:
    """Where steps are not planned but copies leave: the allocator's cache, shaped by the first steps, is emptied
    after them (:class:`SettledCache`), on ``memory``'s counters or CUDA's; ``None`` where there are neither."""
    if options.mode == "off" or (memory is None and device.type != "cuda"):
        return None
    return SettledCache(memory if memory is not None else DeviceMemory(device), budget)


def close_step(planner: BudgetPlanner, path: Datapath) -> None:
    """End the planner's open step (the datapath's ``stats`` describe it): it learns from its peak and timings, and the
    next step's device time counts from here. :func:`plan_step` calls it as a step begins; the engine's ``end_step``
    earlier, where a batch runs without it or validation runs. A step ends once."""
    transfer, outbound, stats = path.transfer, path.outbound, path.stats
    assert isinstance(transfer, StreamedTransfer) and outbound is not None
    limits = None
    if planner.measuring:
        limits = CopyLimits(
            tail=outbound.default_tail,
            prefetch_bytes=outbound.prefetch_cap,
            inflight_cap=outbound.configured_inflight_cap or DEFAULT_MAX_INFLIGHT_BYTES,
            inflight_fixed=outbound.inflight_fixed,
            host_bytes=outbound.host_capacity(),
        )
        forward_ms, backward_ms = transfer.forward_ms(), transfer.backward_ms()
    else:
        forward_ms, backward_ms = transfer.last_compute_ms, transfer.last_backward_ms
    step_ms = transfer.step_began(planner.trying)  # a host sync, only while plans are timed
    planner.end_step(
        stats,
        forward_ms,
        backward_ms,
        step_ms,
        transfer.link_rate,
        limits,
        forward_timing=transfer.last_forward,
        copy_waits=transfer.last_stalls,
    )


def plan_step(planner: BudgetPlanner, path: Datapath) -> int | None:
    """Close the planner's previous step and configure the datapath's copy queues for the next one.

    Returns:
        The step's offload limit (0: keep everything, do not install the hooks; ``None``: no limit, a measuring
        step, which offloads once :meth:`StepMarks.passed_watermark`).
    """
    transfer, outbound, inbound = path.transfer, path.outbound, path.inbound
    assert isinstance(transfer, StreamedTransfer) and outbound is not None and inbound is not None
    close_step(planner, path)
    plan = planner.begin_step(lambda: path.log.position, lambda: path.casts.nbytes)
    path.casts.start(counting=plan is None)  # a measuring step counts the weight casts its blocks hold
    profile = planner.profile
    apart = plan is not None and profile is not None and profile.two_peaks
    # Plans with the head's backward apart count no copy in flight there: the engine lets go of them as forward
    # reaches the head.
    planner.at_head(outbound.let_go_all if apart else None)
    # The link model runs on the profile's paces (the planner's own, corrected by faster later steps).
    pace = (profile.eligible, profile.forward_ms, profile.backward_ms) if plan is not None and profile else None
    transfer.configure(planner.step, pace)
    if plan is None:
        # Measuring: keep everything unless memory passes the watermark; from there on the step must be frugal, so
        # copies barely run ahead of compute either way.
        frugal = frugal_cap(planner.budget)
        outbound.configure(
            tail=KEEP_ALL, inflight_cap=min(outbound.configured_inflight_cap or DEFAULT_MAX_INFLIGHT_BYTES, frugal)
        )
        inbound.configure(cap=min(outbound.prefetch_cap, frugal))
        return None
    outbound.configure(tail=outbound.default_tail, inflight_cap=plan.inflight_cap)
    inbound.configure(cap=plan.prefetch_cap if plan.prefetch_cap is not None else outbound.prefetch_cap)
    return plan.offload_bytes


def check_input_key(key: Hashable) -> None:
    """Refuse an ``input_changed(key)`` that cannot name an input: one that does not hash, or a tensor (it hashes by
    identity and compares element by element)."""
    if isinstance(key, torch.Tensor):
        raise TypeError(
            "input_changed(key=<tensor>): expected the input's shapes, e.g. tuple(batch.shape), or another "
            "hashable value that names the input"
        )
    hash(key)


def step_failed(planner: BudgetPlanner, exc: BaseException | None) -> str | None:
    """The planner's open step raised ``exc``: it is dropped, and an out-of-memory error corrects the plan. Returns
    what to say of an out-of-memory error, in numbers, or ``None`` (also where no step is open: the error was said of
    the step that raised it, which ran again, or it came between steps)."""
    out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError) and planner.core.open is not None
    text = planner.out_of_memory() if out_of_memory else None  # said of the step before it is dropped
    planner.abandon_step(out_of_memory, requested_bytes(exc) if out_of_memory else 0)
    return text


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+ ?[A-Za-z]+)")


def requested_bytes(exc: BaseException | None) -> int:
    """The allocation an out-of-memory error failed on, read from CUDA's message ("1000.00 MiB", read as the byte
    options' size strings are; 0: not stated)."""
    found = _REQUEST.search(str(exc)) if exc is not None else None
    return (size_in_bytes(found.group(1)) or 0) if found else 0
