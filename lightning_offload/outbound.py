"""The way out: copies saved but not yet sent (the resident tail, the byte limit), their sending, and copies in flight.

A copy leaves once enough bytes were saved after it (``resident_tail_bytes``) and only if it lies within the first
``limit`` bytes of its forward. While its device -> host copy runs, its source must stay allocated: the queue holds
it, and lets go once the copy is known to be done (its event reports done) or ordered before all later compute (the
compute stream waited for it, on the device). Waiting is forced when too many bytes are in flight (the throttle) and
where the link model says the copy is done anyway (free then); never a host synchronization.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lightning_offload.copies import State, StorageCopy
from lightning_offload.host_pool import HostMemoryFull, PoolAccount
from lightning_offload.options import DEFAULT_MAX_INFLIGHT_BYTES, OffloadOptions
from lightning_offload.savelog import SaveLog
from lightning_offload.stats import OffloadStats
from lightning_offload.streams import Event
from lightning_offload.transfer import StreamedTransfer, Transfer


@dataclass
class InFlight:
    """A device -> host copy that may still be reading its source."""

    done: Event
    nbytes: int
    src: torch.Tensor  # keeps the source allocated until the copy is done
    copy: weakref.ref[StorageCopy]
    deadline: float | None  # position by which the link model says it is done (None: no model yet)


class OutboundQueue:
    """Pending copies in save order, their sending, and the copies on their way out, oldest first.

    Args:
        options: the engine's options (tail, limit, in-flight cap, what to do when host memory is full).
        transfer: moves the bytes.
        pool: hands out host buffers.
        host_limit: the bytes the pool may hold (read when a buffer is needed).
    """

    def __init__(
        self, options: OffloadOptions, transfer: Transfer, pool: PoolAccount, host_limit: Callable[[], int]
    ) -> None:
        self.tail = self.default_tail = options.resident_tail_bytes
        self.prefetch_cap = options.prefetch_bytes
        cap = options.max_inflight_bytes
        if cap is None and options.max_offload_bytes is None:
            cap = DEFAULT_MAX_INFLIGHT_BYTES
        self.inflight_cap = self.configured_inflight_cap = cap  # a memory-budget plan may change the first per step
        self.inflight_fixed = options.max_inflight_bytes is not None  # the user's: plans keep it
        self.limit: int | None = None  # the most bytes of the open forward that may leave
        self.planned_limit: int | None = None  # the limit the memory-budget plan set for this step
        self._options = options
        self._transfer = transfer
        self._pool = pool
        self._host_limit = host_limit
        self._warned_host_full = False
        # Weak: a saved tensor whose graph is dropped while it waits (a metric computed with grad enabled) is freed at
        # once, as without offloading, instead of held to the end of forward and then copied out for nothing.
        self.pending: deque[weakref.ref[StorageCopy]] = deque()
        self.inflight: deque[InFlight] = deque()
        self.inflight_bytes = 0
        self.forward_copies: list[weakref.ref[StorageCopy]] = []  # offloaded copies of the open forward

    def configure(self, tail: int, inflight_cap: int | None) -> None:
        """Set the next forward's resident tail and in-flight bound (a memory-budget plan's, or a measuring step's)."""
        self.tail, self.inflight_cap = tail, inflight_cap

    @property
    def link_ratio(self) -> float | None:
        transfer = self._transfer
        return transfer.link.ratio if isinstance(transfer, StreamedTransfer) else None

    def host_capacity(self) -> int:
        """The most bytes of copies the host pool could hold now (its limit, or what the machine's RAM allows)."""
        return self._pool.capacity(self._host_limit())

    def start_forward(self, planned_limit: int | None) -> None:
        """A forward starts saving: fix how many of its bytes may leave (a plan's limit, else the option's)."""
        self.limit = planned_limit if planned_limit is not None else self._options.max_offload_bytes

    def end_forward(self, stats: OffloadStats) -> list[weakref.ref[StorageCopy]]:
        """The open forward ended: what is still pending stays on the device. Returns its offloaded copies."""
        self.keep_pending(stats)
        copies, self.forward_copies = self.forward_copies, []
        return copies

    def keep_pending(self, stats: OffloadStats) -> None:
        """Everything pending (and still saved by a live graph) stays on the device."""
        for ref in self.pending:
            copy = ref()
            if copy is not None:
                self.keep_resident(copy, stats)
        self.pending.clear()

    def send_decided(self, log: SaveLog, stats: OffloadStats) -> None:
        """Offload the pending copies that left the tail (or keep those beyond the limit), oldest first."""
        if self.inflight:
            self.retire()
            self.wait_due(log.position, self._transfer.wait)
        for copy, leaves in self.decided(log.position, log.forward_start, log.previous_forward):
            if leaves:
                self.offload(copy, stats)
            else:
                self.keep_resident(copy, stats)

    def keep_resident(self, copy: StorageCopy, stats: OffloadStats) -> None:
        copy.state = State.RESIDENT
        stats.resident_bytes += copy.nbytes

    def offload(self, copy: StorageCopy, stats: OffloadStats) -> None:
        """Send ``copy`` to a host buffer (or keep it, when host memory is full and ``on_host_full='warn'``)."""
        try:
            host, ready = self._pool.acquire(copy.nbytes, self._host_limit())
        except HostMemoryFull as err:
            if self._options.on_host_full == "error":
                raise
            if not self._warned_host_full:
                self._warned_host_full = True
                warnings.warn(err.message("warn"), RuntimeWarning, stacklevel=5)
            self.keep_resident(copy, stats)
            return
        copy.host, copy.pool = host, self._pool
        copy.state = State.OFFLOADED
        done = self._transfer.copy_out(copy, host[: copy.nbytes], ready)
        copy.d2h_done = copy.last_use = done
        if done is None:  # the copy is complete: the host holds the saved bytes
            copy.seal_version()
            copy.src = None
        else:
            deadline = self._transfer.link.deadline(copy.end_pos, copy.nbytes)  # type: ignore[union-attr]
            self.track(copy, done, deadline)
            cap = self.inflight_cap
            if cap is None and self.link_ratio is None:
                cap = DEFAULT_MAX_INFLIGHT_BYTES  # no model of the link yet (first forward): bound memory plainly
            self.throttle(self._transfer.wait, cap)
        self.forward_copies.append(weakref.ref(copy))
        stats.offloaded_bytes += copy.nbytes
        stats.offloaded_tensors += copy.views_left

    def beyond_limit(self, forward_bytes: int) -> bool:
        """Whether a copy ending ``forward_bytes`` into the open forward lies past the limit (it stays)."""
        return self.limit is not None and forward_bytes > self.limit

    def decided(
        self, position: int, forward_start: int, previous_total: int | None
    ) -> Iterator[tuple[StorageCopy, bool]]:
        """Pending copies whose fate is now known, oldest first: ``(copy, leaves)``.

        From the second forward on, the previous forward's size says which copies end up outside the tail, so they
        go at once instead of waiting for ``tail`` more bytes to be saved after them.
        """
        cutoff = forward_start + previous_total - self.tail if previous_total is not None else -1
        pending = self.pending
        while pending:
            copy = pending[0]()
            if copy is None:  # its graph was dropped: nothing will ever read it
                pending.popleft()
                continue
            if self.beyond_limit(copy.end_pos - forward_start):
                # Only the first ``limit`` bytes of a forward leave: the earliest tensors have the most compute to
                # hide their copies behind, both ways.
                pending.popleft()
                yield copy, False
                continue
            if position - copy.end_pos < self.tail and copy.end_pos > cutoff:
                return
            pending.popleft()
            yield copy, True

    def track(self, copy: StorageCopy, done: Event, deadline: float | None) -> None:
        assert copy.src is not None
        self.inflight.append(InFlight(done, copy.nbytes, copy.src, weakref.ref(copy), deadline))
        self.inflight_bytes += copy.nbytes

    def throttle(self, wait: Callable[[Event], None], cap: int | None) -> None:
        """Bound the bytes whose copies lag behind: the compute stream waits (on the device) for the oldest.

        Once the compute stream waits for a copy's event, everything it runs later is ordered after the copy, so the
        source can be let go at once: its memory is reused only by that later work.
        """
        if cap is None:
            return
        while self.inflight_bytes > cap and len(self.inflight) > 1:
            self._let_go(self.inflight.popleft(), wait)

    def wait_due(self, position: int, wait: Callable[[Event], None]) -> None:
        """Let go of sources whose copies the link model says are done by ``position`` (device-side wait)."""
        while self.inflight:
            deadline = self.inflight[0].deadline
            if deadline is None or deadline > position:
                return
            self._let_go(self.inflight.popleft(), wait)

    def let_go_all(self) -> None:
        """Let go of every source still being copied out (device-side waits): forward reached the head, whose
        transient (the logits, the loss) comes on top of whatever the device still holds. A memory-budget plan
        counts these copies done by then; where the link is behind, compute waits for it here, once."""
        while self.inflight:
            self._let_go(self.inflight.popleft(), self._transfer.wait)

    def retire(self) -> None:
        """Let go of sources whose copies the device reports done."""
        inflight = self.inflight
        while inflight and inflight[0].done.query():
            self._let_go(inflight.popleft(), None)

    def _let_go(self, item: InFlight, wait: Callable[[Event], None] | None) -> None:
        if wait is not None:
            wait(item.done)
        self.inflight_bytes -= item.nbytes
        copy = item.copy()
        if copy is None or copy.fetched is item.src:
            return  # backward already uses the source in place: keep watching its version
        # From here on the host bytes are complete and every later write is ordered after them: an in-place change
        # seen now may have raced the copy (flag it), one made later cannot reach the host copy.
        copy.seal_version()
        if copy.src is item.src:
            copy.src = None

    def clear(self) -> None:
        self.forward_copies = []
        self.pending.clear()
        self.inflight.clear()
        self.inflight_bytes = 0
