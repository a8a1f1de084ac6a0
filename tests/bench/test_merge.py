"""Merging benchmark runs: later runs win per workload, sources are named, verdicts are recomputed."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_offload.bench.merge import main, merge
from lightning_offload.bench.workloads import WORKLOADS


def _run(name: str, workloads: dict[str, float]) -> dict:
    results = []
    for workload, step in workloads.items():
        rows = [
            {"mode": "none", "group": "baseline", "status": "ok", "step_s": 1.0, "peak_alloc_gib": 10.0},
            {"mode": "off", "group": "ours", "status": "ok", "step_s": step, "peak_alloc_gib": 10.0, "engine": {}},
        ]
        spec = {**WORKLOADS["small-h512"].as_dict(), "name": workload}
        results.append({"workload": spec, "rows": rows})
    results.append({"workload": {"name": "skipped"}, "rows": [], "error": "skipped: deadline"})
    return {"name": name, "created": "now", "wall_s": 1.0, "args": {}, "results": results}


def test_later_run_wins_and_sources_are_named(tmp_path: Path) -> None:
    a = _run("run-a", {"w1": 1.5, "w2": 1.01})
    b = _run("run-b", {"w1": 1.01})
    merged = merge([a, b], "dev")
    by_name = {r["workload"]["name"]: r for r in merged["results"]}
    assert set(by_name) == {"w1", "w2"}  # a workload with no rows in any run is left out
    assert by_name["w1"]["source_run"] == "run-b" and by_name["w2"]["source_run"] == "run-a"
    off = {row["mode"]: row for row in by_name["w1"]["rows"]}["off"]
    assert off["ratio"] == 1.01  # derived again from the winning run's rows
    p4 = next(v for v in merged["verdicts"] if v["key"] == "P4")
    assert p4["status"] == "met"  # both workloads' `off` within 1.02x after the merge (run-a's w1 was 1.5x)


def test_cli_writes_report(tmp_path: Path) -> None:
    for name, workloads in (("run-a", {"w1": 1.5}), ("run-b", {"w2": 1.0})):
        (tmp_path / f"{name}.json").write_text(json.dumps(_run(name, workloads)))
    assert (
        main([str(tmp_path / "run-a.json"), str(tmp_path / "run-b.json"), "--out", str(tmp_path), "--device-name", "m"])
        == 0
    )
    text = (tmp_path / "m.md").read_text()
    assert "`w1` from `run-a`" in text and "`w2` from `run-b`" in text
    assert (tmp_path / "m.png").stat().st_size > 0
    assert json.loads((tmp_path / "m.json").read_text())["runs"].keys() == {"run-a", "run-b"}
