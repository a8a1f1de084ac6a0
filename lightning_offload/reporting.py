"""What the Lightning callback logs: per-step figures, the memory-budget plan, and epoch summaries.

Peaks are per optimizer step (all micro-batches of an accumulation window): the highest of its batches' peaks. The
counters are reset as every batch begins (the first of every fit included, so no figure carries memory from before the
fit), after the engine read the step before's: the memory-budget planner learns from each batch's own peak.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_offload.budget import BudgetPlanner
from lightning_offload.device_memory import AllocatorCounters, read_counters
from lightning_offload.engine import OffloadEngine
from lightning_offload.metrics import OffloadEpochMetrics
from lightning_offload.options import GiB, OffloadOptions
from lightning_offload.planner.profile import Plan
from lightning_offload.stats import OffloadStats

# Every figure the callback logs, in the words its docstring (and ``--help``) shows.
METRIC_DOCS = """\
    Logged metrics (through ``LightningModule.log``, so ``log_every_n_steps`` applies; a batch the dataloader yielded as
    ``None`` logs nothing offloaded and NaN for the peaks and the plan; a batch whose row Lightning writes only because
    a hook stopped training during or after it holds its own figures, its copy timings left out):
        ``offload/peak_allocated_gib``: peak ``torch.cuda.memory_allocated`` over the optimizer step (all
        micro-batches of an accumulation window), in GiB; the first batch of every fit starts from a reset.
        ``offload/peak_reserved_gib``: the same for memory reserved by the caching allocator.
        ``offload/alloc_flushes``: how often in the optimizer step an allocation found the device (or the process's
        memory fraction) full and the caching allocator freed its cached blocks to try again, a slow path that
        synchronizes the device: a step near its memory limit pays for it.
        ``offload/offloaded_gib``: bytes copied to host memory in the latest batch, in GiB.
        ``offload/host_pinned_gib``: host memory the pinned pool holds, in GiB.
        ``offload/stall_ms``: (``mode="streamed"`` on CUDA) time the compute stream waited for host-to-device
        copies in the latest batch, in milliseconds.
        ``offload/d2h_gbps`` and ``offload/h2d_gbps``: (``mode="streamed"`` on CUDA with ``measure_copies=True``)
        achieved bandwidth; NaN for a batch that timed no copy that way.
        ``offload/memory_budget_gib``: (with a memory budget) the budget, in GiB.
        ``offload/plan_offload_gib``: the bytes of each forward the batch's plan offloads, in GiB; NaN for a batch
        that measures instead (the first two, and the first one or two of each new input shape, unless no dimension of
        it is larger than an input whose plan keeps everything: it runs that plan).
        ``offload/plan_checkpoint_blocks``: how many blocks the batch's plan checkpoints (NaN: it measured).
        ``offload/plan_split``: 1 where the plan checkpoints those blocks by their parts, 0 where whole (NaN: it
        measured).
        ``offload/plan_light_blocks``: how many blocks the batch's plan runs with elementwise recompute (matrix
        products and attention kept; NaN: it measured).
        ``offload/plan_peak_gib``: the peak the batch's plan predicts, in GiB (NaN: it measured). A batch that runs
        the plan of a larger input (one that keeps everything) logs that input's prediction: a bound, not its own.
        ``offload/plan_trial``: 1 for a batch whose plan was being timed against others (``plan_trials``), else 0
        (NaN: it measured).

    Epoch summaries (logged at the end of every training epoch, reduced over all processes with torchmetrics):
        ``offload/peak_allocated_gib_epoch_max``: the highest ``offload/peak_allocated_gib`` of the epoch (CUDA).
        ``offload/peak_reserved_gib_epoch_max``: the highest ``offload/peak_reserved_gib`` of the epoch (CUDA).
        ``offload/offloaded_gib_epoch_mean``: the mean ``offload/offloaded_gib`` per training batch.
        ``offload/host_pinned_gib_epoch_max``: the most host memory the pool held after a batch.
        ``offload/stall_ms_epoch_mean``: (``mode="streamed"`` on CUDA) the mean ``offload/stall_ms`` per batch.
        ``offload/d2h_gbps_epoch_mean`` and ``offload/h2d_gbps_epoch_mean``: (``mode="streamed"`` on CUDA with
        ``measure_copies=True``) the epoch's bandwidth: bytes copied over time spent copying.
