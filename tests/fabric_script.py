"""A Fabric training loop with ``fabric_offload``, launched by ``tests/test_fabric.py`` as a script.

Usage: ``python tests/fabric_script.py OUT_DIR DEVICES`` (``MASTER_PORT`` set when ``DEVICES`` > 1). Each process
trains the same tiny per-token MLP for ``STEPS`` SGD steps, first without offloading (``baseline``) and then inside
``fabric_offload`` (``offload``), seeded alike, under ``Fabric(accelerator="cpu", devices=DEVICES,
strategy="ddp")`` and ``fabric.launch()`` (gloo). Fabric's launcher runs this script again for every other rank, so
everything happens under ``if __name__ == "__main__"``. Rank ``r`` writes into ``OUT_DIR``:

- ``{tag}_params_rank{r}.pt``: the parameters after training (also ``accumulate_{tag}``: ``ACCUMULATE``
  micro-batches per step under ``fabric.no_backward_sync``, the engine streamed);
- ``offload_rank{r}.json``: what it offloaded per step, its engine's process count and host limit, and the RAM
  available when the engine sized that limit.

Rank ``r`` trains on sequences of ``LENGTHS[r]`` tokens, so the ranks offload different amounts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_offload.fabric import fabric_offload
from lightning_offload.host_pool import pool_for

STEPS = 3
ACCUMULATE = 2  # micro-batches per optimizer step in the ``accumulate_`` runs
BATCH = 4
WIDTH = 32
LENGTHS = (8, 64)  # tokens per sequence on rank 0 and rank 1
# Offload every saved CPU tensor: no size threshold, no resident tail.
OFFLOAD_OPTIONS: dict[str, Any] = {
    "mode": "sync",
    "compute_device": "cpu",
    "min_tensor_bytes": 0,
    "resident_tail_bytes": 0,
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.LayerNorm(4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH))


def batch_for(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, LENGTHS[rank % len(LENGTHS)], WIDTH, generator=generator)


def train(fabric: Fabric, out: Path, offload: bool, accumulate: bool = False) -> None:
    """``STEPS`` optimizer steps; ``accumulate``: each of ``ACCUMULATE`` micro-batches, the streamed engine, DDP's
    gradient sync skipped (``fabric.no_backward_sync``) in all but the last."""
    tag = ("accumulate_" if accumulate else "") + ("offload" if offload else "baseline")
    module = make_model()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    record: dict[str, Any] = {"offloaded_bytes": [], "pid": os.getpid(), "rank": fabric.global_rank}
    off = None
    if offload:
        record["available_at_start"] = psutil.virtual_memory().available
        record["pool_reserved_at_start"] = pool_for(torch.device("cpu")).reserved_bytes
        options = {**OFFLOAD_OPTIONS, "mode": "streamed"} if accumulate else OFFLOAD_OPTIONS
        off = fabric_offload(fabric, model, **options)
    micro_batches = ACCUMULATE if accumulate else 1
    for step in range(STEPS):
        for micro in range(micro_batches):
            batch = batch_for(fabric.global_rank, step * micro_batches + micro)
            with fabric.no_backward_sync(model, enabled=micro < micro_batches - 1):
                with off if off is not None else contextlib.nullcontext():
                    loss = F.mse_loss(model(batch), batch.flip(-1))
                fabric.backward(loss / micro_batches)
        optimizer.step()
        optimizer.zero_grad()
        if off is not None:
            record["offloaded_bytes"].append(off.stats.offloaded_bytes)
    params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    torch.save(params, out / f"{tag}_params_rank{fabric.global_rank}.pt")
    if off is not None:
        record.update(world_size=fabric.world_size, local_processes=off.local_processes, host_limit=off.host_limit())
        (out / f"{tag}_rank{fabric.global_rank}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    train(fabric, out, offload=False)
    train(fabric, out, offload=True)
    train(fabric, out, offload=False, accumulate=True)
    train(fabric, out, offload=True, accumulate=True)
    fabric.barrier()
    # Rank 0 started the other ranks: let them exit before the test reads their files.
    for child in getattr(fabric.strategy.launcher, "procs", None) or []:
        child.wait(timeout=60)


if __name__ == "__main__":
    main()
