"""The README and CI stay in step with the code: every option, every logged key, the install and test commands."""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from lightning_offload import ActivationOffloadCallback, OffloadOptions, metrics

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# The CPU build of torch from PyTorch's own CPU wheel index, as PyTorch documents it: works on any machine.
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
USER_INSTALL = 'pip install "lightning-offload @ git+https://github.com/lightning-offload/lightning-offload"'
INSTALL = 'pip install -e ".[test]"'
RUN_EXAMPLE = "python examples/train_transformer.py"
TEST_COMMAND = "python -m pytest -q"
REPOSITORY = "https://github.com/lightning-offload/lightning-offload/blob/main/"
RAW = "https://raw.githubusercontent.com/lightning-offload/lightning-offload/main/"


def readme_code_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]


def test_readme_has_the_setup_and_test_commands() -> None:
    lines = readme_code_lines()
    for command in (CPU_TORCH, USER_INSTALL, INSTALL, RUN_EXAMPLE, TEST_COMMAND):
        assert command in lines, f"README has no code line {command!r}"
    assert lines.index(CPU_TORCH) < len(lines) - 1 - lines[::-1].index(USER_INSTALL), "torch's CPU build goes first"
    assert "[test]" not in USER_INSTALL
    assert (ROOT / "examples" / "train_transformer.py").is_file()


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert script.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in script
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert TEST_COMMAND in commands  # the README's test command (a wheel check may follow it)
    # CI installs torch's CPU build before the project, as the README's CPU lines do.
    torch_lines = [i for i, command in enumerate(commands) if command.startswith("pip install torch")]
    assert torch_lines and torch_lines[0] < commands.index(INSTALL)
    assert "ruff check ." in commands and "ruff format --check ." in commands
    assert commands.index("ruff check .") < commands.index(TEST_COMMAND)


