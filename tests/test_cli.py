"""The callback from the command line: plain ``LightningCLI`` (YAML fragment, ``--trainer.callbacks+=``), ``OffloadCLI``
(``--offload.*``), ``pytorch_lightning.cli``, ``--help``, and the CLI example's CPU run end to end.

Every test that composes configs starts from a user config with callbacks of its own, and checks that they survive
next to exactly one offloading callback, and that every option given on the command line applies.
"""

from __future__ import annotations

import csv
import inspect
import runpy
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateFinder, LearningRateMonitor, ModelSummary
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_offload import ActivationOffloadCallback, OffloadOptions
from lightning_offload.cli import OffloadCLI
from lightning_offload.config import fragment_path
from lightning_offload.memory_picture import FILENAME
from lightning_offload.metrics import HOST_PINNED, OFFLOADED

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# The fragment ships inside the package (package data), found the way a user finds it.
FRAGMENT = fragment_path()
CLASS_PATH = "lightning_offload.ActivationOffloadCallback"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter is intended:UserWarning"),
]

PARAMETERS = [name for name in inspect.signature(ActivationOffloadCallback.__init__).parameters if name != "self"]
DEFAULTS = {name: inspect.signature(ActivationOffloadCallback.__init__).parameters[name].default for name in PARAMETERS}
# A value other than the default for every option: (as typed on the command line, as the callback then holds it).
NON_DEFAULT: dict[str, tuple[str, Any]] = {
    "mode": ("sync", "sync"),
    "memory_budget": ("8GiB", 8 << 30),
    "compute_device": ("cpu", torch.device("cpu")),
    "min_tensor_bytes": ("1024", 1024),
    "resident_tail_bytes": ("0", 0),
    "max_offload_bytes": ("4096", 4096),
    "max_inflight_bytes": ("8192", 8192),
    "prefetch_bytes": ("65536", 65536),
    "host_memory_limit": ("1073741824", 1 << 30),
    "on_host_full": ("error", "error"),
    "measure_copies": ("true", True),
    "plan_trials": ("false", False),
    "checkpoint": ("auto", "auto"),
    "recompute": ("elementwise", "elementwise"),
    "progress_bar": ("true", True),
    "memory_picture": ("true", True),
    "memory_picture_compare": ("false", False),
    "memory_snapshot": ("true", True),
}


def held(callback: ActivationOffloadCallback) -> dict[str, Any]:
    """Every option as the callback holds it (``None`` for the picture's options when there is no picture)."""
    picture = callback._picture
    values: dict[str, Any] = {f.name: getattr(callback.options, f.name) for f in fields(OffloadOptions)}
    values.update(
        checkpoint=callback.checkpoint,
        recompute=callback.recompute,
        progress_bar=callback.progress_bar,
        memory_picture=picture is not None,
        memory_picture_compare=None if picture is None else picture.compare,
        memory_snapshot=None if picture is None else picture.snapshot,
    )
    missing = set(PARAMETERS) - set(values)
    assert not missing, f"held() does not read the callback option(s) {sorted(missing)}: add them here"
    return values


