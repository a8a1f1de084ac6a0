"""The memory picture (``memory_picture=True``): one PNG per fit in the log folder, and an image in TensorBoard."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offload import ActivationOffloadCallback
from lightning_offload.memory_picture import FILENAME, SNAPSHOT_FILENAME, TAG, MemoryPicture
from tests.tiny_modules import OFFLOAD_ALL, make_module, trainer_kwargs

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
]


def assert_picture(path: Path) -> None:
    """A readable, non-empty PNG that is not one flat colour."""
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width > 100 and image.height > 100
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20, "the picture is blank"


def kinds(callback: ActivationOffloadCallback) -> list[str]:
    assert callback._picture is not None
    return [trace.kind for trace in callback._picture._traces]


def test_tensorboard_run_writes_png_and_image(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, logger=logger, callbacks=[callback]))
    trainer.fit(make_module(pl))
    path = Path(logger.log_dir) / FILENAME
    assert callback._picture is not None and callback._picture.path == path
    assert_picture(path)
    assert kinds(callback) == ["offloaded", "baseline"]
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert TAG in events.Tags()["images"]
    (image,) = events.Images(TAG)
    assert image.width > 100 and image.height > 100 and len(image.encoded_image_string) > 1000


def test_recorded_step_has_phases_and_engine_figures(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, logger=CSVLogger(tmp_path), callbacks=[callback]))
    trainer.fit(make_module(pl))
    assert callback._picture is not None
    offloaded, baseline = callback._picture._traces
    assert list(offloaded.marks) == ["forward", "backward", "optimizer", "end"]
    assert 0.0 == offloaded.marks["forward"] < offloaded.marks["backward"] < offloaded.marks["end"]
    # Forward hooks and gradient hooks sample every module in both directions.
    in_backward = [t for t in offloaded.t if offloaded.marks["backward"] < t < offloaded.marks["optimizer"]]
    assert len(offloaded.t) > 10 and len(in_backward) >= 3
    assert max(offloaded.offloaded) > 0 and max(offloaded.host_held) > 0
    assert max(baseline.offloaded) == 0  # no engine in the comparison step
    assert_picture(Path(trainer.loggers[0].log_dir) / FILENAME)


def test_comparison_batch_offloads_nothing(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, logger=logger, callbacks=[callback]))
    trainer.fit(make_module(pl))
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    steps = {int(r["step"]): float(r["offload/offloaded_gib"]) for r in rows if r.get("offload/offloaded_gib")}
    assert sorted(steps) == [0, 1, 2, 3]
    assert steps[2] == 0.0  # batch 2 ran without offloading, for the picture
    assert steps[0] == steps[1] == steps[3] > 0
    # The epoch summary describes offloading: the comparison batch is left out of it.
    (summary,) = [
        float(r["offload/offloaded_gib_epoch_mean"]) for r in rows if r.get("offload/offloaded_gib_epoch_mean")
    ]
    assert summary == pytest.approx(steps[0])


def test_picture_and_comparison_leave_training_unchanged(tmp_path: Path) -> None:
    reference = make_module(pl)
    pl.Trainer(**trainer_kwargs(tmp_path / "a", max_steps=4, logger=False)).fit(reference)
    pictured = make_module(pl)
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path / "b", max_steps=4, logger=False, callbacks=[callback])).fit(pictured)
    for a, b in zip(reference.parameters(), pictured.parameters(), strict=True):
        assert torch.equal(a, b)
    # Without a logger the picture goes into the trainer's root folder.
    assert_picture(tmp_path / "b" / FILENAME)


def test_no_comparison_under_gradient_accumulation(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    kwargs = trainer_kwargs(tmp_path, max_steps=2, accumulate_grad_batches=2, logger=False, callbacks=[callback])
    pl.Trainer(**kwargs).fit(make_module(pl))
    assert kinds(callback) == ["offloaded"]
    assert_picture(tmp_path / FILENAME)


def test_compare_off_records_only_the_offloaded_step(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, memory_picture_compare=False, **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path, max_steps=3, logger=False, callbacks=[callback])).fit(make_module(pl))
    assert kinds(callback) == ["offloaded"]
    assert_picture(tmp_path / FILENAME)


def test_short_fits(tmp_path: Path) -> None:
    # One batch: nothing after the warm-up to record, and no error.
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path / "one", max_steps=1, logger=False, callbacks=[callback])).fit(make_module(pl))
    assert not (tmp_path / "one" / FILENAME).exists()
    # Two batches: the comparison never ran; the offloaded step is drawn when training ends.
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path / "two", max_steps=2, logger=False, callbacks=[callback])).fit(make_module(pl))
    assert kinds(callback) == ["offloaded"]
    assert_picture(tmp_path / "two" / FILENAME)


def test_once_per_fit(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=False, callbacks=[callback]))
    trainer.fit(make_module(pl, batches=3))
    assert kinds(callback) == ["offloaded", "baseline"]


def test_picture_pickles_without_hooks() -> None:
    import pickle

    picture = MemoryPicture(compare=True)
    picture.on_fit_start(record=True, compare_allowed=True)
    model = torch.nn.Linear(4, 4)
    assert picture.offload_batch() and picture.offload_batch()
    picture.on_batch_start(model, None, torch.device("cpu"))
    clone = pickle.loads(pickle.dumps(picture))
    assert clone._handles == [] and clone._trace is None
    picture.close()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_recorded_batch_skipped_by_the_module_leaves_no_hooks(tmp_path: Path) -> None:
    """``on_train_batch_start`` returning -1 ends the epoch without ``on_train_batch_end`` for that batch."""
    model = make_module(pl, batches=4)
    skipped: list[int] = []

    def skip_second(batch: torch.Tensor, batch_idx: int) -> int | None:
        if batch_idx == 1 and not skipped:  # the batch the picture records
            skipped.append(batch_idx)
            return -1
        return None

    model.on_train_batch_start = skip_second
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=False, callbacks=[callback])).fit(model)
    assert skipped == [1]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert kinds(callback) == ["offloaded", "baseline"]  # recorded again in the next epoch
    assert_picture(tmp_path / FILENAME)


def test_memory_picture_without_matplotlib_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory_picture=True`` without matplotlib raises ImportError when the callback is created (not when the
    picture is drawn, after a training step), with the install command; without the picture nothing is needed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` now raises ImportError
    with pytest.raises(ImportError) as info:
        ActivationOffloadCallback(compute_device="cpu", memory_picture=True)
    message = str(info.value)
    assert message.startswith("ActivationOffloadCallback(memory_picture=True): "), message
    assert "pip install matplotlib" in message and "lightning-offload[plot]" in message, message
    assert ActivationOffloadCallback(compute_device="cpu", memory_picture=False)._picture is None


def test_memory_snapshot_on_cpu_warns_and_writes_only_the_picture(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, memory_snapshot=True, **OFFLOAD_ALL)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, logger=False, callbacks=[callback]))
    with pytest.warns(UserWarning, match=r"snapshot=True\): the step runs on 'cpu'.*only for CUDA") as caught:
        trainer.fit(make_module(pl))
    assert len([w for w in caught if "snapshot=True" in str(w.message)]) == 1  # once per fit, not per sample
    assert_picture(tmp_path / FILENAME)
    assert not (tmp_path / SNAPSHOT_FILENAME).exists()
    assert callback._picture is not None and callback._picture.snapshot_path is None


def test_memory_snapshot_needs_the_memory_picture() -> None:
    with pytest.raises(ValueError, match=r"memory_snapshot=True, memory_picture=False\).*pass memory_picture=True"):
        ActivationOffloadCallback(memory_snapshot=True)
    with pytest.raises(TypeError, match=r"memory_snapshot='yes'\): memory_snapshot must be True or False"):
        ActivationOffloadCallback(memory_picture=True, memory_snapshot="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_on_cuda_holds_the_recorded_step(tmp_path: Path) -> None:
    import pickle

    callback = ActivationOffloadCallback(
        mode="streamed",
        memory_budget=None,
        min_tensor_bytes=1024,
        resident_tail_bytes=0,
        memory_picture=True,
        memory_snapshot=True,
    )
    kwargs = trainer_kwargs(tmp_path, max_steps=4, logger=False, callbacks=[callback], accelerator="cuda")
    pl.Trainer(**kwargs).fit(make_module(pl))
    path = tmp_path / SNAPSHOT_FILENAME
    assert callback._picture is not None and callback._picture.snapshot_path == path
    assert_picture(tmp_path / FILENAME)
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    assert {"segments", "device_traces"} <= set(snapshot)
    events = [entry for trace in snapshot["device_traces"] for entry in trace]
    assert any(entry["action"] == "alloc" for entry in events)
    assert any(entry["action"].startswith("free") for entry in events)
