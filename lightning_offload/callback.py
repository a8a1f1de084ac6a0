"""``ActivationOffloadCallback``: activation offloading for any LightningModule, without code changes."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_offload.checkpointing import CHECKPOINT_DOCS, RunCheckpointing, check_recompute
from lightning_offload.engine import OffloadEngine
from lightning_offload.host_pool import release_host_memory
from lightning_offload.memory_picture import PICTURE_OPTION_DOCS, MemoryPicture
from lightning_offload.options import (
    DEFAULT_MIN_TENSOR_BYTES,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_RESIDENT_TAIL_BYTES,
    Mode,
    OffloadOptions,
    OnHostFull,
    no_cuda_message,
    option_docs,
    warn_unused_budget,
)
from lightning_offload.planned_blocks import compiled_modules
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
    that shape's plan again.

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
        call = f"ActivationOffloadCallback(checkpoint={checkpoint!r}" + (
            f", recompute={recompute!r})" if recompute != "all" else ")"
        )
        check_recompute(recompute, call, checkpoint)
        self._manual = RunCheckpointing(checkpoint, call, recompute) if checkpoint is not None else None
        # Said now, once: with compute_device=None the device is the module's, known in ``setup``, where off CUDA
        # the callback says it offloads nothing at all.
        warn_unused_budget("ActivationOffloadCallback", self.options, memory_budget, checkpoint)
        _check_reporting_args(values)
        self.progress_bar = progress_bar
        self._reporter = StepReporter(self.options, progress_bar)
        self._picture = (
            MemoryPicture(compare=memory_picture_compare, snapshot=memory_snapshot) if memory_picture else None
        )
        self._plain_batch = False  # this batch runs without offloading (the memory picture's comparison)
        self._engine: OffloadEngine | None = None  # built in ``setup``, where the device is known
        self._plans: dict[str, Any] | None = None  # the last fit's plans, for the next (and checkpoints)
        self._active = False
        self._leave_after_backward = True
        self._last_stats = OffloadStats()
        self._batch_started = False

    @property
    def stats(self) -> OffloadStats:
        """What the latest training batch offloaded."""
        return self._last_stats

    @property
    def engine(self) -> OffloadEngine | None:
        """The engine, once ``setup`` has run on a device that offloads."""
        return self._engine

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.options.mode)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_engine"] = None  # streams, events and host buffers do not cross processes
        for name in ("log", "log_dict"):  # bound methods of the module Lightning attaches per fit: the whole model
            state.pop(name, None)
        return state

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        ours = [cb for cb in trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
        if len(ours) > 1:
            raise RuntimeError(
                f"Trainer(callbacks=[...]) holds {len(ours)} ActivationOffloadCallback instances. Saved-tensor hooks "
                "stack and only the innermost would run; pass a single ActivationOffloadCallback."
            )
        if stage != "fit":
            return
        if self._manual is not None and not _builds_layers_after_setup(pl_module):
            self._manual.check(pl_module)  # a name that matches nothing fails now, before anything runs
        options = self.options
        device = options.compute_device
        if device is None:
            device = pl_module.device
            if device.type != "cuda":
                rank_zero_warn(no_cuda_message("ActivationOffloadCallback", f"module on {device.type}"))
                self._active = False
                return
            options = dataclasses.replace(options, compute_device=device)
        if self.checkpoint is not None:
            options = dataclasses.replace(options, memory_budget=None)  # checkpointing by hand: the user decides
        # One process per device on this machine (ddp, ddp_spawn, fsdp): Lightning's launchers do not set
        # LOCAL_WORLD_SIZE, so the count comes from the trainer.
        self._engine = OffloadEngine(options, model=pl_module, local_processes=max(1, trainer.num_devices))
        self._engine.load_plans(self._plans)  # an earlier fit's (or a checkpoint's): measured again where they differ
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
        # A batch that runs forward again after a backward (LBFGS calls its closure repeatedly; manual optimization
        # may call backward several times) keeps the hooks until the batch ends.
        self._leave_after_backward = pl_module.automatic_optimization and not any(
            isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers
        )
        if self._picture is not None:
            # Planned here, not in ``setup``: whether a batch is one whole optimizer step needs the optimizers. The
            # comparison batch skips offloading for one whole optimizer step (not so under accumulation, manual
            # optimization or LBFGS), and with mode="off" there is nothing to compare.
            whole = self.options.mode != "off" and self._leave_after_backward and trainer.accumulate_grad_batches == 1
            self._picture.on_fit_start(record=trainer.is_global_zero, compare_allowed=whole)
        planned = self._engine is not None and self._engine.options.plans and not compiled_modules(pl_module)
        if planned and pl_module.device.type == "cuda":  # (a compiled module is not planned: the engine says so)
            budget = self.options.memory_budget
            rank_zero_info(f"ActivationOffloadCallback: memory_budget={budget!r}; measuring the first batch to plan")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _require_trainer(trainer, "on_train_batch_start")
        engine = self._engine
        if not self._active or engine is None:
            return
        self._batch_started = True
        picture = self._picture
        self._plain_batch = picture is not None and not picture.offload_batch()
        # A new input shape is measured (the old one's plan may not fit, or may waste time); one met before runs the
        # plan it had (lengths that change from batch to batch would otherwise measure at every step).
        engine.input_changed(_shapes(batch))
        if self._plain_batch:
            engine.end_step()  # the planner's step before this batch ends here: this batch's peak is not its
        elif not engine.installed:
            self._reporter.before_install(trainer, engine)
            engine.install()
            planner = engine.planner
            if planner is not None and planner.on_plan is None:
                planner.owns_peaks = False  # the reporter resets the peak counters as each batch begins
                planner.on_plan = lambda text: rank_zero_info(f"ActivationOffloadCallback: {text}")
        self._reporter.start_batch()  # after the engine read the previous step's peak
        if picture is not None:
            picture.on_batch_start(pl_module, engine, engine.device or pl_module.device)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._picture is not None:
            self._picture.mark("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None and self._leave_after_backward:
            self._engine.uninstall()
        if self._picture is not None:
            self._picture.mark("optimizer")

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
        if self._picture is not None:
            self._picture.on_batch_end(trainer, self._picture_title())
        stats = self._reporter.end_batch(trainer, pl_module, engine, self._plain_batch)
        if not self._plain_batch:
            self._last_stats = stats
        self._plain_batch = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None:
            self._engine.uninstall()
            if self._batch_started and not self._plain_batch:
                # The module's on_train_batch_start returned -1 after this batch's step began: it ran nothing. Dropped,
                # so the memory-budget planner neither measures it (a plan from a step without activations) nor times
                # it (its time would be the epoch's end).
                self._engine.reset()
        self._batch_started = self._plain_batch = False
        if self._picture is not None:
            self._picture.discard_batch()  # a recorded batch that never ended leaves no hooks behind
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
        if self._picture is not None:
            # Training ended before the comparison batch: draw what was recorded.
            self._picture.flush(trainer, self._picture_title())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._engine is not None:
            if self._batch_started:
                self._engine.failed(exception)  # before the model is left: its message names the blocks checkpointed
            else:
                # Raised outside a training batch (validation, saving a checkpoint): not the planned step's doing, so
                # nothing explains it in that step's numbers; what the engine holds is dropped all the same.
                self._engine.reset()
        self._batch_started = False
        self._leave_model(pl_module)  # Lightning calls no teardown hook after an exception
        if self._picture is not None:
            self._picture.close()
        self._reporter.discard()
        # The fit is over: the idle pinned buffers kept for its next step go, as in ``teardown`` (a retry pins anew).
        release_host_memory()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._leave_model(pl_module)
        if self._picture is not None:
            self._picture.discard_batch()
        if self._engine is not None:
            self._plans = self._engine.plans_state()
            self._engine.reset()
            self._engine = None
            release_host_memory()
        self._active = False

    @override
    def state_dict(self) -> dict[str, Any]:
        """The planner's plans (plain values, with a fingerprint of the model, budget and device): a fit resumed from
        the checkpoint runs them without measuring, where those are the same."""
        plans = self._engine.plans_state() if self._engine is not None else self._plans
        return {"plans": plans} if plans is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._plans = state_dict.get("plans")
        if self._engine is not None and (self._engine.planner is None or not self._engine.planner.step):
            self._engine.load_plans(self._plans)

    def _leave_model(self, pl_module: pl.LightningModule) -> None:
        """Remove every checkpoint wrapper this callback (or its planner) applied."""
        if self._manual is not None:
            self._manual.remove(pl_module)
        if self._engine is not None:
            self._engine.close()

    def _picture_title(self) -> str:
        return f"ActivationOffloadCallback(mode={self.options.mode!r}): one training step"


# The options are documented once, in ``OffloadOptions`` (the picture's and ``checkpoint``'s where they are
# implemented); the logged figures once, where they are logged.
_doc = (ActivationOffloadCallback.__doc__ or "").replace(" " * 8 + "{options}", option_docs(8))
_doc = _doc.replace(" " * 8 + "{picture}\n", PICTURE_OPTION_DOCS).replace(" " * 8 + "{checkpoint}\n", CHECKPOINT_DOCS)
ActivationOffloadCallback.__doc__ = _doc.replace(" " * 4 + "{metrics}\n", METRIC_DOCS)


def _shapes(batch: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of the tensors in a batch: any nesting of mappings (their values by name), sequences and
    dataclasses. A tensor's name is its path of mapping keys and dataclass fields (``"inputs.ids"``; ``""`` where it
    has none): the planner runs a new input on the plan of one no larger in every dimension unmeasured, and tensors of
    other names (``text`` and ``audio`` in a multi-modal run) take other paths through the model.

    Walked by hand rather than with ``torch.utils._pytree``, which sees a ``Mapping`` that is no ``dict`` (Hugging
    Face's ``BatchEncoding``, a ``UserDict``) or a dataclass as one opaque leaf: a new sequence length inside it
    would go unnoticed and the old shape's plan would run on it.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def walk(value: Any, path: str = "") -> None:
        if isinstance(value, torch.Tensor):
            shapes.append((path, tuple(value.shape)))
        elif isinstance(value, Mapping):
            # In the order of the names, not of insertion: the planner compares keys position by position (a new
            # input no larger in every dimension than one whose plan keeps everything runs that plan unmeasured), and
            # a collate that builds each batch's dict in its first sample's order (samples of two sources) would line
            # up one batch's long tensor with another's short one.
            for name in sorted(value, key=str):
                walk(value[name], f"{path}.{name}" if path else str(name))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for item in value:
                walk(item, path)  # (positions are compared as they come)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), f"{path}.{field.name}" if path else field.name)

    walk(batch)
    return tuple(shapes)


def _require_trainer(trainer: Any, hook: str) -> None:
    """Refuse to run outside a Lightning ``Trainer`` (e.g. ``fabric.call``), where ``setup`` never built the engine.

    Without this, the hook would return without offloading anything, and nothing would say so.
    """
    trainers: tuple[type, ...] = (pl.Trainer,)
    # The twin's trainer, when ``pytorch_lightning`` is in use (imported: no import cost for anyone else).
    standalone = getattr(sys.modules.get("pytorch_lightning"), "Trainer", None)
    if isinstance(standalone, type):
        trainers = (*trainers, standalone)
    if not isinstance(trainer, trainers):
        raise RuntimeError(
            f"ActivationOffloadCallback.{hook}(trainer={type(trainer).__name__}): the callback runs inside a "
            "Lightning Trainer, whose setup builds the offloading engine; called any other way (such as "
            "fabric.call) it would offload nothing. In a Fabric loop use "
            "`off = lightning_offload.fabric.fabric_offload(fabric, model)` and `with off:` around each forward."
        )


def _builds_layers_after_setup(pl_module: pl.LightningModule) -> bool:
    """Whether the module may create layers after the callbacks' ``setup``: in its own ``setup`` (called after the
    callbacks') or in ``configure_model`` (called after every ``setup``)."""
    # The base class is named: ``is_overridden`` finds it only for a ``lightning.pytorch`` module and raises for a
    # ``pytorch_lightning`` one (the twin callback in ``pl_compat``), whose base is that package's own class.
    parent: type = pl.LightningModule
    standalone = getattr(sys.modules.get("pytorch_lightning"), "LightningModule", None)
    if not isinstance(pl_module, parent) and isinstance(standalone, type) and isinstance(pl_module, standalone):
        parent = standalone
    hooks = ("setup", "configure_model", "configure_sharded_model")
    return any(is_overridden(hook, pl_module, parent) for hook in hooks)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "ActivationOffloadCallback(memory_picture=True): drawing the memory picture needs matplotlib, which is "
            "not installed; install it with `pip install matplotlib` (or `pip install lightning-offload[plot]`), "
            "or pass memory_picture=False"
        ) from err


def _check_reporting_args(values: dict[str, Any]) -> None:
    """The callback's own options (what it shows and draws): types, combinations, and matplotlib when drawing."""
    for name in ("progress_bar", "memory_picture", "memory_picture_compare", "memory_snapshot"):
        if not isinstance(values[name], bool):
            raise TypeError(f"ActivationOffloadCallback({name}={values[name]!r}): {name} must be True or False")
    if values["memory_snapshot"] and not values["memory_picture"]:
        raise ValueError(
            "ActivationOffloadCallback(memory_snapshot=True, memory_picture=False): the snapshot covers the step "
            "the memory picture records; pass memory_picture=True too"
        )
    if values["memory_picture"]:
        _require_matplotlib()