def yaml_literal(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def write_user_config(tmp_path: Path, offload_entry: dict[str, Any] | None = None) -> Path:
    """A user's config with two callbacks of its own (and, if given, an offloading callback listed after them)."""
    callbacks: list[dict[str, Any]] = [
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
        {"class_path": "lightning.pytorch.callbacks.LearningRateFinder", "init_args": {"num_training_steps": 7}},
    ]
    if offload_entry is not None:
        callbacks.append({"class_path": CLASS_PATH, "init_args": offload_entry})
    config = {"trainer": {"default_root_dir": str(tmp_path), "max_steps": 2, "callbacks": callbacks}}
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def assert_user_callbacks_kept(callbacks: list[Any]) -> ActivationOffloadCallback:
    """The user's two callbacks, with their own arguments, and exactly one offloading callback; returns it."""
    (monitor,) = [cb for cb in callbacks if isinstance(cb, LearningRateMonitor)]
    assert monitor.logging_interval == "step"
    (finder,) = [cb for cb in callbacks if isinstance(cb, LearningRateFinder)]
    assert finder._num_training_steps == 7
    ours = [cb for cb in callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert len(ours) == 1, f"expected one ActivationOffloadCallback, got {len(ours)}"
    return ours[0]


def budget_unused() -> pytest.WarningsChecker:
    """NON_DEFAULT sets ``memory_budget`` beside ``mode="sync"`` (or ``"off"``): a budget no planner can use, which the
    callback says as it is built."""
    return pytest.warns(
        UserWarning, match=r"memory_budget is not used: the memory-budget planner needs mode='streamed'"
    )


def test_every_option_has_a_test_value() -> None:
    missing = [name for name in PARAMETERS if name not in NON_DEFAULT]
    assert not missing, f"NON_DEFAULT lacks a non-default command-line value for {missing}"
    for name, (_, value) in NON_DEFAULT.items():
        assert value != DEFAULTS[name], f"NON_DEFAULT[{name!r}] equals the default"


# ------------------------------------------------------------------ plain LightningCLI: the standard way


def test_fragment_appends_to_a_user_config_and_every_flag_applies(tmp_path: Path) -> None:
    flags = [f"--trainer.callbacks.init_args.{name}={text}" for name, (text, _) in NON_DEFAULT.items()]
    args = [f"--config={write_user_config(tmp_path)}", f"--config={FRAGMENT}", *flags]
    with budget_unused():
        cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert held(callback) == {name: value for name, (_, value) in NON_DEFAULT.items()}


def test_fragment_alone_adds_the_callback_at_its_defaults(tmp_path: Path) -> None:
    args = [f"--config={FRAGMENT}", f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert held(callback) == held(ActivationOffloadCallback())


def test_command_line_appends_the_callback_to_a_user_config(tmp_path: Path) -> None:
    args = [
        f"--config={write_user_config(tmp_path)}",
        f"--trainer.callbacks+={CLASS_PATH}",
        "--trainer.callbacks.init_args.mode=off",
        "--trainer.callbacks.init_args.max_offload_bytes=2147483648",
    ]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert callback.options.mode == "off" and callback.options.max_offload_bytes == 2 << 30


def test_offload_yaml_is_a_fragment_with_every_option_at_its_default() -> None:
    config = yaml.safe_load(FRAGMENT.read_text())
    assert set(config) == {"trainer"} and set(config["trainer"]) == {"callbacks+"}, "the fragment sets only callbacks+"
    entry = config["trainer"]["callbacks+"]
    assert entry["class_path"] == CLASS_PATH
    assert entry["init_args"] == DEFAULTS, (
        "lightning_offload/offload.yaml is out of date: show every default of the callback"
    )


# Every byte option with a size string (either kind of unit) and the byte count it means.
SIZES: dict[str, tuple[str, int]] = {
    "memory_budget": ("40GiB", 40 << 30),
    "min_tensor_bytes": ("2MiB", 2 << 20),
    "resident_tail_bytes": ("128M", 128 << 20),
    "max_offload_bytes": ("2GB", 2 * 10**9),
    "max_inflight_bytes": ("64MB", 64 * 10**6),
    "prefetch_bytes": ("1G", 1 << 30),
    "host_memory_limit": ("8GiB", 8 << 30),
}


def test_byte_options_take_size_strings_in_yaml_and_on_the_command_line(tmp_path: Path) -> None:
    """The sizes the options document pass the CLI's type check (the signature said ``int``, so ``"2GiB"`` was
    refused before the callback saw it), from a YAML entry, from ``--trainer.callbacks.init_args.*`` and from
    ``--offload.*``."""
    assert set(SIZES) == {
        "memory_budget",
        "host_memory_limit",
        *(name for name in PARAMETERS if name.endswith("_bytes")),
    }
    expected = {name: size for name, (_, size) in SIZES.items()}
    entry = {name: text for name, (text, _) in SIZES.items()}
    user = write_user_config(tmp_path, offload_entry=entry)
    with pytest.warns(UserWarning, match=r"memory_budget is not used"):  # beside max_offload_bytes
        cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=[f"--config={user}"])
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert {name: getattr(callback.options, name) for name in SIZES} == expected
    flags = [f"--trainer.callbacks.init_args.{name}={text}" for name, (text, _) in SIZES.items()]
    args = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks+={CLASS_PATH}", *flags]
    with pytest.warns(UserWarning, match=r"memory_budget is not used"):
        cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert {name: getattr(callback.options, name) for name in SIZES} == expected
    flags = [f"--offload.{name}={text}" for name, (text, _) in SIZES.items()]
    with pytest.warns(UserWarning, match=r"memory_budget is not used"):
        cli = OffloadCLI(
            BoringModel, BoringDataModule, run=False, args=[f"--trainer.default_root_dir={tmp_path}", *flags]
        )
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert {name: getattr(callback.options, name) for name in SIZES} == expected


# ------------------------------------------------------------------ pytorch_lightning.cli


def test_pytorch_lightning_cli_takes_the_twin_class(tmp_path: Path) -> None:
    pl_cli = pytest.importorskip("pytorch_lightning.cli")
    from pytorch_lightning.callbacks import LearningRateMonitor as PLLearningRateMonitor
    from pytorch_lightning.demos.boring_classes import BoringDataModule as PLData
    from pytorch_lightning.demos.boring_classes import BoringModel as PLModel

    from lightning_offload.pl_compat import ActivationOffloadCallback as Twin

    args = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=pytorch_lightning.callbacks.LearningRateMonitor",
        "--trainer.callbacks+=lightning_offload.pl_compat.ActivationOffloadCallback",
        "--trainer.callbacks.init_args.mode=sync",
        "--trainer.callbacks.init_args.compute_device=cpu",
    ]
    cli = pl_cli.LightningCLI(PLModel, PLData, run=False, args=args)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, Twin)]
    assert callback.options.mode == "sync" and callback.options.compute_device == torch.device("cpu")
    assert any(isinstance(cb, PLLearningRateMonitor) for cb in cli.trainer.callbacks)


