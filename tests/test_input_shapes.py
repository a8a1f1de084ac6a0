"""Comparing a step's input with the one the planner measured: the same, nowhere larger, or new."""

from __future__ import annotations

import dataclasses
from collections import UserDict

import torch

from lightning_offload.input_shapes import MeasuredInput, input_shapes, nowhere_larger


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    name: str = "batch"


def test_shapes_are_read_through_mappings_sequences_and_dataclasses_in_order() -> None:
    ids, mask = torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7)
    expected = ((2, 7), (2, 7), (3,))
    assert input_shapes(UserDict(ids=ids, rest=[mask, ("text", torch.zeros(3))])) == expected
    assert input_shapes(Batch(ids, mask)) == ((2, 7), (2, 7))
    assert input_shapes(["no tensors", b"here"]) == ()


def test_nowhere_larger_needs_the_same_tensors_each_no_larger_in_any_dimension() -> None:
    assert nowhere_larger(((2, 5), (2, 5)), ((2, 7), (2, 7)))
    assert nowhere_larger(((2, 7),), ((2, 7),))
    assert not nowhere_larger(((2, 8),), ((4, 7),))  # longer, though fewer elements
    assert not nowhere_larger(((2, 5),), ((2, 7), (2, 7)))  # other tensors
    assert not nowhere_larger(((2, 5, 1),), ((2, 7),))  # another number of dimensions


def test_the_measured_input_is_the_latest_one_larger_somewhere() -> None:
    measured = MeasuredInput()
    seen = [measured.compare(shapes) for shapes in [((2, 7),), ((2, 7),), ((2, 3),), ((2, 9),), ((2, 8),), ((1, 9),)]]
    assert seen == ["same", "same", "smaller", "new", "smaller", "smaller"]
    assert measured.shapes == ((2, 9),)
    assert measured.compare(((4, 2),)) == "new"  # larger in one dimension, smaller in the other
    assert measured.compare(((2, 9),)) == "new"  # not within the input measured last
