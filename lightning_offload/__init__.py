"""Activation offloading for PyTorch and PyTorch Lightning.

``offload_activations`` and ``no_offload`` need only torch; ``ActivationOffloadCallback`` is imported on first
use, so plain PyTorch users never import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_offload.checkpointing import apply_checkpointing, find_repeated_blocks, remove_checkpointing
from lightning_offload.context import offload_activations
from lightning_offload.engine import OffloadEngine
from lightning_offload.host_pool import HostMemoryFull, release_host_memory
from lightning_offload.options import OffloadOptions
from lightning_offload.policy import no_offload
from lightning_offload.stats import OffloadStats

if TYPE_CHECKING:
    from lightning_offload.callback import ActivationOffloadCallback

__all__ = [
    "ActivationOffloadCallback",
    "HostMemoryFull",
    "OffloadEngine",
    "OffloadOptions",
    "OffloadStats",
    "apply_checkpointing",
    "find_repeated_blocks",
    "no_offload",
    "offload_activations",
    "release_host_memory",
    "remove_checkpointing",
]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name == "ActivationOffloadCallback":
        from lightning_offload.callback import ActivationOffloadCallback

        return ActivationOffloadCallback
    raise AttributeError(f"module 'lightning_offload' has no attribute {name!r}")
