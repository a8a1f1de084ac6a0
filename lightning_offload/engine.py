"""The offload engine: ``saved_tensors_hooks`` that move activations to host memory and bring them back.

Glossary:
    step: one ``with`` block of the engine (for the callback: one training batch); its counters are ``stats``.
    forward: the saves between the first save of a step and the first unpack (backward) after it. Several
        forwards may await one backward (gradient accumulation inside one block, DPO-style losses).
    position: eligible bytes saved since the engine was made; forward moves it up, backward walks it down.
    copy: one :class:`~lightning_offload.copies.StorageCopy`, the bytes of one storage span, crossing the link once
        however many saved tensors (views) share it.
    view: what autograd holds for a saved tensor (a :class:`~lightning_offload.copies.SavedView`).
    tail: the last ``resident_tail_bytes`` of a forward, which stay on the device (backward needs them first).
    limit: ``max_offload_bytes``: only the first this-many bytes of a forward may leave.

Data flows one way, through the hooks of ``datapath.py``: pack, policy, copy, pool, unpack. This module holds the
step's lifecycle (install, end, failure) and where it meets the memory-budget planner (``budget.py``, through
``step_driver.py``).

Torch only: no Lightning import, so plain training loops can use it as a context manager (``context.py``).
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from typing_extensions import override

from lightning_offload import policy, rerun
from lightning_offload.budget import BudgetPlanner, check_measuring_steps
from lightning_offload.carried_plans import carried, fingerprint, take_carried
from lightning_offload.checkpointing import WrappedBlocks
from lightning_offload.compile_warnings import unplanned_if_compiled, warn_if_compiled_across_blocks
from lightning_offload.datapath import Datapath
from lightning_offload.host_pool import host_limit
from lightning_offload.options import OffloadOptions, no_cuda_message
from lightning_offload.stats import OffloadStats
from lightning_offload.step_driver import (
    check_input_key,
    close_step,
    plan_step,
    planner_for,
    settling_for,
    step_failed,
)
from lightning_offload.streams import StreamBackend

_log = logging.getLogger("lightning_offload")
_T = TypeVar("_T")


class OffloadEngine:
    """Offloads saved activations while installed; rebuilds them in backward, also after the block is left.

    Create it once and install it every step: streams, the host pool and the forward profile carry over. See
    :class:`~lightning_offload.options.OffloadOptions` for the options.

    Args:
        options: validated options.
        model: its parameters and buffers (by storage) are never offloaded.
        local_processes: processes on this machine, each with its own pool: the default host limit is split between
            them. ``None``: read ``LOCAL_WORLD_SIZE`` (torchrun sets it; Lightning's launchers pass the count).
        streams: the stream backend for ``mode="streamed"``; ``None``: CUDA streams on CUDA, simulated on the CPU.
        memory: the allocator counters the planner reads, or without it :class:`~.device_memory.SettledCache` (the
            cache emptied after the first two optimizer steps); ``None``: CUDA's, or none off CUDA. Tests pass a fake.
        blocks: the blocks the call that made this engine checkpointed (``checkpoint=``): :meth:`close` takes their
            wrappers off, and installing again puts them back.
        optimizers: under a budget, their state to come counts in the floor said before the first step.
    """

    def __init__(
        self,
        options: OffloadOptions,
        model: torch.nn.Module | None = None,
        local_processes: int | None = None,
        streams: StreamBackend | None = None,
        memory: Any = None,
        blocks: WrappedBlocks | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        self.options, self._blocks = options, blocks
        self._optimizers = [weakref.ref(optimizer) for optimizer in optimizers]  # (not kept alive by the engine)
        self.local_processes = local_processes
        self._model_ref = weakref.ref(model) if model is not None else None
        self._path = Datapath(options)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._active = False  # between install and uninstall, also where a plan keeps everything (no hooks then)
        self._streams, self._memory = streams, memory
        # Created with the device (at the first install: the engine must pickle before first use), when options plan.
        self.planner: BudgetPlanner | None = None
        self._carried_plans: dict[str, Any] | None = None  # an earlier fit's plans, given to the planner as it is made
        self._host_limit: int | None = None
        self._first_input: tuple[Hashable] | None = None  # named before the planner existed (``None`` is a key too)
        self.told_failures: list[str | None] | None = None  # where :meth:`failed` puts what it says (``None``: the log)

    # The compute device, once the engine was first installed (``meta`` when nothing can be offloaded).
    device = property(lambda self: self._path.device)
    # Whether the hooks are installed (not in a step whose plan keeps everything, which installs none).
    installed = property(lambda self: self._hooks is not None)

    def install(self) -> None:
        """Start a step: tensors saved from now on go through the hooks."""
        if self._active:
            raise RuntimeError("offload_activations(): this engine is already active; enter it once at a time")
        path = self._path
        path.end_forward()  # a forward that never got its backward ends here, and counts in its own step
        if self._blocks is not None:
            self._blocks.apply()  # taken off by close()
        if path.device is None:
            self._resolve_device()
            if self.planner is not None and self._first_input is not None:
                self.planner.input_changed(self._first_input[0])
        self.collect_stats(wait=False)  # leftovers of older steps (never a host sync here), and the pool's counts
        if self._path.settling is not None and self._path.settling.step_begins():
            _log.debug("offload_activations(): the allocator's cache, shaped by the first steps, was emptied")
        plan_limit = plan_step(self.planner, path) if self.planner is not None else None
        path.start_step()
        if plan_limit == 0:
            self._active = True
            return  # the plan keeps everything: no hooks, no cost
        # A measuring step offloads past its watermark (and switches then); one that offloads from its first saved
        # tensor (under a budget the user gave) switches before it allocates anything.
        if self.planner is None or not self.planner.marks.watermark:
            switched = path.offloading_starts()
            if switched and self.planner is not None:
                self.planner.marks.cache_emptied()
        self.refresh_parameters()
        path.outbound.planned_limit = plan_limit  # type: ignore[union-attr]
        hooks = torch.autograd.graph.saved_tensors_hooks(_run_eagerly(path.pack), _run_eagerly(path.unpack))
        hooks.__enter__()
        self._hooks = hooks
        self._active = True

    def end_step(self) -> None:
        """End the current step now, not as the next one begins: what runs before the next step (a batch without the
        engine, validation inside fit) must not count in the planner's measurements of this step's peak and time."""
        if self._active:
            raise RuntimeError("offload_activations(): end_step() inside the engine's block; call it after the block")
        path = self._path
        path.end_forward()
        if self.planner is not None and path.outbound is not None:
            path.collect_stats(wait=False)
            close_step(self.planner, path)

    def uninstall(self) -> None:
        """Remove the hooks (idempotent). Tensors already saved can still be unpacked."""
        hooks, self._hooks = self._hooks, None
        self._active = False
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if self._path.outbound is not None:
            self._path.outbound.retire()  # finished copies let go of their sources now, not at the next step

    def close(self) -> None:
        """Leave the model as it was: remove the hooks and the blocks checkpointed by the planner or by ``checkpoint=``
        (installing the engine again puts them back)."""
        self.uninstall()
        if self._blocks is not None:
            self._blocks.remove()
        if self.planner is not None:
            self.planner.remove()
        if self._path.settling is not None:
            self._path.settling.close()

    def __enter__(self) -> OffloadEngine:
        self.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object) -> None:
        self.uninstall()
        if exc_type is not None:
            self.failed(exc)

    def failed(self, exc: BaseException | None) -> None:
        """The step raised ``exc``: drop what it held (:meth:`reset`); an out-of-memory error under a memory budget
        is explained in numbers (a warning)."""
        text = step_failed(self.planner, exc) if self.planner is not None else None
        self.reset()
        if self.told_failures is not None:
            self.told_failures.append(text)
        elif text is not None:
            _log.warning(text)

    def run_step(self, step: Callable[[], _T]) -> _T:
        """Run ``step``, one training step, and return what it returns; where it runs out of memory under a memory
        budget and the planner's correction makes the next step more frugal, run it again, until it fits or no step is
        more frugal (the error is then raised). ``step`` clears the gradients before its backward (as a closure given to
        ``optimizer.step`` does), enters this engine's block for forward and runs backward; with gradient accumulation,
        one call runs a whole accumulation window. See :mod:`~lightning_offload.rerun`."""
        return rerun.run_step(self, step)

    def refresh_parameters(self, tensors: Any = None) -> None:
        """Re-read the storages never to offload (the model's parameters and buffers, or ``tensors``), every step: an
        earlier walk would miss tensors registered or swapped since (``torch.utils.swap_tensors``, FSDP2's DTensors)."""
        if tensors is None:
            model = self._model_ref() if self._model_ref is not None else None
            tensors = [] if model is None else policy.parameters_and_buffers(model)
            if model is not None and self._path.inbound is not None:
                self._path.inbound.reserve_for_gradients(tensors)
        self._path.params.update(tensors)

    def reset(self) -> None:
        """Drop everything held for the current step (:meth:`Datapath.drop_step`): after an exception, nothing may leak
        into the next one. The planner learns nothing from the step; between steps, the last step's measurement goes."""
        self.uninstall()
        self._path.drop_step()
        if self.planner is not None:
            self.planner.abandon_step()  # learn nothing from a step that raised

    def _resolve_device(self) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        # A budget the user gave bounds the room the cache is emptied for, also where it goes unplanned (compiled).
        budget = self.options.budget_bytes()
        if self.options.plans and model is not None:
            # (before the options shape the transfer and the queues)
            self.options = unplanned_if_compiled(self.options, model)
        if self.options.mode != "off" and model is not None:
            warn_if_compiled_across_blocks(model)
        device = self.options.resolved_device() or _no_device()
        path = self._path
        path.connect(self.options, device, self._streams, self.host_limit)
        optimizers = [o for o in (ref() for ref in self._optimizers) if o is not None]  # (said before the first step)
        self.planner = planner_for(self.options, device, path.transfer, model, self._memory, optimizers=optimizers)
        path.use_planner(self.planner)
        if self.planner is not None and self._carried_plans is not None:
            take_carried(self.planner.core, self._fingerprint(), self._carried_plans)
        if self.planner is None:
            path.settling = settling_for(self.options, device, self._memory, budget)

    def plans_state(self) -> dict[str, Any] | None:
        """The planner's plans, as plain values with a fingerprint of the model, budget and device they were measured
        on (``None``: nothing planned yet); :meth:`load_plans` gives them to another engine."""
        if self.planner is None:
            return self._carried_plans
        return carried(self.planner.core, self._fingerprint())

    def load_plans(self, state: dict[str, Any] | None) -> None:
        """Plans from :meth:`plans_state` of an earlier engine (an earlier fit, a checkpoint): inputs met again run
        them without measuring, where the model, budget and device are the same; elsewhere they measure afresh. Call
        it before the first step."""
        if self.planner is not None and self.planner.step:
            raise RuntimeError("OffloadEngine.load_plans(state): call it before the first step")
        self._carried_plans = state
        if self.planner is not None and state is not None:
            take_carried(self.planner.core, self._fingerprint(), state)

    def _fingerprint(self) -> str:
        assert self.planner is not None and self._path.device is not None
        model = self._model_ref() if self._model_ref is not None else None
        return fingerprint(model, self.planner.budget, self._path.device, self.planner.memory.total())

    def input_changed(self, key: Hashable) -> None:
        """Name the next step's input, e.g. ``tuple(batch.shape)`` (before each step, outside the block): under a memory
        budget a new input is measured before it is planned, and one met before runs its plan again. A tuple of ints
        (or of such tuples, which may hold names as strings) is read as shapes: a new input no larger in any dimension
        than one whose plan keeps everything, with the same names, runs that plan at once. Without a planner it does
        nothing.

        Raises:
            RuntimeError: called inside the engine's block.
            TypeError: ``key`` is not hashable, or is a tensor (it hashes by identity and compares element by element:
                pass its shape).
        """
        check_input_key(key)  # refused before anything changes
        if self._active:
            raise RuntimeError("offload_activations(): input_changed() inside the engine's block; call it before it")
        planner = self.planner
        if planner is None:
            self._first_input = (key,)  # named to the planner once the first step makes it
            return
        if planner.core.runs_input(key):
            return
        self.end_step()  # the step before ran the old input: it counts for that one
        planner.input_changed(key)

    def replan(self, measuring_steps: int = 1) -> None:
        """Measure again before planning (call it when the model or the optimizer changes; for a new input shape,
        :meth:`input_changed`): ``measuring_steps`` steps, 2 when the optimizer is new too (it allocates its state in
        its first step). The plans kept for other inputs are forgotten too.

        Raises:
            ValueError: ``measuring_steps`` is not a positive int (also without a planner, where the call does nothing).
        """
        check_measuring_steps(measuring_steps)  # without a planner too: the call is wrong either way
        if self.planner is not None:
            self.planner.replan(measuring_steps)

    @property
    def stats(self) -> OffloadStats:
        """Counters of the latest step (reading it waits for the timing events of that step)."""
        return self.collect_stats(wait=True)

    def collect_stats(self, wait: bool) -> OffloadStats:
        """Counters of the latest step; with ``wait=False`` timings still running are left for a later read."""
        return self._path.collect_stats(wait)

    def host_limit(self) -> int:
        """Bytes the host pool may hold: ``host_memory_limit``, or a share of the RAM available at first use."""
        if self._host_limit is None:
            self._host_limit = host_limit(self.options.host_memory_limit, self._path.pool, self.local_processes)
        return self._host_limit


def _run_eagerly(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``hook`` never traced by ``torch.compile``. Called by autograd from inside a compiled module's frames, a hook
    would otherwise be compiled as a frame of its own (graph breaks, guards on the engine's state, objects made while
    tracing), where it is bookkeeping in Python that must run as written, once per saved tensor. Left as it is while
    nothing in the process imported dynamo (nothing is compiled then, and importing it takes about a second); the
    hooks are made anew at every install, so a model compiled later gets them wrapped from its next step on."""
    if "torch._dynamo" not in sys.modules:
        return hook
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if disable is not None else hook


def _no_device() -> torch.device:
    """Never offload CPU tensors unless asked: without CUDA, an engine made directly keeps everything (and says so
    once, as the entry points do; they return an :class:`IdleEngine` instead)."""
    warnings.warn(no_cuda_message("OffloadEngine", "CUDA is not available"), UserWarning, stacklevel=5)
    return torch.device("meta")  # no real tensor lives there: nothing is eligible


class IdleEngine(OffloadEngine):
    """An engine that offloads nothing and installs no hooks: what ``offload_activations`` and ``fabric_offload``
    return where there is no CUDA device to offload from (having said so once, as they were called), so that a loop
    written for CUDA runs unchanged, at no cost, on any other device. Its ``stats`` stay zero."""

    @override
    def install(self) -> None:
        if self._active:
            raise RuntimeError("offload_activations(): this engine is already active; enter it once at a time")
        self._path.stats = OffloadStats()
        self._active = True
