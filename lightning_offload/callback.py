"""``ActivationOffloadCallback``: activation offloading for any LightningModule, without code changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_offload.batch_shapes import batch_shapes
from lightning_offload.callback_checks import (
    builds_layers_after_setup,
    check_reporting_args,
    checked_checkpointing,
    require_single_callback,
    require_trainer,
)
from lightning_offload.checkpointing import CHECKPOINT_DOCS
from lightning_offload.engine import OffloadEngine
from lightning_offload.fit_engine import (
    announce_planning,
    end_epoch,
    end_on_exception,
    engine_for_fit,
    install_for_batch,
    leaves_after_backward,
    rerun_when_eased,
    say_if_floor_over,
)
from lightning_offload.host_pool import release_host_memory
from lightning_offload.kept_plans import KeptPlans
from lightning_offload.memory_picture import PICTURE_OPTION_DOCS, MemoryPicture
from lightning_offload.options import (
    DEFAULT_MIN_TENSOR_BYTES,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_RESIDENT_TAIL_BYTES,
    Mode,
    OffloadOptions,
    OnHostFull,
    option_docs,
    warn_unused_budget,
)
from lightning_offload.picture_batches import PictureBatches
from lightning_offload.reporting import METRIC_DOCS, StepReporter
from lightning_offload.stats import OffloadStats


class ActivationOffloadCallback(Callback):
    r"""Move the activations autograd saves in ``training_step`` to host memory (as much as the budget needs).

    Gradients are unchanged: tensors are copied bit for bit. Hooks are installed in ``on_train_batch_start`` and
    removed after backward (or, when a batch may run forward again after a backward — LBFGS closures, manual
    optimization — in ``on_train_batch_end``), and always in ``on_train_batch_end``, ``on_train_epoch_end``,
    ``on_exception`` and ``teardown``. Streams and the pinned pool are created lazily, so the callback pickles
    (``ddp_spawn``). With a memory budget (the default), the first batches are measured and a plan is chosen and
    reported (one line at INFO); where plans are worth comparing, each runs a few batches and the fastest is kept
    (``plan_trials``, reported too); a batch whose tensors take a new shape is measured, one of a shape met before runs
    that shape's plan again. A batch that ran out of memory runs again under the planner's correction, where it can
    (automatic optimization, one process; with gradient accumulation only its ``training_step``: see the README).

    Example::

        trainer = Trainer(callbacks=[ActivationOffloadCallback()])  # fit the device, as cheaply as possible
        trainer = Trainer(callbacks=[ActivationOffloadCallback(memory_budget="40GiB")])

    Args:
        {options}
        {checkpoint}
        progress_bar: also show the step's peak allocated GiB in the progress bar (the offloaded GiB when the
            compute device is the CPU, where no peak is measured).
        {picture}

    {metrics}
    """

    def __init__(
        self,
        mode: Mode = "streamed",
        memory_budget: int | str | None = "auto",
        compute_device: str | None = None,
        min_tensor_bytes: int | str = DEFAULT_MIN_TENSOR_BYTES,
        resident_tail_bytes: int | str = DEFAULT_RESIDENT_TAIL_BYTES,
        max_offload_bytes: int | str | None = None,
        max_inflight_bytes: int | str | None = None,
        prefetch_bytes: int | str = DEFAULT_PREFETCH_BYTES,
        host_memory_limit: int | str | None = None,
        on_host_full: OnHostFull = "warn",
        measure_copies: bool = False,
        plan_trials: bool = True,
        checkpoint: str | type[nn.Module] | list[str | type[nn.Module]] | None = None,
        recompute: str = "all",
        progress_bar: bool = False,
        memory_picture: bool = False,
        memory_picture_compare: bool = True,
        memory_snapshot: bool = False,
    ) -> None:
        super().__init__()
        values = dict(locals())
        shared = {name: values[name] for name in OffloadOptions.names()}
        self.options = OffloadOptions.create("ActivationOffloadCallback", **shared)
        self.checkpoint, self.recompute = checkpoint, recompute
        self._manual = checked_checkpointing(checkpoint, recompute)
        # Said now, once: with compute_device=None the device is the module's, known in ``setup``, where off CUDA
        # the callback says it offloads nothing at all.
        warn_unused_budget("ActivationOffloadCallback", self.options, memory_budget, checkpoint)
        check_reporting_args(values)
        self.progress_bar = progress_bar
        self._reporter = StepReporter(self.options, progress_bar)
        picture = MemoryPicture(compare=memory_picture_compare, snapshot=memory_snapshot) if memory_picture else None
        self._pictures = PictureBatches(picture, self.options.mode)
        self._engine: OffloadEngine | None = None  # built in ``setup``, where the device is known
        self._plans = KeptPlans()  # the last fit's plans, for the next (and checkpoints)
        self._active = False
        self._leave_after_backward = True
        self._unwrap: Callable[[], None] | None = None  # undoes the batches' running again (``rerun_when_eased``)
        self._last_stats, self._batch_started = OffloadStats(), False

    @property
    def stats(self) -> OffloadStats:
        """What the latest training batch offloaded."""
        return self._last_stats

    @property
    def engine(self) -> OffloadEngine | None:
        """The engine, once ``setup`` has run on a device that offloads."""
        return self._engine

    @property
    def _picture(self) -> MemoryPicture | None:
        """The memory picture (``None`` without ``memory_picture=True``)."""
        return self._pictures.picture

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.options.mode)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_engine"] = None  # streams, events and host buffers do not cross processes
        state["_unwrap"] = None  # (undoes a wrapper of this process's module)
        for name in ("log", "log_dict"):  # bound methods of the module Lightning attaches per fit: the whole model
            state.pop(name, None)
        return state

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_single_callback(trainer.callbacks, ActivationOffloadCallback)
        if stage != "fit":
            return
        if self._manual is not None and not builds_layers_after_setup(pl_module):
            self._manual.check(pl_module)  # a name that matches nothing fails now, before anything runs
        built = engine_for_fit(self.options, pl_module, trainer.num_devices, by_hand=self.checkpoint is not None)
        if built is None:  # no CUDA (said): nothing offloads
            self._active = False
            return
        self._engine, device = built
        self._plans.give(self._engine)  # an earlier fit's (or a checkpoint's): measured again where they differ
        self._active = True
        self._reporter.start_fit(device)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Both need what only exists now: the blocks ``configure_model`` builds, the optimizers Lightning set up.
        if self._manual is not None:
            # Checked even when the callback does nothing here (no CUDA), so a wrong name fails on every machine.
            self._manual.check(pl_module)
            if self._active:
                self._manual.apply(pl_module)
        if not self._active:
            return
        self._leave_after_backward = leaves_after_backward(trainer, pl_module)
        if self._engine is not None:
            self._unwrap = rerun_when_eased(trainer, pl_module, self._engine, self._reporter)
        self._pictures.fit_start(trainer, self._leave_after_backward)
        announce_planning(self._engine, pl_module, self.options.memory_budget)
        say_if_floor_over(self._engine, trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        require_trainer(trainer, "on_train_batch_start")
        engine = self._engine
        if not self._active or engine is None:
            return
        self._batch_started = True
        plain = self._pictures.batch_start()
        # A new input shape is measured (the old one's plan may not fit, or may waste time); one met before runs the
        # plan it had (lengths that change from batch to batch would otherwise measure at every step).
        engine.input_changed(batch_shapes(batch))
        if plain:
            engine.end_step()  # the planner's step before this batch ends here: this batch's peak is not its
        elif not engine.installed:
            install_for_batch(engine, self._reporter, trainer)
        self._reporter.start_batch()  # after the engine read the previous step's peak
        self._pictures.record(pl_module, engine)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._pictures.mark("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None and self._leave_after_backward:
            self._engine.uninstall()
        self._pictures.mark("optimizer")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._reporter.optimizer_stepped()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if not self._active or engine is None:
            return
        engine.uninstall()
        if not self._batch_started:
            # Lightning skipped on_train_batch_start (the dataloader yielded None): nothing was offloaded.
            self._last_stats = OffloadStats()
            self._reporter.skipped_batch(trainer, pl_module, engine)
            return
        self._batch_started = False
        self._pictures.batch_end(trainer)
        stats = self._reporter.end_batch(trainer, pl_module, engine, self._pictures.plain)
        if not self._pictures.plain:
            self._last_stats = stats
        self._pictures.plain = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None:
            end_epoch(self._engine, ran_nothing=self._batch_started and not self._pictures.plain)
        self._batch_started = self._pictures.plain = False
        self._pictures.discard_batch()  # a recorded batch that never ended leaves no hooks behind
        if self._engine is not None and self._active:
            self._reporter.end_epoch(pl_module, self._engine)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation inside fit (``val_check_interval``, or after an epoch's last batch) runs between two training
        # batches, and the memory-budget planner's step stays open until the next one begins: validation's device
        # time would count as that step's (plans under trial are timed start to start), its peak as that step's peak.
        # The step ends here instead. (In the sanity check, before the first batch, no step is open: nothing to end.)
        if self._engine is not None:
            self._engine.end_step()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pictures.flush(trainer)  # training ended before the comparison batch: draw what was recorded

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._engine is not None:
            end_on_exception(self._engine, exception, in_batch=self._batch_started)
        self._batch_started = False
        self._leave_model(pl_module)  # Lightning calls no teardown hook after an exception
        self._pictures.close()
        self._reporter.discard()
        # The fit is over: the idle pinned buffers kept for its next step go, as in ``teardown`` (a retry pins anew).
        release_host_memory()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._leave_model(pl_module)
        self._pictures.discard_batch()
        if self._engine is not None:
            self._plans.keep(self._engine)
            self._engine.reset()
            self._engine = None
            release_host_memory()
        self._active = False

    @override
    def state_dict(self) -> dict[str, Any]:
        """The planner's plans (plain values, with a fingerprint of the model, budget and device): a fit resumed from
        the checkpoint runs them without measuring, where those are the same."""
        return self._plans.state_dict(self._engine)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._plans.load_state_dict(state_dict, self._engine)

    def _leave_model(self, pl_module: pl.LightningModule) -> None:
        """Remove every checkpoint wrapper this callback (or its planner) applied, and its wrapper of the module's
        ``optimizer_step``."""
        if self._unwrap is not None:
            self._unwrap, unwrap = None, self._unwrap
            unwrap()
        if self._manual is not None:
            self._manual.remove(pl_module)
        if self._engine is not None:
            self._engine.close()


# The options are documented once, in ``OffloadOptions`` (the picture's and ``checkpoint``'s where they are
# implemented); the logged figures once, where they are logged.
_doc = (ActivationOffloadCallback.__doc__ or "").replace(" " * 8 + "{options}", option_docs(8))
_doc = _doc.replace(" " * 8 + "{picture}\n", PICTURE_OPTION_DOCS).replace(" " * 8 + "{checkpoint}\n", CHECKPOINT_DOCS)
ActivationOffloadCallback.__doc__ = _doc.replace(" " * 4 + "{metrics}\n", METRIC_DOCS)
