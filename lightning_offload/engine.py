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

Data flows one way. ``pack`` asks the policy (``policy.py``) whether a saved tensor may leave, finds or creates the
copy of its span (``savelog.py`` dedups) and queues it on the way out (``outbound.py``), which decides when it
leaves; the transfer (``transfer.py``: sync, or streamed on copy streams) moves it into a pooled host buffer
(``host_pool.py``). In backward, ``unpack`` rebuilds the tensor; the first unpack of a forward seals it, and the way
back (``inbound.py``) fetches copies ahead of need on the link model of ``schedule.py``.

Torch only: no Lightning import, so plain training loops can use it as a context manager (``context.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from typing_extensions import override

from lightning_offload import policy
from lightning_offload.budget import BudgetPlanner, check_measuring_steps
from lightning_offload.carried_plans import carried, fingerprint, take_carried
from lightning_offload.checkpointing import WrappedBlocks
from lightning_offload.copies import SavedView, State, StorageCopy, modified_error, version_root
from lightning_offload.device_memory import DeviceMemory, SettledCache, use_expandable_segments
from lightning_offload.host_pool import PoolAccount, host_limit, pool_for
from lightning_offload.inbound import InboundQueue
from lightning_offload.options import OffloadOptions, no_cuda_message, size_in_bytes
from lightning_offload.outbound import OutboundQueue
from lightning_offload.planned_blocks import compiled_across_blocks, compiled_modules
from lightning_offload.savelog import SaveLog
from lightning_offload.stats import OffloadStats
from lightning_offload.step_driver import close_step, plan_step, planner_for
from lightning_offload.streams import CudaStreams, SimulatedStreams, StreamBackend
from lightning_offload.transfer import StreamedTransfer, SyncTransfer, Transfer, producer_stream

_log = logging.getLogger("lightning_offload")


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
        memory: the device's allocator counters for the memory-budget planner, or, without one, for emptying the
            cache after the first two optimizer steps (:class:`~lightning_offload.device_memory.SettledCache`);
            ``None``: CUDA's (without CUDA and without this, neither). Tests pass a fake.
        blocks: the blocks the call that made this engine checkpointed (``checkpoint=``): :meth:`close` takes their
            wrappers off, and installing again puts them back.
    """

    def __init__(
        self,
        options: OffloadOptions,
        model: torch.nn.Module | None = None,
        local_processes: int | None = None,
        streams: StreamBackend | None = None,
        memory: Any = None,
        blocks: WrappedBlocks | None = None,
    ) -> None:
        self.options = options
        self._blocks = blocks
        self.local_processes = local_processes
        self._model_ref = weakref.ref(model) if model is not None else None
        self._params = policy.ParameterStorages()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        # Between install and uninstall, also where a plan keeps everything and no hooks are installed.
        self._active = False
        self._streams = streams
        self._memory = memory
        self.planner: BudgetPlanner | None = None  # created with the device, when the options plan
        self._carried_plans: dict[str, Any] | None = None  # an earlier fit's plans, given to the planner as it is made
        self._settling: SettledCache | None = None  # without a planner: the cache emptied after the first steps
        # Resolved at the first install, where the device is known: the engine must pickle before first use.
        self._device: torch.device | None = None
        self._transfer: Transfer = SyncTransfer()
        self._outbound: OutboundQueue | None = None
        self._inbound: InboundQueue | None = None
        self._stats = OffloadStats()
        self._allocations_at_start = 0
        self._host_limit: int | None = None
        self._log = SaveLog()
        # The input named before the planner existed, in a tuple (see input_changed; ``None`` is a key too).
        self._first_input: tuple[Hashable] | None = None
        self._counted: list[StorageCopy] = []  # mode="off": what the open forward would offload (kept for dedup)
        self._said_tail = False  # whether a forward that fell wholly in the resident tail was said (once per engine)

    @property
    def device(self) -> torch.device | None:
        """The compute device, once the engine was first installed (``meta`` when nothing can be offloaded)."""
        return self._device

    @property
    def installed(self) -> bool:
        """Whether the hooks are installed (not in a step whose plan keeps everything, which installs none)."""
        return self._hooks is not None

    def install(self) -> None:
        """Start a step: tensors saved from now on go through the hooks."""
        if self._active:
            raise RuntimeError("offload_activations(): this engine is already active; enter it once at a time")
        self._end_forward()  # a forward that never got its backward ends here, and counts in its own step
        if self._blocks is not None:
            self._blocks.apply()  # taken off by close()
        if self._device is None:
            self._resolve_device()
            if self.planner is not None and self._first_input is not None:
                self.planner.input_changed(self._first_input[0])
        self.collect_stats(wait=False)  # leftovers of older steps (never a host sync here), and the pool's counts
        if self._settling is not None and self._settling.step_begins():
            _log.debug("offload_activations(): the allocator's cache, shaped by the first steps, was emptied")
        plan_limit = None
        if self.planner is not None:
            plan_limit = plan_step(
                self.planner, self._transfer, self._outbound, self._inbound, self._stats, lambda: self._log.position
            )
        self._stats = OffloadStats()
        self._allocations_at_start = self._pool.allocations
        self._log.start_step()
        if plan_limit == 0:
            self._active = True
            return  # the plan keeps everything: no hooks, no cost
        # A measuring step offloads past its watermark (and switches then); one that offloads from its first saved
        # tensor (under a budget the user gave) switches before it allocates anything.
        if self.planner is None or not self.planner.watermark:
            switched = self._offloading_starts()
            if switched and self.planner is not None:
                self.planner.cache_emptied()
        self.refresh_parameters()
        self._outbound.planned_limit = plan_limit  # type: ignore[union-attr]
        hooks = torch.autograd.graph.saved_tensors_hooks(_run_eagerly(self._pack), _run_eagerly(self._unpack))
        hooks.__enter__()
        self._hooks = hooks
        self._active = True

    def end_step(self) -> None:
        """End the current step now, not as the next one begins: what runs before the next step (a batch without the
        engine, the memory picture's comparison; validation inside fit) must not count as this step's peak and time
        in the memory-budget planner's measurements."""
        if self._active:
            raise RuntimeError("offload_activations(): end_step() inside the engine's block; call it after the block")
        self._end_forward()
        if self.planner is not None and self._outbound is not None:
            self.collect_stats(wait=False)
            close_step(self.planner, self._transfer, self._outbound, self._stats)

    def uninstall(self) -> None:
        """Remove the hooks (idempotent). Tensors already saved can still be unpacked."""
        hooks, self._hooks = self._hooks, None
        self._active = False
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if self._outbound is not None:
            self._outbound.retire()  # finished copies let go of their sources now, not at the next step

    def close(self) -> None:
        """Leave the model as it was: remove the hooks and the blocks checkpointed by the memory-budget planner or by
        the call that made this engine (``checkpoint=``).

        Installing the engine again later applies its plan (and that checkpointing) again."""
        self.uninstall()
        if self._blocks is not None:
            self._blocks.remove()
        if self.planner is not None:
            self.planner.remove()
        if self._settling is not None:
            self._settling.close()

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
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError)
        planner, text = self.planner, None
        if planner is not None:
            text = planner.out_of_memory() if out_of_memory else None  # said of the step before it is dropped
            planner.abandon_step(out_of_memory, _requested_bytes(exc) if out_of_memory else 0)
        self.reset()
        if text is not None:
            _log.warning(text)

    def refresh_parameters(self, tensors: Any = None) -> None:
        """Re-read the storages never to offload (the model's parameters and buffers, or ``tensors``).

        Every step, walking the module tree: a cache of what an earlier walk found was tried (on an H200 the walk is
        ~0.2 ms of small-h512's 23 ms step) and withdrawn. Held by weak reference, the tensors could no longer be
        swapped (``torch.utils.swap_tensors``, which ``Module.to`` uses for FSDP2's DTensor parameters), and a tensor
        registered between walks went unseen: offloaded for nothing, and counted by the memory-budget planner as
        activations."""
        if tensors is None:
            model = self._model_ref() if self._model_ref is not None else None
            tensors = [] if model is None else policy.parameters_and_buffers(model)
            if model is not None and self._inbound is not None:
                self._inbound.reserve_for_gradients(tensors)
        self._params.update(tensors)

    def reset(self) -> None:
        """Drop everything held for the current step: after an exception, nothing may leak into the next one.

        Host buffers of copies that the (failed) graph still references go back to the pool; unpacking such a
        tensor later raises a clear error instead of reading reused memory. The memory-budget planner learns nothing
        from the step (:meth:`failed` tells it whether the step ran out of memory): called after a step finished and
        before the next one, that step's measurement or timing is dropped too.
        """
        self.uninstall()
        self._transfer.synchronize()
        # Only this step's copies: graphs of earlier steps (a forward awaiting backward) stay valid.
        for copy in self._log.step_copies():
            copy.drop()
        self._transfer.discard()
        if self._outbound is not None and self._inbound is not None:
            self._outbound.clear()
            self._inbound.clear()
        self._log = SaveLog()
        self._counted = []
        if self.planner is not None:
            self.planner.abandon_step()  # learn nothing from a step that raised

    def _resolve_device(self) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        # A budget the user gave bounds the room the cache is emptied for, also where it goes unplanned (compiled).
        budget = self.options.budget_bytes()
        if self.options.plans and model is not None:
            self._unplanned_if_compiled(model)  # (before the options shape the transfer and the queues)
        if self.options.mode != "off" and model is not None:
            _warn_if_compiled_across_blocks(model)
        device = self.options.resolved_device() or _no_device()
        self._device = device
        self._pool = PoolAccount(pool_for(device))  # the process's pool, this engine's figures
        if self.options.mode == "streamed" and device.type != "meta":
            streams = self._streams
            if streams is None:
                streams = CudaStreams(device) if device.type == "cuda" else SimulatedStreams()
            self._transfer = StreamedTransfer(streams, self.options.measure_copies)
        self._outbound = OutboundQueue(self.options, self._transfer, self._pool, self.host_limit)
        self._inbound = InboundQueue(self._transfer, device, self.options.prefetch_bytes)
        self.planner = planner_for(self.options, device, self._transfer, model, self._memory)
        if self.planner is not None and self._carried_plans is not None:
            take_carried(self.planner.core, self._fingerprint(), self._carried_plans)
        if self.planner is None and self.options.mode != "off" and (self._memory is not None or device.type == "cuda"):
            memory = self._memory if self._memory is not None else DeviceMemory(device)
            self._settling = SettledCache(memory, budget)

    def _unplanned_if_compiled(self, model: torch.nn.Module) -> None:
        """A model compiled with ``torch.compile`` cannot be planned (:func:`compiled_modules`): said in a warning, and
        the engine runs without a planner. Under the default budget it offloads nothing (a model that fits pays
        nothing); under a budget the user gave, it offloads everything eligible, the least memory it can reach
        without planning."""
        compiled = compiled_modules(model)
        if not compiled:
            return
        shown = _module_names(model, compiled)
        budget = self.options.memory_budget
        auto = budget == "auto"
        said = "'auto'" if auto else f"{budget / (1 << 30):.2f} GiB"  # type: ignore[operator]
        warnings.warn(
            f"memory_budget={said}: the model is compiled (torch.compile: {shown}), and the "
            "planner cannot watch or checkpoint the blocks of a compiled model (hooks added after compiling may never "
            "run). "
            + (
                "Nothing is offloaded. "
                if auto
                else "Every eligible activation is offloaded instead, which may not keep the step within the budget. "
            )
            + "To offload without planning, pass memory_budget=None (with checkpoint='auto' to checkpoint the blocks) "
            "and compile each block rather than the whole model; to plan, leave the model uncompiled.",
            stacklevel=5,
        )
        self.options = dataclasses.replace(self.options, memory_budget=None, **({"mode": "off"} if auto else {}))

    def _offloading_starts(self) -> bool:
        """Offloading's frees would fragment fixed segments of reserved memory: switch to expandable ones when copies
        are about to leave (an engine whose plan keeps everything leaves the allocator alone). Returns whether the
        allocator switched (and emptied its cache) here."""
        return self.options.mode != "off" and self._device is not None and use_expandable_segments(self._device)

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
        assert self.planner is not None and self._device is not None
        model = self._model_ref() if self._model_ref is not None else None
        return fingerprint(model, self.planner.budget, self._device, self.planner.memory.total())

    def input_changed(self, key: Hashable) -> None:
        """Name the next step's input, e.g. ``tuple(batch.shape)`` (call it before each step, outside the block): under
        a memory budget a new input is measured before it is planned (its shapes save other bytes), and an input met
        before runs the plan it had then, without measuring again. Inputs whose length changes from batch to batch
        would otherwise measure at every step, each measuring step the most frugal there is. A key that is a tuple of
        ints (or of such tuples, which may hold names as strings) is read as shapes: a new input no larger in any
        dimension than one whose plan keeps every activation on the device, with the same names, runs that plan at
        once, unmeasured (it saves no more); name inputs that are not shapes by something else, a string say. Without
        a planner it does nothing.

        Raises:
            RuntimeError: called inside the engine's block.
            TypeError: ``key`` is not hashable, or is a tensor (it hashes by identity and compares element by element:
                pass its shape).
        """
        if isinstance(key, torch.Tensor):
            raise TypeError(
                "input_changed(key=<tensor>): expected the input's shapes, e.g. tuple(batch.shape), or another "
                "hashable value that names the input"
            )
        hash(key)  # refused before anything changes
        if self._active:
            raise RuntimeError("offload_activations(): input_changed() inside the engine's block; call it before it")
        planner = self.planner
        if planner is None:
            self._first_input = (key,)  # named to the planner once the first step makes it
            return
        if planner.runs_input(key):
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
        stats = self._stats
        self._transfer.collect(stats, wait)
        if self._outbound is not None:
            stats.inflight_bytes = self._outbound.inflight_bytes
            stats.host_bytes_held = self._pool.in_use_bytes
            stats.host_pinned_bytes = self._pool.reserved_bytes
            stats.host_allocations = self._pool.allocations - self._allocations_at_start
        return stats

    def host_limit(self) -> int:
        """Bytes the host pool may hold: ``host_memory_limit``, or a share of the RAM available at first use."""
        if self._host_limit is None:
            self._host_limit = host_limit(self.options.host_memory_limit, self._pool, self.local_processes)
        return self._host_limit

    # ------------------------------------------------------------------ the hooks

    def _pack(self, tensor: torch.Tensor) -> Any:
        stats = self._stats
        stats.saved_tensors += 1
        span = policy.offload_span(tensor, self._device, self.options.min_tensor_bytes, self._params)
        if span is None:
            return _keep(tensor)
        start, end, lo, hi = span
        log, outbound = self._log, self._outbound
        assert outbound is not None
        if not log.forward_open:
            log.forward_open = True
            outbound.start_forward(outbound.planned_limit)
            self._transfer.forward_started()
        if self.planner is not None and self.planner.passed_watermark():
            # The measuring step nears the budget: everything saved so far and from now on leaves. (Keeping the tail
            # here was tried: the plans then counted it twice, as part of the peak's fixed share and as kept
            # activations; on an H200 Llama-1B's floor budget went from checkpointing at 1.24x to offloading at 3.2x.)
            outbound.tail = 0
            self._offloading_starts()
        storage = tensor.untyped_storage()
        # Only tensors sharing a version counter share a copy: its version check then covers each of them. (The copy
        # pins both identities, so neither address can be reused while it lives.)
        key = (storage._cdata, version_root(tensor)._cdata)
        copy = log.find(key, start, end, tensor._version)
        off = self.options.mode == "off"
        if copy is None:
            # Past the forward's byte limit a copy can never leave: it needs no producer stream and no place in the
            # queue of copies waiting for their fate (the limit is fixed for the forward; positions only grow).
            stays = off or outbound.beyond_limit(log.position + hi - lo - log.forward_start)
            producer = None if stays else producer_stream(self._transfer)
            copy = StorageCopy(tensor, StorageWeakRef(storage), lo, hi, producer)
            log.add(copy, key)
            stats.eligible_bytes += copy.nbytes
            if off:
                # Count only (each storage span once): the record lives until forward ends, for dedup, without holding
                # the tensor (it weakly references the storage and root, which keep their identities unique), so a
                # tensor whose graph is dropped in forward is freed at once, as without the engine.
                copy.state = State.RESIDENT
                copy.alias = None
                self._counted.append(copy)
                return _keep(tensor)
            view = SavedView(copy, tensor, start, copy.end_pos - copy.nbytes, primary=True)
            if stays:
                outbound.keep_resident(copy, stats)
            else:
                outbound.pending.append(weakref.ref(copy))
            # Also where this copy stays: each save is where the way out lets go of the sources whose copies are done
            # (skipping it past the limit kept them allocated to the end of forward, past what plans count).
            outbound.send_decided(log, stats)
            return view
        if off:
            return _keep(tensor)
        if copy.state is State.OFFLOADED:
            stats.offloaded_tensors += 1  # served by a copy already on its way to the host
        return SavedView(copy, tensor, start, log.saved_again(copy))

    def _end_forward(self) -> None:
        """End the open forward: the pending tail stays resident, and its offloaded copies queue for prefetch."""
        if not self._log.forward_open:
            return
        assert self._outbound is not None and self._inbound is not None
        offloaded = self._outbound.end_forward(self._stats)
        self._counted = []
        saved = self._log.close_forward()
        if not offloaded and not self._said_tail:
            self._say_if_all_in_tail(saved)
        self._transfer.forward_ended(saved)
        if policy.backward_running():  # the first unpack: backward has started; time it, and note its peak
            self._transfer.backward_started(saved)
            if self.planner is not None:
                self.planner.backward_started()
                self._inbound.hold_above = self.planner.head_start(self._log.position - saved, self._log.position)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        self._inbound.add_forward(offloaded)

    def _say_if_all_in_tail(self, saved: int) -> None:
        """Say, once, that a forward which offloaded nothing saved less than the resident tail: a model that small
        offloads nothing however often it runs, while offloading was asked for. Not where a memory-budget plan keeps
        everything (no hooks, no forward here) or a measuring step keeps what fits (its tail is not the option's)."""
        outbound = self._outbound
        assert outbound is not None
        tail = outbound.default_tail
        if self.options.mode == "off" or outbound.tail != tail or not 0 < saved <= tail:
            return
        self._said_tail = True
        warnings.warn(
            f"lightning_offload: nothing offloaded, because all {saved / (1 << 20):.3g} MiB eligible fell in the "
            f"resident tail: a forward saved less than resident_tail_bytes ({tail / (1 << 20):.3g} MiB), the bytes "
            "backward needs first, which stay on the device. Lower resident_tail_bytes (to '16MiB', say, or 0) to "
            "offload a forward this small.",
            UserWarning,
            stacklevel=2,
        )

    def _backward_finished(self) -> None:
        self._transfer.backward_ended()
        if self._settling is not None:
            self._settling.backward_finished()
        if self.planner is not None:
            self.planner.backward_finished()

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is tuple:
            tensor, version = saved
            if tensor._version != version:
                raise modified_error(version, tensor._version)
            return tensor
        return self._restore(saved)

    def _restore(self, view: SavedView) -> torch.Tensor:
        copy = view.copy
        if copy.state is State.DROPPED:
            raise RuntimeError(
                "lightning_offload: this saved tensor was released because the step that saved it raised an "
                "exception; run forward again before calling backward"
            )
        if self._log.forward_open:
            self._end_forward()
        outbound, inbound = self._outbound, self._inbound
        assert outbound is not None and inbound is not None
        self._log.reached(view)
        if inbound.left_head(self._log.backward_pos) and self.planner is not None:
            self.planner.left_head(outbound.inflight_bytes)
        outbound.retire()  # before the version check: a finished copy seals the version it saw
        copy.check_version(view.version)
        if copy.state is not State.OFFLOADED:
            # The tensor the copy was made from, as a new alias: backward code may rebind what it is handed (``.data
            # = ...``), and the copy's own alias must keep the storage a later view of it is rebuilt from.
            alias = copy.alias
            primary = view.primary and alias is not None
            out = alias.detach() if primary else view.rebuild(copy.src)  # type: ignore[union-attr, arg-type]
            inbound.used_resident(view)
        else:
            out = view.rebuild(inbound.bring_back(copy, self._stats))
            inbound.used_offloaded(view)
        inbound.prefetch(self._log.backward_pos, self._stats)
        return out


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+ ?[A-Za-z]+)")