def test_pytorch_lightning_cli_rejects_the_lightning_class_and_the_readme_says_what_to_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lightning_offload.ActivationOffloadCallback`` is a ``lightning.pytorch`` callback, not a ``pytorch_lightning``
    one; jsonargparse's error cannot be extended, so the README names the twin for that CLI."""
    pl_cli = pytest.importorskip("pytorch_lightning.cli")
    from pytorch_lightning.demos.boring_classes import BoringDataModule as PLData
    from pytorch_lightning.demos.boring_classes import BoringModel as PLModel

    with pytest.raises(SystemExit):
        pl_cli.LightningCLI(PLModel, PLData, run=False, args=[f"--trainer.callbacks+={CLASS_PATH}"])
    assert "does not correspond to a subclass of Callback" in capsys.readouterr().err
    readme = (ROOT / "README.md").read_text()
    assert "--trainer.callbacks+=lightning_offload.pl_compat.ActivationOffloadCallback" in readme


# ------------------------------------------------------------------ OffloadCLI: the --offload.* shorthand


def test_offload_flags_on_any_model(tmp_path: Path) -> None:
    flags = [f"--offload.{name}={text}" for name, (text, _) in NON_DEFAULT.items()]
    with budget_unused():
        cli = OffloadCLI(
            BoringModel, BoringDataModule, run=False, args=[f"--trainer.default_root_dir={tmp_path}", *flags]
        )
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert held(callback) == {name: value for name, (_, value) in NON_DEFAULT.items()}


def test_offload_group_defaults(tmp_path: Path) -> None:
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=[f"--trainer.default_root_dir={tmp_path}"])
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert held(callback) == held(ActivationOffloadCallback())


