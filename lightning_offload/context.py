"""``offload_activations``: the engine as a context manager for plain PyTorch training loops."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from typing import Any

import torch

from lightning_offload.engine import IdleEngine, OffloadEngine
from lightning_offload.options import OffloadOptions, no_cuda_message, warn_unused_budget
from lightning_offload.resting_floor import checked_optimizer


def offload_activations(
    mode: str = "streamed",
    memory_budget: int | str | None = "auto",
    compute_device: str | torch.device | None = None,
    min_tensor_bytes: int | str = OffloadOptions.min_tensor_bytes,
    resident_tail_bytes: int | str = OffloadOptions.resident_tail_bytes,
    max_offload_bytes: int | str | None = None,
    max_inflight_bytes: int | str | None = None,
    prefetch_bytes: int | str = OffloadOptions.prefetch_bytes,
    host_memory_limit: int | str | None = None,
    on_host_full: str = "warn",
    measure_copies: bool = False,
    plan_trials: bool = True,
    model: torch.nn.Module | None = None,
    checkpoint: Any = None,
    recompute: str = "all",
    local_processes: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> OffloadEngine:
    """Offload the activations autograd saves inside the ``with`` block to host memory.

    Example::

        off = offload_activations(model=model, memory_budget="40GiB")  # create once: pool and streams are reused
        for x in batches:
            off.input_changed(tuple(x.shape))  # under the budget: a new shape is measured before it is planned
            with off:
                loss = model(x).sum()
            loss.backward()
            print(off.stats.offloaded_bytes)
        off.close()  # leave ``model`` as it was: the planner's (and ``checkpoint``'s) wrappers come off

    Args:
        mode, memory_budget, compute_device, min_tensor_bytes, resident_tail_bytes, max_offload_bytes,
            max_inflight_bytes, prefetch_bytes, host_memory_limit, on_host_full, measure_copies, plan_trials: see
            :class:`~lightning_offload.options.OffloadOptions`, where every option is documented.
        model: its parameters and buffers (by storage) are never offloaded. Parameters, their views and casts are
            recognised without it; buffers only with it.
        checkpoint: also checkpoint ``model``'s repeated blocks (non-reentrant) so only each block's input is saved
            and offloaded: ``"auto"`` (those :func:`~lightning_offload.find_repeated_blocks` finds), a class, a class
            name or a module name, or a list of those. ``None``: no checkpointing. Applied once, here; a manual
            override that switches the memory-budget planner off.
        recompute: what backward reruns of those blocks: ``"all"`` (their whole forward) or ``"elementwise"`` (their
            matrix products and attention are kept on the device, the rest recomputed; see
            :func:`~lightning_offload.apply_checkpointing`). Needs ``checkpoint``.
        local_processes: processes on this machine sharing its RAM (each has its own pool); the default
            ``host_memory_limit`` is split between them. ``None``: ``LOCAL_WORLD_SIZE``, else 1.
        optimizer: the loop's optimizer: under a ``memory_budget``, a warning comes before the first step where the
            weights, their gradients and its state to come already pass the budget (no plan can fit then).

    Returns:
        An :class:`OffloadEngine`: a reusable context manager whose ``stats`` describe its latest block. Without CUDA
        and without ``compute_device``, one that offloads and checkpoints nothing (a warning says so, once).
    """
    values = dict(locals())
    model, checkpoint, local_processes = values.pop("model"), values.pop("checkpoint"), values.pop("local_processes")
    recompute = values.pop("recompute")
    optimizers = checked_optimizer(values.pop("optimizer"), "offload_activations")
    options = OffloadOptions.create("offload_activations", **values)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload_activations(model={type(model).__name__}): model must be a torch.nn.Module or None")
    if local_processes is not None:
        wrong = f"offload_activations(local_processes={local_processes!r}): expected a positive int or None"
        # Any integer type (numpy's too, as the byte options take), but not a bool; kept as a plain ``int``.
        if isinstance(local_processes, bool) or not isinstance(local_processes, numbers.Integral):
            raise TypeError(wrong)
        if local_processes < 1:
            # Not silently replaced (by ``LOCAL_WORLD_SIZE`` for 0, by 1 below it): the count splits the host limit.
            raise ValueError(wrong)
        local_processes = int(local_processes)
    from lightning_offload.checkpointing import WrappedBlocks, check_recompute, select_blocks

    check_recompute(recompute, f"offload_activations(recompute={recompute!r})", checkpoint)
    names: list[str] = []
    if checkpoint is not None:
        if model is None:
            raise ValueError(f"offload_activations(checkpoint={checkpoint!r}): checkpointing needs model=")
        # Selected first, quoting this call (the user never called ``apply_checkpointing``); then wrapped.
        names = select_blocks(model, checkpoint, call=f"offload_activations(checkpoint={checkpoint!r})")
    if options.compute_device is None and not torch.cuda.is_available():
        # Everything was checked above, so a wrong argument fails on every machine; here nothing more happens.
        warnings.warn(no_cuda_message("offload_activations", "CUDA is not available"), UserWarning, stacklevel=2)
        return IdleEngine(options, model=model, local_processes=local_processes)
    warn_unused_budget("offload_activations", options, memory_budget, checkpoint)
    blocks = None
    if checkpoint is not None:
        blocks = WrappedBlocks(model, names, recompute)  # type: ignore[arg-type]
        options = dataclasses.replace(options, memory_budget=None)  # checkpointing by hand: the user decides
    return OffloadEngine(options, model=model, local_processes=local_processes, blocks=blocks, optimizers=optimizers)
