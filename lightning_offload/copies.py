"""The records a pack hook leaves in the autograd graph: one host copy per storage span, one view per saved tensor."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch._C import _WeakTensorRef
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from lightning_offload.host_pool import PoolAccount

# Spans are cut at this alignment so a restored view sits at the same address modulo 512 as the original:
# kernels (cuBLAS among them) pick code paths by alignment, and the arithmetic must stay bit-identical.
SPAN_ALIGN = 512


_UNMADE = object()  # a copy's byte view not made yet


class State(enum.Enum):
    PENDING = "pending"  # saved, still on the device, may be offloaded later (resident tail / pacing)
    RESIDENT = "resident"  # stays on the device for good
    OFFLOADED = "offloaded"  # its bytes live in a host buffer
    DROPPED = "dropped"  # released after the step raised; unpacking is an error


class StorageCopy:
    """The bytes ``[lo, hi)`` of one device storage, and where they currently live.

    Several saved tensors that share a storage share one ``StorageCopy``, so the bytes cross the link once.
    """

    __slots__ = (
        "__weakref__",
        "_src",
        "alias",
        "d2h_done",
        "end_pos",
        "fetch_guard",
        "fetched",
        "h2d_done",
        "hi",
        "host",
        "last_use",
        "lo",
        "modified",
        "need_pos",
        "pool",
        "producer",
        "root_ref",
        "state",
        "storage_ref",
        "version",
        "views_left",
    )

    def __init__(self, tensor: torch.Tensor, storage_ref: StorageWeakRef, lo: int, hi: int, producer: object) -> None:
        self.storage_ref = storage_ref  # keeps the storage's identity unique while this record lives
        # The same for the tensor whose version counter its views share (``version_root``), without holding its bytes.
        self.root_ref = _WeakTensorRef(version_root(tensor))
        self.version = tensor._version
        self.lo, self.hi = lo, hi
        self._src: torch.Tensor | object | None = _UNMADE  # see ``src``
        self.producer = producer  # the stream that was current when the tensor was saved
        # Shares the saved tensor's version counter for as long as the device bytes may still be read (resident, or
        # a copy out not yet known to be done): an in-place change after the save is then an error autograd would
        # raise (saved-tensor hooks switch its own check off). Once the host copy is complete and ordered before
        # any later write, the host holds the saved values and a later in-place change can no longer reach them.
        self.alias: torch.Tensor | None = tensor.detach()
        self.modified = False
        self.state = State.PENDING
        self.host: torch.Tensor | None = None
        self.pool: PoolAccount | None = None
        self.fetched: torch.Tensor | None = None  # the span back on the device, once fetched
        # Orders the compute stream after the copy into ``fetched``, for a span let go of before backward waited for
        # it (``None`` once it has, or where no copy is pending): its block may then be reused at once.
        self.fetch_guard: Callable[[], None] | None = None
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.last_use: torch.cuda.Event | None = None  # the last copy that touched ``host``
        self.views_left = 0
        self.end_pos = 0
        # The position of its latest save: backward needs it first there. Above ``end_pos`` when a later op saves the
        # same bytes again (rotary embeddings' cos and sin, made once and saved by every block's attention).
        self.need_pos = 0

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def src(self) -> torch.Tensor | None:
        """A flat byte view of the span on the device (copies move raw bytes, whatever the dtype, strides or offset),
        or ``None`` once the device bytes are let go. Made at first use: most copies that stay are never asked for
        it (their first view is served by ``alias``), and making it costs a tensor per saved tensor."""
        src = self._src
        if src is _UNMADE:
            alias = self.alias
            src = None
            if alias is not None:
                src = torch.empty(0, dtype=torch.uint8, device=alias.device).set_(
                    alias.untyped_storage(), self.lo, (self.hi - self.lo,), (1,)
                )
            self._src = src
        return src  # type: ignore[return-value]

    @src.setter
    def src(self, value: torch.Tensor | None) -> None:
        self._src = value

    def check_version(self, saved_version: int) -> None:
        """Raise autograd's in-place error if the saved bytes were (or may have been) changed since the save."""
        if self.modified:
            raise modified_error(saved_version, None)
        if self.alias is not None and self.alias._version != self.version:
            raise modified_error(saved_version, self.alias._version)

    def seal_version(self) -> None:
        """The host copy is complete and ordered before any later work: note a change made before, stop watching."""
        if self.alias is not None:
            self.modified |= self.alias._version != self.version
            self.alias = None

    def covers(self, lo: int, hi: int, version: int) -> bool:
        """Whether a tensor spanning ``[lo, hi)`` of the same storage, at ``version``, can be served from here."""
        return self.lo <= lo and hi <= self.hi and version == self.version and self.state is not State.DROPPED

    def drop(self) -> None:
        """Release everything: the step that made this copy raised, and unpacking it now is an error."""
        self.state = State.DROPPED
        self.release_fetched()
        self.src = self.alias = None
        self.drop_host()

    def release_fetched(self) -> None:
        """Let go of the span fetched back. Its block returns to the compute stream's pool at once (no
        ``record_stream``, which would hold it until the copy stream drained every copy queued meanwhile): a span
        backward never waited for makes the compute stream wait for the copy into it first, so nothing it runs later
        can reuse the block while that copy still writes."""
        guard, self.fetch_guard = self.fetch_guard, None
        if guard is not None and self.fetched is not None:
            guard()
        self.fetched = None

    def drop_host(self) -> None:
        """Return the host buffer to its pool (reused only after the last copy on it completes)."""
        host, pool = self.host, self.pool
        self.host = self.pool = None
        if host is not None and pool is not None:
            pool.release(host, self.last_use)

    def __del__(self) -> None:
        # The graph that held this record is gone (backward ran, or the forward was discarded).
        try:
            self.release_fetched()
        except Exception:  # interpreter shutdown: the streams may be gone already
            pass
        self.drop_host()