@pytest.mark.parametrize(
    ("args", "first"),
    [
        (
            ["--offload.mode=fast"],
            "error: ActivationOffloadCallback(mode='fast'): mode must be one of ['streamed', 'sync', 'off']",
        ),
        (
            ["fit", "--offload.on_host_full=later"],
            "error: ActivationOffloadCallback(on_host_full='later'): on_host_full must be one of ['warn', 'error']",
        ),
        (
            ["--offload.memory_budget=40 parsecs"],
            "error: ActivationOffloadCallback(memory_budget='40 parsecs'): memory_budget must be 'auto', None, an "
            "integer byte count > 0 or a size string such as '40GiB', '512MiB' or '2GB' (GB = 10**9 bytes, GiB = G = "
            "2**30)",
        ),
        (
            [f"--trainer.callbacks+={CLASS_PATH}", "--trainer.callbacks.init_args.max_offload_bytes=1.5"],
            "error: ActivationOffloadCallback(max_offload_bytes='1.5'): max_offload_bytes must be an integer byte "
            "count >= 0 or a size string such as '512MiB', '2GiB' or '2GB' (GB = 10**9 bytes, GiB = G = 2**30), or "
            "None",
        ),
    ],
)
def test_a_bad_value_on_the_command_line_shows_our_one_line_message_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], first: str
) -> None:
    """A bad value printed an 85-line traceback (or the whole usage) with our message buried inside: the CLI's first
    line is now the message, quoting the call, and it exits with status 2, as argparse does."""
    with pytest.raises(SystemExit) as info:
        run = args[0] == "fit"  # a subcommand (the bad value stops it before anything runs)
        OffloadCLI(BoringModel, BoringDataModule, run=run, args=[*args, f"--trainer.default_root_dir={tmp_path}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == first, err[:2000]
    assert "Traceback" not in err and "usage:" not in err


def test_offload_flags_win_over_a_listed_callback_even_at_their_defaults(tmp_path: Path) -> None:
    """A YAML entry sets every option away from its default; flags set every option back: the flags win."""
    entry = {name: yaml.safe_load(text) for name, (text, _) in NON_DEFAULT.items()}
    user = write_user_config(tmp_path, offload_entry=entry)
    flags = [f"--offload.{name}={yaml_literal(DEFAULTS[name])}" for name in PARAMETERS]
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=[f"--config={user}", *flags])
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert held(callback) == held(ActivationOffloadCallback())


def test_listed_callback_configures_offload_cli_where_no_flag_is_given(tmp_path: Path) -> None:
    entry = {name: yaml.safe_load(text) for name, (text, _) in NON_DEFAULT.items()}
    user = write_user_config(tmp_path, offload_entry=entry)
    with budget_unused():
        cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=[f"--config={user}", "--offload.mode=off"])
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert held(callback) == {**{name: value for name, (_, value) in NON_DEFAULT.items()}, "mode": "off"}


def test_offload_cli_with_the_fragment_keeps_user_callbacks_and_applies_every_flag(tmp_path: Path) -> None:
    flags = [f"--offload.{name}={text}" for name, (text, _) in NON_DEFAULT.items()]
    args = [f"--config={write_user_config(tmp_path)}", f"--config={FRAGMENT}", *flags]
    with budget_unused():
        cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=args)
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert held(callback) == {name: value for name, (_, value) in NON_DEFAULT.items()}


def test_offload_cli_keeps_the_fragment_whatever_the_config_order(tmp_path: Path) -> None:
    """``--config <fragment> --config my.yaml``: my.yaml's own ``trainer.callbacks:`` list replaces the fragment's
    ``callbacks+`` entry (YAML lists do not merge), which dropped the fragment's settings silently. OffloadCLI keeps
    them, in either order, with the user's callbacks, and flags still win."""
    fragment = yaml.safe_load(FRAGMENT.read_text())
    fragment["trainer"]["callbacks+"]["init_args"].update(mode="sync", min_tensor_bytes="2MiB")
    edited = tmp_path / "offload.yaml"
    edited.write_text(yaml.safe_dump(fragment))
    user = write_user_config(tmp_path)
    for configs in ([edited, user], [user, edited]):
        args = [f"--config={path}" for path in configs]
        cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=args)
        callback = assert_user_callbacks_kept(cli.trainer.callbacks)
        assert (callback.options.mode, callback.options.min_tensor_bytes) == ("sync", 2 << 20), configs
    args = [f"--config={edited}", f"--config={user}", "--offload.mode=off"]
    cli = OffloadCLI(BoringModel, BoringDataModule, run=False, args=args)
    callback = assert_user_callbacks_kept(cli.trainer.callbacks)
    assert (callback.options.mode, callback.options.min_tensor_bytes) == ("off", 2 << 20)


