"""The way back: bringing offloaded copies back to the device, ahead of need, as backward walks forward down."""

from __future__ import annotations

import weakref

import torch

from lightning_offload.copies import SavedView, State, StorageCopy
from lightning_offload.schedule import plan_prefetch
from lightning_offload.stats import OffloadStats
from lightning_offload.transfer import StreamedTransfer, Transfer


class InboundQueue:
    """Offloaded copies of sealed forwards, needed-last first, each with the backward position where it starts back.

    The bytes fetched ahead are bounded by ``cap``, or by what backward has freed of the activations that stayed on
    the device, less ``grad_reserve``, if that is more: bytes that come back then take the place of bytes that left,
    so the step's peak does not move, and a partial offload (whose copies must start well before backward reaches
    them) is not held back by a fixed cap.

    Args:
        transfer: moves the bytes; prefetching runs only when it overlaps copies with compute.
        device: where copies come back to.
        cap: the most bytes fetched ahead and not yet used by backward (``prefetch_bytes``).

    Attributes:
        grad_reserve: freed bytes that do not count (the gradients backward allocates meanwhile); ``None``: only
            ``cap`` bounds the prefetch.
        freed_bytes: bytes of resident activations backward has used and released since the latest forward: counted
            once another autograd node unpacks, so the node that used them has run (a node unpacks all it saved, then
            allocates its outputs, and only then lets its saved tensors go: crediting them at their unpack let 8B
            LoRA's manual 16 GiB offload on an H200 fetch 3.8 GiB back while the loss's backward still held its
            logits, and its peak fell by 12.2 GiB, not 15.9).
        hold_above: nothing is fetched ahead while backward is above this position (the head's saved bytes: the
            loss's backward is the step's peak, and what it frees is room for copies once it is done); ``None``:
            no hold.
    """

    def __init__(self, transfer: Transfer, device: torch.device, cap: int) -> None:
        self._transfer = transfer
        self._device = device
        self.cap = cap
        self.queue: list[weakref.ref[StorageCopy]] = []  # lowest position (needed last) first
        self.starts: list[float] = []  # backward position at which each queued copy must start coming back
        # Fetched ahead and not yet used, by ``id`` of the copy: the copy and its bytes. (Used copies leave at their
        # last unpack, in any order: a copy every block saves comes back first and is used last.)
        self._ahead: dict[int, tuple[weakref.ref[StorageCopy], int]] = {}
        self.ahead_bytes = 0
        self.grad_reserve: int | None = None
        self.freed_bytes = 0
        # Used by a node that may still run: the view's position, its bytes, and the node (``_running_node``).
        self._freeing: list[tuple[int, int, tuple[int, int] | None]] = []
        self.hold_above: int | None = None

    def configure(self, cap: int) -> None:
        """Set the bound on bytes fetched ahead of need before backward frees any (a memory-budget plan's)."""
        self.cap = cap

    def add_forward(self, copies: list[weakref.ref[StorageCopy]]) -> None:
        """Queue a sealed forward's offloaded copies (save order) and plan when each starts back."""
        transfer = self._transfer
        self.freed_bytes = 0
        self._freeing = []
        if not isinstance(transfer, StreamedTransfer):
            return  # no overlap, no prefetch: each copy comes back when backward asks for it
        # In the order backward first needs them: where each was saved last. A copy saved early and again by later
        # ops (rotary embeddings' cos and sin, saved by every block) comes back first, not last: on an H200, 8B LoRA's
        # 14.4 GiB partial offload fetched their 2 x 2 MiB on demand behind 71 ms of prefetches queued on the link, a
        # 73 ms stall in every backward.
        copies = sorted(copies, key=_need_position)
        # Popped from the end: a later forward (several may await one backward) sits above the earlier ones. What an
        # earlier forward left that no longer waits (gone, used, fetched) goes: a forward whose graph never runs
        # backward would otherwise leave its entries below every later one, step after step.
        self.queue = [ref for ref in self.queue if _waiting(ref)] + copies
        for key, (ref, nbytes) in list(self._ahead.items()):
            if ref() is None:  # its graph went without using it
                del self._ahead[key]
                self.ahead_bytes -= nbytes
        ends, sizes = [], []
        for ref in self.queue:
            copy = ref()
            ends.append(float(copy.need_pos) if copy is not None else float("inf"))
            sizes.append(copy.nbytes if copy is not None else 0)
        self.starts = plan_prefetch(ends, sizes, transfer.link.backward_lead())

    def bring_back(self, copy: StorageCopy, stats: OffloadStats) -> torch.Tensor:
        """The span of an offloaded ``copy`` on the device, ready for the compute stream to read."""
        span = copy.fetched
        if span is None:
            # A source whose device -> host copy is still running is used as it is: no round trip.
            span = copy.src if copy.src is not None else self._fetch(copy, stats, on_demand=True)
        if span is not copy.src:
            self._transfer.await_arrival(copy)
        return span

    def used_offloaded(self, view: SavedView) -> None:
        """Backward unpacked ``view`` of an offloaded copy. Once all its views are used, autograd holds what it needs:
        the span fetched back is let go (a second backward, ``retain_graph``, fetches from host again) and no longer
        counts as fetched ahead. (A source still being copied out stays alive in the outbound queue until its copy is
        done.)"""
        if not _last_use(view):
            return
        copy = view.copy
        copy.release_fetched()
        copy.src = None
        entry = self._ahead.get(id(copy))
        if entry is not None and entry[0]() in (copy, None):
            del self._ahead[id(copy)]
            self.ahead_bytes -= entry[1]

    def reserve_for_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Backward allocates the trainable ``parameters``' gradients while it frees activations: that much of
        what it frees is not room for copies fetched ahead."""
        self.grad_reserve = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)

    def used_resident(self, view: SavedView) -> None:
        """Backward unpacked ``view`` of a copy that stayed on the device; once all its views are used, autograd
        releases the bytes when the node that unpacked them has run (:attr:`freed_bytes` counts them then)."""
        # Freed room matters only to copies still queued to come back (a later forward's queue starts a new count).
        if _last_use(view) and self.queue:
            self._freeing.append((view.position, view.copy.nbytes, _running_node()))

    def left_head(self, backward_pos: int) -> bool:
        """Whether backward, at ``backward_pos``, just left the held head (true once per backward)."""
        if self.hold_above is None or backward_pos >= self.hold_above:
            return False
        self.hold_above = None
        return True

    def prefetch(self, backward_pos: int, stats: OffloadStats) -> None:
        """Start the copies whose planned start backward has reached, latest-saved first, within ``cap`` ahead; and
        later ones already, as far as the room backward has freed allows (nothing while the head is held)."""
        queue, starts = self.queue, self.starts
        if not queue:
            return  # nothing left to fetch in this backward (most unpacks where little or nothing is offloaded)
        self._credit_freed(backward_pos)
        if self.hold_above is not None:
            return
        # Room that backward freed: bytes fetched into it take the place of bytes that left, so the peak does not
        # move and they may come back before their planned start. On an H200, 8B LoRA's 16 GiB partial offload stalled
        # backward 110 ms on its planned starts, and 23 ms where so few kept bytes lay above the offloaded ones that
        # every start was due at once.
        room = self.freed_bytes - self.grad_reserve if self.grad_reserve is not None else 0
        cap = max(self.cap, room)
        while queue:
            copy = queue[-1]()
            nbytes = copy.nbytes if copy is not None else 0
            if starts[-1] < backward_pos:  # not due yet: only into freed room
                if self.ahead_bytes + nbytes > room:
                    return
            elif copy is not None and self.ahead_bytes and self.ahead_bytes + nbytes > cap:
                return  # memory bound: the rest follows as backward consumes what came back
            queue.pop()
            starts.pop()
            if copy is None or copy.state is not State.OFFLOADED or copy.fetched is not None or copy.views_left <= 0:
                continue  # gone, kept, already back, or already used by backward (in place, while in flight)
            if copy.src is not None:
                copy.fetched = copy.src  # still on the device (its copy out is in flight): keep it, fetch nothing
            else:
                self._fetch(copy, stats, on_demand=False)
            stale = self._ahead.pop(id(copy), None)  # a dead copy's entry under a reused id
            self.ahead_bytes += copy.nbytes - (stale[1] if stale is not None else 0)
            self._ahead[id(copy)] = (weakref.ref(copy), copy.nbytes)

    def _credit_freed(self, backward_pos: int) -> None:
        """Count as freed the resident bytes whose node has run: another node unpacks now (autograd runs one node
        at a time). Where torch cannot say which node runs, backward having unpacked a tensor saved below them
        stands in (a node may unpack a lower one of its own first, so that credits some bytes early)."""
        if not self._freeing:
            return
        running = _running_node()
        still = []
        for position, nbytes, node in self._freeing:
            if (node != running) if node is not None else position > backward_pos:
                self.freed_bytes += nbytes
            else:
                still.append((position, nbytes, node))
        self._freeing = still

    def _fetch(self, copy: StorageCopy, stats: OffloadStats, on_demand: bool) -> torch.Tensor:
        span = copy.fetched = self._transfer.copy_in(copy, self._device)
        if on_demand:
            stats.fetched_on_demand_bytes += copy.nbytes
        else:
            stats.prefetched_bytes += copy.nbytes
        return span

    def clear(self) -> None:
        self.hold_above = None
        self.queue, self.starts = [], []
        self._ahead.clear()
        self._freeing = []
        self.ahead_bytes = self.freed_bytes = 0


def _need_position(ref: weakref.ref[StorageCopy]) -> int:
    """Where backward first needs a queued copy (a copy already gone sorts first: it is dropped when reached)."""
    copy = ref()
    return copy.need_pos if copy is not None else -1


def _last_use(view: SavedView) -> bool:
    """Note backward's first unpack of ``view``; whether it was the last of its copy's views to be used."""
    if not view.first:
        return False
    view.first = False
    view.copy.views_left -= 1
    return view.copy.views_left <= 0


def _waiting(ref: weakref.ref[StorageCopy]) -> bool:
    """Whether a queued copy still waits to come back: alive, on the host, not fetched, and not used."""
    copy = ref()
    return copy is not None and copy.state is State.OFFLOADED and copy.fetched is None and copy.views_left > 0


_current_node = getattr(torch._C, "_current_autograd_node", None)


def _running_node() -> tuple[int, int] | None:
    """The autograd node running now, as a key (``None``: outside backward, or a torch that cannot say).

    The ``id`` of the Python object that shows a node is not enough: blocks checkpointed with ``use_reentrant=True``
    make their nodes during backward and free them after it, and the next block's nodes take the freed addresses
    (freed room was then credited, or not, at random). torch's sequence number tells apart the nodes a thread made;
    the address, those of two threads (backward on a device thread recomputes there)."""
    node = _current_node() if _current_node is not None else None
    if node is None:
        return None
    number = getattr(node, "_sequence_nr", None)
    return (number() if number is not None else -1, id(node))
