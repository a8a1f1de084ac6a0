"""What was saved, and where: positions, the copies of the open forward (for dedup) and of the current step."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from lightning_offload.copies import SavedView, StorageCopy


class SaveLog:
    """Positions and records of saved copies.

    Attributes:
        position: eligible bytes saved since the log was made: monotone across forwards, so copies of several
            forwards awaiting one backward still order correctly.
        forward_start: the position where the open (or latest) forward began.
        previous_forward: eligible bytes of the latest finished forward (``None`` before the first).
        backward_pos: the lowest position backward has reached (it walks forward's positions down).
        forward_open: whether a forward is saving now.
    """

    def __init__(self) -> None:
        self.position = 0
        self.forward_start = 0
        self.previous_forward: int | None = None
        self.backward_pos = 0
        self.forward_open = False
        # The open forward's copies, for dedup, by storage and by the tensor whose version counter their views share.
        self._by_storage: dict[tuple[int, int], list[weakref.ref[StorageCopy]]] = {}
        self._step: list[weakref.ref[StorageCopy]] = []  # copies of the current step and of older live graphs
        self._step_first = 0  # copies before this index belong to earlier steps

    def find(self, key: tuple[int, int], start: int, end: int, version: int) -> StorageCopy | None:
        """The open forward's copy that can serve bytes ``[start, end)`` of a storage at ``version``, if any. ``key``:
        the storage's and the version root's (:func:`~lightning_offload.copies.version_root`) identities."""
        for ref in self._by_storage.get(key, ()):
            copy = ref()
            if copy is not None and copy.covers(start, end, version):
                return copy
        return None

    def add(self, copy: StorageCopy, key: tuple[int, int]) -> None:
        """Record a new copy at the top of the open forward (``key`` as for :meth:`find`)."""
        ref = weakref.ref(copy)
        self._by_storage.setdefault(key, []).append(ref)
        self._step.append(ref)
        self.position += copy.nbytes
        copy.end_pos = copy.need_pos = self.position

    def saved_again(self, copy: StorageCopy) -> int:
        """A later op of the open forward saved bytes ``copy`` holds: backward needs them from here on (the top of the
        forward so far). Returns that position."""
        copy.need_pos = max(copy.need_pos, self.position)
        return self.position

    def close_forward(self) -> int:
        """End the open forward; returns its eligible bytes."""
        self.forward_open = False
        self.previous_forward = self.position - self.forward_start
        self.forward_start = self.backward_pos = self.position
        self._by_storage = {}
        return self.previous_forward

    def reached(self, view: SavedView) -> None:
        """Backward has reached the op that saved ``view`` (not the copy's own position: bytes saved early and again
        by a later op are unpacked there first, and backward has not walked down to their first save)."""
        self.backward_pos = min(self.backward_pos, view.position)

    def start_step(self) -> None:
        self._step = [ref for ref in self._step if ref() is not None]
        self._step_first = len(self._step)

    def step_copies(self) -> Iterator[StorageCopy]:
        """The live copies made in the current step."""
        for ref in self._step[self._step_first :]:
            copy = ref()
            if copy is not None:
                yield copy
