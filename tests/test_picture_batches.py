"""The memory picture as the callback's hooks drive it (``PictureBatches``): the comparison batch runs plain, the
comparison is planned only where a batch is one whole optimizer step, and without a picture nothing happens."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_offload.picture_batches import PictureBatches


class FakePicture:
    """Records what the batches tell it; its second batch is the comparison (run without offloading)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.batches = 0

    def on_fit_start(self, record: bool, compare_allowed: bool) -> None:
        self.calls.append(("fit_start", (record, compare_allowed)))

    def offload_batch(self) -> bool:
        self.batches += 1
        return self.batches != 2

    def on_batch_end(self, trainer: Any, title: str) -> None:
        self.calls.append(("batch_end", title))


def trainer(accumulate: int = 1) -> Any:
    return SimpleNamespace(is_global_zero=True, accumulate_grad_batches=accumulate)


def test_without_a_picture_every_batch_offloads_and_nothing_is_recorded() -> None:
    batches = PictureBatches(None, "streamed")
    batches.fit_start(trainer(), whole_steps=True)
    assert [batches.batch_start() for _ in range(3)] == [False, False, False] and not batches.plain
    batches.mark("backward")
    batches.batch_end(trainer())
    batches.flush(trainer())
    batches.discard_batch()
    batches.close()


def test_the_comparison_batch_runs_plain_and_the_drawing_is_titled_with_the_mode() -> None:
    picture = FakePicture()
    batches = PictureBatches(picture, "sync")  # type: ignore[arg-type]
    assert [batches.batch_start() for _ in range(3)] == [False, True, False]
    batches.batch_end(trainer())
    assert picture.calls == [("batch_end", "ActivationOffloadCallback(mode='sync'): one training step")]


@pytest.mark.parametrize(
    ("mode", "whole_steps", "accumulate", "compared"),
    [("streamed", True, 1, True), ("off", True, 1, False), ("streamed", False, 1, False), ("sync", True, 2, False)],
)
def test_a_comparison_is_planned_only_where_a_batch_is_one_whole_optimizer_step_that_offloads(
    mode: str, whole_steps: bool, accumulate: int, compared: bool
) -> None:
    picture = FakePicture()
    PictureBatches(picture, mode).fit_start(trainer(accumulate), whole_steps)  # type: ignore[arg-type]
    assert picture.calls == [("fit_start", (True, compared))]
