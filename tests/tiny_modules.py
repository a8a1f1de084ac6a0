"""Tiny LightningModules for the metrics, memory-picture, pl_compat and CLI tests.

Built for either namespace (``lightning.pytorch`` or ``pytorch_lightning``), since the two class hierarchies are
separate. Activations are a few hundred KiB, so tests pass ``min_tensor_bytes``/``resident_tail_bytes`` that make
the CPU engine offload them.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

WIDTH = 64
BATCH = 16

# Offload every saved tensor of the tiny models (they are ~4 KiB each).
OFFLOAD_ALL: dict[str, Any] = {"compute_device": "cpu", "min_tensor_bytes": 1024, "resident_tail_bytes": 0}


def make_module(namespace: types.ModuleType, batches: int = 4, seed: int = 0) -> Any:
    """A LightningModule of ``namespace`` (``lightning.pytorch`` or ``pytorch_lightning``): an MLP on random data.

    Args:
        namespace: the package whose ``LightningModule`` to subclass.
        batches: training batches per epoch.
        seed: seed of the parameters and data.
    """

    class TinyMLP(namespace.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            self.net = nn.Sequential(
                nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.LayerNorm(4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
            )
            with torch.no_grad():
                for p in self.net.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            self.data = torch.randn(batches * BATCH, WIDTH, generator=generator)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch), batch.flip(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=BATCH)

    return TinyMLP()


def trainer_kwargs(root: Any, **overrides: Any) -> dict[str, Any]:
    """Quiet, CPU-only Trainer arguments writing under ``root``."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "enable_progress_bar": False,
        "default_root_dir": str(root),
    }
    kwargs.update(overrides)
    return kwargs