"""

# The per-batch figures, as Lightning's result collection names them: logged from ``on_train_batch_end``.
_STEP_KEYS = (
    "offload/peak_allocated_gib",
    "offload/peak_reserved_gib",
    "offload/alloc_flushes",
    "offload/offloaded_gib",
    "offload/host_pinned_gib",
    "offload/stall_ms",
    "offload/d2h_gbps",
    "offload/h2d_gbps",
    "offload/memory_budget_gib",
    "offload/plan_offload_gib",
    "offload/plan_checkpoint_blocks",
    "offload/plan_split",
    "offload/plan_light_blocks",
    "offload/plan_peak_gib",
    "offload/plan_trial",
)
_LOGGED_FROM = tuple(f"on_train_batch_end.{key}" for key in _STEP_KEYS)


class StepReporter:
    """Measures and logs one training batch after another for :class:`~lightning_offload.ActivationOffloadCallback`.

    Args:
        options: the callback's options (which figures exist depends on the mode and ``measure_copies``).
        progress_bar: show the step's peak (or, on the CPU, the offloaded GiB) in the progress bar.
    """

    def __init__(self, options: OffloadOptions, progress_bar: bool) -> None:
        self.options = options
        self.progress_bar = progress_bar
        self.cuda: torch.device | None = None
        self.epoch_metrics: OffloadEpochMetrics | None = None
        self._new_step = True  # the next batch opens a new optimizer step
        self._stepped = False  # an optimizer step ran in this batch
        # Copy timings of a batch not logged may still be running: read later, they count in a later batch's figures.
        self._timings_behind = False
        self._flushes_at_start = 0  # the allocator's cache flushes as the optimizer step began (CUDA)
        # The optimizer step's peaks so far, allocated and reserved: the highest of its batches' (CUDA).
        self._step_peaks = (0, 0)

    def start_fit(self, device: torch.device) -> None:
        """A fit begins on ``device``: fresh epoch summaries, and the next batch opens a new step."""
        self.cuda = peak_device(device)
        self.epoch_metrics = OffloadEpochMetrics(
            cuda=self.cuda is not None,
            streamed=self.options.mode == "streamed",
            measure_copies=self.options.measure_copies,
        )
        self._new_step, self._stepped, self._timings_behind = True, False, False

    def start_batch(self) -> None:
        """Reset the peak counters as this batch begins (after the engine started its step, and read the peak of the
        step before): the memory-budget planner reads each batch's own peak. Under gradient accumulation a window's
        batches may run different inputs, each planned on its own profile: reset once per optimizer step, a short
        batch after a long one read the long one's peak as its own, measured that heavy or corrected towards memory.
        The optimizer step's figures are the highest of its batches' (:meth:`end_batch`)."""
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
            if self._new_step:
                self._flushes_at_start = read_counters(self.cuda).alloc_retries
                self._step_peaks = (0, 0)
        self._new_step = False

    def before_install(self, trainer: pl.Trainer, engine: OffloadEngine) -> None:
        """Before the engine starts this batch's step: where the logger writes this batch, wait for the copy timings
        the batch before left running (a batch not logged does not wait). Read later, they would count in this
        batch's figures (the engine adds what it reads to the step open then) instead of that batch's."""
        if self.cuda is not None and _logs(trainer):
            engine.collect_stats(wait=True)
            self._timings_behind = False

    def optimizer_stepped(self) -> None:
        self._stepped = True

    def end_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: OffloadEngine, plain: bool
    ) -> OffloadStats:
        """Log the batch's figures; returns its stats. ``plain``: the batch ran without offloading on purpose."""
        stepped = self._stepped or not pl_module.automatic_optimization
        self._new_step, self._stepped = stepped, False
        # Timing events are waited for only when the logger writes: anything else would sync every step.
        will_log = _logs(trainer)
        # A batch logged although it was not to be as it began (training was stopped during it: by its training_step,
        # by a hook that runs before this one) did not wait then for the batch before's timings: its own would be read
        # together with them. Left out, as for a batch not logged (the comparison batch logs none of the engine's).
        timed = will_log and (plain or not self._timings_behind)
        stats = engine.collect_stats(wait=will_log)
        self._timings_behind = not will_log
        if plain:
            # The memory picture's comparison batch offloaded nothing: log that (and its real peak), and keep it out
            # of the epoch summaries, which describe offloading.
            stats = _held_only(stats)
        cuda = self.cuda
        # Reading the allocator's counters is host-side bookkeeping (no device synchronization), one read of them all:
        # at every batch, whose peaks count towards its optimizer step's (the counters restart at the next batch).
        counters = read_counters(cuda) if cuda else None
        if counters is not None:
            allocated, reserved = self._step_peaks
            self._step_peaks = (max(allocated, counters.peak), max(reserved, counters.reserved_peak))
            counters = counters._replace(peak=self._step_peaks[0], reserved_peak=self._step_peaks[1])
        counters = counters if stepped else None
        peaks = (counters.peak, counters.reserved_peak) if counters is not None else None
        if self.epoch_metrics is not None and not plain:
            self.epoch_metrics.update(stats, *(peaks or (None, None)))
        planner = engine.planner
        # Measuring and comparison batches ran no plan (the one held may be an earlier input shape's).
        plan = planner.plan if planner is not None and not planner.measuring and not plain else None
        self._hand_over(
            trainer, pl_module, self._figures(stats, counters, planner, plan, ran=True, timed=timed), will_log
        )
        return stats

    def skipped_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: OffloadEngine) -> None:
        """Log a batch that ran no step (the dataloader yielded None): nothing offloaded, no peak, no plan.

        Lightning writes a row for it all the same, with the last value each key was given: logging nothing would log
        the batch before's figures under this batch's step. The step the next batch belongs to is left as it was.
        """
        will_log = _logs(trainer)
        stats = _held_only(engine.collect_stats(wait=False))
        self._hand_over(
            trainer, pl_module, self._figures(stats, None, engine.planner, None, ran=False, timed=will_log), will_log
        )

    def _figures(
        self,
        stats: OffloadStats,
        counters: AllocatorCounters | None,
        planner: BudgetPlanner | None,
        plan: Plan | None,
        ran: bool,
        timed: bool,
    ) -> dict[str, float]:
        """One batch's figures, by metric name.

        Args:
            stats: its counters.
            counters: the allocator's counters as it closed an optimizer step (``None``: it closed none).
            planner: the memory-budget planner, if any.
            plan: the plan it ran (``None``: it ran none, its ``plan_*`` keys are NaN).
            ran: it ran at all; one that did not logs NaN for the peaks (it has none, and Lightning would log the last
                step's again).
            timed: its copy timings were waited for; otherwise the figures CUDA events time are left out.
        """
        metrics: dict[str, float] = {}
        cuda = self.cuda
        nan = float("nan")
        if counters is not None:
            metrics["offload/peak_allocated_gib"] = counters.peak / GiB
            metrics["offload/peak_reserved_gib"] = counters.reserved_peak / GiB
            metrics["offload/alloc_flushes"] = float(counters.alloc_retries - self._flushes_at_start)
        elif cuda is not None and not ran:
            for key in ("offload/peak_allocated_gib", "offload/peak_reserved_gib", "offload/alloc_flushes"):
                metrics[key] = nan
        metrics["offload/offloaded_gib"] = stats.offloaded_bytes / GiB
        metrics["offload/host_pinned_gib"] = stats.host_pinned_bytes / GiB
        if self.options.mode == "streamed" and cuda is not None and timed:
            metrics["offload/stall_ms"] = stats.stall_ms
        if self.options.measure_copies and self.options.mode == "streamed" and cuda is not None and timed:
            # Only the copy streams' copies are timed (sync mode copies untimed on the compute stream), and a batch
            # that timed no copy has no bandwidth: NaN, not 0 GB/s (nor the last value, which Lightning would repeat).
            metrics["offload/d2h_gbps"] = stats.d2h_gbps() if stats.d2h_ms > 0 else nan
            metrics["offload/h2d_gbps"] = stats.h2d_gbps() if stats.h2d_ms > 0 else nan
        if planner is not None:
            metrics["offload/memory_budget_gib"] = planner.budget / GiB
            # A batch that ran no plan logs its keys as NaN rather than leaving them out: Lightning would log a key's
            # last value again at a step that did not log it.
            metrics["offload/plan_offload_gib"] = plan.offload_bytes / GiB if plan is not None else nan
            metrics["offload/plan_checkpoint_blocks"] = float(plan.checkpoint_blocks) if plan is not None else nan
            metrics["offload/plan_split"] = float(plan.split) if plan is not None else nan
            metrics["offload/plan_light_blocks"] = float(plan.light_blocks) if plan is not None else nan
            metrics["offload/plan_peak_gib"] = plan.peak / GiB if plan is not None else nan
            metrics["offload/plan_trial"] = float(planner.trying) if plan is not None else nan
        return metrics

    def _hand_over(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, figures: dict[str, float], will_log: bool
    ) -> None:
        """Log a batch's figures where the logger writes it; else hold them for a row Lightning may write after all."""
        # Until a batch was logged, Lightning holds no entry to hand figures to: the first batch not logged is logged
        # all the same (once; the logger does not write it), so a row written late before the first logged batch
        # (training stopped early by ``max_time``) holds that batch's figures instead of none.
        if will_log or next(_held_entries(trainer), None) is None:
            self._log(trainer, pl_module, figures)
        else:
            _hold_for_late_row(trainer, figures)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        """Log one batch's figures through ``LightningModule.log``."""
        cuda = self.cuda
        shown = "offload/peak_allocated_gib" if cuda is not None else "offload/offloaded_gib"
        # Without a logger the values still reach ``trainer.callback_metrics`` and the progress bar; asking for the
        # logger anyway would make Lightning warn once per key.
        to_logger = bool(trainer.loggers)
        for key, value in metrics.items():
            prog_bar = self.progress_bar and key == shown
            # A host scalar: given a float, Lightning makes a tensor on the module's device (a blocking copy per key),
            # and reading it back (the progress bar does after every batch) waits for the device's queued work.
            held = _host_scalar(value)
            pl_module.log(key, held, on_step=True, on_epoch=False, logger=to_logger, prog_bar=prog_bar, batch_size=1)
        # A key logged before that this batch has no figure for (its copy timings, left out) would be written with the
        # value it was last given, another batch's: left out of the row instead.
        for name, held in _held_entries(trainer):
            if name not in metrics:
                held.has_reset = True

    def end_epoch(self, pl_module: pl.LightningModule, engine: OffloadEngine) -> None:
        # The next epoch's first batch opens an optimizer step: Lightning steps at an epoch's last batch, and zeroes the
        # gradients of a window cut short by ``on_train_batch_start`` returning -1 as the next epoch begins. Without
        # this, that step's peaks and flushes would count from the cut batch's start, the epoch's end included.
        self._new_step, self._stepped = True, False
        summaries = self.epoch_metrics
        if summaries is None:
            return
        engine.collect_stats(wait=True)  # the last batch's timings: one wait per epoch
        self._timings_behind = False
        # Every process computes (the reduction is collective), and logs the same reduced values. ``sync_dist``
        # averages identical numbers (a no-op on the values); without it Lightning warns on every epoch key.
        to_logger = bool(pl_module.loggers)
        for key, value in summaries.compute(pl_module.device).items():
            pl_module.log(key, value, on_step=False, on_epoch=True, logger=to_logger, batch_size=1, sync_dist=True)

    def discard(self) -> None:
        """Forget the epoch so far (a step raised)."""
        if self.epoch_metrics is not None:
            self.epoch_metrics.reset()


