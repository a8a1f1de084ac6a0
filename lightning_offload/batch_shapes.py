"""The input key a Lightning batch gives the memory-budget planner: the names and shapes of the batch's tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_shapes(batch: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of the tensors in a batch: any nesting of mappings (their values by name), sequences and
    dataclasses. A tensor's name is its path of mapping keys and dataclass fields (``"inputs.ids"``; ``""`` where it
    has none): the planner runs a new input on the plan of one no larger in every dimension unmeasured, and tensors of
    other names (``text`` and ``audio`` in a multi-modal run) take other paths through the model.

    Walked by hand rather than with ``torch.utils._pytree``, which sees a ``Mapping`` that is no ``dict`` (Hugging
    Face's ``BatchEncoding``, a ``UserDict``) or a dataclass as one opaque leaf: a new sequence length inside it
    would go unnoticed and the old shape's plan would run on it.

    Args:
        batch: the batch Lightning hands ``on_train_batch_start``.

    Returns:
        ``(name, shape)`` for each tensor, in the order the walk meets them (a mapping's values sorted by name).
    """
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def walk(value: Any, path: str = "") -> None:
        if isinstance(value, torch.Tensor):
            shapes.append((path, tuple(value.shape)))
        elif isinstance(value, Mapping):
            # In the order of the names, not of insertion: the planner compares keys position by position (a new
            # input no larger in every dimension than one whose plan keeps everything runs that plan unmeasured), and
            # a collate that builds each batch's dict in its first sample's order (samples of two sources) would line
            # up one batch's long tensor with another's short one.
            for name in sorted(value, key=str):
                walk(value[name], f"{path}.{name}" if path else str(name))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for item in value:
                walk(item, path)  # (positions are compared as they come)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), f"{path}.{field.name}" if path else field.name)

    walk(batch)
    return tuple(shapes)
