"""``lightning_offload.pl_compat``: the callback for ``import pytorch_lightning as pl`` users."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

import lightning_offload  # noqa: E402
from lightning_offload.memory_picture import FILENAME  # noqa: E402
from lightning_offload.metrics import OFFLOADED  # noqa: E402
from lightning_offload.pl_compat import ActivationOffloadCallback  # noqa: E402
from tests.tiny_modules import OFFLOAD_ALL, make_module, trainer_kwargs  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
]


def test_twin_is_a_pytorch_lightning_callback_sharing_the_implementation() -> None:
    assert issubclass(ActivationOffloadCallback, pl.Callback)
    assert issubclass(ActivationOffloadCallback, lightning_offload.ActivationOffloadCallback)
    # No copy of the implementation: every hook is the primary class's.
    assert (
        ActivationOffloadCallback.on_train_batch_start
        is lightning_offload.ActivationOffloadCallback.on_train_batch_start
    )
    assert set(vars(ActivationOffloadCallback)) <= {
        "__module__",
        "__doc__",
        "__qualname__",
        "__firstlineno__",
        "__static_attributes__",
    }
    callback = ActivationOffloadCallback(mode="sync")
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is ActivationOffloadCallback
    assert clone.options == callback.options


def test_pytorch_lightning_trainer_run(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", memory_picture=True, **OFFLOAD_ALL)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=4, logger=[logger, CSVLogger(tmp_path, name="csv")], callbacks=[callback])
    )
    model = make_module(pl)
    trainer.fit(model)
    assert callback.stats.offloaded_bytes > 0
    assert trainer.callback_metrics["offload/offloaded_gib"] > 0
    assert trainer.callback_metrics[OFFLOADED] > 0
    assert (Path(logger.log_dir) / FILENAME).is_file()
    assert torch.is_grad_enabled()


def test_matches_a_run_without_offloading(tmp_path: Path) -> None:
    reference = make_module(pl)
    pl.Trainer(**trainer_kwargs(tmp_path / "a", max_steps=3, logger=False)).fit(reference)
    offloaded = make_module(pl)
    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path / "b", max_steps=3, logger=False, callbacks=[callback])).fit(offloaded)
    assert callback.stats.offloaded_bytes > 0
    for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)


def test_two_callbacks_are_refused(tmp_path: Path) -> None:
    """The callback keeps state (its plans), so the Trainer refuses a second one as it is made."""
    callbacks = [ActivationOffloadCallback(**OFFLOAD_ALL), ActivationOffloadCallback(**OFFLOAD_ALL)]
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `ActivationOffloadCallback`"):
        pl.Trainer(**trainer_kwargs(tmp_path, max_steps=1, logger=False, callbacks=callbacks))


def test_checkpoint_option_trains_under_a_pytorch_lightning_trainer(tmp_path: Path) -> None:
    """``checkpoint=`` checks, in ``setup``, whether the module builds its layers later (its own ``setup`` or
    ``configure_model``): that check must work for a ``pytorch_lightning.LightningModule`` too (it is not a
    ``lightning.pytorch`` one), and training is the plain one, with the wrappers gone afterwards."""
    reference = make_module(pl)
    pl.Trainer(**trainer_kwargs(tmp_path / "a", max_steps=3, logger=False)).fit(reference)
    offloaded = make_module(pl)
    callback = ActivationOffloadCallback(mode="sync", checkpoint="net.3", **OFFLOAD_ALL)
    pl.Trainer(**trainer_kwargs(tmp_path / "b", max_steps=3, logger=False, callbacks=[callback])).fit(offloaded)
    assert callback.stats.offloaded_bytes > 0
    for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "forward" not in offloaded.net[3].__dict__