def options_table() -> dict[str, str]:
    """The README's ``## Options`` table: option name -> the default as shown."""
    section = README.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `([^`]+)`", section, flags=re.MULTILINE)}


def documented_options() -> dict[str, object]:
    """Every option a user can set, with its default: the engine's (``OffloadOptions``) and the callback's own."""
    options: dict[str, object] = {f.name: f.default for f in fields(OffloadOptions) if f.default is not MISSING}
    for name, parameter in inspect.signature(ActivationOffloadCallback.__init__).parameters.items():
        if name != "self":
            options[name] = parameter.default  # the callback's default is the one a user meets
    return options


def shown(default: object) -> str:
    return f'"{default}"' if isinstance(default, str) else repr(default)


def test_every_option_is_in_the_readme_table_with_its_default() -> None:
    rows = options_table()
    for name, default in documented_options().items():
        source = "OffloadOptions" if name in {f.name for f in fields(OffloadOptions)} else "ActivationOffloadCallback"
        assert name in rows, f"README's options table has no row for `{name}` (an option of {source}): add one"
        assert rows[name] == shown(default), f"README shows {name}={rows[name]}, the default is {shown(default)}"


def test_the_readme_table_has_no_option_the_code_lacks() -> None:
    extra = sorted(set(options_table()) - set(documented_options()))
    assert not extra, f"README's options table documents {extra}, which no longer exist"


def test_no_document_claims_auto_offloading_is_free() -> None:
    """``max_offload_bytes="auto"`` is known to offload far too much (3x step time on the H200)."""
    texts = {
        "README.md": README,
        "the callback's docstring": ActivationOffloadCallback.__doc__ or "",
        "lightning_offload/offload.yaml": (ROOT / "lightning_offload" / "offload.yaml").read_text(),
    }
    for where, text in texts.items():
        assert "almost no step time" not in text, where


def test_every_loop_example_names_each_batchs_input_before_entering_the_engine() -> None:
    """Without the callback, nothing notices a new input shape: a loop that does not call ``input_changed`` runs the
    first shape's plan on every later one (under a hard cap, out of memory at a longer sequence). Every example loop
    (plain PyTorch and Fabric, in the README and in the docstrings) calls it before it enters the engine."""
    from lightning_offload import fabric, offload_activations

    python_blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    loops = {
        "README's context manager": next(b for b in python_blocks if "offload_activations(" in b),
        "README's Fabric loop": next(b for b in python_blocks if "fabric_offload(" in b),
        "offload_activations' docstring": offload_activations.__doc__ or "",
        "the fabric module's docstring": fabric.__doc__ or "",
    }
    for where, text in loops.items():
        # The loop, or the step function a loop runs through ``run_step``, that enters the engine first.
        before = text.split("with off", 1)[0]
        body = re.split(r"\bfor |\bdef ", before)[-1]
        assert "input_changed(" in body, f"{where}: no input_changed() before `with off`"


def test_every_logged_key_is_documented() -> None:
    epoch_keys = [value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)]
    step_keys = [key.removesuffix("_epoch_max").removesuffix("_epoch_mean") for key in epoch_keys]
    docstring = ActivationOffloadCallback.__doc__ or ""
    for key in {*epoch_keys, *step_keys}:
        assert f"`{key}`" in README, f"README does not document {key}"
        assert f"``{key}``" in docstring, f"the callback's docstring does not document {key}"


def test_streams_figure_exists() -> None:
    assert (ROOT / "docs" / "streams.png").stat().st_size > 10_000
    assert "streams.png" in (ROOT / "docs" / "how-it-works.md").read_text()
    assert "<!-- BENCHMARK TABLE -->" in README


USER_DOCS = ["README.md", "CHANGELOG.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


def test_readme_links_are_absolute_and_name_files_that_exist() -> None:
    """The README is the package's long description, read where relative links break: every link and image is
    absolute, and one into this repository names a file (or folder) it has."""
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    assert targets
    for target in targets:
        assert target.startswith("https://"), f"README links to {target!r}: use {REPOSITORY}<path>"
        for base in (REPOSITORY, RAW):
            if target.startswith(base):
                path = target.removeprefix(base).split("#")[0]
                assert (ROOT / path).exists(), f"README links to {target}, but {path} does not exist"


def test_the_docs_pages_link_to_files_that_exist() -> None:
    for name in USER_DOCS[2:]:
        text = (ROOT / name).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" not in target and not target.startswith("#"):
                path = (ROOT / name).parent / target.split("#")[0]
                assert path.exists(), f"{name} links to {target}, which does not exist"


def test_user_documents_carry_no_run_ids_or_verdict_codes() -> None:
    """Run ids (``v96``, ``h200-v108``) and the benchmark's verdict codes belong in the lab notes
    (``benchmarks/results/<date>/NOTES.md``), not in what a user reads; a results file's name in a link is fine."""
    for name in USER_DOCS:
        text = re.sub(r"\]\([^)]*\)", "]", (ROOT / name).read_text())  # link targets left out
        text = re.sub(r"`[^`]*`", "", text)  # so are code spans (file names, commands)
        for pattern in (r"\bv\d{2,3}\b", r"\b(?:B[1-5]|P[1-4]b?)\b", r"\b(?:session|thirteenth|retired)\b"):
            found = re.findall(pattern, text)
            assert not found, f"{name} carries {found} (pattern {pattern})"


def test_no_tracked_file_names_the_old_benchmark_path() -> None:
    import subprocess

    # A source archive (`git archive`, an sdist) has no repository to list; the scan is a check on the checkout.
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (no .git): `git ls-files` has nothing to list")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    old = "lightning_offload" + ".bench"  # the rig's former module path, now the top-level `benchmarks` folder
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".png"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        assert old not in text and old.replace(".", "/") not in text, f"{name} names the old benchmark path"


def test_benchmark_commands_in_the_docs_are_current() -> None:
    import shlex

    from benchmarks.__main__ import parse_args

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


def readme_cli_lines() -> list[str]:
    """The README's ``python train.py fit ...`` command lines (continuations joined, comments dropped)."""
    section = README.split("### From the command line (LightningCLI)\n", 1)[1].split("\n### ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line.startswith("python train.py fit")]


@pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter is intended:UserWarning")
def test_readme_cli_command_lines_train_with_one_offloading_callback(tmp_path: Path) -> None:
    """Every ``train.py fit`` line of the README builds a trainer with exactly one offloading callback: two would
    raise at ``setup`` (saved-tensor hooks stack), none would offload nothing."""
    import shlex

    import yaml
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    section = README.split("### From the command line (LightningCLI)\n", 1)[1]
    (shown_yaml,) = re.findall(r"```yaml\n# (\S+\.yaml)\n(.*?)```", section, flags=re.DOTALL)[:1]
    written = {shown_yaml[0]: shown_yaml[1]}
    # Any other config a line names is the user's own, without offloading: a callback of theirs only.
    user_config = {"trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]}}
    lines = [line for line in readme_cli_lines() if ".help" not in line]
    assert len(lines) >= 3, lines
    for line in lines:
        args = shlex.split(line)[3:]
        for i, arg in enumerate(args[:-1]):
            if arg == "--config":
                name = args[i + 1]
                if name == "$(python -m lightning_offload.config --path)":  # the packaged fragment
                    from lightning_offload.config import fragment_path

                    args[i + 1] = str(fragment_path())
                    continue
                if name.startswith("configs/"):
                    args[i + 1] = str(ROOT / name)
                    continue
                path = tmp_path / name
                path.write_text(written.get(name, yaml.safe_dump(user_config)))
                args[i + 1] = str(path)
        cli = LightningCLI(
            BoringModel, BoringDataModule, run=False, args=[*args, f"--trainer.default_root_dir={tmp_path}"]
        )
        ours = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationOffloadCallback)]
        assert len(ours) == 1, f"README's `{line}` trains with {len(ours)} ActivationOffloadCallback(s)"


def logged_step_keys() -> set[str]:
    """Every per-step key the callback's reporter logs: the ``offload/...`` string constants of its code (the
    module's docstring and ``METRIC_DOCS`` left out)."""
    import ast

    from lightning_offload import reporting

    tree = ast.parse(Path(reporting.__file__).read_text())
    texts = {reporting.METRIC_DOCS, ast.get_docstring(tree)}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value not in texts
        if re.fullmatch(r"offload/\w+", node.value)
    }


