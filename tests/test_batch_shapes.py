"""The input key a batch gives the planner (``batch_shapes``): tensors named by their path of mapping keys and
dataclass fields, mappings read by name whatever their kind, so that a batch is no larger than another only where its
tensors of the same names are."""

from __future__ import annotations

import dataclasses
from collections import UserDict

import torch

from lightning_offload.batch_shapes import batch_shapes
from lightning_offload.planner.inputs import no_larger


class Encoding(UserDict):
    """A batch as a ``Mapping`` that is no ``dict`` (as Hugging Face's ``BatchEncoding``, a ``UserDict``)."""


def test_a_batch_whose_named_tensors_grew_is_never_no_larger_for_listing_them_in_another_order() -> None:
    """A batch's mapping is read by name: the same tensors listed in another order (a collate that builds each dict in
    its first sample's order, samples of two sources) name the same input, and one whose long tensor grew is not
    taken for no larger than a batch that listed it second (it would run that batch's plan unmeasured)."""
    short, long = torch.zeros(2, 8), torch.zeros(2, 64)
    assert batch_shapes({"ids": short, "labels": long}) == batch_shapes({"labels": long, "ids": short})
    first = batch_shapes({"prompt": short, "response": long})
    grown = batch_shapes({"response": short, "prompt": torch.zeros(2, 60)})  # the prompt: 8 -> 60
    assert not no_larger(grown, first)


def test_batches_whose_tensors_have_other_names_are_never_no_larger_than_each_other() -> None:
    """A batch is named by its tensors' names too: in a multi-task or multi-modal run, ``{"text": (8, 16)}`` and
    ``{"audio": (8, 32)}`` take other paths through the model, so the smaller is not run on the larger's plan unmeasured
    (by shapes alone, in the same positions, it would be). The same names compare by their shapes, nested names and
    dataclass fields included."""
    text, audio = {"text": torch.zeros(8, 16)}, {"audio": torch.zeros(8, 32)}
    assert not no_larger(batch_shapes(text), batch_shapes(audio))
    assert no_larger(batch_shapes({"text": torch.zeros(8, 8)}), batch_shapes(text))
    nested_short = {"inputs": {"ids": torch.zeros(2, 8)}, "labels": torch.zeros(2, 8)}
    nested_long = {"inputs": {"ids": torch.zeros(2, 16)}, "labels": torch.zeros(2, 16)}
    assert no_larger(batch_shapes(nested_short), batch_shapes(nested_long))
    assert not no_larger(
        batch_shapes({"inputs": {"mask": torch.zeros(2, 8)}, "labels": torch.zeros(2, 8)}),
        batch_shapes(nested_long),
    )
    assert no_larger(batch_shapes(Encoding(x=torch.zeros(2, 8))), batch_shapes({"x": torch.zeros(2, 16)}))

    @dataclasses.dataclass
    class Pair:
        text: torch.Tensor
        audio: torch.Tensor

    short, long = Pair(torch.zeros(2, 8), torch.zeros(2, 4)), Pair(torch.zeros(2, 16), torch.zeros(2, 4))
    assert no_larger(batch_shapes(short), batch_shapes(long))
    assert not no_larger(batch_shapes(long), batch_shapes(short))
    assert batch_shapes(short) == (("text", (2, 8)), ("audio", (2, 4)))  # (fields in their order)
    assert batch_shapes([{"ids": torch.zeros(3)}, torch.zeros(1)]) == (("ids", (3,)), ("", (1,)))


def test_values_that_are_no_tensors_strings_and_classes_add_nothing() -> None:
    """Only tensors are named: a string or bytes is no sequence of items to walk, and a dataclass *class* (not an
    instance) is no batch; a mapping's keys that are no strings are named by their ``str``."""

    @dataclasses.dataclass
    class Sample:
        ids: torch.Tensor

    batch = {
        "text": "hello",
        "raw": b"\x00",
        "kind": Sample,
        "n": 3,
        1: torch.zeros(4),
        "sample": Sample(torch.zeros(2)),
    }
    assert batch_shapes(batch) == (("1", (4,)), ("sample.ids", (2,)))
    assert batch_shapes(torch.zeros(3, 5)) == (("", (3, 5)),)
    assert batch_shapes(None) == () and batch_shapes([]) == ()


def test_a_mapping_that_is_no_dict_names_its_tensors_as_a_dict_does() -> None:
    """A ``UserDict`` batch (a tokenizer's ``BatchEncoding``) is walked, not taken for one opaque leaf: a new sequence
    length inside it changes the key."""
    batch = Encoding(input_ids=torch.zeros(2, 8), attention_mask=torch.zeros(2, 8))
    assert batch_shapes(batch) == batch_shapes(dict(batch)) == (("attention_mask", (2, 8)), ("input_ids", (2, 8)))
    assert batch_shapes(Encoding(input_ids=torch.zeros(2, 9), attention_mask=torch.zeros(2, 9))) != batch_shapes(batch)
