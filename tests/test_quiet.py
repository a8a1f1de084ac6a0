"""A fit with the callback and no logger prints no warning about offloading, and its figures still reach the trainer."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

import lightning_offload
from lightning_offload.metrics import HOST_PINNED, OFFLOADED
from tests.tiny_modules import OFFLOAD_ALL, make_module, trainer_kwargs

PACKAGE_DIR = str(Path(lightning_offload.__file__).resolve().parent)


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings raised in this package's code or about it (Lightning's per-key logger warning names the key)."""
    return [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if str(Path(w.filename).resolve()).startswith(PACKAGE_DIR)
        or "offload" in str(w.message).lower()
        or "ActivationOffloadCallback" in str(w.message)
    ]


def fit_recording_warnings(namespace: types.ModuleType, callback: pl.Callback, root: Path) -> tuple[object, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # also what the test configuration or an earlier test filtered or saw once
        trainer = namespace.Trainer(**trainer_kwargs(root, max_steps=4, logger=False, callbacks=[callback]))
        trainer.fit(make_module(namespace))
    return trainer, caught


@pytest.mark.parametrize("picture", [False, True], ids=["plain", "memory_picture"])
def test_fit_without_logger_emits_no_warning_from_the_callback(tmp_path: Path, picture: bool) -> None:
    callback = lightning_offload.ActivationOffloadCallback(
        mode="sync", progress_bar=True, memory_picture=picture, **OFFLOAD_ALL
    )
    trainer, caught = fit_recording_warnings(pl, callback, tmp_path)
    assert ours(caught) == []
    # Quiet, not silent: the figures still reach the trainer (and the progress bar) without a logger. (The memory
    # picture runs batch 2 without offloading; batch 3, the last, offloads again.)
    assert callback.stats.offloaded_bytes > 0
    metrics = trainer.callback_metrics
    assert metrics["offload/offloaded_gib"] > 0
    assert metrics[OFFLOADED] > 0 and HOST_PINNED in metrics
    assert "offload/offloaded_gib" in trainer.progress_bar_metrics


def test_pytorch_lightning_fit_without_logger_emits_no_warning_from_the_callback(tmp_path: Path) -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from lightning_offload.pl_compat import ActivationOffloadCallback

    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    trainer, caught = fit_recording_warnings(pytorch_lightning, callback, tmp_path)
    assert ours(caught) == []
    assert trainer.callback_metrics["offload/offloaded_gib"] > 0
