"""Two-process CPU FSDP2 runs of the engine and the callback, launched by ``tests/test_fsdp2.py`` through torchrun.

Usage: ``python -m torch.distributed.run --standalone --nproc-per-node=2 tests/fsdp2_script.py OUT_DIR``.

Each rank trains :class:`BlockStack` (an input layer, ``nn.ModuleList`` of MLP blocks, a head), with every block and
then the root ``fully_shard``-ed over gloo, fp32, ``STEPS`` SGD steps, from the same seed each time:

- ``census``: one forward and backward under a recording ``saved_tensors_hooks`` (no engine), which tells apart what
  autograd saved from the unsharded parameters FSDP2 all-gathered and what it saved from activations;
- ``baseline``: a plain torch loop without offloading; ``sync`` and ``streamed``: the same loop with
  ``offload_activations`` around forward (``streamed`` runs on the simulated CPU copy streams);
- ``pl_baseline`` and ``pl_offload``: Lightning's ``ModelParallelStrategy`` (FSDP2 in ``configure_model``), without
  and with ``ActivationOffloadCallback``, in the same processes (Lightning finds torchrun's process group).

For every run, :class:`UnshardedWatch` records the storages of the unsharded parameters (read in forward pre-hooks
of the layers, where FSDP2 has swapped them in) and wraps ``lightning_offload.policy.offload_span`` to see every
saved tensor the engine is asked about: how many were unsharded parameters (or views of them), and how many of those
it let go. Each rank writes ``{run}_rank{r}.json`` and ``{run}_params_rank{r}.pt`` (its local shards) to ``OUT_DIR``.
The ranks train on different sequence lengths, so they offload different amounts.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_offload import offload_activations, policy

WORLD = 2
STEPS = 3
BATCH = 4
WIDTH, HIDDEN, BLOCKS = 16, 64, 3
TOKENS = (8, 24)  # tokens per sequence on rank 0 and on rank 1
LR = 0.1
# Offload every saved CPU tensor, everything at once (no planner), no size threshold, no resident tail.
OPTIONS: dict[str, Any] = {
    "compute_device": "cpu",
    "min_tensor_bytes": 0,
    "resident_tail_bytes": 0,
    "memory_budget": None,
}


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    """An input layer, ``BLOCKS`` MLP blocks and a head; the root's own parameters are the input layer and head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def shard(model: BlockStack, mesh: Any = None) -> BlockStack:
    """FSDP2: each block, then the root (which takes the input layer and the head)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s input at ``step``: ``TOKENS[rank]`` tokens per sequence."""
    generator = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(BATCH, TOKENS[rank], WIDTH, generator=generator)


def key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