# ------------------------------------------------------------------ --help and the example


def run_example(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example puts its own folder on the path
    main = runpy.run_path(str(ROOT / "examples" / "cli.py"))["main"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python examples/cli.py fit --trainer.callbacks.help lightning_offload.ActivationOffloadCallback``."""
    run_example(["fit", "--trainer.callbacks.help", CLASS_PATH], monkeypatch)
    text = capsys.readouterr().out
    assert "--trainer.callbacks.mode {streamed,sync,off}" in text
    for name in PARAMETERS:
        assert f"--trainer.callbacks.{name}" in text
    assert "overlaps copies with compute" in text  # the Args: docstring reached the help
    assert "almost no step time" not in text


def test_offload_cli_help_documents_the_offload_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        OffloadCLI(BoringModel, BoringDataModule, run=False, args=["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--offload.on_host_full {warn,error}" in text
    for name in PARAMETERS:
        assert f"--offload.{name}" in text


def test_demo_cpu_config_runs_and_logs(tmp_path: Path) -> None:
    """What the README shows: ``python examples/cli.py fit --config configs/demo_cpu.yaml``, a few steps."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "cli.py"),
        "fit",
        f"--config={CONFIGS / 'demo_cpu.yaml'}",
        "--trainer.callbacks.init_args.min_tensor_bytes=8192",
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
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    (entry,) = saved["trainer"]["callbacks"]
    assert entry["class_path"] == CLASS_PATH
    assert entry["init_args"]["mode"] == "sync" and entry["init_args"]["min_tensor_bytes"] == 8192


def test_offload_flags_win_under_a_subcommand(tmp_path: Path) -> None:
    """``python train.py fit ...`` trains: the flags given after the subcommand win over a listed callback too."""
    entry = {"mode": "off", "compute_device": "cpu", "min_tensor_bytes": 0, "resident_tail_bytes": 0}
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelSummary", "init_args": {"max_depth": 3}},
        {"class_path": CLASS_PATH, "init_args": entry},
    ]
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"trainer": {"default_root_dir": str(tmp_path), "callbacks": callbacks}}))
    args = ["fit", f"--config={user}", "--offload.mode=sync", "--trainer.max_steps=1", "--trainer.logger=false"]
    cli = OffloadCLI(BoringModel, BoringDataModule, args=args)
    (summary,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelSummary)]
    assert summary._max_depth == 3
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert callback.options.mode == "sync" and callback.options.compute_device == torch.device("cpu")
    assert callback.stats.offloaded_bytes > 0  # it trained, offloading


class WidthModel(BoringModel):
    """A model with a required argument, as most real models have."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width


def test_offload_cli_takes_required_arguments_from_default_config_files(tmp_path: Path) -> None:
    """LightningCLI fills required arguments from ``default_config_files``; OffloadCLI must too, under the plain
    parser and under a subcommand's."""
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(yaml.safe_dump({"model": {"width": 3}, "trainer": {"default_root_dir": str(tmp_path)}}))
    args = ["--offload.mode=sync"]
    cli = OffloadCLI(
        WidthModel, BoringDataModule, run=False, args=args, parser_kwargs={"default_config_files": [defaults]}
    )
    assert cli.model.width == 3
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
    assert callback.options.mode == "sync"
    args = ["fit", "--offload.mode=off", "--trainer.max_steps=1", "--trainer.logger=false"]
    # The fit runs on the CPU here: the callback says it offloads nothing there (on a GPU it would run).
    no_cuda = pytest.warns(UserWarning, match="no CUDA device") if not torch.cuda.is_available() else nullcontext()
    with no_cuda:
        cli = OffloadCLI(
            WidthModel, BoringDataModule, args=args, parser_kwargs={"fit": {"default_config_files": [defaults]}}
        )
    assert cli.model.width == 3 and cli.trainer.global_step == 1
