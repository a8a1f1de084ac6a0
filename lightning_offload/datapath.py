"""The datapath of one engine: the saved-tensor hooks and what they keep for a step.

``pack`` asks the policy (``policy.py``) whether a saved tensor may leave, finds or creates the copy of its span
(``savelog.py`` dedups) and queues it on the way out (``outbound.py``), which decides when it leaves; the transfer
(``transfer.py``: sync, or streamed on copy streams) moves it into a pooled host buffer (``host_pool.py``). In
backward, ``unpack`` rebuilds the tensor; the first unpack of a forward seals it, and the way back (``inbound.py``)
fetches copies ahead of need on the link model of ``schedule.py``.

Where there is a memory-budget planner, the datapath marks the step's landmarks for it in its
:class:`~lightning_offload.step_marks.StepMarks` (a measuring step's watermark passed, backward begun, the head left,
backward ended); nothing is decided here. Per saved tensor that is an attribute read, and a call only in a measuring
step with a watermark. Torch only.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload import policy
from lightning_offload.copies import SavedView, State, StorageCopy, modified_error, version_root
from lightning_offload.device_memory import SettledCache, use_expandable_segments
from lightning_offload.host_pool import PoolAccount, pool_for
from lightning_offload.inbound import InboundQueue
from lightning_offload.options import OffloadOptions
from lightning_offload.outbound import OutboundQueue
from lightning_offload.savelog import SaveLog
from lightning_offload.stats import OffloadStats
from lightning_offload.streams import CudaStreams, SimulatedStreams, StreamBackend
from lightning_offload.transfer import StreamedTransfer, SyncTransfer, Transfer, producer_stream
from lightning_offload.weight_casts import WeightCasts

if TYPE_CHECKING:
    from lightning_offload.budget import BudgetPlanner
    from lightning_offload.step_marks import StepMarks


class Datapath:
    """The hooks' side of an engine: the step's save log and counters, the queues out and back, the transfer.

    Made with the engine; :meth:`connect` gives it the device (at the engine's first install), before which it
    holds nothing and moves nothing.

    Args:
        options: validated options (``mode``, ``min_tensor_bytes`` and the queues' sizes are read here).
    """

    def __init__(self, options: OffloadOptions) -> None:
        self.options = options
        self.device: torch.device | None = None
        self.params = policy.ParameterStorages()  # storages never to offload (the model's parameters and buffers)
        self.transfer: Transfer = SyncTransfer()
        self.outbound: OutboundQueue | None = None
        self.inbound: InboundQueue | None = None
        self.pool: PoolAccount | None = None
        self.planner: BudgetPlanner | None = None  # set with its marks by :meth:`use_planner`
        self.marks: StepMarks | None = None  # the planner's: read per saved tensor, so held here
        self.settling: SettledCache | None = None  # without a planner: the cache emptied after the first steps
        self.stats = OffloadStats()
        self.log = SaveLog()
        self.casts = WeightCasts()  # a measuring step's weight casts, per block (the planner turns it on)
        self.counted: list[StorageCopy] = []  # mode="off": what the open forward would offload (kept for dedup)
        self.said_tail = False  # whether a forward that fell wholly in the resident tail was said (once per engine)
        self._allocations_at_start = 0

    def connect(
        self,
        options: OffloadOptions,
        device: torch.device,
        streams: StreamBackend | None,
        host_limit: Callable[[], int],
    ) -> None:
        """Make the transfer and the queues for ``device`` (streamed copies where ``options.mode`` asks for them;
        ``streams``: their backend, ``None`` for CUDA's, or simulated ones on the CPU)."""
        self.options, self.device = options, device
        self.pool = PoolAccount(pool_for(device))  # the process's pool, this engine's figures
        if options.mode == "streamed" and device.type != "meta":
            if streams is None:
                streams = CudaStreams(device) if device.type == "cuda" else SimulatedStreams()
            self.transfer = StreamedTransfer(streams, options.measure_copies)
        self.outbound = OutboundQueue(options, self.transfer, self.pool, host_limit)
        self.inbound = InboundQueue(self.transfer, device, options.prefetch_bytes)

    def use_planner(self, planner: BudgetPlanner | None) -> None:
        """Mark the steps' landmarks for ``planner`` (``None``: steps are not planned)."""
        self.planner, self.marks = planner, planner.marks if planner is not None else None

    def start_step(self) -> None:
        """A new step's counters; the save log's positions carry on."""
        self.stats = OffloadStats()
        self._allocations_at_start = self.pool.allocations if self.pool is not None else 0
        self.log.start_step()

    def offloading_starts(self) -> bool:
        """Offloading's frees would fragment fixed segments of reserved memory: switch to expandable ones when copies
        are about to leave (an engine whose plan keeps everything leaves the allocator alone). Returns whether the
        allocator switched (and emptied its cache) here."""
        return self.options.mode != "off" and self.device is not None and use_expandable_segments(self.device)

    def collect_stats(self, wait: bool) -> OffloadStats:
        """Counters of the latest step; with ``wait=False`` timings still running are left for a later read."""
        stats = self.stats
        self.transfer.collect(stats, wait)
        if self.outbound is not None and self.pool is not None:
            stats.inflight_bytes = self.outbound.inflight_bytes
            stats.host_bytes_held = self.pool.in_use_bytes
            stats.host_pinned_bytes = self.pool.reserved_bytes
            stats.host_allocations = self.pool.allocations - self._allocations_at_start
        return stats

    def drop_step(self) -> None:
        """Drop what the current step holds (it raised): its copies' host buffers go back to the pool, and unpacking
        one of its tensors later raises a clear error instead of reading reused memory. Graphs of earlier steps (a
        forward awaiting backward) stay valid."""
        self.transfer.synchronize()
        for copy in self.log.step_copies():
            copy.drop()
        self.transfer.discard()
        if self.outbound is not None and self.inbound is not None:
            self.outbound.clear()
            self.inbound.clear()
        self.log = SaveLog()
        self.counted = []

    # ------------------------------------------------------------------ the hooks

    def pack(self, tensor: torch.Tensor) -> Any:
        stats = self.stats
        stats.saved_tensors += 1
        span = policy.offload_span(tensor, self.device, self.options.min_tensor_bytes, self.params)
        if span is None:
            if self.casts.counting:  # a measuring step: what the blocks hold out of the engine's reach
                self.casts.saw(tensor, self.device, self.params)
            return keep(tensor)
        start, end, lo, hi = span
        log, outbound = self.log, self.outbound
        assert outbound is not None
        if not log.forward_open:
            log.forward_open = True
            outbound.start_forward(outbound.planned_limit)
            self.transfer.forward_started()
        marks = self.marks
        if marks is not None and marks.watermark is not None and marks.passed_watermark():
            # The measuring step nears the budget: everything saved so far and from now on leaves. (Keeping the tail
            # here was tried: the plans then counted it twice, as part of the peak's fixed share and as kept
            # activations; on an H200 Llama-1B's floor budget went from checkpointing at 1.24x to offloading at 3.2x.)
            outbound.tail = 0
            self.offloading_starts()
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
            producer = None if stays else producer_stream(self.transfer)
            copy = StorageCopy(tensor, StorageWeakRef(storage), lo, hi, producer)
            log.add(copy, key)
            stats.eligible_bytes += copy.nbytes
            if off:
                # Count only (each storage span once): the record lives until forward ends, for dedup, without holding
                # the tensor (it weakly references the storage and root, which keep their identities unique), so a
                # tensor whose graph is dropped in forward is freed at once, as without the engine.
                copy.state = State.RESIDENT
                copy.alias = None
                self.counted.append(copy)
                return keep(tensor)
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
            return keep(tensor)
        if copy.state is State.OFFLOADED:
            stats.offloaded_tensors += 1  # served by a copy already on its way to the host
        return SavedView(copy, tensor, start, log.saved_again(copy))

    def end_forward(self) -> None:
        """End the open forward: the pending tail stays resident, and its offloaded copies queue for prefetch."""
        if not self.log.forward_open:
            return
        assert self.outbound is not None and self.inbound is not None
        offloaded = self.outbound.end_forward(self.stats)
        self.counted = []
        saved = self.log.close_forward()
        if not offloaded and not self.said_tail:
            self._say_if_all_in_tail(saved)
        self.transfer.forward_ended(saved)
        if policy.backward_running():  # the first unpack: backward has started; time it, and note its peak
            self.transfer.backward_started(saved)
            if self.planner is not None:
                self.planner.marks.backward_started()
                self.inbound.hold_above = self.planner.head_start(self.log.position - saved, self.log.position)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        self.inbound.add_forward(offloaded)

    def _say_if_all_in_tail(self, saved: int) -> None:
        """Say, once, that a forward which offloaded nothing saved less than the resident tail: a model that small
        offloads nothing however often it runs, while offloading was asked for. Not where a memory-budget plan keeps
        everything (no hooks, no forward here) or a measuring step keeps what fits (its tail is not the option's)."""
        outbound = self.outbound
        assert outbound is not None
        tail = outbound.default_tail
        if self.options.mode == "off" or outbound.tail != tail or not 0 < saved <= tail:
            return
        self.said_tail = True
        warnings.warn(
            f"lightning_offload: nothing offloaded, because all {saved / (1 << 20):.3g} MiB eligible fell in the "
            f"resident tail: a forward saved less than resident_tail_bytes ({tail / (1 << 20):.3g} MiB), the bytes "
            "backward needs first, which stay on the device. Lower resident_tail_bytes (to '16MiB', say, or 0) to "
            "offload a forward this small.",
            UserWarning,
            stacklevel=2,
        )

    def _backward_finished(self) -> None:
        self.transfer.backward_ended()
        if self.settling is not None:
            self.settling.backward_finished()
        if self.marks is not None:
            self.marks.backward_finished()

    def unpack(self, saved: Any) -> torch.Tensor:
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
        if self.log.forward_open:
            self.end_forward()
        outbound, inbound = self.outbound, self.inbound
        assert outbound is not None and inbound is not None
        self.log.reached(view)
        if inbound.left_head(self.log.backward_pos) and self.marks is not None:
            self.marks.left_head(outbound.inflight_bytes)
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
            out = view.rebuild(inbound.bring_back(copy, self.stats))
            inbound.used_offloaded(view)
        inbound.prefetch(self.log.backward_pos, self.stats)
        return out


def keep(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What autograd holds for a tensor that stays: a detached alias and its version, checked at unpack.

    Returning the tensor itself would make a saved output refer to itself through its ``grad_fn``: a cycle
    the garbage collector never frees. The version check is autograd's own, which hooks switch off.
    """
    return tensor.detach(), tensor._version