def _requested_bytes(exc: BaseException | None) -> int:
    """The allocation an out-of-memory error failed on, read from CUDA's message ("1000.00 MiB", read as the byte
    options' size strings are; 0: not stated)."""
    found = _REQUEST.search(str(exc)) if exc is not None else None
    return (size_in_bytes(found.group(1)) or 0) if found else 0


def _keep(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What autograd holds for a tensor that stays: a detached alias and its version, checked at unpack.

    Returning the tensor itself would make a saved output refer to itself through its ``grad_fn``: a cycle
    the garbage collector never frees. The version check is autograd's own, which hooks switch off.
    """
    return tensor.detach(), tensor._version


def _warn_if_compiled_across_blocks(model: torch.nn.Module) -> None:
    """Say that offloading can hardly lower the peak of a model compiled whole (:func:`compiled_across_blocks`)."""
    across = compiled_across_blocks(model)
    if not across:
        return
    shown = _module_names(model, across)
    warnings.warn(
        f"lightning_offload: {shown} is compiled (torch.compile) across several blocks: a compiled graph hands "
        "autograd its saved tensors only as it returns, so every activation of its blocks is on the device at its "
        "end whatever is offloaded after, and offloading can hardly lower the peak (on an H200, 0.06 GiB lower with "
        "1.8 GiB offloaded per step). Compile each block instead (for layer in model.layers: layer.compile()): "
        "the activations then leave block by block.",
        stacklevel=5,
    )


def _module_names(model: torch.nn.Module, names: list[str]) -> str:
    """``names`` of modules of ``model`` for a message: the first three quoted (the model itself by its class), then
    how many more."""
    shown = ", ".join(repr(name or type(model).__name__) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


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
        self._stats = OffloadStats()
        self._active = True
