"""The gradient check's rig on a CPU: the tiny workload, every arm, each step's gradients against a plain step's."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import run_on_cpu


def test_every_arm_reports_its_gradients_bit_equal_to_a_plain_step_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "grads.json"
    done = run_on_cpu(
        "benchmarks.grad_check",
        "--workload",
        "small-h512",
        "--plain-repeats",
        "2",
        "--attention",
        "math",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    arms = [
        "plain again",
        "plain again 2",
        *(f"default step {i}" for i in range(1, 5)),
        "keep",
        "manual",
        "all",
        "all-sync",
    ]
    assert all(results[arm] == {} for arm in arms), results  # no parameter's gradient differs
    assert results["attention"] == "math"
    assert results["keep offloaded GiB"] == 0 and results["all offloaded GiB"] > 0
    assert "all " in done.stdout and "largest 0 in 0 parameter(s)" in done.stdout


def test_a_repeat_count_below_one_is_refused_naming_the_option() -> None:
    done = run_on_cpu("benchmarks.grad_check", "--plain-repeats", "0")
    assert done.returncode != 0 and "--plain-repeats must be at least 1, got 0" in done.stderr
