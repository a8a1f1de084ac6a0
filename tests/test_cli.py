"""``OffloadCLI`` and the CLI example: the ``--offload.*`` group, the YAML configs, and a CPU run end to end."""

from __future__ import annotations

import csv
import inspect
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_offload import ActivationOffloadCallback
from lightning_offload.cli import OffloadCLI
from lightning_offload.memory_picture import FILENAME
from lightning_offload.metrics import HOST_PINNED, OFFLOADED

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter is intended:UserWarning"),
]


def offload_callbacks(cli: OffloadCLI) -> list[ActivationOffloadCallback]:
    return [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]


def test_offload_flags_on_any_model(tmp_path: Path) -> None:
    cli = OffloadCLI(
        BoringModel,
        BoringDataModule,
        run=False,
        args=[
            f"--trainer.default_root_dir={tmp_path}",
            "--offload.mode=sync",
            "--offload.compute_device=cpu",
            "--offload.max_offload_bytes=1048576",
            "--offload.checkpoint=auto",
            "--offload.memory_picture=true",
        ],
    )
    (callback,) = offload_callbacks(cli)
    assert callback.options.mode == "sync"
    assert callback.options.compute_device is not None and callback.options.compute_device.type == "cpu"
    assert callback.options.max_offload_bytes == 1 << 20
    assert callback.checkpoint == "auto"
    assert callback._picture is not None


def test_offload_group_defaults(tmp_path: Path) -> None:
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=[f"--trainer.default_root_dir={tmp_path}"])
    (callback,) = offload_callbacks(cli)
    assert callback.options == ActivationOffloadCallback().options


def test_invalid_mode_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        OffloadCLI(BoringModel, BoringDataModule, run=False, args=["--offload.mode=fast"])
    assert "offload.mode" in capsys.readouterr().err


def test_callback_listed_in_yaml_is_the_only_one(tmp_path: Path) -> None:
    """configs/offload.yaml lists the callback under trainer.callbacks; --offload.* values apply on top of it."""
    args = [f"--config={CONFIGS / 'offload.yaml'}", f"--trainer.default_root_dir={tmp_path}"]
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=args)
    (callback,) = offload_callbacks(cli)
    assert callback.options == ActivationOffloadCallback().options
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=[*args, "--offload.mode=off"])
    (callback,) = offload_callbacks(cli)
    assert callback.options.mode == "off"


def test_offload_yaml_shows_every_option_at_its_default() -> None:
    import yaml

    config = yaml.safe_load((CONFIGS / "offload.yaml").read_text())
    (entry,) = config["trainer"]["callbacks"]
    assert entry["class_path"] == "lightning_offload.ActivationOffloadCallback"
    defaults = {
        name: p.default
        for name, p in inspect.signature(ActivationOffloadCallback.__init__).parameters.items()
        if name != "self"
    }
    assert entry["init_args"] == defaults, "configs/offload.yaml is out of date: show every default of the callback"


def test_help_documents_the_offload_group(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python examples/cli.py fit --help`` lists every option with its type, default and docstring."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example puts its own folder on the path
    main = runpy.run_path(str(ROOT / "examples" / "cli.py"))["main"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--offload.mode {streamed,sync,off}" in text
    assert "--offload.on_host_full {warn,error}" in text
    for name in inspect.signature(ActivationOffloadCallback.__init__).parameters:
        if name != "self":
            assert f"--offload.{name}" in text
    assert "copies overlap compute" in text  # the Args: docstring reached the help


def test_demo_cpu_config_runs_and_logs(tmp_path: Path) -> None:
    """What CI runs: ``python examples/cli.py fit --config configs/demo_cpu.yaml`` for a few steps."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "cli.py"),
        "fit",
        f"--config={CONFIGS / 'demo_cpu.yaml'}",
        "--offload.mode=sync",
        "--trainer.max_steps=4",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (log_dir,) = (tmp_path / "demo_cpu").iterdir()
    with open(log_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    keys = {key for row in rows for key, value in row.items() if value}
    assert {"offload/offloaded_gib", "offload/host_pinned_gib", OFFLOADED, HOST_PINNED, "train_loss"} <= keys
    assert max(float(r["offload/offloaded_gib"]) for r in rows if r["offload/offloaded_gib"]) > 0
    assert (log_dir / FILENAME).is_file()
    assert "mode: sync" in (log_dir / "config.yaml").read_text()