def _logs(trainer: pl.Trainer) -> bool:
    """Whether the logger writes this training batch's figures (``log_every_n_steps``)."""
    return bool(getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", True))


def _hold_for_late_row(trainer: pl.Trainer, figures: dict[str, float]) -> None:
    """Give Lightning this batch's figures without logging them: for a batch the logger does not write, unless a hook
    that runs after the callback's (``Trainer(max_time=...)``'s timer, the module's own ``on_train_batch_end``) stops
    training, and Lightning writes the batch's row after all. It would write the value each key was last logged with,
    another batch's. Logging every batch would cost ``LightningModule.log``'s bookkeeping per key (about 0.1-0.2 ms
    each on a CPU core) at every step; this writes the value Lightning holds for each key the callback logged before
    (a CPU scalar each, no device synchronization), and leaves out a key this batch has no figure for (its copy
    timings, not waited for). It reaches into Lightning's result collection, which is not public: where that has
    another layout, nothing is held, as before.
    """
    for name, held in _held_entries(trainer):
        value = figures.get(name)
        if value is None:
            held.has_reset = True  # left out of the metrics Lightning collects until the key is logged again
        else:
            # As logging does (the epoch's start resets every key: a row written then holds the figures too).
            held._forward_cache, held.has_reset = _host_scalar(value), False


def _held_entries(trainer: pl.Trainer) -> Iterator[tuple[str, Any]]:
    """The entries of Lightning's result collection (not public) that hold the per-batch figures the callback logged
    before, by metric name; none where it has another layout."""
    results = getattr(trainer, "_results", None)
    if results is None or not isinstance(results, dict):
        return
    for key in _LOGGED_FROM:
        held = results.get(key)
        meta = getattr(held, "meta", None)
        if meta is None or not hasattr(held, "_forward_cache") or not hasattr(held, "has_reset"):
            continue
        yield meta.name, held


def _host_scalar(value: float) -> torch.Tensor:
    """``value`` as a CPU scalar of float32 or wider, as Lightning stores a logged float: ``torch.tensor(value)``
    alone would follow the default dtype (bf16 under ``torch.set_default_dtype(torch.bfloat16)``: three significant
    digits) and the default device (``torch.set_default_device("cuda")``: the copy this avoids)."""
    dtype = torch.get_default_dtype()
    return torch.tensor(value, dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32, device="cpu")


def _held_only(stats: OffloadStats) -> OffloadStats:
    """The figures of a batch that offloaded nothing: only what the host pool holds."""
    return OffloadStats(host_bytes_held=stats.host_bytes_held, host_pinned_bytes=stats.host_pinned_bytes)


def peak_device(device: torch.device) -> torch.device | None:
    """The device whose allocator peaks are measured: ``device`` on CUDA; none elsewhere (no such counters)."""
    return device if device.type == "cuda" else None
