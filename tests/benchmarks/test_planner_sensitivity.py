"""The constants' sensitivity table: a constant that paces the trials changes recorded answers; one that bounds how
many inputs are remembered changes none of the single-input traces."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import planner_sensitivity as sensitivity

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def _traces() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in TRACES.glob("cpu-*.json")}


def test_constants_are_found_and_restored_after_patching() -> None:
    modules = sensitivity.planner_modules()
    found = sensitivity.constants(modules)
    assert {"TRIAL_STEPS", "FIT_ROOM_SHARE", "_TRIAL_ROUNDS"} <= set(found)
    assert not set(found) & sensitivity.SKIPPED
    module, value = found["TRIAL_STEPS"]
    with sensitivity.patched(modules, "TRIAL_STEPS", 9):
        assert module.TRIAL_STEPS == 9
    assert module.TRIAL_STEPS == value


def test_a_constant_that_paces_trials_changes_answers_and_one_never_reached_does_not() -> None:
    traces = _traces()
    modules = sensitivity.planner_modules()
    assert sensitivity.changed_traces(traces) == []
    with sensitivity.patched(modules, "TRIAL_STEPS", 8):
        assert "cpu-trials-slow-hooks" in sensitivity.changed_traces(traces)
    with sensitivity.patched(modules, "REMEMBERED_INPUTS", 64):
        assert sensitivity.changed_traces(traces) == []


def test_the_table_names_rows_and_scales_integers_to_at_least_one(tmp_path: Path) -> None:
    assert sensitivity.short_name("h100-zoo-after-04-vit") == "after-04"
    assert sensitivity.short_name("h100-zoo-27-llama") == "27" and sensitivity.short_name("cpu-x") == "cpu-x"
    assert sensitivity.scaled(3, 0.5) == 2 and sensitivity.scaled(1, 0.5) == 1 and sensitivity.scaled(0.1, 2.0) == 0.2


def test_recorded_traces_are_read_from_zoo_trace_files_and_workload_rows(tmp_path: Path) -> None:
    trace = _traces()["cpu-trials-slow-hooks"]
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "2026-01-01-traces.json").write_text(json.dumps({"07-vit-x": trace, "08-note": "not a trace"}))
    rows = [{"mode": "none"}, {"mode": "ours-budget-0.9x", "trace": trace}]
    workloads = {"results": [{"workload": {"name": "small-h512"}, "rows": rows}, "skipped"]}
    (tmp_path / "workloads.json").write_text(json.dumps(workloads))
    (tmp_path / "broken.json").write_text("{")
    found = sensitivity.recorded_traces(tmp_path)
    assert sorted(found) == ["workloads/small-h512/ours-budget-0.9x", "zoo/2026-01-01-traces/07"]
    assert sensitivity.changed_traces(found) == []
