"""What the engine says and does about a model compiled with ``torch.compile``: a model compiled whole cannot be
planned, and one compiled across several blocks can hardly have its peak lowered by offloading."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from lightning_offload.options import OffloadOptions
from lightning_offload.planned_blocks import compiled_across_blocks, compiled_modules


def unplanned_if_compiled(options: OffloadOptions, model: torch.nn.Module) -> OffloadOptions:
    """The options to run ``model`` with: as given, or, where it is compiled (:func:`compiled_modules`), without a
    planner, said in a warning. Under the default budget it then offloads nothing (a model that fits pays nothing);
    under a budget the user gave, it offloads everything eligible, the least memory it can reach without planning."""
    compiled = compiled_modules(model)
    if not compiled:
        return options
    shown = module_names(model, compiled)
    budget = options.memory_budget
    auto = budget == "auto"
    said = "'auto'" if auto else f"{budget / (1 << 30):.2f} GiB"  # type: ignore[operator]
    warnings.warn(
        f"memory_budget={said}: the model is compiled (torch.compile: {shown}), and the "
        "planner cannot watch or checkpoint the blocks of a compiled model (hooks added after compiling may never "
        "run). "
        + (
            "Nothing is offloaded. "
            if auto
            else "Every eligible activation is offloaded instead, which may not keep the step within the budget. "
        )
        + "To offload without planning, pass memory_budget=None (with checkpoint='auto' to checkpoint the blocks) "
        "and compile each block rather than the whole model; to plan, leave the model uncompiled.",
        stacklevel=5,
    )
    return dataclasses.replace(options, memory_budget=None, **({"mode": "off"} if auto else {}))


def warn_if_compiled_across_blocks(model: torch.nn.Module) -> None:
    """Say that offloading can hardly lower the peak of a model compiled whole (:func:`compiled_across_blocks`)."""
    across = compiled_across_blocks(model)
    if not across:
        return
    shown = module_names(model, across)
    warnings.warn(
        f"lightning_offload: {shown} is compiled (torch.compile) across several blocks: a compiled graph hands "
        "autograd its saved tensors only as it returns, so every activation of its blocks is on the device at its "
        "end whatever is offloaded after, and offloading can hardly lower the peak (on an H200, 0.06 GiB lower with "
        "1.8 GiB offloaded per step). Compile each block instead (for layer in model.layers: layer.compile()): "
        "the activations then leave block by block.",
        stacklevel=5,
    )


def module_names(model: torch.nn.Module, names: list[str]) -> str:
    """``names`` of modules of ``model`` for a message: the first three quoted (the model itself by its class), then
    how many more."""
    shown = ", ".join(repr(name or type(model).__name__) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
