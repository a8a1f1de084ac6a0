"""Checks of ``ActivationOffloadCallback``'s arguments and of where it runs, each failing with a message that names
the fix: its checkpointing and reporting options, the trainer that calls it, a second instance beside it, and whether
the module may still build layers after its ``setup``."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_offload.checkpointing import RunCheckpointing, check_recompute


def checked_checkpointing(
    checkpoint: str | type[nn.Module] | list[str | type[nn.Module]] | None, recompute: str
) -> RunCheckpointing | None:
    """The callback's checkpointing by hand, its arguments checked; errors quote the callback's call.

    Args:
        checkpoint: the callback's ``checkpoint`` (the blocks to checkpoint; ``None``: none by hand).
        recompute: the callback's ``recompute``.

    Returns:
        The checkpointing the callback applies for each fit, or ``None`` where ``checkpoint`` is ``None``.

    Raises:
        ValueError: ``recompute`` is unknown, or other than ``"all"`` without ``checkpoint``; or ``checkpoint`` is
            no block selector.
    """
    call = f"ActivationOffloadCallback(checkpoint={checkpoint!r}" + (
        f", recompute={recompute!r})" if recompute != "all" else ")"
    )
    check_recompute(recompute, call, checkpoint)
    return RunCheckpointing(checkpoint, call, recompute) if checkpoint is not None else None


def check_reporting_args(values: dict[str, Any]) -> None:
    """The callback's own options (what it shows and draws): types, combinations, and matplotlib when drawing.

    Args:
        values: the callback's arguments by name (at least ``progress_bar``, ``memory_picture``,
            ``memory_picture_compare`` and ``memory_snapshot``).

    Raises:
        TypeError: one of them is not a ``bool``.
        ValueError: ``memory_snapshot=True`` without ``memory_picture=True``.
        ImportError: ``memory_picture=True`` without matplotlib.
    """
    for name in ("progress_bar", "memory_picture", "memory_picture_compare", "memory_snapshot"):
        if not isinstance(values[name], bool):
            raise TypeError(f"ActivationOffloadCallback({name}={values[name]!r}): {name} must be True or False")
    if values["memory_snapshot"] and not values["memory_picture"]:
        raise ValueError(
            "ActivationOffloadCallback(memory_snapshot=True, memory_picture=False): the snapshot covers the step "
            "the memory picture records; pass memory_picture=True too"
        )
    if values["memory_picture"]:
        _require_matplotlib()


def require_trainer(trainer: Any, hook: str) -> None:
    """Refuse to run outside a Lightning ``Trainer`` (e.g. ``fabric.call``), where ``setup`` never built the engine.

    Without this, the hook would return without offloading anything, and nothing would say so.

    Args:
        trainer: what called the hook as its trainer.
        hook: the hook's name, for the message.

    Raises:
        RuntimeError: ``trainer`` is no ``lightning.pytorch`` (nor ``pytorch_lightning``) ``Trainer``.
    """
    trainers: tuple[type, ...] = (pl.Trainer,)
    # The twin's trainer, when ``pytorch_lightning`` is in use (imported: no import cost for anyone else).
    standalone = getattr(sys.modules.get("pytorch_lightning"), "Trainer", None)
    if isinstance(standalone, type):
        trainers = (*trainers, standalone)
    if not isinstance(trainer, trainers):
        raise RuntimeError(
            f"ActivationOffloadCallback.{hook}(trainer={type(trainer).__name__}): the callback runs inside a "
            "Lightning Trainer, whose setup builds the offloading engine; called any other way (such as "
            "fabric.call) it would offload nothing. In a Fabric loop use "
            "`off = lightning_offload.fabric.fabric_offload(fabric, model)` and `with off:` around each forward."
        )


def require_single_callback(callbacks: Iterable[object], kind: type) -> None:
    """Refuse a trainer whose callbacks hold more than one offloading callback.

    Args:
        callbacks: the trainer's callbacks.
        kind: the offloading callback's class (its instances are counted).

    Raises:
        RuntimeError: more than one instance of ``kind`` is among ``callbacks``.
    """
    ours = [cb for cb in callbacks if isinstance(cb, kind)]
    if len(ours) > 1:
        raise RuntimeError(
            f"Trainer(callbacks=[...]) holds {len(ours)} ActivationOffloadCallback instances. Saved-tensor hooks "
            "stack and only the innermost would run; pass a single ActivationOffloadCallback."
        )


def builds_layers_after_setup(pl_module: pl.LightningModule) -> bool:
    """Whether the module may create layers after the callbacks' ``setup``: in its own ``setup`` (called after the
    callbacks') or in ``configure_model`` (called after every ``setup``).

    Args:
        pl_module: a ``lightning.pytorch`` or ``pytorch_lightning`` module.

    Returns:
        Whether it overrides ``setup``, ``configure_model`` or ``configure_sharded_model``.
    """
    # The base class is named: ``is_overridden`` finds it only for a ``lightning.pytorch`` module and raises for a
    # ``pytorch_lightning`` one (the twin callback in ``pl_compat``), whose base is that package's own class.
    parent: type = pl.LightningModule
    standalone = getattr(sys.modules.get("pytorch_lightning"), "LightningModule", None)
    if not isinstance(pl_module, parent) and isinstance(standalone, type) and isinstance(pl_module, standalone):
        parent = standalone
    hooks = ("setup", "configure_model", "configure_sharded_model")
    return any(is_overridden(hook, pl_module, parent) for hook in hooks)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "ActivationOffloadCallback(memory_picture=True): drawing the memory picture needs matplotlib, which is "
            "not installed; install it with `pip install matplotlib` (or `pip install lightning-offload[plot]`), "
            "or pass memory_picture=False"
        ) from err