def test_every_key_the_reporter_logs_is_documented_and_every_documented_key_is_logged() -> None:
    epoch_keys = {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}
    step_keys = logged_step_keys()
    assert {"offload/peak_allocated_gib", "offload/plan_trial", "offload/d2h_gbps"} <= step_keys, step_keys
    docstring = ActivationOffloadCallback.__doc__ or ""
    for key in step_keys | epoch_keys:
        assert f"`{key}`" in README, f"README does not document {key}"
        assert f"``{key}``" in docstring, f"the callback's docstring does not document {key}"
    section = README.split("\n## Logged metrics\n", 1)[1].split("\n## ", 1)[0]
    tables = "\n".join(line for line in section.splitlines() if line.startswith("| `offload/"))
    documented = set(re.findall(r"`(offload/\w+)`", tables))
    assert documented == step_keys | epoch_keys, "README's metric tables and the logged keys differ"
    in_docstring = set(re.findall(r"``(offload/\w+)``", docstring))
    assert in_docstring == step_keys | epoch_keys, "the callback's docstring and the logged keys differ"


def test_the_keys_held_for_a_late_row_are_every_key_the_reporter_logs_per_batch() -> None:
    """A batch the logger does not write still hands Lightning its figures, key by key from a list: a key logged but
    missing from it would show another batch's value in a row Lightning writes after a later hook stops training."""
    from lightning_offload import reporting

    assert set(reporting._STEP_KEYS) == logged_step_keys()
    assert len(reporting._STEP_KEYS) == len(set(reporting._STEP_KEYS))