class SavedView:
    """What autograd holds instead of an offloadable tensor: how to rebuild it from its ``StorageCopy``."""

    __slots__ = ("copy", "dtype", "first", "offset", "position", "primary", "size", "stride", "version")

    def __init__(
        self, copy: StorageCopy, tensor: torch.Tensor, byte_start: int, position: int, primary: bool = False
    ) -> None:
        self.copy = copy
        # The view of the tensor its copy was made from: while the copy stays on the device, the copy's ``alias`` is
        # that tensor, and backward gets an alias of it without a tensor rebuilt from the span.
        self.primary = primary
        self.position = position  # where backward unpacks it: the saved bytes' position when it was saved
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = byte_start - copy.lo  # bytes from the start of the span to the tensor's first element
        self.version = tensor._version
        self.first = True
        copy.views_left += 1

    def rebuild(self, span: torch.Tensor) -> torch.Tensor:
        """The saved tensor, as a view with its exact size, stride and storage offset into ``span``'s storage."""
        itemsize = self.dtype.itemsize
        offset = (span.storage_offset() + self.offset) // itemsize
        out = torch.empty(0, dtype=self.dtype, device=span.device)
        return out.set_(span.untyped_storage(), offset, self.size, self.stride)


def version_root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``tensor`` shares for certain: the base it is a view of, else itself.

    Tensors of one storage do not always share a counter: ``unsafe_chunk`` and ``unsafe_split`` (PyTorch's GRU cell
    on the CPU changes such chunks of its gates in place and saves each), ``_unsafe_view`` and ``.data`` give each
    their own. Equal versions of two counters say nothing about the bytes, so a copy serves only tensors of one root.
    (Aliases that share a counter without being views, ``x.detach()``, count as roots of their own: copied apart.)
    """
    base = tensor._base
    return tensor if base is None else base


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``tensor`` can touch."""
    itemsize = tensor.element_size()
    start = tensor.storage_offset() * itemsize
    if tensor.is_contiguous():  # most saved tensors: the extent is the element count (a tenth of the general sum)
        return start, start + tensor.numel() * itemsize
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + extent * itemsize


def copy_span(start: int, end: int, storage_nbytes: int) -> tuple[int, int]:
    """The span to copy for a tensor at ``[start, end)``: the whole storage unless the tensor uses under half.

    Copying the whole storage lets every other tensor saved from it (q/k/v of one projection, chunks, views)
    reuse the copy; a small slice of a big storage is copied alone, its start rounded down to ``SPAN_ALIGN``.
    """
    if 2 * (end - start) >= storage_nbytes:
        return 0, storage_nbytes
    return start - start % SPAN_ALIGN, end


def modified_error(saved: int, now: int | None) -> RuntimeError:
    """The error autograd raises for a saved tensor changed in place (its own check is off under hooks)."""
    found = "later" if now is None else f"{now}"
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: it was "
        f"saved at version {saved} and is now at version {found} (detected by lightning_offload, whose saved-"
        "tensor hooks replace autograd's own check). Clone the tensor before modifying it in place."
    )
