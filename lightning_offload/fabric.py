"""Activation offloading in a Lightning Fabric training loop.

Fabric has no training loop of its own, so there is no hook to drive a callback from: the loop enters the engine
around each forward itself. :func:`fabric_offload` builds that engine for the process Fabric runs: on Fabric's
device, with the default host limit split between the processes Fabric launched on this machine.

Example::

    from lightning.fabric import Fabric
    from lightning_offload.fabric import fabric_offload

    fabric = Fabric(accelerator="cuda", devices=2, strategy="ddp")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    off = fabric_offload(fabric, model)  # once: the pinned pool, the streams and the profile are reused
    for batch in fabric.setup_dataloaders(loader):
        off.input_changed(tuple(batch.shape))  # under a memory budget: a new shape is measured before it is planned
        with off:  # the activations saved in forward go to host memory
            loss = model(batch)
        fabric.backward(loss)  # and come back as backward needs them
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from lightning_offload.engine import IdleEngine, OffloadEngine
from lightning_offload.options import OffloadOptions, no_cuda_message, warn_unused_budget
from lightning_offload.resting_floor import checked_optimizer

__all__ = ["fabric_offload"]


def fabric_offload(
    fabric: Any, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> OffloadEngine:
    """An offloading engine for the process ``fabric`` runs: enter it around each forward of the training loop.

    Call it after ``fabric.launch()`` (each process builds its own engine, with its own pinned pool).

    Args:
        fabric: a launched ``lightning.fabric.Fabric``.
        model: the model (as ``fabric.setup`` returned it, or the plain module): its parameters and buffers are
            never offloaded, and ``checkpoint=`` applies to its blocks.
        optimizer: the loop's optimizer (as ``fabric.setup`` returned it, or the plain one): under a
            ``memory_budget``, a warning comes before the first step where the weights, their gradients and its state
            to come already pass the budget.
        **options: the options of :func:`lightning_offload.offload_activations` (``mode``, ``max_offload_bytes``,
            ``checkpoint``, ``recompute``, ...). ``compute_device`` defaults to Fabric's device when it is CUDA (and
            may name no other then); on any other device nothing is offloaded (a warning says so, once) unless
            ``compute_device="cpu"`` asks to run the engine on CPU tensors. ``host_memory_limit=None`` splits 80% of
            the available RAM between the processes Fabric runs on this machine.

    Returns:
        An :class:`~lightning_offload.OffloadEngine`: a reusable context manager whose ``stats`` describe the
        latest forward. Where Fabric's device is not CUDA and no ``compute_device`` was given, one that offloads and
        checkpoints nothing.

    Raises:
        TypeError: ``fabric`` is not a Fabric, ``model`` not a module, or an option is unknown.
        ValueError: Fabric runs ``strategy="dp"`` over several devices (replicas in threads the hooks do not
            see), Fabric's device is CUDA and ``compute_device`` names another device, ``local_processes`` was
            passed (it comes from Fabric), or an option's value is invalid (on any device). Errors quote this call,
            and nothing is checkpointed then.
    """
    if not (hasattr(fabric, "device") and hasattr(fabric, "strategy")):
        raise TypeError(
            f"fabric_offload(fabric={type(fabric).__name__}): fabric must be a lightning.fabric.Fabric (launched); "
            "the model comes second: fabric_offload(fabric, model)"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"fabric_offload(model={type(model).__name__}): model must be a torch.nn.Module or None")
    # Fabric wraps the optimizer; its state and parameter groups are the wrapped one's.
    optimizers = checked_optimizer(getattr(optimizer, "optimizer", optimizer), "fabric_offload")
    if "local_processes" in options:
        raise ValueError(
            f"fabric_offload(local_processes={options['local_processes']!r}): the process count comes from "
            "Fabric's strategy; leave it out"
        )
    allowed = {*OffloadOptions.names(), "checkpoint", "recompute"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"fabric_offload() got unexpected argument(s) {unknown}; allowed: {sorted(allowed)}")
    if _threads_replicas(fabric.strategy):
        raise ValueError(
            f"fabric_offload(fabric): Fabric's strategy 'dp' ({type(fabric.strategy).__name__}) runs each device's "
            "replica in a thread of its own, and saved-tensor hooks see only the thread that entered them: nothing "
            "would be offloaded. Use strategy='ddp' (a process per device)."
        )
    device = torch.device(fabric.device)
    # Off CUDA (and without compute_device) nothing is offloaded; the options are checked all the same, so that a
    # wrong one fails on every machine.
    idle = options.get("compute_device") is None and device.type != "cuda"
    if options.get("compute_device") is None and not idle:
        options["compute_device"] = device
    elif device.type == "cuda":
        _check_fabric_device(options["compute_device"], device)
    from lightning_offload.checkpointing import WrappedBlocks, check_recompute, select_blocks

    checkpoint, recompute = options.pop("checkpoint", None), options.pop("recompute", "all")
    check_recompute(recompute, f"fabric_offload(recompute={recompute!r})", checkpoint)
    # Checked and warned about here, once, so that errors and warnings quote this call, the one the user made.
    engine_options = OffloadOptions.create("fabric_offload", **options)
    # ``fabric.setup`` wraps the module (and DDP inside the wrapper); the blocks belong to the original.
    module = getattr(model, "module", model) if _is_fabric_wrapper(model) else model
    names: list[str] = []
    if checkpoint is not None:
        if module is None:
            raise ValueError(f"fabric_offload(checkpoint={checkpoint!r}): checkpointing needs model=")
        names = select_blocks(module, checkpoint, call=f"fabric_offload(checkpoint={checkpoint!r})")
    if idle:
        warnings.warn(no_cuda_message("fabric_offload", f"Fabric runs on {device}"), UserWarning, stacklevel=2)
        return IdleEngine(engine_options, model=model, local_processes=local_processes(fabric))
    warn_unused_budget("fabric_offload", engine_options, options.get("memory_budget"), checkpoint)
    if checkpoint is not None:
        # Checkpointing by hand: the user decides, as with ``offload_activations``.
        engine_options = dataclasses.replace(engine_options, memory_budget=None)
    # Selected (and the options checked) above: nothing left to fail once the blocks are wrapped.
    blocks = WrappedBlocks(module, names, recompute) if names else None
    return OffloadEngine(
        engine_options, model=model, local_processes=local_processes(fabric), blocks=blocks, optimizers=optimizers
    )


def local_processes(fabric: Any) -> int:
    """The processes ``fabric`` runs on this machine: one per local device for DDP, FSDP and the like, else 1.

    (Fabric's launchers do not export ``LOCAL_WORLD_SIZE``; the strategy knows the count.)
    """
    count = getattr(fabric.strategy, "num_processes", 1)
    return count if isinstance(count, int) and count >= 1 else 1


def _threads_replicas(strategy: Any) -> bool:
    """Whether ``strategy`` is Fabric's ``DataParallelStrategy`` over several devices: ``torch.nn.DataParallel``
    then runs every replica's forward in a worker thread (on one device it calls the module in the caller's)."""
    is_dp = any(cls.__name__ == "DataParallelStrategy" for cls in type(strategy).__mro__)
    return is_dp and len(getattr(strategy, "parallel_devices", None) or ()) > 1


def _check_fabric_device(requested: Any, device: torch.device) -> None:
    """Refuse a ``compute_device`` other than Fabric's CUDA device: this process's activations live on Fabric's
    device, and the engine offloads only tensors of its own, so every rank but one would offload nothing, silently
    (``"cuda:0"`` copied from single-GPU code). ``"cuda"`` names the current device, which Fabric set to its own."""
    try:
        parsed = torch.device(requested)
    except (RuntimeError, TypeError):
        return  # not a device at all: ``OffloadOptions`` says what is allowed
    if parsed.type != "cuda" or (parsed.index is not None and parsed.index != device.index):
        raise ValueError(
            f"fabric_offload(compute_device={requested!r}): Fabric runs this process on {str(device)!r}, so "
            f"tensors of {str(parsed)!r} are not this process's activations and nothing would be offloaded; leave "
            "compute_device out (Fabric's device is used)"
        )


def _is_fabric_wrapper(model: Any) -> bool:
    # ``_FabricModule`` keeps the module it runs as ``_forward_module`` and the one the user passed as ``module``.
    return hasattr(model, "_forward_module") and isinstance(getattr(model, "module", None), torch.nn.Module)
