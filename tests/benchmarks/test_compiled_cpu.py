"""The torch.compile benchmark's loop on a CPU (``DEVICE=cpu``: aot_eager, no planner, no memory counters)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.processes import run_on_cpu


def test_each_compile_mode_offloads_with_the_gradients_it_gives_without(tmp_path: Path) -> None:
    out = tmp_path / "compiled.json"
    # One layer of width 256 at 256 tokens: the loop's bookkeeping, not the model's size, is under test.
    done = run_on_cpu("benchmarks.compiled", str(out), "1", "256", "256", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["backend"] == "aot_eager"
    assert sorted(results["arms"]) == ["blocks", "eager", "whole"]
    for how, arms in results["arms"].items():
        assert arms["reference_repeatable"] is True and arms["grads_equal"] is True, how
        assert arms["offload"]["offloaded_gib"] > 0 and arms["none"]["offloaded_gib"] == 0, how
        assert len(arms["offload"]["step_peaks_gib"]) == len(arms["offload"]["plans"]) == 7
        assert "budget" not in arms  # the planner needs CUDA's allocator counters
