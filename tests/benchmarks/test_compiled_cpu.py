"""The torch.compile benchmark's loop on a CPU (``DEVICE=cpu``: aot_eager, no planner, no memory counters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_compile_mode_offloads_with_the_gradients_it_gives_without(tmp_path: Path) -> None:
    out = tmp_path / "compiled.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compiled", str(out), "1", "512"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["backend"] == "aot_eager"
    assert sorted(results["arms"]) == ["blocks", "eager", "whole"]
    for how, arms in results["arms"].items():
        assert arms["reference_repeatable"] is True and arms["grads_equal"] is True, how
        assert arms["offload"]["offloaded_gib"] > 0 and arms["none"]["offloaded_gib"] == 0, how
        assert len(arms["offload"]["step_peaks_gib"]) == len(arms["offload"]["plans"]) == 7
        assert "budget" not in arms  # the planner needs CUDA's allocator counters
