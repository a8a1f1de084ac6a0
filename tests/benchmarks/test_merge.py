"""Merging benchmark runs: later runs win per workload (and per capacity model and cap), sources are named,
verdicts are recomputed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.merge import main, merge
from benchmarks.workloads import CAPACITY_MODELS, WORKLOADS


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


def _capacity_run(name: str, ours: dict[float, int]) -> dict:
    def entry(mode: str, longest: int) -> dict:
        return {
            "mode": mode,
            "status": "ok",
            "step": 2048,
            "max_seq": 131072,
            "longest": longest,
            "first_fail": longest + 2048,
            "capped": False,
            "upper": longest,
            "probes": [{"seq": longest, "fits": True}],
        }

    results = [
        {
            "model": CAPACITY_MODELS["llama1b"].as_dict(),
            "cap_gib": cap,
            "searches": [entry("ac", 10240), entry("ours-budget", longest)],
        }
        for cap, longest in ours.items()
    ]
    results.append({"model": CAPACITY_MODELS["llama1b"].as_dict(), "cap_gib": 80, "searches": [], "error": "skipped"})
    return {"name": name, "kind": "capacity", "created": "now", "wall_s": 1.0, "args": {}, "capacity": results}


def test_capacity_runs_merge_per_model_and_cap(tmp_path: Path) -> None:
    a = _capacity_run("cap-a", {24: 8192, 40: 20480})
    b = _capacity_run("cap-b", {24: 12288})
    merged = merge([_run("run-a", {"w1": 1.0}), a, b], "dev")
    by_cap = {r["cap_gib"]: r for r in merged["capacity"]}
    assert set(by_cap) == {24, 40}  # the skipped 80 GiB worker measured nothing
    assert by_cap[24]["source_run"] == "cap-b" and by_cap[40]["source_run"] == "cap-a"
    b3 = next(v for v in merged["capacity_verdicts"] if v["key"] == "B3")
    assert b3["status"] == "met"  # cap-b's 12288 >= AC's 10240 at 24 GiB (cap-a's 8192 would miss)
    for name, run in (("a", a), ("b", b), ("w", _run("run-w", {"w1": 1.0}))):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    paths = [str(tmp_path / f"{n}.json") for n in ("w", "a", "b")]
    assert main([*paths, "--out", str(tmp_path / "out"), "--device-name", "m"]) == 0
    text = (tmp_path / "out" / "m.md").read_text()
    assert text.startswith("# Activation offloading benchmark: m")
    assert "\n## Capacity under hard memory caps: m" in text and "\n### llama1b" in text
    assert "`llama1b` @ 24 GiB from `cap-b`" in text


def test_merging_nothing_measured_writes_nothing(tmp_path: Path) -> None:
    empty = {"name": "e", "results": [{"workload": {"name": "x"}, "rows": [], "error": "skipped: deadline"}]}
    (tmp_path / "e.json").write_text(json.dumps(empty))
    assert main([str(tmp_path / "e.json"), "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


def test_a_capacity_run_of_one_mode_keeps_the_other_modes_of_an_earlier_run() -> None:
    """A later run that searched only AC again replaces AC's search at that model and cap and keeps ours."""
    a = _capacity_run("cap-a", {80: 47104})
    b = _capacity_run("cap-b", {80: 1})
    b["capacity"][0]["searches"] = [s for s in b["capacity"][0]["searches"] if s["mode"] == "ac"]
    b["capacity"][0]["searches"][0].update(longest=45056, upper=45056, probes=[{"seq": 45056, "fits": True}])
    merged = merge([a, b], "dev")
    (result,) = [r for r in merged["capacity"] if r["cap_gib"] == 80]
    longest = {s["mode"]: s["longest"] for s in result["searches"]}
    assert longest == {"ac": 45056, "ours-budget": 47104}
    assert result["source_run"] == "ac from cap-b, ours-budget from cap-a"


def _with_ac_search(run: dict, ac_complete: bool, **ac: Any) -> dict:
    """``run`` with ours' search finished and AC's ``complete`` as given, its fields updated with ``ac``."""
    for search in run["capacity"][0]["searches"]:
        search["complete"] = ac_complete or search["mode"] != "ac"
        if search["mode"] == "ac":
            search.update(ac)
    return run


def _kept_at(merged: dict, cap: int) -> tuple[dict, dict[str, int]]:
    """The merged capacity result at ``cap`` and the longest sequence of each mode's search kept."""
    (result,) = [r for r in merged["capacity"] if r["cap_gib"] == cap]
    return result, {s["mode"]: s["longest"] for s in result["searches"]}


