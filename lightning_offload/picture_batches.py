"""The memory picture as ``ActivationOffloadCallback``'s hooks drive it through a fit: which batch runs without
offloading (the comparison), the stages marked in the batch recorded, and when the picture is drawn."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_offload.engine import OffloadEngine
    from lightning_offload.memory_picture import MemoryPicture


class PictureBatches:
    """A fit's batches as the memory picture sees them; without a picture every call does nothing.

    Args:
        picture: the callback's memory picture (``None`` without ``memory_picture=True``).
        mode: the callback's ``mode`` (named in the drawing's title; ``"off"`` has nothing to compare).
    """

    def __init__(self, picture: MemoryPicture | None, mode: str) -> None:
        self.picture = picture
        self.mode = mode
        self.title = f"ActivationOffloadCallback(mode={mode!r}): one training step"
        self.plain = False  # this batch runs without offloading (the memory picture's comparison)

    def fit_start(self, trainer: pl.Trainer, whole_steps: bool) -> None:
        """Plan the fit's picture.

        Args:
            trainer: the trainer (its rank and gradient accumulation).
            whole_steps: whether each batch runs forward and backward once (no manual optimization, no LBFGS).
        """
        if self.picture is not None:
            # Planned here, not in ``setup``: whether a batch is one whole optimizer step needs the optimizers. The
            # comparison batch skips offloading for one whole optimizer step (not so under accumulation, manual
            # optimization or LBFGS), and with mode="off" there is nothing to compare.
            whole = self.mode != "off" and whole_steps and trainer.accumulate_grad_batches == 1
            self.picture.on_fit_start(record=trainer.is_global_zero, compare_allowed=whole)

    def batch_start(self) -> bool:
        """Decide whether the batch beginning runs without offloading (the comparison batch).

        Returns:
            Whether it does (kept in :attr:`plain` until the batch ends).
        """
        self.plain = self.picture is not None and not self.picture.offload_batch()
        return self.plain

    def record(self, model: pl.LightningModule, engine: OffloadEngine) -> None:
        """Start recording the batch beginning, if the picture records it.

        Args:
            model: the module being fit.
            engine: the fit's engine (its device, else the module's, is the one recorded).
        """
        if self.picture is not None:
            self.picture.on_batch_start(model, engine, engine.device or model.device)

    def mark(self, stage: str) -> None:
        """Mark where a stage of the batch recorded begins (``"backward"``, ``"optimizer"``)."""
        if self.picture is not None:
            self.picture.mark(stage)

    def batch_end(self, trainer: pl.Trainer) -> None:
        """End the batch recorded (the picture is drawn once it holds what it compares)."""
        if self.picture is not None:
            self.picture.on_batch_end(trainer, self.title)

    def flush(self, trainer: pl.Trainer) -> None:
        """Training ended before the comparison batch: draw what was recorded."""
        if self.picture is not None:
            self.picture.flush(trainer, self.title)

    def discard_batch(self) -> None:
        """Drop a recorded batch that never ended: it leaves no hooks behind."""
        if self.picture is not None:
            self.picture.discard_batch()

    def close(self) -> None:
        """Stop recording for good (the fit failed)."""
        if self.picture is not None:
            self.picture.close()
