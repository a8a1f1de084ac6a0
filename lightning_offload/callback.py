"""``ActivationOffloadCallback``: activation offloading for any LightningModule, without code changes."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_offload.checkpointing import (
    apply_checkpointing,
    checkpointed_modules,
    parse_blocks,
    remove_checkpointing,
    select_blocks,
)
from lightning_offload.engine import OffloadEngine
from lightning_offload.host_pool import release_host_memory
from lightning_offload.memory_picture import MemoryPicture
from lightning_offload.options import (
    DEFAULT_MIN_TENSOR_BYTES,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_RESIDENT_TAIL_BYTES,
    Mode,
    OffloadOptions,
    OnHostFull,
    option_docs,
)
from lightning_offload.reporting import StepReporter
from lightning_offload.stats import OffloadStats


class ActivationOffloadCallback(Callback):
    r"""Move the activations autograd saves in ``training_step`` to host memory (as much as the budget needs).

    Gradients are unchanged: tensors are copied bit for bit. Hooks are installed in ``on_train_batch_start`` and
    removed after backward (or, when a batch may run forward again after a backward — LBFGS closures, manual
    optimization — in ``on_train_batch_end``), and always in ``on_train_batch_end``, ``on_train_epoch_end``,
    ``on_exception`` and ``teardown``. Streams and the pinned pool are created lazily, so the callback pickles
    (``ddp_spawn``). With a memory budget (the default), the first batch is measured and a plan is chosen and
    reported (one line at INFO); a batch whose tensors change shape is measured again.

    Example::

        trainer = Trainer(callbacks=[ActivationOffloadCallback()])  # fit the device, as cheaply as possible
        trainer = Trainer(callbacks=[ActivationOffloadCallback(memory_budget="40GiB")])

    Args:
        {options}
        checkpoint: also apply non-reentrant activation checkpointing to the module's repeated blocks, so only
            each block's input is saved (and offloaded, where it hides behind the block's compute): ``"auto"``
            (the largest ``ModuleList`` of same-class blocks), a class name or module name, an ``nn.Module``
            subclass, or a list mixing names and classes. ``None``: leave the model as it is (the memory-budget
            planner may still checkpoint some blocks). A manual override: it switches the planner off. A selector
            that matches no module raises in ``setup`` (or, when the module builds its layers in its own ``setup``
            or ``configure_model``, in ``on_fit_start``, still before any batch), listing the candidate block
            classes. Wrappers (the planner's too) are removed at the end of the fit (``teardown``, or
            ``on_exception``), so the module's ``forward`` is afterwards what it was; ``state_dict`` keys never
            change.
        progress_bar: also show the step's peak allocated GiB in the progress bar (the offloaded GiB when the
            compute device is the CPU, where no peak is measured).
        memory_picture: once per fit, record one training step's memory over time and write it as
            ``offload_memory_picture.png`` into the logger's folder (and as an image to TensorBoard when a
            TensorBoard logger is attached): allocated memory against time with forward, backward and the optimizer
            step marked, the offloaded bytes the host holds and the bytes with a copy in flight. The second training
            batch is recorded (the first warms the host pool up); the recorded step synchronizes the device at every
            sample and so runs slower than the others. Needs matplotlib (checked here).
        memory_picture_compare: with ``memory_picture``, run the batch after the recorded one without offloading
            and draw it too, for comparison. That batch logs what it did (nothing offloaded, its peak without
            offloading) and is left out of the epoch summaries. It needs the memory offloading saves: turn this
            off when the model fits only with offloading. It is skipped with ``mode="off"``, gradient
            accumulation, manual optimization and LBFGS.
        memory_snapshot: with ``memory_picture``, also record the CUDA caching allocator's history over the recorded
            step (``torch.cuda.memory._record_memory_history``) and write it beside the picture as
            ``offload_memory_snapshot.pickle``, for PyTorch's memory viewer: every allocation and free of the step
            with its Python stack. CUDA only: on another device it warns and writes no snapshot.

    Logged metrics (through ``LightningModule.log``, so ``log_every_n_steps`` applies):
        ``offload/peak_allocated_gib``: peak ``torch.cuda.memory_allocated`` over the optimizer step (all
        micro-batches of an accumulation window), in GiB; the first batch of every fit starts from a reset.
        ``offload/peak_reserved_gib``: the same for memory reserved by the caching allocator.
        ``offload/offloaded_gib``: bytes copied to host memory in the latest batch, in GiB.
        ``offload/host_pinned_gib``: host memory the pinned pool holds, in GiB.
        ``offload/stall_ms``: (``mode="streamed"`` on CUDA) time the compute stream waited for host-to-device
        copies in the latest batch, in milliseconds.
        ``offload/d2h_gbps`` and ``offload/h2d_gbps``: (with ``measure_copies=True``) achieved bandwidth.
        ``offload/memory_budget_gib``: (with a memory budget, once planned) the budget, in GiB.
        ``offload/plan_offload_gib``: the bytes of each forward the plan offloads, in GiB.
        ``offload/plan_checkpoint_blocks``: how many blocks the plan checkpoints.
        ``offload/plan_peak_gib``: the peak the plan predicts, in GiB.

    Epoch summaries (logged at the end of every training epoch, reduced over all processes with torchmetrics):
        ``offload/peak_allocated_gib_epoch_max``: the highest ``offload/peak_allocated_gib`` of the epoch (CUDA).
        ``offload/peak_reserved_gib_epoch_max``: the highest ``offload/peak_reserved_gib`` of the epoch (CUDA).
        ``offload/offloaded_gib_epoch_mean``: the mean ``offload/offloaded_gib`` per training batch.
        ``offload/host_pinned_gib_epoch_max``: the most host memory the pool held after a batch.
        ``offload/stall_ms_epoch_mean``: (``mode="streamed"`` on CUDA) the mean ``offload/stall_ms`` per batch.
        ``offload/d2h_gbps_epoch_mean`` and ``offload/h2d_gbps_epoch_mean``: (with ``measure_copies=True``) the
        epoch's bandwidth: bytes copied over time spent copying.
    """

    def __init__(
        self,
        mode: Mode = "streamed",
        memory_budget: int | str | None = "auto",
        compute_device: str | None = None,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        resident_tail_bytes: int = DEFAULT_RESIDENT_TAIL_BYTES,
        max_offload_bytes: int | None = None,
        max_inflight_bytes: int | None = None,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        host_memory_limit: int | None = None,
        on_host_full: OnHostFull = "warn",
        measure_copies: bool = False,
        checkpoint: str | type[nn.Module] | list[str | type[nn.Module]] | None = None,
        progress_bar: bool = False,
        memory_picture: bool = False,
        memory_picture_compare: bool = True,
        memory_snapshot: bool = False,
    ) -> None:
        super().__init__()
        values = dict(locals())
        shared = {name: values[name] for name in OffloadOptions.names()}
        self.options = OffloadOptions.create("ActivationOffloadCallback", **shared)
        if checkpoint is not None:
            parse_blocks(checkpoint, call=f"ActivationOffloadCallback(checkpoint={checkpoint!r})")
        self.checkpoint = checkpoint
        self._checkpointed: list[str] = []  # the wrappers this callback applied in this fit, removed at its end
        for name in ("progress_bar", "memory_picture", "memory_picture_compare", "memory_snapshot"):
            if not isinstance(values[name], bool):
                raise TypeError(f"ActivationOffloadCallback({name}={values[name]!r}): {name} must be True or False")
        if memory_snapshot and not memory_picture:
            raise ValueError(
                "ActivationOffloadCallback(memory_snapshot=True, memory_picture=False): the snapshot covers the step "
                "the memory picture records; pass memory_picture=True too"
            )
        if memory_picture:
            _require_matplotlib()
        self.progress_bar = progress_bar
        self._reporter = StepReporter(self.options, progress_bar)
        self._picture = (
            MemoryPicture(compare=memory_picture_compare, snapshot=memory_snapshot) if memory_picture else None
        )
        self._plain_batch = False  # this batch runs without offloading (the memory picture's comparison)
        self._engine: OffloadEngine | None = None  # built in ``setup``, where the device is known
        self._active = False
        self._leave_after_backward = True
        self._last_stats = OffloadStats()
        self._batch_started = False
        self._shapes: tuple[Any, ...] | None = None  # the latest batch's tensor shapes: a change is planned anew

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
        # Lightning attaches the module's ``log`` and ``log_dict`` to every callback at each fit: bound methods that
        # would pickle the whole model. The next fit attaches them again.
        state.pop("log", None)
        state.pop("log_dict", None)
        state["_checkpointed"] = []  # a copy applied no wrappers, so it has none to remove
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
        if self.checkpoint is not None and not _builds_layers_after_setup(pl_module):
            self._check_checkpoint(pl_module)  # a name that matches nothing fails now, before anything runs
        options = self.options
        device = options.compute_device
        if device is None:
            device = pl_module.device
            if device.type != "cuda":
                rank_zero_warn(
                    f"ActivationOffloadCallback: the model runs on {device.type!r}, not CUDA; activations stay where "
                    "they are and the callback does nothing. (Pass compute_device='cpu' to exercise it on the CPU.)"
                )
                self._active = False
                return
            options = dataclasses.replace(options, compute_device=device)
        if self.checkpoint is not None:
            options = dataclasses.replace(options, memory_budget=None)  # checkpointing by hand: the user decides
        # One process per device on this machine (ddp, ddp_spawn, fsdp): Lightning's launchers do not set
        # LOCAL_WORLD_SIZE, so the count comes from the trainer.
        self._engine = OffloadEngine(options, model=pl_module, local_processes=max(1, trainer.num_devices))
        self._active = True
        self._shapes = None
        self._reporter.start_fit(device)
        if self._picture is not None:
            # The comparison batch skips offloading for one whole optimizer step; under accumulation, manual
            # optimization or LBFGS a batch is not one whole step, and with mode="off" there is nothing to compare.
            compare_allowed = (
                options.mode != "off" and self._leave_after_backward and trainer.accumulate_grad_batches == 1
            )
            self._picture.on_fit_start(record=trainer.is_global_zero, compare_allowed=compare_allowed)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Both need what only exists now: the blocks ``configure_model`` builds, the optimizers Lightning set up.
        if self.checkpoint is not None:
            # Checked even when the callback does nothing here (no CUDA), so a wrong name fails on every machine.
            self._check_checkpoint(pl_module)
            if self._active:
                already = set(checkpointed_modules(pl_module))  # the user's own wrappers stay after the fit
                applied = apply_checkpointing(pl_module, self.checkpoint)
                self._checkpointed = [name for name in applied if name not in already]
        if not self._active:
            return
        # A batch that runs forward again after a backward (LBFGS calls its closure repeatedly; manual optimization
        # may call backward several times) keeps the hooks until the batch ends.
        self._leave_after_backward = pl_module.automatic_optimization and not any(
            isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers
        )
        if self._engine is not None and self._engine.options.plans and pl_module.device.type == "cuda":
            rank_zero_info(
                f"ActivationOffloadCallback: memory_budget={self.options.memory_budget!r}; measuring the first "
                "training batch to plan what to offload and checkpoint"
            )

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
        shapes = _shapes(batch)
        if self._shapes is not None and shapes != self._shapes:
            engine.replan()  # a new input shape: the plan of the old one may not fit, or may waste time
        self._shapes = shapes
        if not engine.installed and not self._plain_batch:
            engine.install()
            planner = engine.planner
            if planner is not None and planner.on_plan is None:
                planner.owns_peaks = False  # the reporter resets the peak counters per optimizer step
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
        if self._picture is not None:
            self._picture.discard_batch()  # a recorded batch that never ended leaves no hooks behind
        if self._engine is not None and self._active:
            self._reporter.end_epoch(pl_module, self._engine)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._picture is not None:
            # Training ended before the comparison batch: draw what was recorded.
            self._picture.flush(trainer, self._picture_title())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._leave_model(pl_module)  # Lightning calls no teardown hook after an exception
        if self._engine is not None:
            self._engine.reset()
        if self._picture is not None:
            self._picture.close()
        self._reporter.discard()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._leave_model(pl_module)
        if self._picture is not None:
            self._picture.discard_batch()
        if self._engine is not None:
            self._engine.reset()
            self._engine = None
            release_host_memory()
        self._active = False

    def _check_checkpoint(self, pl_module: pl.LightningModule) -> None:
        """Raise, listing the candidate block classes, when a ``checkpoint`` selector matches no module."""
        assert self.checkpoint is not None
        select_blocks(pl_module, self.checkpoint, call=f"ActivationOffloadCallback(checkpoint={self.checkpoint!r})")

    def _leave_model(self, pl_module: pl.LightningModule) -> None:
        """Remove every checkpoint wrapper this callback (or its planner) applied."""
        if self._checkpointed:
            remove_checkpointing(pl_module, self._checkpointed)
            self._checkpointed = []
        if self._engine is not None and self._engine.planner is not None:
            self._engine.planner.remove()

    def _picture_title(self) -> str:
        return f"ActivationOffloadCallback(mode={self.options.mode!r}): one training step"


ActivationOffloadCallback.__doc__ = (ActivationOffloadCallback.__doc__ or "").replace(
    " " * 8 + "{options}", option_docs(8)
)


def _shapes(batch: Any) -> tuple[Any, ...]:
    """The shapes of the tensors in a batch (any nesting of lists, tuples and dicts)."""
    from torch.utils._pytree import tree_leaves

    return tuple(tuple(leaf.shape) for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor))


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
    return any(is_overridden(hook, pl_module) for hook in ("setup", "configure_model", "configure_sharded_model"))


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "ActivationOffloadCallback(memory_picture=True): drawing the memory picture needs matplotlib, which is "
            "not installed; install it with `pip install matplotlib` (or `pip install lightning-offload[plot]`), "
            "or pass memory_picture=False"
        ) from err
