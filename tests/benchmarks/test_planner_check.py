"""``benchmarks/planner_check.sh``, the one device call that runs the planner's workloads beside a baseline tree and
parts of the model zoo: every part runs under its own limit, in its own tree, and what they wrote comes back packed."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "planner_check.sh"

# Stands in for the interpreter: says where it ran and with what, and writes what the rig would at its --out.
FAKE_PYTHON = """#!/bin/sh
echo "ran in $PWD: $*"
echo "path=$PYTHONPATH"
out=""; name=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift ;;
        --device-name) name=$2; shift ;;
    esac
    shift
done
if [ -n "$name" ]; then mkdir -p "$out"; echo '{"results": []}' > "$out/$name.json"
else mkdir -p "$(dirname "$out")"; echo '{"rows": []}' > "$out"; echo '{}' > "${out%.json}-traces.json"; fi
exit ${FAKE_RC:-0}
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str], dict[str, str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "PYTHON": str(fake), **env},
        timeout=60,
        check=False,
    )
    summary = (out / "summary.txt").read_text().splitlines()
    with tarfile.open(out / "planner-check.tgz") as pack:
        files = {
            Path(m.name).name: pack.extractfile(m).read().decode()  # type: ignore[union-attr]
            for m in pack.getmembers()
            if m.isfile()
        }
    assert sorted(p.name for p in out.iterdir()) == ["planner-check.tgz", "summary.txt"]  # two files come back
    return done, summary, files


def test_the_planner_check_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, check=False).returncode == 0


def test_each_part_runs_in_its_tree_and_what_it_wrote_comes_back_packed(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline-tree"
    baseline.mkdir()
    done, summary, files = _run(tmp_path, BASELINE=str(baseline), ZOO="1/3 3/3", WORKLOADS="small-h512")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in summary] == ["workloads-head", "workloads-baseline", "zoo-1", "zoo-3"]
    assert all("rc=0" in line for line in summary)
    assert sorted(files) == [
        "workloads-baseline.json",
        "workloads-baseline.log",
        "workloads-head.json",
        "workloads-head.log",
        "zoo-1-traces.json",
        "zoo-1.json",
        "zoo-1.log",
        "zoo-3-traces.json",
        "zoo-3.json",
        "zoo-3.log",
    ]
    # This tree's workloads run here with every mode compared; the baseline's in its own tree, the planner's rows.
    assert (
        f"ran in {ROOT}: -m benchmarks --workloads small-h512 --modes none,ours-default,ac,"
        in files["workloads-head.log"]
    )
    assert (
        f"ran in {baseline}: -m benchmarks --workloads small-h512 --modes none,ours-budget-0.9x,"
        in files["workloads-baseline.log"]
    )
    assert f"path={ROOT}" in files["workloads-head.log"]  # this tree's package first on the path
    assert f"path={baseline}\n" in files["workloads-baseline.log"]  # the baseline's alone
    assert "-m benchmarks.zoo --part 3/3" in files["zoo-3.log"]


def test_zoo_parts_alone_where_workloads_is_set_but_empty(tmp_path: Path) -> None:
    done, summary, files = _run(tmp_path, WORKLOADS="", BASELINE=str(tmp_path), ZOO="2/3")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in summary] == ["zoo-2"]
    assert sorted(files) == ["zoo-2-traces.json", "zoo-2.json", "zoo-2.log"]


def test_a_failing_part_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    done, summary, files = _run(tmp_path, FAKE_RC="3", ZOO="2/2")
    assert done.returncode == 1
    assert [line.split()[0] for line in summary] == ["workloads-head", "zoo-2"]  # no baseline named: none runs
    assert all("rc=3" in line for line in summary)
    assert "zoo-2.log" in files and "workloads-head.log" in files
