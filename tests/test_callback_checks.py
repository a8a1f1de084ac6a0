"""The callback's checks (``callback_checks``): each wrong argument or wrong caller fails with a message that names
the fix, and what is right passes."""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import pytest
from torch import nn

from lightning_offload.callback_checks import (
    builds_layers_after_setup,
    check_reporting_args,
    checked_checkpointing,
    require_single_callback,
    require_trainer,
)
from lightning_offload.checkpointing import RunCheckpointing

REPORTING = {"progress_bar": False, "memory_picture": False, "memory_picture_compare": True, "memory_snapshot": False}


def test_a_reporting_option_that_is_no_bool_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"ActivationOffloadCallback\(progress_bar=1\): progress_bar must be True"):
        check_reporting_args({**REPORTING, "progress_bar": 1})
    with pytest.raises(TypeError, match=r"memory_picture_compare='yes'\): memory_picture_compare must be"):
        check_reporting_args({**REPORTING, "memory_picture_compare": "yes"})
    check_reporting_args(REPORTING)


def test_a_snapshot_without_the_picture_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"memory_snapshot=True, memory_picture=False\).*pass memory_picture=True"):
        check_reporting_args({**REPORTING, "memory_snapshot": True})


def test_drawing_without_matplotlib_is_an_import_error_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install lightning-offload\[plot\]"):
        check_reporting_args({**REPORTING, "memory_picture": True})
    check_reporting_args(REPORTING)  # not drawing: matplotlib is not needed


def test_checkpointing_by_hand_is_checked_and_quotes_the_callbacks_call() -> None:
    assert checked_checkpointing(None, "all") is None
    manual = checked_checkpointing("auto", "all")
    assert isinstance(manual, RunCheckpointing) and manual.call == "ActivationOffloadCallback(checkpoint='auto')"
    with pytest.raises(
        ValueError, match=r"^ActivationOffloadCallback\(checkpoint='auto', recompute='some'\): recompute"
    ):
        checked_checkpointing("auto", "some")
    with pytest.raises(ValueError, match=r"recompute applies to the blocks checkpoint= selects"):
        checked_checkpointing(None, "elementwise")


def test_only_a_lightning_trainer_may_call_the_hooks() -> None:
    with pytest.raises(
        RuntimeError, match=r"ActivationOffloadCallback\.on_train_batch_start\(trainer=object\).*fabric"
    ):
        require_trainer(object(), "on_train_batch_start")
    require_trainer(pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False), "setup")


def test_a_second_offloading_callback_is_refused() -> None:
    class Offload:
        pass

    require_single_callback([Offload(), object()], Offload)
    with pytest.raises(RuntimeError, match=r"holds 2 ActivationOffloadCallback instances"):
        require_single_callback([Offload(), object(), Offload()], Offload)


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class BuildsInConfigureModel(Plain):
    def configure_model(self) -> None:
        self.late = nn.Linear(2, 2)


class BuildsInSetup(Plain):
    def setup(self, stage: str) -> None:
        self.late = nn.Linear(2, 2)


@pytest.mark.parametrize(("module", "late"), [(Plain, False), (BuildsInConfigureModel, True), (BuildsInSetup, True)])
def test_a_module_builds_layers_after_setup_where_it_overrides_setup_or_configure_model(
    module: Any, late: bool
) -> None:
    assert builds_layers_after_setup(module()) is late
