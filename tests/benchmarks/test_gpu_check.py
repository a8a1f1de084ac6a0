"""``benchmarks/gpu_check.sh``, the one call that runs every GPU test and the dynamic-lengths arms on a CUDA machine:
it must parse, name test files that exist, and report a part that fails without stopping the others."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_the_gpu_check_parses_and_names_test_files_that_exist() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, check=False).returncode == 0
    named = re.findall(r"tests/\S+\.py", SCRIPT.read_text())
    assert len(named) >= 4
    assert all((ROOT / name).is_file() for name in named), named


def test_a_failing_part_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    """With an interpreter that fails at once, every part runs, each says its exit status, and the script fails."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 3\n")
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": str(fake)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == [
        "gpu-tests",
        "gpu-unmarked-tests",
        "dyn-auto-none",
        "dyn-auto-input_changed",
        "dyn-cap-fixed",
        "dyn-cap-input_changed",
    ]
    assert all("rc=3" in line for line in summary)
    assert "no torch here" in (tmp_path / "gpu-tests.log").read_text()
