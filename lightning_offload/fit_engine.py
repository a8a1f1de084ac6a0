"""The offloading engine as a Lightning fit drives it: built in ``setup`` for the module's device, told when its
hooks may leave, installed at each training batch with the planner's notices said at rank zero, and left as an epoch
ends or the fit fails."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_offload.engine import OffloadEngine
from lightning_offload.options import OffloadOptions, no_cuda_message
from lightning_offload.planned_blocks import compiled_modules
from lightning_offload.reporting import StepReporter
from lightning_offload.resting_floor import floor_over

_log = logging.getLogger("lightning_offload")


def engine_for_fit(
    options: OffloadOptions, pl_module: pl.LightningModule, num_devices: int, by_hand: bool
) -> tuple[OffloadEngine, torch.device] | None:
    """The engine a fit offloads with, and the device it computes on.

    Args:
        options: the callback's options.
        pl_module: the module being fit; its device is the compute device where ``options`` name none.
        num_devices: the trainer's devices: one process per device on this machine.
        by_hand: whether the blocks are checkpointed by hand (the callback's ``checkpoint``): then nothing is planned.

    Returns:
        The engine and its compute device, or ``None`` (said in a warning) where ``options`` name no device and the
        module is off CUDA: the callback then offloads nothing at all.
    """
    device = options.compute_device
    if device is None:
        device = pl_module.device
        if device.type != "cuda":
            # (stacklevel 5: the warning points where the callback's ``setup`` was called, past this function)
            rank_zero_warn(no_cuda_message("ActivationOffloadCallback", f"module on {device.type}"), stacklevel=5)
            return None
        options = dataclasses.replace(options, compute_device=device)
    if by_hand:
        options = dataclasses.replace(options, memory_budget=None)  # checkpointing by hand: the user decides
    # One process per device on this machine (ddp, ddp_spawn, fsdp): Lightning's launchers do not set
    # LOCAL_WORLD_SIZE, so the count comes from the trainer.
    return OffloadEngine(options, model=pl_module, local_processes=max(1, num_devices)), device


def leaves_after_backward(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the engine's hooks may leave after backward rather than as the batch ends.

    A batch that runs forward again after a backward (LBFGS calls its closure repeatedly; manual optimization may call
    backward several times) keeps the hooks until the batch ends.

    Args:
        trainer: the trainer, its optimizers set up.
        pl_module: the module being fit.

    Returns:
        ``False`` under manual optimization or with an LBFGS optimizer.
    """
    return pl_module.automatic_optimization and not any(
        isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers
    )


def rerun_when_eased(
    trainer: pl.Trainer, pl_module: pl.LightningModule, engine: OffloadEngine, reporter: StepReporter
) -> Callable[[], None] | None:
    """Where a batch can run again after an out-of-memory error, have it: through :meth:`OffloadEngine.run_step`, which
    runs it again where the planner's correction made the next step more frugal; each run again begins the engine's
    step afresh, with the peak counters reset.

    Without gradient accumulation, Lightning's closure (the batch's forward, its clearing of the gradients and its
    backward) runs once per batch, through the module's ``optimizer_step``: the closure runs again, whether its forward
    or its backward failed. With accumulation (or a scheduler that may accumulate later, which refuses an
    ``optimizer_step`` that is not the module's own), a batch's backward adds to gradients it cannot take back: only
    ``training_step`` runs again, where its forward failed. Nothing is wrapped under manual optimization or LBFGS
    (:func:`leaves_after_backward`: a batch's forward may follow a backward), nor in several processes, where one that
    ran a batch again would run its collectives out of step with the others.

    Args:
        trainer: the trainer, its optimizers set up.
        pl_module: the module being fit.
        engine: the fit's engine.
        reporter: the callback's reporter (it resets the peak counters as a batch begins).

    Returns:
        What undoes the wrapping (``None``: nothing was wrapped).
    """
    if not (engine.options.plans and trainer.world_size == 1 and leaves_after_backward(trainer, pl_module)):
        return None
    scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)  # type: ignore[attr-defined]

    def anew(run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` through ``run_step``, each run after the first beginning the batch's step afresh."""

        def again(*args: Any, **kwargs: Any) -> Any:
            runs = [0]

            def attempt() -> Any:
                if runs[0]:  # the run before ran out of memory
                    install_for_batch(engine, reporter, trainer)
                    reporter.start_batch()
                runs[0] += 1
                return run(*args, **kwargs)

            return engine.run_step(attempt)

        return again

    if trainer.accumulate_grad_batches == 1 and not scheduled:
        step = pl_module.optimizer_step  # the module's own (Lightning's, or the user's override)

        def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
            if optimizer_closure is not None:
                optimizer_closure = anew(optimizer_closure)
            return step(epoch, batch_idx, optimizer, optimizer_closure)

        pl_module.optimizer_step = optimizer_step  # type: ignore[method-assign]
        return lambda: pl_module.__dict__.pop("optimizer_step", None)
    # (Wrapped with its signature: Lightning reads it to tell what the step takes.)
    pl_module.training_step = functools.wraps(pl_module.training_step)(anew(pl_module.training_step))
    return lambda: pl_module.__dict__.pop("training_step", None)


def announce_planning(engine: OffloadEngine | None, pl_module: pl.LightningModule, budget: object) -> None:
    """Say (at INFO, on rank zero) that the first batch is measured to plan, where the engine plans on CUDA.

    Args:
        engine: the fit's engine (``None``: nothing offloads).
        pl_module: the module being fit (a compiled one is not planned: the engine says so).
        budget: the ``memory_budget`` the callback was given, for the message.
    """
    planned = engine is not None and engine.options.plans and not compiled_modules(pl_module)
    if planned and pl_module.device.type == "cuda":  # (a compiled module is not planned: the engine says so)
        rank_zero_info(f"ActivationOffloadCallback: memory_budget={budget!r}; measuring the first batch to plan")


def say_if_floor_over(engine: OffloadEngine | None, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Say before the first batch, where the weights, their gradients and the optimizers' state to come already pass
    a budget the user gave: no plan fits then (:mod:`~lightning_offload.resting_floor`).

    Args:
        engine: the fit's engine (``None``: nothing offloads).
        trainer: the trainer, its optimizers set up.
        pl_module: the module being fit.

    Returns:
        Whether it was said.
    """
    budget = engine.options.budget_bytes() if engine is not None and engine.options.plans else None
    device = pl_module.device  # (the engine meets its device at its first step, after this)
    if budget is None or device.type != "cuda":
        return False
    allocated = torch.cuda.memory_allocated(device)
    return say_floor_over(budget, allocated, device, trainer.optimizers, pl_module.parameters())


def say_floor_over(
    budget: int, allocated: int, device: torch.device, optimizers: Iterable[torch.optim.Optimizer], params: Iterable
) -> bool:
    """Say, and return whether, the floor of ``allocated`` bytes and the gradients and optimizers' state to come on
    ``device`` (:func:`~lightning_offload.resting_floor.floor_over`) passes ``budget``."""
    text = floor_over(budget, allocated, device, optimizers, params)
    if text is not None:
        _log.warning(f"ActivationOffloadCallback: {text}")
    return text is not None


def install_for_batch(engine: OffloadEngine, reporter: StepReporter, trainer: pl.Trainer) -> None:
    """Start the engine's step for a training batch: install its hooks, and have its planner (made at the first
    install) say its plans at rank zero and leave the peak counters to the reporter.

    Args:
        engine: the fit's engine, not installed.
        reporter: the callback's reporter.
        trainer: the trainer running the batch.
    """
    reporter.before_install(trainer, engine)
    engine.install()
    planner = engine.planner
    if planner is not None and planner.on_plan is None:
        planner.owns_peaks = False  # the reporter resets the peak counters as each batch begins
        planner.on_plan = lambda text: rank_zero_info(f"ActivationOffloadCallback: {text}")


def end_epoch(engine: OffloadEngine, ran_nothing: bool) -> None:
    """Remove the engine's hooks as an epoch ends, and drop the step open if its batch ran nothing.

    Args:
        engine: the fit's engine.
        ran_nothing: whether a batch's step began but the batch never ran (nor ran plain, for the memory picture).
    """
    engine.uninstall()
    if ran_nothing:
        # The module's on_train_batch_start returned -1 after this batch's step began: it ran nothing. Dropped,
        # so the memory-budget planner neither measures it (a plan from a step without activations) nor times
        # it (its time would be the epoch's end).
        engine.reset()


def end_on_exception(engine: OffloadEngine, exception: BaseException, in_batch: bool) -> None:
    """Leave the engine as the fit fails.

    Args:
        engine: the fit's engine.
        exception: what the fit raised.
        in_batch: whether it was raised inside a training batch (its step begun).
    """
    if in_batch:
        engine.failed(exception)  # before the model is left: its message names the blocks checkpointed
    else:
        # Raised outside a training batch (validation, saving a checkpoint): not the planned step's doing, so
        # nothing explains it in that step's numbers; what the engine holds is dropped all the same.
        engine.reset()
