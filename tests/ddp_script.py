"""Two-process CPU DDP runs of ``ActivationOffloadCallback``, launched by ``tests/test_ddp.py`` as a script.

Usage: ``python tests/ddp_script.py OUT_DIR STRATEGY`` with ``STRATEGY`` ``ddp`` or ``ddp_spawn``; ``MASTER_PORT``
must be set. Each process trains the same tiny per-token MLP twice with SGD for ``STEPS`` optimizer steps, first
without the callback (``baseline``) and then with it (``offload``), seeded alike, under
``Trainer(strategy=STRATEGY, accelerator="cpu", devices=2)`` over gloo. It writes into ``OUT_DIR``:

- ``{tag}_params_rank{r}.pt``: the parameters after training, from every rank;
- ``{tag}_rank{r}.json``: what rank ``r`` saw (pid, environment, per-batch offload stats, its host pool, the engine's
  host limit, the epoch summary it logged);
- ``logs/offload/version_0/metrics.csv``: the CSV logger of the ``offload`` run (written by rank zero only).

``ddp`` re-runs this script for rank 1 (Lightning's subprocess launcher), so everything happens under
``if __name__ == "__main__"``; ``ddp_spawn`` pickles the module and callbacks into spawned processes.

The data make the two ranks offload different amounts: item ``i`` is a sequence of ``SHORT`` tokens when ``i`` is
even and ``LONG`` tokens when odd, and the unshuffled ``DistributedSampler`` hands rank 0 the even items and rank 1
the odd ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_offload import ActivationOffloadCallback
from lightning_offload.host_pool import pool_for
from lightning_offload.metrics import OFFLOADED

WORLD = 2
STEPS = 3
BATCH = 8
WIDTH = 32
SHORT, LONG = 8, 64  # tokens per item on rank 0 and on rank 1: rank 1's activations need bigger host buffers
CPU = torch.device("cpu")
# Offload every saved CPU tensor (no size threshold, no resident tail), with the default host limit.
OFFLOAD_OPTIONS: dict[str, Any] = {
    "mode": "sync",
    "compute_device": "cpu",
    "min_tensor_bytes": 0,
    "resident_tail_bytes": 0,
}


class TokenData(Dataset):
    """``WORLD * STEPS * BATCH`` fixed random sequences; odd items are ``LONG`` tokens long, even ones ``SHORT``."""

    def __len__(self) -> int:
        return WORLD * STEPS * BATCH

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + index)
        return torch.randn(LONG if index % 2 else SHORT, WIDTH, generator=generator)


class TokenMLP(pl.LightningModule):
    """A per-token MLP (Linear / GELU / LayerNorm / Linear) trained with SGD on a reconstruction loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.LayerNorm(4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch), batch.flip(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = TokenData()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False, drop_last=True
        )
        return DataLoader(data, batch_size=BATCH, sampler=sampler)


class Recorder(pl.Callback):
    """Listed after the offload callback: writes what this rank saw when training ends (before ``teardown``)."""

    def __init__(self, out: Path, tag: str, offload: ActivationOffloadCallback | None) -> None:
        self.out, self.tag, self.offload = out, tag, offload
        self.record: dict[str, Any] = {"offloaded_bytes": [], "host_pinned_bytes": [], "pool_reserved_bytes": []}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if "available_at_start" not in self.record:
            # The engine sizes its default host limit on its first copy, in this batch's forward.
            self.record["available_at_start"] = psutil.virtual_memory().available
            self.record["pool_reserved_at_start"] = pool_for(CPU).reserved_bytes

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.offload is not None:
            self.record["offloaded_bytes"].append(self.offload.stats.offloaded_bytes)
            self.record["host_pinned_bytes"].append(self.offload.stats.host_pinned_bytes)
        self.record["pool_reserved_bytes"].append(pool_for(CPU).reserved_bytes)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        engine = self.offload.engine if self.offload is not None else None
        epoch_value = trainer.callback_metrics.get(OFFLOADED)
        self.record.update(
            rank=rank,
            pid=os.getpid(),
            world_size=trainer.world_size,
            global_step=trainer.global_step,
            env={k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_PORT")},
            available_at_end=psutil.virtual_memory().available,
            host_limit=engine.host_limit() if engine is not None else None,
            epoch_offloaded_gib=None if epoch_value is None else float(epoch_value),
        )
        params = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        torch.save(params, self.out / f"{self.tag}_params_rank{rank}.pt")
        (self.out / f"{self.tag}_rank{rank}.json").write_text(json.dumps(self.record, indent=1))


def fit(out: Path, strategy: str, offload: bool) -> pl.Trainer:
    tag = "offload" if offload else "baseline"
    callbacks: list[pl.Callback] = []
    callback = None
    if offload:
        callback = ActivationOffloadCallback(**OFFLOAD_OPTIONS)
        callbacks.append(callback)
    callbacks.append(Recorder(out, tag, callback))
    logger = CSVLogger(out / "logs", name=tag, version=0) if offload else False
    pl.seed_everything(0, verbose=False)
    model = TokenMLP()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=STEPS,
        max_epochs=1,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=str(out),
    )
    trainer.fit(model)
    return trainer


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    first = fit(out, strategy, offload=False)
    fit(out, strategy, offload=True)
    if strategy == "ddp":
        # Under ``ddp`` this process is rank 0 or rank 1 (the processes stay joined across both fits).
        torch.distributed.barrier()
        children = getattr(first.strategy.launcher, "procs", None) or []
        for child in children:  # rank 0 launched rank 1: let it finish before the test reads its files
            child.wait(timeout=60)


if __name__ == "__main__":
    main()
