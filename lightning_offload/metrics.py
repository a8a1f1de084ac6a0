"""Epoch summaries of the callback's per-step figures, aggregated with torchmetrics (synchronized across processes).

Every training batch contributes its figures (peak memory, offloaded bytes, stall, copy bandwidth); at the end of the
epoch the summaries are reduced over all processes and logged next to the per-step keys, e.g.
``offload/peak_allocated_gib_epoch_max`` beside ``offload/peak_allocated_gib``.

Lightning only reaches this module through :class:`~lightning_offload.ActivationOffloadCallback`; it imports only
torch and torchmetrics.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import MaxMetric, MeanMetric, Metric

from lightning_offload.options import GiB
from lightning_offload.stats import OffloadStats

__all__ = ["OffloadEpochMetrics"]

# Epoch keys: "<per-step key>_epoch_<reduction>". Kept here so the callback's docstring, the README and the tests
# name the same strings.
PEAK_ALLOCATED = "offload/peak_allocated_gib_epoch_max"
PEAK_RESERVED = "offload/peak_reserved_gib_epoch_max"
OFFLOADED = "offload/offloaded_gib_epoch_mean"
HOST_PINNED = "offload/host_pinned_gib_epoch_max"
STALL = "offload/stall_ms_epoch_mean"
D2H = "offload/d2h_gbps_epoch_mean"
H2D = "offload/h2d_gbps_epoch_mean"


@dataclass
class _Running:
    """Host-side running sum / weight / max of one figure over the epoch."""

    total: float = 0.0
    weight: float = 0.0
    peak: float = -math.inf

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total += value * weight
        self.weight += weight
        self.peak = max(self.peak, value)


class OffloadEpochMetrics:
    """Aggregates the per-step offloading figures of one training epoch and reduces them over all processes.

    Which summaries exist follows the configuration, so every process computes (and so synchronizes) the same set:
    peaks only on CUDA, the stall only in ``"streamed"`` mode on CUDA, bandwidth only there with ``measure_copies``.

    Per-step figures are summed on the host and handed to the torchmetrics objects once per epoch: updating a metric
    on a CUDA device every batch would copy a Python float to the device, and that copy waits for the compute
    stream (a host synchronization per step, which the callback otherwise never does). The metric objects are
    created on first use, on the module's device, so the callback still pickles before ``setup`` (``ddp_spawn``),
    and their ``compute`` gathers the states from every process through ``torch.distributed``, the process group the
    strategy initialized.

    Timings finish on the device after the batch that issued them ends. A batch's stall and copy times are therefore
    read one batch later (by then the engine has folded the events that completed into that batch's counters), and
    the last batch of the epoch when the epoch ends (one wait per epoch). Bandwidth is averaged weighted by copy time,
    so the epoch figure is total bytes over total copy time.

    Args:
        cuda: the compute device is CUDA (peak memory and device timings exist).
        streamed: the engine runs in ``"streamed"`` mode (a stall can occur).
        measure_copies: copies are timed (bandwidth exists).
    """

    def __init__(self, cuda: bool, streamed: bool, measure_copies: bool) -> None:
        keys = [OFFLOADED, HOST_PINNED]
        if cuda:
            keys += [PEAK_ALLOCATED, PEAK_RESERVED]
            if streamed:
                keys.append(STALL)
                if measure_copies:  # only the copy streams' copies are timed
                    keys += [D2H, H2D]
        self.keys: tuple[str, ...] = tuple(keys)
        self._running: dict[str, _Running] = {key: _Running() for key in keys}
        self._metrics: dict[str, Metric] | None = None
        self._timed: OffloadStats | None = None  # the latest batch's stats, whose timings may still be running

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_metrics"] = None  # created again, on the right device, in the process that uses them
        state["_timed"] = None
        return state

    def update(self, stats: OffloadStats, peak_allocated: int | None = None, peak_reserved: int | None = None) -> None:
        """Add one training batch.

        Args:
            stats: the batch's counters; the engine may still add timings to this object (read one batch later).
            peak_allocated: peak allocated device bytes of the optimizer step the batch closed, or ``None`` when the
                batch did not close one (the peak of an accumulation window is counted once).
            peak_reserved: the same for reserved bytes.
        """
        self._commit_timings()
        running = self._running
        running[OFFLOADED].add(stats.offloaded_bytes / GiB)
        running[HOST_PINNED].add(stats.host_pinned_bytes / GiB)
        if peak_allocated is not None and PEAK_ALLOCATED in running:
            running[PEAK_ALLOCATED].add(peak_allocated / GiB)
        if peak_reserved is not None and PEAK_RESERVED in running:
            running[PEAK_RESERVED].add(peak_reserved / GiB)
        self._timed = stats

    def compute(self, device: torch.device) -> dict[str, float]:
        """Reduce the epoch over all processes and start a new epoch.

        Every process must call this (it may synchronize with the others). Summaries with nothing to report (no
        optimizer step closed, no copy timed) are left out. Collect the engine's stats with ``wait=True`` first, so
        the latest batch's timings are complete.

        Args:
            device: where the metric states live: the module's device (NCCL gathers CUDA tensors only).

        Returns:
            The epoch summaries by key.
        """
        self._commit_timings()
        metrics = self._metrics_on(device)
        out: dict[str, float] = {}
        for key in self.keys:
            metric, running = metrics[key], self._running[key]
            # One update per epoch with the host-side aggregate: the same reduction, one device copy.
            if isinstance(metric, MaxMetric):
                if running.weight > 0:
                    metric.update(running.peak)
            elif running.weight > 0:
                metric.update(running.total / running.weight, weight=running.weight)
            with warnings.catch_warnings():
                # A process with nothing to add still has to take part in the reduction.
                warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
                value = float(metric.compute())
            metric.reset()
            if math.isfinite(value):
                out[key] = value
        self._running = {key: _Running() for key in self.keys}
        return out

    def reset(self) -> None:
        """Forget the running epoch (e.g. after an exception)."""
        self._running = {key: _Running() for key in self.keys}
        self._timed = None
        if self._metrics is not None:
            for metric in self._metrics.values():
                metric.reset()

    def _commit_timings(self) -> None:
        stats, self._timed = self._timed, None
        if stats is None:
            return
        running = self._running
        if STALL in running:
            running[STALL].add(stats.stall_ms)
        if D2H in running and stats.d2h_ms > 0:
            running[D2H].add(stats.d2h_gbps(), weight=stats.d2h_ms)
        if H2D in running and stats.h2d_ms > 0:
            running[H2D].add(stats.h2d_gbps(), weight=stats.h2d_ms)

    def _metrics_on(self, device: torch.device) -> dict[str, Metric]:
        if self._metrics is None:
            self._metrics = {key: (MaxMetric() if key.endswith("_epoch_max") else MeanMetric()) for key in self.keys}
        for metric in self._metrics.values():
            if metric.device != device:
                metric.to(device)
        return self._metrics
