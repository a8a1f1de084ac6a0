"""Other projects' offloaders, the anchors the benchmark compares against, loaded by ordinary imports.

They are not dependencies: ``fetch_anchors.sh`` downloads their wheels into ``.whl/`` and installs them into
``.refimpl/`` (both git-ignored) at benchmark time; ``python -m benchmarks`` puts ``.refimpl/pkgs`` (the anchors) and
``.refimpl/ao`` (torchao, hidden from peft until torchtune needs it) on its workers' ``PYTHONPATH`` when they exist.
An anchor that cannot be imported becomes a "not available: ..." row.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

StepContext = Callable[[], contextlib.AbstractContextManager[Any]]

ENVIRONMENT = {
    # torchao (imported by torchtune) ships C++ extensions built for one torch release; loading them into another
    # can abort the process. Offloading uses none of them, so they are never loaded.
    "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def prepare_process() -> None:
    """Set :data:`ENVIRONMENT` (where not set already) in this process, before any anchor is imported.

    Called by the workers' ``main``, never at import time: importing this module changes nothing.
    """
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)


# torchtune 0.6.1 needs a torchao that still has ``int4_weight_only`` (<= 0.15), while peft refuses to create LoRA
# layers at all when it finds a torchao older than 0.16 (it raises instead of ignoring it).
_PEFT_MIN_TORCHAO = (0, 16)


class AnchorUnavailable(RuntimeError):
    """The anchor's package could not be imported; the message says why."""


_hidden_paths: list[str] = []


def hide_old_torchao() -> None:
    """Take a torchao older than peft accepts off ``sys.path`` until the torchtune anchor needs it.

    Call it before ``transformers`` or ``peft`` is imported: both import torchao when they find it (peft then
    refuses to build LoRA layers), and the GPU image has no torchao of its own, so hiding it also keeps every other
    mode in the same software environment as without the anchors' wheels.
    """
    if "torchao" in sys.modules:
        return
    entries = [entry for entry in sys.path if _old_torchao_at(entry)]
    if entries:
        sys.path[:] = [entry for entry in sys.path if entry not in entries]
        _hidden_paths.extend(entries)
        importlib.invalidate_caches()


def _reveal_torchao() -> None:
    if _hidden_paths:
        sys.path[:0] = [entry for entry in _hidden_paths if entry not in sys.path]
        _hidden_paths.clear()
        importlib.invalidate_caches()


def _old_torchao_at(entry: str) -> bool:
    root = Path(entry or ".")
    if not (root / "torchao" / "__init__.py").is_file():
        return False
    for dist in root.glob("torchao-*.dist-info"):
        release = dist.name[len("torchao-") : -len(".dist-info")].split(".")
        try:
            return (int(release[0]), int(release[1])) < _PEFT_MIN_TORCHAO
        except (ValueError, IndexError):
            return False
    return False


def save_on_cpu() -> StepContext:
    """torch's own offloader: every saved tensor goes to (per-step allocated) pinned host memory."""
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)


def torchtune(model: torch.nn.Module) -> StepContext:
    """torchtune 0.6.1 ``OffloadActivations`` with streams, one instance entered every step."""
    del model  # torchtune's own head detection only knows torchtune models
    _reveal_torchao()
    try:
        from torchtune.training import OffloadActivations
    except Exception as err:  # any import-time failure of an optional package
        raise AnchorUnavailable(f"torchtune: {type(err).__name__}: {err}") from err
    ctx = OffloadActivations(use_streams=True)
    return lambda: ctx


def trl(model: torch.nn.Module) -> StepContext:
    """TRL's port (``get_act_offloading_ctx_manager``): streams, and the LM head kept out of offloading."""
    try:
        from accelerate import PartialState

        # TRL logs through accelerate's logger, which refuses to log before the state exists.
        PartialState()
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except Exception as err:
        raise AnchorUnavailable(f"trl: {type(err).__name__}: {err}") from err
    ctx = get_act_offloading_ctx_manager(model)
    return lambda: ctx


def versions() -> dict[str, str | None]:
    """Installed versions of the anchors' packages (``None`` where missing)."""
    found: dict[str, str | None] = {}
    for name in ("torchtune", "trl", "torchao", "accelerate", "datasets"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