class UnshardedWatch:
    """The unsharded parameters' storages of one model, and what the engine's policy decided about them."""

    def __init__(self, model: nn.Module) -> None:
        self.param_keys: set[int] = set()
        self.param_types: set[str] = set()
        self.param_saves = 0  # saved tensors the policy saw that live in an unsharded parameter's storage
        self.param_offloaded = 0  # of those, how many the policy let go (must stay 0)
        self.activation_saves = 0  # other saved tensors the policy saw
        self.activation_offloaded = 0  # of those, how many it let go
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                module.register_forward_pre_hook(self._note_parameters)
        self._original: Callable[..., Any] | None = None

    def _note_parameters(self, module: nn.Module, args: Any) -> None:
        # FSDP2's pre-forward hook of the enclosing block (or root) has run: these are the all-gathered parameters.
        for param in module.parameters(recurse=False):
            self.param_types.add(type(param).__name__)
            self.param_keys.add(key(param))

    def __enter__(self) -> UnshardedWatch:
        original = self._original = policy.offload_span

        def watched(tensor: torch.Tensor, *args: Any) -> Any:
            span = original(tensor, *args)
            if key(tensor) in self.param_keys:
                self.param_saves += 1
                self.param_offloaded += span is not None
            else:
                self.activation_saves += 1
                self.activation_offloaded += span is not None
            return span

        policy.offload_span = watched  # the engine looks it up on the module at every save
        return self

    def __exit__(self, *exc: object) -> None:
        policy.offload_span = self._original  # type: ignore[assignment]

    def as_dict(self) -> dict[str, Any]:
        names = ("param_saves", "param_offloaded", "activation_saves", "activation_offloaded")
        return {"param_types": sorted(self.param_types), **{name: getattr(self, name) for name in names}}


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (FSDP2 parameters are DTensors sharded on dim 0)."""
    out = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}, not a DTensor: fully_shard missing"
        out[name] = param.to_local().detach().clone()
    return out


def census(rank: int) -> dict[str, Any]:
    """What one forward saves, split by storage into unsharded parameters and activations, without the engine."""
    torch.manual_seed(0)
    model = shard(BlockStack())
    watch = UnshardedWatch(model)
    saved: dict[int, int] = {}
    param_tensors = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal param_tensors
        saved[key(tensor)] = tensor.untyped_storage().nbytes()
        param_tensors += key(tensor) in watch.param_keys
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, batch(rank, 0))
    loss.backward()
    params = {k: n for k, n in saved.items() if k in watch.param_keys}
    return {
        "param_types": sorted(watch.param_types),
        "param_tensors_saved": param_tensors,  # the weights themselves, and views such as linear's transposes
        "param_storages_saved": len(params),
        "param_bytes_saved": sum(params.values()),
        # Each storage once, as the engine copies it.
        "activation_bytes": sum(n for k, n in saved.items() if k not in watch.param_keys),
    }


def train_plain(rank: int, mode: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``STEPS`` SGD steps in a plain loop; ``mode=None`` without the engine."""
    torch.manual_seed(0)
    model = shard(BlockStack())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = offload_activations(mode=mode, model=model, **OPTIONS) if mode is not None else None
    record: dict[str, Any] = {"offloaded_bytes": [], "saved_tensors": [], "losses": []}
    with UnshardedWatch(model) as watch:
        for step in range(STEPS):
            x = batch(rank, step)
            if engine is None:
                loss = loss_of(model, x)
            else:
                with engine:
                    loss = loss_of(model, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record["losses"].append(loss.item())
            if engine is not None:
                record["offloaded_bytes"].append(engine.stats.offloaded_bytes)
                record["saved_tensors"].append(engine.stats.saved_tensors)
    record["watch"] = watch.as_dict()
    return record, local_shards(model)


def train_lightning(rank: int, offload: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The same training under ``Trainer(strategy=ModelParallelStrategy(...))``, with or without the callback."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_offload import ActivationOffloadCallback

    class Data(Dataset):
        def __len__(self) -> int:
            return WORLD * STEPS

        def __getitem__(self, index: int) -> torch.Tensor:
            step, item_rank = divmod(index, WORLD)  # the sampler deals item i to rank i % WORLD
            return batch(item_rank, step)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: BlockStack | None = None
            self.watch: UnshardedWatch | None = None

        @override
        def configure_model(self) -> None:
            torch.manual_seed(0)
            self.model = shard(BlockStack(), mesh=self.device_mesh["data_parallel"])
            self.watch = UnshardedWatch(self.model)

        @override
        def on_train_start(self) -> None:
            self.watch.__enter__()  # type: ignore[union-attr]

        @override
        def on_train_end(self) -> None:
            self.watch.__exit__()  # type: ignore[union-attr]

        @override
        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return loss_of(self.model, x[0])  # type: ignore[arg-type]

        @override
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        @override
        def train_dataloader(self) -> DataLoader:
            # Unshuffled: rank r gets items r, r + WORLD, ...: its own batches, in step order.
            sampler = DistributedSampler(Data(), num_replicas=WORLD, rank=self.global_rank, shuffle=False)
            return DataLoader(Data(), batch_size=1, sampler=sampler)

    record: dict[str, Any] = {"offloaded_bytes": []}

    class Recorder(pl.Callback):
        @override
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if callback is not None:
                record["offloaded_bytes"].append(callback.stats.offloaded_bytes)

    callback = ActivationOffloadCallback(**OPTIONS) if offload else None
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_steps=STEPS,
        callbacks=[c for c in (callback, Recorder()) if c is not None],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert trainer.global_step == STEPS and trainer.world_size == WORLD and trainer.global_rank == rank
    record["watch"] = module.watch.as_dict()  # type: ignore[union-attr]
    return record, local_shards(module.model)  # type: ignore[arg-type]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, f"run with --nproc-per-node={WORLD}"
    torch.manual_seed(0)
    (out / f"initial_params_rank{rank}.pt").parent.mkdir(parents=True, exist_ok=True)
    torch.save(local_shards(shard(BlockStack())), out / f"initial_params_rank{rank}.pt")
    runs: dict[str, Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]]] = {
        "baseline": lambda: train_plain(rank, None),
        "sync": lambda: train_plain(rank, "sync"),
        "streamed": lambda: train_plain(rank, "streamed"),
        "pl_baseline": lambda: train_lightning(rank, offload=False),
        "pl_offload": lambda: train_lightning(rank, offload=True),
    }
    (out / f"census_rank{rank}.json").write_text(json.dumps(census(rank)))
    for name, run in runs.items():
        record, params = run()
        record.update(rank=rank, pid=os.getpid())
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(record))
        torch.save(params, out / f"{name}_params_rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