_CUT_SHORT = {"upper": None, "first_fail": None, "status": "incomplete: deadline"}


def test_a_search_cut_short_does_not_replace_one_that_finished() -> None:
    """A later run whose AC search its deadline cut short keeps the earlier, finished AC search; its own finished
    search of ours replaces the earlier one."""
    a = _with_ac_search(_capacity_run("cap-a", {8: 92160}), True, longest=49152, upper=49152)
    b = _with_ac_search(_capacity_run("cap-b", {8: 98304}), False, longest=45056, **_CUT_SHORT)
    result, longest = _kept_at(merge([a, b], "dev"), 8)
    assert longest == {"ac": 49152, "ours-budget": 98304}
    assert result["source_run"] == "ac from cap-a, ours-budget from cap-b"
    assert set(result["run_walls"]) == {"cap-a", "cap-b"}  # both runs' searches are kept, so both workers count


def test_of_two_searches_cut_short_the_one_that_got_further_is_kept() -> None:
    """Two AC searches both cut short by their deadlines: the one that got further (a longer sequence trained) is
    kept, whichever run came last; ours, finished in the later run, comes from it."""
    a = _capacity_run("cap-a", {80: 43008})
    a = _with_ac_search(a, False, longest=36864, upper=38912, status="incomplete: deadline")
    b = _with_ac_search(_capacity_run("cap-b", {80: 43008}), False, longest=24576, **_CUT_SHORT)
    result, longest = _kept_at(merge([a, b], "dev"), 80)
    assert longest == {"ac": 36864, "ours-budget": 43008}
    assert result["source_run"] == "ac from cap-a, ours-budget from cap-b"


def test_a_search_cut_short_that_trained_longer_replaces_a_finished_one_it_contradicts() -> None:
    """An earlier, finished AC search says 10240 is the longest (12288 ran out of memory); a later one cut short by its
    deadline trained 14336: the later one is kept, so the report neither claims 10240 exact nor B3 met by ours' 12288
    against it."""
    a = _with_ac_search(_capacity_run("cap-a", {24: 12288}), True)
    probes = [{"seq": 14336, "fits": True}]
    b = _with_ac_search(_capacity_run("cap-b", {24: 12288}), False, longest=14336, probes=probes, **_CUT_SHORT)
    merged = merge([a, b], "dev")
    _, longest = _kept_at(merged, 24)
    assert longest == {"ac": 14336, "ours-budget": 12288}
    b3 = next(v for v in merged["capacity_verdicts"] if v["key"] == "B3")
    assert b3["status"] == "missed" and "ac >= 14336" in b3["detail"]


def _interleaved(workload: str, none_ms: float, default_ms: float) -> dict:
    arms = {"none": {"median_ms": none_ms}, "default": {"median_ms": default_ms}, "ac": {"median_ms": 3 * none_ms}}
    return {"workload": {"name": workload}, "rounds": 200, "arms": arms}


def test_an_alternating_measurement_judges_the_default_where_it_was_made(tmp_path: Path) -> None:
    run = _run("run-a", {"w1": 1.0, "w2": 1.0})
    for result in run["results"]:
        for row in result["rows"]:
            row["mode"] = "ours-default" if row["mode"] == "off" else row["mode"]
    rows = run["results"][0]["rows"]
    rows[1]["step_s"] = 1.3  # w1's sequential rows: the default 1.3x
    (tmp_path / "run-a.json").write_text(json.dumps(run))
    (tmp_path / "alt-w1.json").write_text(json.dumps(_interleaved("w1", 10.0, 10.1)))
    (tmp_path / "alt-other.json").write_text(json.dumps(_interleaved("elsewhere", 10.0, 20.0)))
    argv = [str(tmp_path / n) for n in ("run-a.json", "alt-w1.json", "alt-other.json")]
    assert main([*argv, "--out", str(tmp_path), "--device-name", "m"]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    b4 = next(v for v in merged["verdicts"] if v["key"] == "B4")
    assert b4["status"] == "met"
    assert "w1: 1.010x in alternating steps (200 each, `alt-w1`; the sequential rows 1.300x)" in b4["detail"]
    assert "w2: 1.000x" in b4["detail"] and "elsewhere" not in b4["detail"]  # no rows there: nothing to attach to
    assert merged["runs"].keys() == {"run-a"}
    # Without the alternating file the sequential ratio judges, and misses.
    merged = merge([json.loads((tmp_path / "run-a.json").read_text())], "m")
    assert next(v for v in merged["verdicts"] if v["key"] == "B4")["status"] == "missed"
