"""How a step's input compares with the one the memory-budget planner measured: the same, nowhere larger, or new.

A plan made for an input also fits one that is nowhere larger (a shorter sequence, a smaller batch: what a step saves
only grows with its input's dimensions), so only an input larger somewhere needs measuring again. Inputs padded to the
longest sequence of each batch then cost a measuring step per new longest input, not one per step.

Torch only: no Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

Shapes = tuple[tuple[int, ...], ...]


def input_shapes(batch: Any) -> Shapes:
    """The shapes of the tensors in a batch: any nesting of mappings, sequences and dataclasses.

    Walked by hand rather than with ``torch.utils._pytree``, which sees a ``Mapping`` that is no ``dict`` (Hugging
    Face's ``BatchEncoding``, a ``UserDict``) or a dataclass as one opaque leaf: a new sequence length inside it
    would go unnoticed and the old shape's plan would run on it.
    """
    shapes: list[tuple[int, ...]] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(value.shape))
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for item in value:
                walk(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))

    walk(batch)
    return tuple(shapes)


def nowhere_larger(shapes: Shapes, bound: Shapes) -> bool:
    """Whether ``shapes`` are the tensors of ``bound`` (as many, each with as many dimensions), none of them larger in
    any dimension."""
    if len(shapes) != len(bound):
        return False
    pairs = zip(shapes, bound, strict=True)
    return all(len(a) == len(b) and all(x <= y for x, y in zip(a, b, strict=True)) for a, b in pairs)


class MeasuredInput:
    """The input shapes the planner's profile was measured at, and how each step's input compares with them."""

    def __init__(self) -> None:
        self.shapes: Shapes | None = None  # None until the first input

    def compare(self, shapes: Shapes) -> Literal["same", "smaller", "new"]:
        """``"same"`` (the first input too), ``"smaller"`` (nowhere larger: it runs the measured input's plan) or
        ``"new"`` (larger somewhere, or other tensors: measure it, and compare later inputs with it)."""
        if self.shapes is None or shapes == self.shapes:
            self.shapes = shapes
            return "same"
        if nowhere_larger(shapes, self.shapes):
            return "smaller"
        self.shapes = shapes
        return "new"
