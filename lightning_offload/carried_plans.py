"""Plans carried from one fit (or process) to the next: the planner's plans with a fingerprint of what they were
measured on, so that a later engine on the same model, budget and device runs them without measuring, and any other
measures afresh."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
from torch import nn

from lightning_offload.planner.core import Planner
from lightning_offload.planner.state import export_plans, restore_plans

_log = logging.getLogger("lightning_offload")


def fingerprint(model: nn.Module | None, budget: int, device: torch.device, total: int) -> str:
    """What plans depend on, hashed: the model's parameters (names, shapes, dtypes, which train), the budget, the
    device's name and its memory (``total``)."""
    digest = hashlib.sha256()
    if model is not None:
        for name, p in model.named_parameters():
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    digest.update(f"budget={budget};device={name};total={total}".encode())
    return digest.hexdigest()


def carried(planner: Planner, print_: str) -> dict[str, Any]:
    """The plans of ``planner`` under the fingerprint ``print_``, as plain values."""
    return {"fingerprint": print_, "plans": export_plans(planner)}


def take_carried(planner: Planner, print_: str, state: dict[str, Any]) -> int:
    """Give a fresh ``planner`` the plans ``state`` carries where its fingerprint is ``print_``; returns how many
    inputs' plans it took (0: measured afresh, as the model, the budget or the device differ)."""
    if state.get("fingerprint") != print_:
        _log.info(
            "memory_budget: the plans carried over were measured on another model, budget or device; measuring afresh"
        )
        return 0
    taken = restore_plans(planner, state.get("plans") or {})
    if taken:
        _log.info("memory_budget: %d input(s) run the plans carried over, without measuring", taken)
    return taken
