"""``ActivationOffloadCallback``: activation offloading for any LightningModule, without code changes."""

from __future__ import annotations

import sys
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_offload.engine import OffloadEngine
from lightning_offload.host_pool import release_host_memory
from lightning_offload.memory_picture import MemoryPicture
from lightning_offload.metrics import OffloadEpochMetrics
from lightning_offload.options import (
    DEFAULT_MIN_TENSOR_BYTES,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_RESIDENT_TAIL_BYTES,
    GiB,
    Mode,
    OffloadOptions,
    OnHostFull,
)
from lightning_offload.stats import OffloadStats


class ActivationOffloadCallback(Callback):
    r"""Move the activations autograd saves in ``training_step`` to host memory, and back in backward.

    Gradients are unchanged: tensors are copied bit for bit. Hooks are installed in ``on_train_batch_start`` and
    removed after backward (or, when a batch may run forward again after a backward — LBFGS closures, manual
    optimization — in ``on_train_batch_end``), and always in ``on_train_batch_end``, ``on_train_epoch_end``,
    ``on_exception`` and ``teardown``. Streams and the pinned pool are created lazily, so the callback pickles
    (``ddp_spawn``).

    Example::

        trainer = Trainer(callbacks=[ActivationOffloadCallback()])

    Args:
        mode: ``"streamed"`` (copies overlap compute on two copy streams, backward prefetches), ``"sync"``
            (copy when saved and when needed; for debugging), or ``"off"`` (offload nothing; log what would
            be offloaded and the memory figures).
        compute_device: the device whose activations are offloaded. ``None``: the module's device when it is
            CUDA; otherwise the callback warns once and does nothing. ``"cpu"`` runs the engine on CPU tensors
            (for tests).
        min_tensor_bytes: saved tensors smaller than this stay on the device.
        resident_tail_bytes: the most recently saved bytes of each forward stay on the device (they are needed
            first in backward).
        max_offload_bytes: offload at most the first this-many bytes of each forward; the rest stays on the
            device. The knob that trades memory for step time. ``None``: no limit. ``"auto"``: meant to offload what
            the link moves during forward (bandwidth x forward time, measured); known to offload far too much on an
            H200, so prefer a byte count.
        max_inflight_bytes: device-to-host copies may lag forward by this many bytes before the compute stream
            waits for them (on the device), bounding the memory copies in flight hold. ``None``: 512 MiB when
            everything eligible is offloaded, unbounded with ``max_offload_bytes``.
        prefetch_bytes: the most bytes fetched back ahead of backward and not yet used; a model of the link
            decides when each copy starts.
        host_memory_limit: bytes of host memory the pool may hold. ``None``: 80% of the available RAM divided
            by the processes on this machine.
        on_host_full: ``"warn"`` keeps tensors on the device (one warning) when host memory runs out; ``"error"``
            raises ``HostMemoryFull``.
        measure_copies: time every copy, to log achieved bandwidth.
        checkpoint: also apply non-reentrant activation checkpointing to the module's repeated blocks, so only
            each block's input is saved (and offloaded, where it hides behind the block's compute): ``"auto"``
            (the largest ``ModuleList`` of same-class blocks), a class name or module name, or a list of those.
            ``None``: leave the model as it is.
        progress_bar: also show the step's peak allocated GiB in the progress bar (the offloaded GiB when the
            compute device is the CPU, where no peak is measured).
        memory_picture: once per fit, record one training step's memory over time and write it as
            ``offload_memory_picture.png`` into the logger's folder (and as an image to TensorBoard when a
            TensorBoard logger is attached): allocated memory against time with forward, backward and the optimizer
            step marked, the offloaded bytes the host holds and the bytes with a copy in flight. The second training
            batch is recorded (the first warms the host pool up); the recorded step synchronizes the device at every
            sample and so runs slower than the others.
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
        micro-batches of an accumulation window), in GiB.
        ``offload/peak_reserved_gib``: the same for memory reserved by the caching allocator.
        ``offload/offloaded_gib``: bytes copied to host memory in the latest batch, in GiB.
        ``offload/host_pinned_gib``: host memory the pinned pool holds, in GiB.
        ``offload/stall_ms``: (``mode="streamed"`` on CUDA) time the compute stream waited for host-to-device
        copies in the latest batch, in milliseconds.
        ``offload/d2h_gbps`` and ``offload/h2d_gbps``: (with ``measure_copies=True``) achieved bandwidth.

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
        compute_device: str | None = None,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        resident_tail_bytes: int = DEFAULT_RESIDENT_TAIL_BYTES,
        max_offload_bytes: int | Literal["auto"] | None = None,
        max_inflight_bytes: int | None = None,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        host_memory_limit: int | None = None,
        on_host_full: OnHostFull = "warn",
        measure_copies: bool = False,
        checkpoint: str | list[str] | None = None,
        progress_bar: bool = False,
        memory_picture: bool = False,
        memory_picture_compare: bool = True,
        memory_snapshot: bool = False,
    ) -> None:
        super().__init__()
        self.options = OffloadOptions.create(
            "ActivationOffloadCallback",
            mode=mode,
            compute_device=compute_device,
            min_tensor_bytes=min_tensor_bytes,
            resident_tail_bytes=resident_tail_bytes,
            max_offload_bytes=max_offload_bytes,
            max_inflight_bytes=max_inflight_bytes,
            prefetch_bytes=prefetch_bytes,
            host_memory_limit=host_memory_limit,
            on_host_full=on_host_full,
            measure_copies=measure_copies,
        )
        if checkpoint is not None and not isinstance(checkpoint, (str, list, tuple)):
            raise ValueError(
                f"ActivationOffloadCallback(checkpoint={checkpoint!r}): checkpoint must be None, 'auto', a class or "
                "module name, or a list of names"
            )
        self.checkpoint = checkpoint
        for name, value in (
            ("progress_bar", progress_bar),
            ("memory_picture", memory_picture),
            ("memory_picture_compare", memory_picture_compare),
            ("memory_snapshot", memory_snapshot),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"ActivationOffloadCallback({name}={value!r}): {name} must be True or False")
        if memory_snapshot and not memory_picture:
            raise ValueError(
                "ActivationOffloadCallback(memory_snapshot=True, memory_picture=False): the snapshot covers the step "
                "the memory picture records; pass memory_picture=True too"
            )
        self.progress_bar = progress_bar
        # Created in ``setup``, where the device is known; both pickle without their device state (``ddp_spawn``).
        self._epoch_metrics: OffloadEpochMetrics | None = None
        self._picture = (
            MemoryPicture(compare=memory_picture_compare, snapshot=memory_snapshot) if memory_picture else None
        )
        self._plain_batch = False  # this batch runs without offloading (the memory picture's comparison)
        self._engine: OffloadEngine | None = None
        self._active = False
        self._leave_after_backward = True
        self._stepped = False  # an optimizer step ran in this batch
        self._reset_peaks = True  # the next batch opens a new optimizer step (accumulation window)
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
            options = OffloadOptions(**{**options.__dict__, "compute_device": device})
        # One process per device on this machine (ddp, ddp_spawn, fsdp): Lightning's launchers do not set
        # LOCAL_WORLD_SIZE, so the count comes from the trainer.
        self._engine = OffloadEngine(options, model=pl_module, local_processes=max(1, trainer.num_devices))
        self._active = True
        self._setup_reporting(trainer, device)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        # Both need what only exists now: the blocks ``configure_model`` builds, the optimizers Lightning set up.
        if self.checkpoint is not None:
            from lightning_offload.checkpointing import apply_checkpointing

            apply_checkpointing(pl_module, self.checkpoint)
        # A batch that runs forward again after a backward (LBFGS calls its closure repeatedly; manual optimization
        # may call backward several times) keeps the hooks until the batch ends.
        self._leave_after_backward = pl_module.automatic_optimization and not any(
            isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _require_trainer(trainer, "on_train_batch_start")
        engine = self._engine
        if not self._active or engine is None:
            return
        device = self._cuda_device()
        if device is not None and self._reset_peaks:
            torch.cuda.reset_peak_memory_stats(device)
        self._reset_peaks = False
        self._batch_started = True
        picture = self._picture
        self._plain_batch = picture is not None and not picture.offload_batch()
        if not engine.installed and not self._plain_batch:
            engine.__enter__()
        if picture is not None:
            picture.on_batch_start(pl_module, engine, engine._device or pl_module.device)

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
        self._stepped = True

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
        self._log(trainer, pl_module, engine)
        self._plain_batch = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None:
            self._engine.uninstall()
        if self._picture is not None:
            self._picture.discard_batch()  # a recorded batch that never ended leaves no hooks behind
        self._log_epoch(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._picture is not None:
            # Training ended before the comparison batch: draw what was recorded.
            self._picture.flush(trainer, self._picture_title())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._engine is not None:
            self._engine.reset()
        if self._picture is not None:
            self._picture.close()
        if self._epoch_metrics is not None:
            self._epoch_metrics.reset()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._picture is not None:
            self._picture.discard_batch()
        if self._engine is not None:
            self._engine.reset()
            self._engine = None
            release_host_memory()
        self._active = False

    def _cuda_device(self) -> torch.device | None:
        engine = self._engine
        if engine is None or engine._device is None or engine._device.type != "cuda":
            return None
        return engine._device

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: OffloadEngine) -> None:
        # Peaks cover a whole optimizer step, across the micro-batches of an accumulation window.
        stepped = self._stepped or not pl_module.automatic_optimization
        self._reset_peaks = stepped
        self._stepped = False
        # Timing events are waited for only when the logger writes: anything else would sync every step.
        will_log = _will_log(trainer)
        stats = engine.collect_stats(wait=will_log)
        if self._plain_batch:
            # The memory picture's comparison batch offloaded nothing: log that (and its real peak), and keep it out
            # of ``stats`` and the epoch summaries, which describe offloading.
            stats = OffloadStats(host_bytes_held=stats.host_bytes_held, host_pinned_bytes=stats.host_pinned_bytes)
        else:
            self._last_stats = stats
        device = self._cuda_device()
        # Reading the peaks is host-side allocator bookkeeping: no device synchronization.
        peaks = (
            (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            if stepped and device is not None
            else None
        )
        if self._epoch_metrics is not None and not self._plain_batch:
            self._epoch_metrics.update(stats, *(peaks or (None, None)))
        if not will_log:
            return
        metrics: dict[str, float] = {}
        if peaks is not None:
            metrics["offload/peak_allocated_gib"] = peaks[0] / GiB
            metrics["offload/peak_reserved_gib"] = peaks[1] / GiB
        metrics["offload/offloaded_gib"] = stats.offloaded_bytes / GiB
        metrics["offload/host_pinned_gib"] = stats.host_pinned_bytes / GiB
        if self.options.mode == "streamed" and device is not None:
            metrics["offload/stall_ms"] = stats.stall_ms
        if self.options.measure_copies and device is not None:
            metrics["offload/d2h_gbps"] = stats.d2h_gbps()
            metrics["offload/h2d_gbps"] = stats.h2d_gbps()
        shown = "offload/peak_allocated_gib" if device is not None else "offload/offloaded_gib"
        # Without a logger the values still reach ``trainer.callback_metrics`` and the progress bar; asking for the
        # logger anyway would make Lightning warn once per key.
        to_logger = bool(trainer.loggers)
        for key, value in metrics.items():
            prog_bar = self.progress_bar and key == shown
            pl_module.log(key, value, on_step=True, on_epoch=False, logger=to_logger, prog_bar=prog_bar, batch_size=1)

    def _setup_reporting(self, trainer: pl.Trainer, device: torch.device) -> None:
        options = self.options
        self._epoch_metrics = OffloadEpochMetrics(
            cuda=device.type == "cuda", streamed=options.mode == "streamed", measure_copies=options.measure_copies
        )
        if self._picture is not None:
            # The comparison batch skips offloading for one whole optimizer step; under accumulation, manual
            # optimization or LBFGS a batch is not one whole step, and with mode="off" there is nothing to compare.
            compare_allowed = (
                options.mode != "off" and self._leave_after_backward and trainer.accumulate_grad_batches == 1
            )
            self._picture.on_fit_start(record=trainer.is_global_zero, compare_allowed=compare_allowed)

    def _picture_title(self) -> str:
        options = self.options
        return f"ActivationOffloadCallback(mode={options.mode!r}): one training step"

    def _log_epoch(self, pl_module: pl.LightningModule) -> None:
        summaries = self._epoch_metrics
        engine = self._engine
        if summaries is None or engine is None or not self._active:
            return
        engine.collect_stats(wait=True)  # the last batch's timings: one wait per epoch
        # Every process computes (the reduction is collective), and logs the same reduced values. ``sync_dist``
        # averages identical numbers (a no-op on the values); without it Lightning warns on every epoch key.
        to_logger = bool(pl_module.loggers)  # as in ``_log``: no logger, no warning per key
        for key, value in summaries.compute(pl_module.device).items():
            pl_module.log(key, value, on_step=False, on_epoch=True, logger=to_logger, batch_size=1, sync_dist=True)


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


def _will_log(trainer: pl.Trainer) -> bool:
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
