"""The examples' CPU smoke runs: what a user who runs them without a GPU gets."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")


def example_main(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ``main`` of ``examples/<name>.py`` (each example puts its own folder on ``sys.path``)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))["main"]


def test_train_transformer_cpu_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    main = example_main("train_transformer", monkeypatch)
    results = main(["--cpu", "--steps", "3", "--memory-picture", "--log-dir", str(tmp_path)])
    plain, offloaded = results.values()
    assert plain["offload/offloaded_gib_epoch_mean"] == 0.0
    assert offloaded["offload/offloaded_gib_epoch_mean"] > 0
    out = capsys.readouterr().out
    assert "offloaded" in out and "GiB per step" in out
    assert "memory picture:" in out


def test_plain_pytorch_cpu_smoke(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    main = example_main("plain_pytorch", monkeypatch)
    figures = main(["--cpu", "--steps", "2", "--mode", "sync"])
    assert figures["offloaded_gib"] > 0
    assert "tensors saved" in capsys.readouterr().out


def test_plain_pytorch_names_each_steps_input_before_entering_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README asks a loop under a ``memory_budget`` (as this example gives on a GPU) to call
    ``off.input_changed(...)`` before each step; the example never did, so a reader who copied it to batches of
    changing lengths ran the first shape's plan on every later one."""
    from lightning_offload.engine import OffloadEngine

    events: list[str] = []
    input_changed, install = OffloadEngine.input_changed, OffloadEngine.install

    def named(self: OffloadEngine, key: Any) -> None:
        events.append("input_changed")
        input_changed(self, key)

    def installed(self: OffloadEngine) -> None:
        events.append("install")
        install(self)

    monkeypatch.setattr(OffloadEngine, "input_changed", named)
    monkeypatch.setattr(OffloadEngine, "install", installed)
    main = example_main("plain_pytorch", monkeypatch)
    main(["--cpu", "--steps", "2"])
    assert events == ["input_changed", "install"] * 3  # the warm-up step and two more


def test_llama_lora_cpu_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    main = example_main("llama_lora", monkeypatch)
    figures = main(["--cpu", "--steps", "2", "--checkpoint", "auto", "--log-dir", str(tmp_path)])
    assert figures["offload/offloaded_gib_epoch_mean"] > 0
