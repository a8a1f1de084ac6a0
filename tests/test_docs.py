"""The README and CI stay in step with the code: every option, every logged key, the two commands."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lightning_offload import ActivationOffloadCallback, metrics

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

INSTALL_AND_RUN = 'pip install -e ".[test]" && python examples/train_transformer.py'
TEST_COMMAND = "python -m pytest -q"


def test_readme_has_the_two_commands() -> None:
    assert INSTALL_AND_RUN in README
    assert TEST_COMMAND in README
    assert (ROOT / "examples" / "train_transformer.py").is_file()


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert script.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in script
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == TEST_COMMAND
    assert commands.index("pip install torch==2.13.0") < commands.index('pip install -e ".[test]"')
    assert "ruff check ." in commands and "ruff format --check ." in commands


def test_every_option_is_in_the_readme_table_with_its_default() -> None:
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `([^`]+)`", README, flags=re.MULTILINE)}
    for name, parameter in inspect.signature(ActivationOffloadCallback.__init__).parameters.items():
        if name == "self":
            continue
        assert name in rows, f"README's option table lacks {name}"
        default = parameter.default
        expected = f'"{default}"' if isinstance(default, str) else repr(default)
        assert rows[name] == expected, f"README shows {name}={rows[name]}, the default is {expected}"


def test_every_logged_key_is_documented() -> None:
    epoch_keys = [value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)]
    step_keys = [key.removesuffix("_epoch_max").removesuffix("_epoch_mean") for key in epoch_keys]
    docstring = ActivationOffloadCallback.__doc__ or ""
    for key in {*epoch_keys, *step_keys}:
        assert f"`{key}`" in README, f"README does not document {key}"
        assert f"``{key}``" in docstring, f"the callback's docstring does not document {key}"


def test_streams_figure_exists() -> None:
    assert (ROOT / "docs" / "streams.png").stat().st_size > 10_000
    assert "docs/streams.png" in README
    assert "<!-- BENCHMARK TABLE -->" in README


def test_benchmark_commands_in_the_docs_are_current() -> None:
    import shlex
    import subprocess

    from benchmarks.__main__ import parse_args

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    old = "lightning_offload" + ".bench"  # the rig's former module path, now the top-level `benchmarks` folder
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".png"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        assert old not in text and old.replace(".", "/") not in text, f"{name} names the old benchmark path"
    notes = (ROOT / "benchmarks" / "NOTES.md").read_text()
    assert "python -m benchmarks" in README and "python -m benchmarks" in notes
    commands = [
        line.split("-m benchmarks", 1)[1]
        for line in notes.splitlines()
        if "-m benchmarks " in line and not line.lstrip().startswith(("`", "#"))
    ]
    assert len(commands) >= 6
    for arguments in commands:  # every documented command line parses
        parse_args([a.replace("$OUT", "out") for a in shlex.split(arguments)])
