"""The diagnostic tools on the CPU: `benchmarks.diagnose` records every step, `benchmarks.interleaved` times plain and
default steps alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import diagnose, interleaved


def test_diagnose_records_each_step_with_its_waits_and_offloaded_bytes(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    args = ["--workload", "small-h512", "--budget-gib", "2", "--steps", "2", "--tiny", "--out", str(out)]
    assert diagnose.main(args) == 0
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [0, 1]
    for step in result["steps"]:
        assert step["wall_s"] > 0
        assert {"fwd_wait_ms", "bwd_stall_ms", "offloaded_gib", "host_allocations"} <= set(step)
    assert result["budget_gib"] == 2.0 and "oom" not in result


def test_interleaved_times_plain_and_default_steps_alike(tmp_path: Path) -> None:
    out = tmp_path / "i.json"
    assert interleaved.main(["--workload", "small-h512", "--pairs", "3", "--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pairs"] == 3 and result["plain_ms"] > 0 and result["default_ms"] > 0
    assert result["ratio"] == pytest.approx(result["default_ms"] / result["plain_ms"])
