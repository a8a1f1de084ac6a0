"""Packaging: every import is a declared dependency, the wheel carries py.typed, the licence and the config fragment,
one version."""

from __future__ import annotations

import ast
import email.parser
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_offload

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# Top-level import name -> the distribution that provides it (where the two differ, or it is worth saying).
DISTRIBUTION = {
    "torch": "torch",
    "lightning": "lightning",
    "pytorch_lightning": "pytorch-lightning",
    "torchmetrics": "torchmetrics",
    "psutil": "psutil",
    "typing_extensions": "typing-extensions",
    "jsonargparse": "jsonargparse",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "tensorboard": "tensorboard",
    "pytest": "pytest",
    "transformers": "transformers",
    "peft": "peft",
    "pynvml": "nvidia-ml-py",
    "torchtune": "torchtune",
    "trl": "trl",
    "accelerate": "accelerate",
}
# This repository's own modules: the package, the tests, and the module the examples share.
LOCAL = {"lightning_offload", "tests", "demo_model", "benchmarks"}
# Modules whose imports of optional packages sit behind an extra (or a guard that names it).
OPTIONAL_MODULES = {"cli.py", "pl_compat.py"}


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Top-level names of the absolute imports in ``path`` (only those at module level with ``top_level_only``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name not in LOCAL}


def python_files() -> list[Path]:
    return [
        path
        for folder in ("lightning_offload", "examples", "tests", "docs", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]


def test_every_import_is_declared_in_pyproject() -> None:
    declared = {requirement_name(r) for r in PROJECT["dependencies"]}
    for requirements in PROJECT["optional-dependencies"].values():
        declared |= {requirement_name(r) for r in requirements}
    for path in python_files():
        for name in imports(path):
            where = path.relative_to(ROOT)
            assert name in DISTRIBUTION, f"{where} imports {name!r}: add its distribution to DISTRIBUTION here"
            assert DISTRIBUTION[name] in declared, (
                f"{where} imports {name!r}, but pyproject.toml declares no {DISTRIBUTION[name]!r} in dependencies "
                "or any extra"
            )


def test_package_modules_import_only_core_dependencies_at_import_time() -> None:
    """What ``import lightning_offload.<module>`` needs is installed by a plain ``pip install lightning-offload``."""
    core = {requirement_name(r) for r in PROJECT["dependencies"]}
    package = ROOT / "lightning_offload"
    for path in sorted(package.glob("*.py")):
        if path.name in OPTIONAL_MODULES:
            continue
        for name in imports(path, top_level_only=True):
            assert DISTRIBUTION.get(name) in core, (
                f"lightning_offload/{path.name} imports {name!r} at import time; pyproject.toml's dependencies "
                f"lack {DISTRIBUTION.get(name, name)!r}"
            )


def test_version_is_written_once() -> None:
    assert "version" not in PROJECT, "pyproject.toml sets a static version: read it from the package instead"
    assert "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_offload.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", lightning_offload.__version__)
    # Keep a Changelog writes a release's heading as `## [0.2.0] - 2026-12-03`.
    version = re.escape(lightning_offload.__version__)
    assert re.search(rf"^## \[{version}\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.MULTILINE), (
        f"CHANGELOG.md has no `## [{lightning_offload.__version__}]` section"
    )


def test_licence_is_apache_2() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # SPDX string and classifier clash


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is not installed")
def test_wheel_ships_py_typed_the_licence_the_config_and_the_version(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "lightning_offload", source / "lightning_offload", ignore=shutil.ignore_patterns("*.pyc"))
    out = tmp_path / "wheels"
    # The installed setuptools, offline: what the test checks is this repository's configuration.
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run([*command, "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    assert "lightning_offload/py.typed" in names
    # The LightningCLI fragment is package data: an installed wheel has it without a checkout.
    assert "lightning_offload/offload.yaml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert metadata["Version"] == lightning_offload.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    requires = {requirement_name(r) for r in metadata.get_all("Requires-Dist") if "extra ==" not in r}
    assert {"torch", "lightning", "torchmetrics", "psutil", "typing-extensions"} <= requires


def run_config_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_offload.config", *args], capture_output=True, text=True, timeout=120
    )


def test_config_module_prints_the_fragment_and_its_path() -> None:
    from lightning_offload.config import fragment_path, fragment_text

    shipped = ROOT / "lightning_offload" / "offload.yaml"
    assert fragment_path().resolve() == shipped.resolve()
    assert fragment_text() == shipped.read_text()
    assert "ActivationOffloadCallback" in fragment_text()

    path = run_config_module("--path")
    assert path.returncode == 0, path.stderr
    assert Path(path.stdout.strip()).resolve() == shipped.resolve()
    text = run_config_module()
    assert text.returncode == 0, text.stderr
    assert text.stdout == shipped.read_text()
    usage = run_config_module("--help")
    assert usage.returncode == 0 and "--path" in usage.stdout, usage.stdout
    wrong = run_config_module("--bogus")
    assert wrong.returncode == 2 and "unrecognized arguments" in wrong.stderr


def test_the_fragment_has_one_copy_and_configs_keeps_only_the_demos() -> None:
    """``configs/`` holds the demo configs; the fragment lives only in the package (two copies would drift)."""
    fragment = (ROOT / "lightning_offload" / "offload.yaml").read_text()
    demos = sorted((ROOT / "configs").glob("*.yaml"))
    assert demos, "configs/ has no demo config"
    for path in demos:
        assert path.read_text() != fragment, f"{path.relative_to(ROOT)} is a copy of lightning_offload/offload.yaml"
        assert "callbacks+" not in path.read_text(), f"{path.relative_to(ROOT)} looks like the offload fragment"


def test_ci_installs_the_wheel_and_runs_the_example_outside_the_checkout() -> None:
    """After the README's test command, ``.ci/run`` builds the wheel, installs it into a fresh environment under a
    temporary folder, and from there runs the main example and finds the packaged config fragment."""
    script = (ROOT / ".ci" / "run").read_text()
    if shutil.which("bash"):
        syntax = subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    after = commands[commands.index("python -m pytest -q") + 1 :]
    steps = [
        "WORK=$(mktemp -d)",
        'pip wheel --no-deps --no-build-isolation -w "$WORK/dist" .',
        'python3 -m venv "$WORK/venv"',
        '"$PY" -m pip install torch==2.13.0',
        '"$PY" -m pip install "$WORK"/dist/lightning_offload-*.whl',
        'cd "$WORK/run"',
        '"$PY" train_transformer.py',
        'FRAGMENT=$("$PY" -m lightning_offload.config --path)',
    ]
    positions = []
    for step in steps:
        assert step in after, f".ci/run lacks {step!r} after the test command"
        positions.append(after.index(step))
    assert positions == sorted(positions), "the wheel steps of .ci/run are out of order"
    assert 'PY="$WORK/venv/bin/python"' in after
    # The interpreter that runs the example is the fresh environment's, and it is checked to import the wheel.
    assert any(line.startswith('INSTALLED=$("$PY" -c') for line in after)
    assert '"$WORK/venv/"*) ;;' in after
