"""The dynamic-lengths benchmark's loop on a CPU (``DEVICE=cpu``: the tiny model, no planner, no memory counters)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import run_on_cpu


def test_every_arm_runs_its_lengths_and_reports_each_steps_figures(tmp_path: Path) -> None:
    out = tmp_path / "dyn.json"
    arms = "none,input_changed,fixed"
    done = run_on_cpu("benchmarks.dynamic_lengths", str(out), arms, "6", "64", "128", "32")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    drawn = results["lengths"]
    assert len(drawn) == 6 and all(64 <= n <= 128 and n % 32 == 0 for n in drawn)
    for arm in ("none", "input_changed", "fixed"):
        r = results[arm]
        assert r["lengths"] == (drawn if arm != "fixed" else [sorted(drawn)[2]] * 6)
        assert len(r["step_s"]) == len(r["info"]) == len(r["step_peaks_gib"]) == len(r["measured"]) == 6
        assert all(0 < q < t for q, t in zip(r["forward_host_s"], r["step_s"], strict=True))
        assert r["out_of_memory_steps"] == 0 and not any(r["measured"])  # no planner on the CPU
        assert all(t > 0 for t in r["step_s"])
    assert "input_changed" in done.stdout
