"""A training step run again where it ran out of memory under a memory budget (:func:`run_step`).

A cap counts the allocator's reserved bytes, and the pieces of free memory between live blocks (fragments) are no
counter the planner can predict before a step: a planned step can run out of memory under a plan predicted to fit. The
planner corrects itself from the failed step (its peak, the request that failed, the fragments held then), and each
correction raises every plan's predicted peak, so the plans it moves to are more frugal and end at the model's most
frugal step. Running the failed step again under each correction makes a step fit wherever that most frugal step fits,
at the cost of the steps run again. The step must clear the gradients before its backward, as a closure given to
``optimizer.step`` does, so that running it again gives the same gradients. In several processes a step is not run
again: the others would wait for it in their collectives.

Torch only: no Lightning import.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from lightning_offload.step_driver import requested_bytes
from lightning_offload.units import GiB, MiB

if TYPE_CHECKING:
    from lightning_offload.engine import OffloadEngine

_log = logging.getLogger("lightning_offload")
_T = TypeVar("_T")


def run_step(engine: OffloadEngine, step: Callable[[], _T]) -> _T:
    """Run ``step`` and return what it returns; where it runs out of memory and ``engine``'s planner made the next step
    more frugal than the one that failed, run it again (:meth:`OffloadEngine.run_step`)."""
    while True:
        told: list[str | None] = []  # what the engine says of a failure is said here, as the step runs again or not
        previous, engine.told_failures = engine.told_failures, told
        try:
            return step()
        except torch.cuda.OutOfMemoryError as exc:
            if not _eased(engine, exc, told):
                raise
        finally:
            engine.told_failures = previous
        # Outside the handler: the failed step's frames, and the tensors they held, are gone; a cycle among them is
        # collected before the cache they reserved is returned, so the step runs again in a layout mapped afresh.
        gc.collect()
        planner = engine.planner
        assert planner is not None
        release = getattr(planner.memory, "release_cache", None)
        if release is not None:
            release()


def _eased(engine: OffloadEngine, exc: BaseException, told: list[str | None]) -> bool:
    """Whether the step that raised ``exc`` runs again: the engine's planner took the failure (inside the engine's
    block the engine told it; outside, the loss or backward, it is told here) and made the next step more frugal.
    Says why either way: the failure in numbers where it does not run again (``told``: what the engine would have
    said)."""
    planner = engine.planner
    if planner is None:
        return False
    if not told and planner.core.open is not None:
        engine.failed(exc)  # raised outside the engine's block, within the step
    eased = bool(told) and planner.core.eased and not _several_processes()
    if not eased:
        for text in told:
            if text is not None:
                _log.warning(text)
        return False
    plan = planner.plan
    what = plan.describe(planner.budget) if plan is not None else "a frugal measuring step"
    request = requested_bytes(exc)
    failed = f"a request of {request / MiB:.0f} MiB failed" if request else "CUDA out of memory"
    _log.warning(
        f"memory_budget={planner.budget / GiB:.2f} GiB: the step ran out of memory ({failed}); running it "
        f"again under {what}"
    )
    return True


def _several_processes() -> bool:
    """Whether this process is one of several in a process group (DDP, FSDP)."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1
