"""Epoch summaries of the callback's figures (``lightning_offload.metrics``), alone and inside a Trainer."""

from __future__ import annotations

import csv
import os
import pickle
import socket
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.loggers import CSVLogger

from lightning_offload import ActivationOffloadCallback, OffloadStats
from lightning_offload.metrics import (
    D2H,
    H2D,
    HOST_PINNED,
    OFFLOADED,
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    STALL,
    OffloadEpochMetrics,
)
from lightning_offload.options import GiB
from tests.tiny_modules import OFFLOAD_ALL, make_module, trainer_kwargs

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
]

CPU = torch.device("cpu")


def stats(
    offloaded: int = 0, pinned: int = 0, stall: float = 0.0, d2h_ms: float = 0.0, h2d_ms: float = 0.0
) -> OffloadStats:
    return OffloadStats(
        offloaded_bytes=offloaded,
        prefetched_bytes=offloaded,
        host_pinned_bytes=pinned,
        stall_ms=stall,
        d2h_ms=d2h_ms,
        h2d_ms=h2d_ms,
    )


def test_keys_follow_the_configuration() -> None:
    assert OffloadEpochMetrics(cuda=False, streamed=True, measure_copies=True).keys == (OFFLOADED, HOST_PINNED)
    cuda_sync = OffloadEpochMetrics(cuda=True, streamed=False, measure_copies=False).keys
    assert set(cuda_sync) == {OFFLOADED, HOST_PINNED, PEAK_ALLOCATED, PEAK_RESERVED}
    # Sync mode times no copy: no bandwidth summary, whatever measure_copies says.
    assert OffloadEpochMetrics(cuda=True, streamed=False, measure_copies=True).keys == cuda_sync
    full = OffloadEpochMetrics(cuda=True, streamed=True, measure_copies=True).keys
    assert set(full) == {OFFLOADED, HOST_PINNED, PEAK_ALLOCATED, PEAK_RESERVED, STALL, D2H, H2D}


def test_mean_max_and_epoch_reset() -> None:
    metrics = OffloadEpochMetrics(cuda=True, streamed=True, measure_copies=False)
    metrics.update(stats(offloaded=1 * GiB, pinned=2 * GiB, stall=4.0), peak_allocated=3 * GiB, peak_reserved=4 * GiB)
    metrics.update(stats(offloaded=3 * GiB, pinned=1 * GiB, stall=2.0))  # a micro-batch: no peak of its own
    metrics.update(stats(offloaded=2 * GiB, pinned=1 * GiB, stall=0.0), peak_allocated=5 * GiB, peak_reserved=2 * GiB)
    out = metrics.compute(CPU)
    assert out[OFFLOADED] == pytest.approx(2.0)
    assert out[HOST_PINNED] == pytest.approx(2.0)
    assert out[PEAK_ALLOCATED] == pytest.approx(5.0)
    assert out[PEAK_RESERVED] == pytest.approx(4.0)
    assert out[STALL] == pytest.approx(2.0)
    # A new epoch starts empty; summaries with nothing to report are left out instead of logging -inf or nan.
    metrics.update(stats(offloaded=GiB))
    out = metrics.compute(CPU)
    assert out[OFFLOADED] == pytest.approx(1.0)
    assert PEAK_ALLOCATED not in out
    assert PEAK_RESERVED not in out
    assert metrics.compute(CPU) == {}


def test_timings_are_read_one_batch_late() -> None:
    """Timing events finish after the batch ends; the engine adds them to that batch's stats object later."""
    metrics = OffloadEpochMetrics(cuda=True, streamed=True, measure_copies=True)
    first = stats(offloaded=GiB, d2h_ms=0.0)
    metrics.update(first)
    first.stall_ms = 6.0  # folded in when the next window begins
    first.d2h_ms = 20.0
    first.h2d_ms = 10.0
    second = stats(offloaded=3 * GiB, d2h_ms=20.0, h2d_ms=30.0)
    metrics.update(second)
    out = metrics.compute(CPU)
    assert out[STALL] == pytest.approx(3.0)
    # Bandwidth over the epoch is total bytes over total copy time.
    assert out[D2H] == pytest.approx(4 * GiB / 40.0 / 1e6)
    assert out[H2D] == pytest.approx(4 * GiB / 40.0 / 1e6)


