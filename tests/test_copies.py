"""Byte spans and exact rebuilds: the records that stand in for saved tensors."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload.copies import SPAN_ALIGN, SavedView, State, StorageCopy, byte_span, copy_span


def _views() -> list[torch.Tensor]:
    base = torch.arange(6 * 8 * 10, dtype=torch.float32).reshape(6, 8, 10)
    return [
        base,
        base.transpose(0, 2),
        base[:, ::2, 3:],
        base[2:4],
        base[5, 7, 9:],  # the last element only
        base.permute(2, 0, 1)[1:, :, ::3],
        torch.arange(12.0)[None].expand(5, 12),
        base.view(torch.int32)[1:, 2],
        base.to(torch.float16).view(torch.uint8)[3:, 1:],
        base.flatten()[::7],
    ]


@pytest.mark.parametrize("index", range(len(_views())))
def test_byte_span_covers_exactly_the_bytes_a_tensor_touches(index: int) -> None:
    """``byte_span`` returns [first touched byte, one past the last) for any strided layout, stride 0 included."""
    t = _views()[index]
    start, end = byte_span(t)
    item = t.element_size()
    offsets = torch.zeros((), dtype=torch.long)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (offsets.unsqueeze(-1) + torch.arange(size) * stride).flatten()
    elements = t.storage_offset() + offsets
    assert start == int(elements.min()) * item
    assert end == (int(elements.max()) + 1) * item


def test_byte_span_empty_tensor() -> None:
    """An empty tensor touches no bytes."""
    t = torch.randn(10)[4:4]
    assert byte_span(t) == (16, 16)


@pytest.mark.parametrize(
    ("start", "end", "storage", "want"),
    [
        (0, 1000, 1000, (0, 1000)),  # the whole storage
        (100, 600, 1000, (0, 1000)),  # exactly half: the whole storage (shareable by the other views)
        (1100, 1600, 4096, (1024, 1600)),  # under half: its span, start aligned down to 512
        (512, 700, 4096, (512, 700)),  # already aligned
        (0, 0, 0, (0, 0)),
    ],
)
def test_copy_span_rule(start: int, end: int, storage: int, want: tuple[int, int]) -> None:
    """Copy the whole storage when the tensor uses at least half of it, else just its span aligned to 512."""
    assert copy_span(start, end, storage) == want
    lo, hi = want
    assert lo % SPAN_ALIGN == 0 and lo <= start and end <= hi


def _geometry(t: torch.Tensor) -> tuple[object, ...]:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _record(t: torch.Tensor) -> tuple[StorageCopy, SavedView]:
    start, end = byte_span(t)
    lo, hi = copy_span(start, end, t.untyped_storage().nbytes())
    copy = StorageCopy(t, StorageWeakRef(t.untyped_storage()), lo, hi, producer=None)
    return copy, SavedView(copy, t, start, position=0)


@pytest.mark.parametrize("index", range(len(_views())))
def test_rebuild_from_the_device_source_is_the_same_view(index: int) -> None:
    """A record still on the device rebuilds the saved tensor on its own storage: same data pointer and geometry."""
    t = _views()[index]
    copy, view = _record(t)
    assert copy.state is State.PENDING and copy.views_left == 1
    got = view.rebuild(copy.src)
    assert got.data_ptr() == t.data_ptr()
    assert _geometry(got) == _geometry(t)
    assert torch.equal(got, t)


@pytest.mark.parametrize("index", range(len(_views())))
def test_rebuild_from_a_fetched_span(index: int) -> None:
    """A record brought back into a fresh buffer of ``nbytes`` rebuilds size, stride, dtype and values; the storage
    offset is exact when the whole storage was copied and keeps its 512-byte alignment otherwise."""
    t = _views()[index]
    copy, view = _record(t)
    assert copy.src is not None
    span = copy.src.clone()  # what a round trip through host memory yields
    got = view.rebuild(span)
    assert got.untyped_storage().data_ptr() == span.data_ptr()
    assert (got.shape, got.stride(), got.dtype) == (t.shape, t.stride(), t.dtype)
    if copy.lo == 0:
        assert got.storage_offset() == t.storage_offset()
    item = t.element_size()
    assert (got.storage_offset() * item) % SPAN_ALIGN == (t.storage_offset() * item) % SPAN_ALIGN
    assert torch.equal(got, t)


def test_covers_needs_same_version_and_a_live_record() -> None:
    """A record serves another tensor only inside its span, at the same version, and never once dropped."""
    storage = torch.randn(4096)
    piece = storage[1000:1100]
    copy, _ = _record(piece)
    start, end = byte_span(piece)
    assert copy.covers(start, end, piece._version)
    assert copy.covers(start + 4, end - 4, piece._version)
    assert not copy.covers(copy.lo, copy.hi + 4, piece._version)
    assert not copy.covers(start, end, piece._version + 1)
    copy.state = State.DROPPED
    assert not copy.covers(start, end, piece._version)
