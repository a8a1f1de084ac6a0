"""The offload engine: ``saved_tensors_hooks`` that move activations to host memory and bring them back.

Data flows one way. In forward, ``pack`` asks the policy whether a saved tensor may leave the device, finds or
creates the ``StorageCopy`` of its storage span, and returns a ``SavedView`` to autograd. Copies leave once out of
the resident tail (and within ``max_offload_bytes``), in save order, device -> host on a copy stream into pooled
host buffers; a model of the link (``schedule.py``) says where in forward each copy is done, and the compute stream
waits there (on the device) before the source is released. In backward, ``unpack`` rebuilds the tensor from its
span; the first unpack of a forward seals it and plans, per copy, the latest point to start bringing it back on
the other copy stream, in reverse save order, with at most ``prefetch_bytes`` fetched ahead.

Torch only: no Lightning import, so plain training loops can use it as a context manager.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import deque
from types import TracebackType
from typing import Any

import psutil
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload import policy
from lightning_offload.copies import SavedView, State, StorageCopy, byte_span, copy_span, modified_error
from lightning_offload.host_pool import HostMemoryFull, HostPool, pool_for
from lightning_offload.options import DEFAULT_MAX_INFLIGHT_BYTES, OffloadOptions
from lightning_offload.schedule import CopySchedule, link_bytes_per_ms
from lightning_offload.stats import OffloadStats
from lightning_offload.streams import TimingEvents, copy_streams, profiler_range

# The default host limit takes this share of the RAM available when the engine first copies, split between the
# processes of this machine (each rank has its own pool).
_DEFAULT_HOST_SHARE = 0.8
# The least lead of a copy back, in bytes saved during forward, whatever the link model says.
_PREFETCH_FLOOR = 64 << 20


class OffloadEngine:
    """Offloads saved activations while entered; rebuilds them in backward, also after the block is left.

    Create it once and enter it every step: streams, the host pool and the forward profile carry over.
    See :func:`offload_activations` for the options.
    """

    def __init__(
        self, options: OffloadOptions, model: torch.nn.Module | None = None, local_processes: int | None = None
    ) -> None:
        self.options = options
        # Processes on this machine, each with its own pool: the default host limit is split between them.
        # ``None``: read ``LOCAL_WORLD_SIZE`` (torchrun sets it; Lightning's own launchers pass the count instead).
        self.local_processes = local_processes
        self._model_ref = weakref.ref(model) if model is not None else None
        self._params = policy.ParameterStorages()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stats = OffloadStats()
        self._device: torch.device | None = None  # resolved lazily: the engine must pickle before first use
        self._warned_host_full = False
        self._host_limit: int | None = None
        cap = options.max_inflight_bytes
        if cap is None and options.max_offload_bytes is None:
            cap = DEFAULT_MAX_INFLIGHT_BYTES
        self._inflight_cap = cap
        self._reset_state()

    # ------------------------------------------------------------------ context management

    def __enter__(self) -> OffloadEngine:
        if self._hooks is not None:
            raise RuntimeError("offload_activations(): this engine is already active; enter it once at a time")
        self._begin_window()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks = hooks
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()
        if exc_type is not None:
            self.reset()

    def uninstall(self) -> None:
        """Remove the hooks (idempotent). Tensors already saved can still be unpacked."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if self._device is not None and self._cuda:
            self._retire_inflight()  # finished copies let go of their sources now, not at the next step

    @property
    def installed(self) -> bool:
        return self._hooks is not None

    def refresh_parameters(self, tensors: Any = None) -> None:
        """Re-read the storages never to offload (the model's parameters and buffers, or ``tensors``)."""
        if tensors is None:
            model = self._model_ref() if self._model_ref is not None else None
            tensors = [] if model is None else [*model.parameters(), *model.buffers()]
        self._params.update(tensors)

    def reset(self) -> None:
        """Drop everything held for the current step: after an exception, nothing may leak into the next one.

        Host buffers of copies that the (failed) graph still references go back to the pool; unpacking such a
        tensor later raises a clear error instead of reading reused memory.
        """
        self.uninstall()
        if self._device is not None and self._device.type == "cuda":
            d2h, h2d = copy_streams(self._device)
            d2h.synchronize()
            h2d.synchronize()
        # Only this window's copies: graphs of earlier windows (a forward awaiting backward) stay valid.
        for ref in self._all_copies[self._window_first_copy :]:
            copy = ref()
            if copy is not None:
                copy.state = State.DROPPED
                copy.src = copy.device = copy.alias = None
                copy.drop_host()
        self._stall_timer.discard()
        self._d2h_timer.discard()
        self._h2d_timer.discard()
        self._reset_state()

    def _reset_state(self) -> None:
        self._by_storage: dict[int, list[weakref.ref[StorageCopy]]] = {}
        self._pending: deque[StorageCopy] = deque()  # saved, not yet offloaded, in save order
        self._segment: list[weakref.ref[StorageCopy]] = []  # offloaded copies of the open forward, in save order
        self._counted: list[StorageCopy] = []  # mode="off": what the open forward would offload
        self._segment_open = False
        # Positions are eligible bytes saved since the engine was made: monotone across forwards, so copies of
        # several forwards awaiting one backward still order correctly.
        self._saved_pos = 0
        self._segment_start = 0  # position where the open forward began
        self._profile_total: int | None = None  # eligible bytes of the previous forward
        self._backward_pos = 0  # lowest position backward has reached (it walks the forward in reverse)
        # Device -> host copies in flight: (done event, bytes, source, its record, position by which it should be
        # done), oldest first.
        self._inflight: deque[tuple[torch.cuda.Event, int, torch.Tensor, weakref.ref[StorageCopy], float | None]] = (
            deque()
        )
        self._schedule = CopySchedule()
        self._inflight_bytes = 0
        self._fetch_queue: list[weakref.ref[StorageCopy]] = []  # sealed forward, next to prefetch at the end
        self._fetch_at: list[float] = []  # backward position at which each queued copy must start coming back
        self._prefetched: deque[tuple[weakref.ref[StorageCopy], int]] = deque()  # fetched ahead, not yet used
        self._prefetched_bytes = 0
        self._all_copies: list[weakref.ref[StorageCopy]] = []
        self._window_first_copy = 0  # copies made before this index belong to earlier windows
        self._stall_timer = TimingEvents()
        self._d2h_timer = TimingEvents()
        self._h2d_timer = TimingEvents()

    def _begin_window(self) -> None:
        self._seal()  # a forward that never got its backward ends here, and counts in its own window
        if self._device is None:
            device = self.options.resolved_device()
            if device is None:
                # Lesson 6: never offload CPU tensors unless asked. Without CUDA, count and keep everything.
                warnings.warn(
                    "offload_activations(): CUDA is not available and compute_device=None, so nothing is "
                    "offloaded. Pass compute_device='cpu' to exercise the engine on CPU tensors.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                device = torch.device("meta")  # no real tensor lives there: nothing is eligible
            self._device = device
            self._cuda = self._device.type == "cuda"
            self._pool: HostPool = pool_for(self._device)
            if self._cuda:
                self._d2h, self._h2d = copy_streams(self._device)
                if self.options.mode == "streamed":
                    self._link_rate = link_bytes_per_ms(self._device)
        self._finish_timers(wait=False)  # leftovers of older windows; never a host sync on the step path
        self._stats = OffloadStats()
        self._allocations_at_start = self._pool.allocations
        self.refresh_parameters()
        self._all_copies = [ref for ref in self._all_copies if ref() is not None]
        self._window_first_copy = len(self._all_copies)

    # ------------------------------------------------------------------ stats

    @property
    def stats(self) -> OffloadStats:
        """Counters of the latest window (reading it waits for the timing events of that window)."""
        return self.collect_stats(wait=True)

    def collect_stats(self, wait: bool) -> OffloadStats:
        """Counters of the latest window; with ``wait=False`` timings still running are left for a later read."""
        self._finish_timers(wait)
        if self._device is not None:
            self._stats.host_bytes_held = self._pool.in_use_bytes
            self._stats.host_pinned_bytes = self._pool.reserved_bytes
            self._stats.host_allocations = self._pool.allocations - self._allocations_at_start
        return self._stats

    def _finish_timers(self, wait: bool = True) -> None:
        if self._device is None or not self._cuda:
            return
        self._stats.stall_ms += self._stall_timer.collect_ms(wait)
        self._stats.d2h_ms += self._d2h_timer.collect_ms(wait)
        self._stats.h2d_ms += self._h2d_timer.collect_ms(wait)

    def host_limit(self) -> int:
        """Bytes the host pool may hold: ``host_memory_limit``, or a share of the RAM available at first use."""
        if self._host_limit is None:
            limit = self.options.host_memory_limit
            if limit is None:
                ranks = self.local_processes or _env_int("LOCAL_WORLD_SIZE", 1)
                ranks = max(1, ranks)
                available = psutil.virtual_memory().available
                limit = self._pool.reserved_bytes + int(available * _DEFAULT_HOST_SHARE / ranks)
            self._host_limit = limit
        return self._host_limit

    # ------------------------------------------------------------------ forward: pack

    def _pack(self, tensor: torch.Tensor) -> Any:
        stats = self._stats
        stats.saved_tensors += 1
        # Cheapest test first: most saved tensors of a small model stop here, for the cost of two attribute reads.
        if tensor.device != self._device or not policy.plain_dense(tensor):
            return _keep(tensor)
        storage = tensor.untyped_storage()
        storage_nbytes = storage.nbytes()
        if storage_nbytes < self.options.min_tensor_bytes or not self._eligible(tensor):
            return _keep(tensor)
        start, end = byte_span(tensor)
        lo, hi = copy_span(start, end, storage_nbytes)
        if hi - lo < self.options.min_tensor_bytes:
            return _keep(tensor)
        if not self._segment_open:
            self._segment_open = True
            if self._cuda and self.options.mode == "streamed":
                self._schedule.forward_started(torch.cuda.current_stream(self._device))
        ref = StorageWeakRef(storage)
        version = tensor._version
        copy = self._find_copy(ref.cdata, start, end, version)
        if copy is None:
            stream = torch.cuda.current_stream(self._device) if self._cuda else None
            copy = StorageCopy(tensor, ref, lo, hi, stream)
            self._by_storage.setdefault(ref.cdata, []).append(weakref.ref(copy))
            self._all_copies.append(weakref.ref(copy))
            self._saved_pos += copy.nbytes
            copy.end_pos = self._saved_pos
            stats.eligible_bytes += copy.nbytes
            if self.options.mode == "off":
                # Count only (each storage span once): the record lives until forward ends, for dedup.
                copy.state = State.RESIDENT
                self._counted.append(copy)
                return _keep(tensor)
            view = SavedView(copy, tensor, start)
            self._pending.append(copy)
            self._release_pending()
            return view
        if self.options.mode == "off":
            return _keep(tensor)
        if copy.state is State.OFFLOADED:
            stats.offloaded_tensors += 1  # served by a copy already on its way to the host
        return SavedView(copy, tensor, start)

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """The rules beyond device, layout and size (checked first, because they are cheaper)."""
        if policy.offload_suppressed() or policy.backward_running():
            return False
        if policy.is_parameter_like(tensor):
            return False
        return StorageWeakRef(tensor.untyped_storage()).cdata not in self._params if len(self._params) else True

    def _find_copy(self, key: int, start: int, end: int, version: int) -> StorageCopy | None:
        for ref in self._by_storage.get(key, ()):
            copy = ref()
            if copy is not None and copy.covers(start, end, version):
                return copy
        return None

    def _release_pending(self) -> None:
        """Offload pending copies, oldest first, once they have left the resident tail."""
        if self._inflight:
            self._retire_inflight()
            self._wait_due()
        tail = self.options.resident_tail_bytes
        budget = self._offload_budget()
        # From the second forward on, the previous forward's size says which copies will end up outside the
        # tail, so they go at once instead of waiting for ``tail`` more bytes to be saved after them.
        start = self._segment_start
        cutoff = (start + self._profile_total - tail) if self._profile_total is not None else -1
        while self._pending:
            copy = self._pending[0]
            if budget is not None and copy.end_pos - start > budget:
                # Only the first ``max_offload_bytes`` of a forward leave: the earliest tensors have the most
                # compute to hide their copies behind, both ways.
                self._pending.popleft()
                copy.state = State.RESIDENT
                self._stats.resident_bytes += copy.nbytes
                continue
            if self._saved_pos - copy.end_pos < tail and copy.end_pos > cutoff:
                return
            self._pending.popleft()
            self._offload(copy)

    def _offload_budget(self) -> int | None:
        budget = self.options.max_offload_bytes
        if budget != "auto":
            return budget
        # What the link moves while forward runs: bandwidth x forward time = forward's bytes / (its pace / link's).
        ratio = self._schedule.ratio
        if ratio is None or self._profile_total is None:
            return None  # until measured (first forward), offload everything: memory first
        return int(self._profile_total / ratio)

    def _offload(self, copy: StorageCopy) -> None:
        try:
            host, ready = self._pool.acquire(copy.nbytes, self.host_limit())
        except HostMemoryFull as err:
            if self.options.on_host_full == "error":
                raise
            if not self._warned_host_full:
                self._warned_host_full = True
                warnings.warn(f"{err} Keeping the remaining tensors on the device.", RuntimeWarning, stacklevel=3)
            copy.state = State.RESIDENT
            self._stats.resident_bytes += copy.nbytes
            return
        src = copy.src
        assert src is not None and copy.alias is not None
        copy.modified = copy.alias._version != copy.version  # changed in place between its save and now
        copy.alias = None
        target = host[: copy.nbytes]
        copy.host, copy.pool = host, self._pool
        copy.state = State.OFFLOADED
        with profiler_range("offload::d2h"):
            if self.options.mode == "streamed" and self._cuda:
                d2h = self._d2h
                d2h.wait_stream(copy.producer)  # the source is complete once its producer got this far
                if ready is not None:
                    d2h.wait_event(ready)  # the buffer's previous copy has finished with it
                timing = self._d2h_timer.start(d2h) if self.options.measure_copies else None
                with torch.cuda.stream(d2h):
                    target.copy_(src, non_blocking=True)
                done = d2h.record_event()
                if timing is not None:
                    timing[1].record(d2h)
                copy.d2h_done = copy.last_use = done
                # The source stays referenced until its copy is done, so the allocator cannot hand its memory to
                # new tensors while the copy stream still reads it; until then backward may also use it directly.
                deadline = self._schedule.deadline(copy.end_pos, copy.nbytes)
                self._inflight.append((done, copy.nbytes, src, weakref.ref(copy), deadline))
                self._inflight_bytes += copy.nbytes
                self._throttle()
            else:
                target.copy_(src)
                copy.src = None
        self._segment.append(weakref.ref(copy))
        self._stats.offloaded_bytes += copy.nbytes
        self._stats.offloaded_tensors += copy.views_left

    def _throttle(self) -> None:
        """Bound the bytes whose copies lag behind: the compute stream waits (on the device) for the oldest.

        Once the compute stream waits for a copy's event, everything it runs later is ordered after the copy, so
        the source can be let go at once: its memory is reused only by that later work. No host synchronization.
        """
        cap = self._inflight_cap
        if cap is None and self._schedule.ratio is None:
            cap = DEFAULT_MAX_INFLIGHT_BYTES  # no model of the link yet (first forward): bound memory plainly
        if cap is None:
            return
        while self._inflight_bytes > cap and len(self._inflight) > 1:
            self._wait_oldest()

    def _wait_due(self) -> None:
        """Let go of sources whose copies the link model says are done by now (device-side wait, no sync)."""
        position = self._saved_pos
        while self._inflight:
            deadline = self._inflight[0][4]
            if deadline is None or deadline > position:
                return
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        done, nbytes, src, ref, _ = self._inflight.popleft()
        torch.cuda.current_stream(self._device).wait_event(done)
        self._inflight_bytes -= nbytes
        self._let_go(src, ref)

    def _retire_inflight(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0][0].query():
            _, nbytes, src, ref, _ = inflight.popleft()
            self._inflight_bytes -= nbytes
            self._let_go(src, ref)

    @staticmethod
    def _let_go(src: torch.Tensor, ref: weakref.ref[StorageCopy]) -> None:
        copy = ref()
        if copy is not None and copy.src is src and copy.device is not src:
            copy.src = None

    # ------------------------------------------------------------------ backward: unpack and prefetch

    def _seal(self) -> None:
        """End the open forward: the pending tail stays resident, and its offloaded copies queue for prefetch."""
        if not self._segment_open:
            return
        self._segment_open = False
        for copy in self._pending:
            copy.state = State.RESIDENT
            self._stats.resident_bytes += copy.nbytes
        self._pending.clear()
        self._counted = []
        self._profile_total = self._saved_pos - self._segment_start
        if self._cuda and self.options.mode == "streamed":
            stream = torch.cuda.current_stream(self._device)
            self._schedule.forward_ended(stream, self._profile_total, self._link_rate)
        self._segment_start = self._backward_pos = self._saved_pos
        # Backward needs the last-saved tensors first; prefetch walks the forward backwards.
        self._fetch_queue = self._segment + self._fetch_queue
        self._segment = []
        self._plan_prefetch()
        self._by_storage = {}

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
        self._seal()
        self._backward_pos = min(self._backward_pos, copy.end_pos - copy.nbytes)
        if copy.modified:
            raise modified_error(view.version, None)
        if copy.alias is not None and copy.alias._version != view.version:
            raise modified_error(view.version, copy.alias._version)
        if copy.state is not State.OFFLOADED:
            out = view.rebuild(copy.src)  # type: ignore[arg-type]
            self._prefetch()
            return out
        if self._inflight:
            self._retire_inflight()
        consumer = torch.cuda.current_stream(self._device) if self._cuda else None
        span = copy.device
        if span is None:
            # A source whose device -> host copy is still running is used as it is: no round trip.
            span = copy.src if copy.src is not None else self._fetch(copy, on_demand=True)
        if consumer is not None and span is not copy.src and self.options.mode == "streamed":
            done = copy.h2d_done
            assert done is not None
            if not done.query():
                _, end = self._stall_timer.start(consumer)
                consumer.wait_event(done)
                end.record(consumer)
            else:
                consumer.wait_event(done)
        out = view.rebuild(span)
        if view.first:
            view.first = False
            copy.views_left -= 1
            if copy.views_left <= 0:
                # Autograd now holds what it needs; a second backward (retain_graph) fetches from host again.
                # (A source still being copied out stays alive in the in-flight queue until its copy is done.)
                copy.device = copy.src = None
        self._prefetch()
        return out

    def _fetch(self, copy: StorageCopy, on_demand: bool) -> torch.Tensor:
        assert copy.host is not None
        source = copy.host[: copy.nbytes]
        with profiler_range("offload::h2d"):
            span = torch.empty(copy.nbytes, dtype=torch.uint8, device=self._device)
            if self.options.mode == "streamed" and self._cuda:
                h2d = self._h2d
                # ``span`` was allocated on the compute stream; its block may still be read by kernels queued
                # there, and the host bytes may still be arriving from the device -> host stream.
                h2d.wait_stream(torch.cuda.current_stream(self._device))
                if copy.d2h_done is not None:
                    h2d.wait_event(copy.d2h_done)
                timing = self._h2d_timer.start(h2d) if self.options.measure_copies else None
                with torch.cuda.stream(h2d):
                    span.copy_(source, non_blocking=True)
                done = h2d.record_event()
                if timing is not None:
                    timing[1].record(h2d)
                # If the graph is dropped before backward uses it, the allocator must not reuse the block while
                # the copy into it is still pending.
                span.record_stream(h2d)
                copy.h2d_done = copy.last_use = done
            else:
                span.copy_(source)
        copy.device = span
        if on_demand:
            self._stats.fetched_on_demand_bytes += copy.nbytes
        else:
            self._stats.prefetched_bytes += copy.nbytes
        return span

    def _plan_prefetch(self) -> None:
        """For each queued copy, the latest backward position at which its copy back can start and still arrive.

        Positions are bytes saved in forward; backward walks them downwards. The host -> device stream serves
        copies in the order backward needs them, so a copy must also start early enough for the ones after it:
        a pass from the last-needed copy up gives each its latest start. Fetching no earlier keeps prefetched
        bytes out of the backward peak; ``prefetch_bytes`` caps what is fetched and not yet used.
        """
        lead = self._schedule.backward_lead()
        floor = _PREFETCH_FLOOR
        latest_start = float("-inf")
        plan = []
        for ref in self._fetch_queue:  # lowest position (needed last) first
            copy = ref()
            if copy is None:
                plan.append(float("inf"))  # dead: drop it whenever the walk reaches it
                continue
            # Done before backward reaches it, and before the copy after it in the queue must start.
            finish = max(float(copy.end_pos), latest_start)
            latest_start = finish + copy.nbytes * lead
            plan.append(max(latest_start, float(copy.end_pos + floor)))
        self._fetch_at = plan

    def _prefetch(self) -> None:
        """Start the copies back whose planned start backward has reached, latest-saved first."""
        if self.options.mode != "streamed" or not self._cuda:
            return
        ahead = self._prefetched
        while ahead and (ahead[0][0]() is None or ahead[0][0]().device is None):  # type: ignore[union-attr]
            self._prefetched_bytes -= ahead.popleft()[1]
        queue, plan = self._fetch_queue, self._fetch_at
        cap = self.options.prefetch_bytes
        while queue and plan[-1] >= self._backward_pos:
            copy = queue[-1]()
            if copy is not None and self._prefetched_bytes and self._prefetched_bytes + copy.nbytes > cap:
                return  # memory bound: the rest follows as backward consumes what came back
            queue.pop()
            plan.pop()
            if copy is None or copy.state is not State.OFFLOADED or copy.device is not None:
                continue
            if copy.src is not None:
                copy.device = copy.src  # still on the device (its copy out is in flight): keep it, fetch nothing
            else:
                self._fetch(copy, on_demand=False)
            ahead.append((weakref.ref(copy), copy.nbytes))
            self._prefetched_bytes += copy.nbytes


def _keep(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What autograd holds for a tensor that stays: a detached alias and its version, checked at unpack.

    Returning the tensor itself would make a saved output refer to itself through its ``grad_fn``: a cycle
    the garbage collector never frees. The version check is autograd's own, which hooks switch off.
    """
    return tensor.detach(), tensor._version


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def offload_activations(
    mode: str = "streamed",
    compute_device: str | torch.device | None = None,
    min_tensor_bytes: int = OffloadOptions.min_tensor_bytes,
    resident_tail_bytes: int = OffloadOptions.resident_tail_bytes,
    max_offload_bytes: int | str | None = None,
    max_inflight_bytes: int | None = None,
    prefetch_bytes: int = OffloadOptions.prefetch_bytes,
    host_memory_limit: int | None = None,
    on_host_full: str = "warn",
    measure_copies: bool = False,
    model: torch.nn.Module | None = None,
    checkpoint: Any = None,
    local_processes: int | None = None,
) -> OffloadEngine:
    """Offload the activations autograd saves inside the ``with`` block to host memory.

    Example::

        off = offload_activations()          # create once: the pinned pool and streams are reused
        for x in batches:
            with off:
                loss = model(x).sum()
            loss.backward()
            print(off.stats.offloaded_bytes)

    Args:
        mode: ``"streamed"`` overlaps copies with compute on two copy streams and prefetches in backward;
            ``"sync"`` copies on the compute stream when a tensor is saved and when backward needs it (simple,
            for debugging); ``"off"`` offloads nothing and only counts what would be offloaded.
        compute_device: the device whose tensors are offloaded. ``None``: the current CUDA device. ``"cpu"``
            treats CPU tensors as offloadable (copied to separate host buffers) so the bookkeeping runs without
            a GPU.
        min_tensor_bytes: storage spans smaller than this stay on the device (default 1 MiB: smaller copies
            are dominated by fixed costs and free almost nothing).
        resident_tail_bytes: a tensor leaves the device only once this many bytes were saved after it in the
            same forward, so the last tensors of forward (logits, loss), needed first by backward, stay.
        max_offload_bytes: offload at most the first this-many bytes of each forward (the earliest tensors hide
            their copies best); the rest stays on the device. ``None``: no limit. This is the knob that trades
            memory for time: about ``link bandwidth x forward time`` bytes move for free, and ``"auto"`` offloads
            exactly that, measured (everything on the first forward, before there is a measurement).
        max_inflight_bytes: device -> host copies may lag forward by this many bytes; beyond it the compute
            stream waits for the oldest copy (a device-side wait), so memory held by copies in flight stays
            bounded. ``None``: 512 MiB when everything eligible is offloaded; no bound with
            ``max_offload_bytes`` (copies of the earliest tensors catch up long before forward ends).
        prefetch_bytes: the most bytes fetched back ahead of backward and not yet used (device memory that
            prefetching may hold). When each copy starts comes from a model of the link: forward's measured
            pace against the link's bandwidth.
        host_memory_limit: the most host memory the pool may hold, in bytes. ``None``: 80% of the RAM
            available at first use, divided by ``LOCAL_WORLD_SIZE``.
        on_host_full: when the limit (or the machine's free RAM) is reached: ``"warn"`` keeps further tensors
            on the device and warns once; ``"error"`` raises :class:`~lightning_offload.HostMemoryFull`.
        measure_copies: time every copy (``stats.d2h_ms``/``h2d_ms``); costs two events per copy.
        model: its parameters and buffers (by storage) are never offloaded. Parameters, their views and casts
            are recognised without it; buffers only with it.
        checkpoint: also checkpoint ``model``'s repeated blocks (non-reentrant) so only each block's input is
            saved and offloaded: ``"auto"`` (the largest list of same-class blocks), a class, a class name or a
            module name, or a list of those. ``None``: no checkpointing. Applied once, here.
        local_processes: the processes on this machine, each with its own pool, that share the default host
            limit. ``None``: ``LOCAL_WORLD_SIZE`` (1 when unset).

    Returns:
        An :class:`OffloadEngine`: a reusable context manager whose ``stats`` describe its latest block.
    """
    options = OffloadOptions.create(
        "offload_activations",
        mode=mode,
        compute_device=compute_device,
        min_tensor_bytes=min_tensor_bytes,
        resident_tail_bytes=resident_tail_bytes,
        max_offload_bytes=max_offload_bytes,
        max_inflight_bytes=max_inflight_bytes,
        prefetch_bytes=prefetch_bytes,
        host_memory_limit=host_memory_limit,
        on_host_full=on_host_full,
        measure_copies=measure_copies,
    )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_activations(model={type(model).__name__}): model must be a torch.nn.Module or None")
    if checkpoint is not None:
        if model is None:
            raise ValueError(f"offload_activations(checkpoint={checkpoint!r}): checkpointing needs model=")
        from lightning_offload.checkpointing import apply_checkpointing

        apply_checkpointing(model, checkpoint)
    return OffloadEngine(options, model=model, local_processes=local_processes)