def test_metric_objects_are_created_lazily_and_do_not_pickle() -> None:
    metrics = OffloadEpochMetrics(cuda=False, streamed=False, measure_copies=False)
    assert metrics._metrics is None
    metrics.update(stats(offloaded=GiB))
    metrics.compute(CPU)
    assert metrics._metrics is not None
    assert all(m.device == CPU for m in metrics._metrics.values())
    clone = pickle.loads(pickle.dumps(metrics))
    assert clone._metrics is None
    clone.update(stats(offloaded=2 * GiB))
    assert clone.compute(CPU)[OFFLOADED] == pytest.approx(2.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, results: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metrics = OffloadEpochMetrics(cuda=True, streamed=False, measure_copies=False)
        if rank == 0:
            metrics.update(stats(offloaded=1 * GiB, pinned=GiB), peak_allocated=2 * GiB, peak_reserved=2 * GiB)
            metrics.update(stats(offloaded=3 * GiB, pinned=GiB), peak_allocated=1 * GiB, peak_reserved=2 * GiB)
        else:
            metrics.update(stats(offloaded=5 * GiB, pinned=3 * GiB), peak_allocated=7 * GiB, peak_reserved=8 * GiB)
        results.put((rank, metrics.compute(CPU)))
    finally:
        dist.destroy_process_group()


def test_summaries_reduce_over_processes() -> None:
    """Under DDP every process logs the same figures: the mean over all batches of all ranks, the max of all."""
    context = mp.get_context("fork")  # fork: a spawned worker would spend most of the test importing torch
    results = context.SimpleQueue()
    mp.start_processes(_ddp_worker, args=(2, _free_port(), results), nprocs=2, join=True, start_method="fork")
    outputs = dict(results.get() for _ in range(2))
    for rank in (0, 1):
        out = outputs[rank]
        assert out[OFFLOADED] == pytest.approx(3.0)  # (1 + 3 + 5) / 3 batches
        assert out[HOST_PINNED] == pytest.approx(3.0)
        assert out[PEAK_ALLOCATED] == pytest.approx(7.0)
        assert out[PEAK_RESERVED] == pytest.approx(8.0)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_trainer_logs_epoch_summaries_next_to_per_step_keys(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    logger = CSVLogger(tmp_path, name="run")
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=logger, callbacks=[callback]))
    trainer.fit(make_module(pl, batches=3))
    rows = _rows(Path(logger.log_dir) / "metrics.csv")
    steps = [float(r["offload/offloaded_gib"]) for r in rows if r.get("offload/offloaded_gib")]
    epochs = [r for r in rows if r.get(OFFLOADED)]
    assert len(steps) == 6
    assert steps[0] > 0
    assert [int(r["epoch"]) for r in epochs] == [0, 1]
    assert float(epochs[0][OFFLOADED]) == pytest.approx(sum(steps[:3]) / 3)
    assert float(epochs[1][HOST_PINNED]) > 0
    # On the CPU there is no CUDA peak, stall or bandwidth to summarize.
    assert PEAK_ALLOCATED not in trainer.callback_metrics
    assert STALL not in trainer.callback_metrics
    assert set(trainer.callback_metrics) >= {OFFLOADED, HOST_PINNED, "offload/offloaded_gib"}


def test_epoch_summaries_when_max_steps_stops_mid_epoch(tmp_path: Path) -> None:
    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=2, logger=CSVLogger(tmp_path), callbacks=[callback]))
    trainer.fit(make_module(pl, batches=5))
    assert trainer.callback_metrics[OFFLOADED] > 0


@pytest.mark.parametrize("progress_bar", [False, True])
def test_progress_bar_shows_memory(tmp_path: Path, progress_bar: bool) -> None:
    callback = ActivationOffloadCallback(mode="sync", progress_bar=progress_bar, **OFFLOAD_ALL)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=2, logger=False, callbacks=[callback]))
    trainer.fit(make_module(pl))
    # On the CPU the bar shows the offloaded GiB (there is no CUDA peak).
    assert ("offload/offloaded_gib" in trainer.progress_bar_metrics) is progress_bar
    assert "offload/offloaded_gib" in trainer.callback_metrics


def test_callback_pickles_before_and_after_fit(tmp_path: Path) -> None:
    """``ddp_spawn`` pickles callbacks before ``setup``; the metric objects are made later, in the worker."""
    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    assert pickle.loads(pickle.dumps(callback))._reporter.epoch_metrics is None
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=2, logger=False, callbacks=[callback]))
    trainer.fit(make_module(pl))
    assert callback._reporter.epoch_metrics is not None
    assert callback._reporter.epoch_metrics._metrics is not None
    # (The callback itself holds the module's bound ``log`` after a fit, which Lightning attaches.)
    clone = pickle.loads(pickle.dumps(callback._reporter.epoch_metrics))
    assert clone._metrics is None
    assert clone.keys == callback._reporter.epoch_metrics.keys


def test_rejects_non_bool_flags() -> None:
    with pytest.raises(TypeError, match=r"ActivationOffloadCallback\(progress_bar='yes'\)"):
        ActivationOffloadCallback(progress_bar="yes")  # type: ignore[arg-type]
