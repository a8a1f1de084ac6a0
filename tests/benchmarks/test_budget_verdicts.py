"""Verdicts of the memory-budget planner (B1-B5) on hand-made results: each flips when its numbers cross."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import report
from benchmarks.workloads import CAPACITY_MODELS, MODES, WORKLOADS

GiB = 1 << 30


def row(mode: str, step: float | None, peak: float | None = None, status: str = "ok", **extra: Any) -> dict:
    spec = MODES[mode]
    out = {"mode": mode, "group": spec.group, "checkpoint": spec.checkpoint, "sweep": spec.sweep, "status": status}
    if status == "ok":
        out.update(step_s=step, fwd_s=step * 0.3, bwd_s=step * 0.6, opt_s=step * 0.1, peak_alloc_gib=peak)
        out["peak_reserved_gib"] = extra.pop("reserved", peak * 1.02 if peak is not None else None)
        if "offloaded_gib" in extra:
            out["engine"] = {"offloaded_bytes": extra.pop("offloaded_gib") * GiB}
    out.update(extra)
    return out


def budget(mode: str, step: float | None, peak: float | None, budget_gib: float, status: str = "ok", **extra: Any):
    return row(
        mode, step, peak, status=status, budget_gib=budget_gib, offloaded_gib=extra.pop("offloaded_gib", 3.0), **extra
    )


def result(name: str, rows: list[dict]) -> dict:
    return report.derive({"workload": WORKLOADS[name].as_dict(), "link": {}, "rows": rows})


def verdicts(results: list[dict]) -> dict[str, report.Verdict]:
    return {v.key: v for v in report.verdicts(results)}


# none 1.00 s / 30 GiB; AC 1.25 s / 18 GiB; a hand-tuned budget point 1.05 s / 27 GiB; ac+offload 1.27 s / 16 GiB.
BASE = [
    row("none", 1.00, 30.0),
    row("ac", 1.25, 18.0),
    row("budget-2G", 1.05, 27.0, offloaded_gib=2.0),
    row("ac+offload", 1.27, 16.0, offloaded_gib=0.5),
]
GOOD_BUDGETS = [
    budget("ours-budget-0.9x", 1.06, 26.5, 27.0),  # best fitting under 27 GiB: budget-2G at 1.05 s
    budget("ours-budget-0.7x", 1.20, 20.5, 21.0),  # under 21 GiB only AC (1.25 s) and ac+offload fit
    budget("ours-budget-0.5x", 1.30, 14.8, 15.0),  # nothing else fits under 15 GiB
    budget("ours-budget-floor", 1.29, 17.0, 17.6),  # ac+offload (1.27 s) fits under 17.6 GiB
]


def test_b1_needs_three_budgets_without_an_oom() -> None:
    v = verdicts([result("llama1b-s4k", BASE + GOOD_BUDGETS)])["B1"]
    assert v.status == "met" and "3 of 3 budgets ran" in v.detail
    # The range starts at the plan floor: a budget below it is shown, and its failure is not a miss.
    assert "ours-budget-0.5x under 15.0 GiB: ok (below the floor: not counted)" in v.detail
    below_oom = [*GOOD_BUDGETS[:2], budget("ours-budget-0.5x", None, None, 15.0, status="OOM"), GOOD_BUDGETS[3]]
    v = verdicts([result("llama1b-s4k", BASE + below_oom)])["B1"]
    assert v.status == "met" and "ours-budget-0.5x under 15.0 GiB: OOM (below the floor: not counted)" in v.detail
    assert "ours-budget-0.5x" not in verdicts([result("llama1b-s4k", BASE + below_oom)])["B2"].detail
    oom = [*GOOD_BUDGETS[:3], budget("ours-budget-floor", None, None, 17.6, status="OOM", oom=True)]
    v = verdicts([result("llama1b-s4k", BASE + oom)])["B1"]
    assert v.status == "missed" and "ours-budget-floor under 17.6 GiB: OOM" in v.detail  # 3 ran, but one OOMed
    two = [*GOOD_BUDGETS[:2], {**GOOD_BUDGETS[2], "status": "not measured: no peak of `none` to take a fraction of"}]
    v = verdicts([result("llama1b-s4k", BASE + two)])["B1"]
    assert v.status == "missed" and "2 of 2 budgets ran (< 3)" in v.detail
    # One workload short of budgets misses B1 for the benchmark.
    both = [result("llama1b-s4k", BASE + GOOD_BUDGETS), result("llama1b-s16k", BASE + two)]
    assert verdicts(both)["B1"].status == "missed"


def test_b1_b2_without_the_planner_say_so() -> None:
    absent = [{**b, "status": report.NO_BUDGET_API} for b in GOOD_BUDGETS]
    v = verdicts([result("llama1b-s4k", BASE + absent)])
    assert v["B1"].status == "n/a" and v["B1"].detail == "not measured: memory_budget not available"
    assert v["B2"].status == "n/a" and v["B2"].detail == "not measured: memory_budget not available"


def test_b2_against_the_fastest_row_that_fits_under_each_budget() -> None:
    v = verdicts([result("llama1b-s4k", BASE + GOOD_BUDGETS)])["B2"]
    assert v.status == "met"
    assert "ours-budget-0.9x (27.0 GiB): 1.060 s vs budget-2G 1.050 s at 27.0 GiB (1.01x)" in v.detail
    assert "ours-budget-0.7x (21.0 GiB): 1.200 s vs ac 1.250 s at 18.0 GiB (0.96x)" in v.detail
    assert "ours-budget-0.5x" not in v.detail  # below the floor row's budget: outside the range
    assert "ours-budget-floor (17.6 GiB): 1.290 s vs ac+offload 1.270 s" in v.detail
    # 1.11 s at 0.9x: more than 1.05x budget-2G's 1.05 s.
    slow = [budget("ours-budget-0.9x", 1.11, 26.5, 27.0), *GOOD_BUDGETS[1:]]
    v = verdicts([result("llama1b-s4k", BASE + slow)])["B2"]
    assert v.status == "missed" and "(1.06x)" in v.detail
    # Exactly 1.05x passes (inclusive).
    edge = [budget("ours-budget-0.9x", 1.05 * 1.05, 26.5, 27.0)]
    assert verdicts([result("llama1b-s4k", BASE + edge)])["B2"].status == "met"
    # A budget row that OOMed misses B2 too; `ours-default` is never a reference.
    oom = [budget("ours-budget-0.9x", None, None, 27.0, status="OOM")]
    assert verdicts([result("llama1b-s4k", BASE + oom)])["B2"].status == "missed"
    default = [row("ours-default", 0.5, 10.0, offloaded_gib=1.0), budget("ours-budget-0.5x", 1.30, 14.8, 15.0)]
    v = verdicts([result("llama1b-s4k", BASE + default)])["B2"]
    assert v.status == "met" and "no other row fits" in v.detail


def test_b2_a_reference_fits_by_its_peak_allocated_not_reserved() -> None:
    # AC's peak 21.0 <= budget 21.0 (inclusive): it is the reference, and ours at 1.32 s is too slow.
    rows = [row("none", 1.0, 30.0), row("ac", 1.25, 21.0, reserved=23.0), budget("ours-budget-0.7x", 1.32, 20.5, 21.0)]
    v = verdicts([result("llama1b-s4k", rows)])["B2"]
    assert v.status == "missed" and "vs ac 1.250 s" in v.detail
    rows[1]["peak_alloc_gib"] = 21.01
    assert verdicts([result("llama1b-s4k", rows)])["B2"].status == "met"  # AC no longer fits


def test_b2_a_reference_whose_reserved_passes_the_budget_counts_as_it_ran_under_the_cap() -> None:
    ac = row("ac", 1.25, 20.0, reserved=22.0)  # allocated fits the 21 GiB budget, reserved does not
    ours = budget("ours-budget-0.7x", 1.32, 20.5, 21.0)
    rows = [row("none", 1.0, 30.0), ac, ours]
    assert report.references_in_doubt(ours, rows) == ["ac"]
    # Not run again yet: judged by its uncapped time (1.32 / 1.25 = 1.06x).
    assert verdicts([result("llama1b-s4k", rows)])["B2"].status == "missed"
    # Under the cap it trained, slower (the allocator flushed its cache every step): ours is within 1.05x of that.
    ours["capped_references"] = {"ac": {"status": "ok", "step_s": 1.30, "alloc_flushes_per_step": 1.0}}
    v = verdicts([result("llama1b-s4k", rows)])["B2"]
    assert v.status == "met"
    assert "vs ac 1.300 s under the same cap (1.250 s without) (1.02x)" in v.detail
    # Under the cap it ran out of memory: no other row fits, and the detail says why.
    ours["capped_references"] = {"ac": {"status": "OOM", "step_s": None}}
    v = verdicts([result("llama1b-s4k", rows)])["B2"]
    assert v.status == "met"
    assert "no other row fits under the budget; under the same cap ac OOM" in v.detail
    # A second run that failed otherwise says nothing of the fit: the reference counts as first measured.
    ours["capped_references"] = {"ac": {"status": "error: RuntimeError: boom", "step_s": None}}
    v = verdicts([result("llama1b-s4k", rows)])["B2"]
    assert v.status == "missed"
    assert "vs ac 1.250 s at 20.0 GiB (its run under the same cap: error: RuntimeError: boom) (1.06x)" in v.detail
    ours["capped_references"] = {"ac": {"status": "OOM", "step_s": None}}
    # A faster reference that fits by its reserved bytes too is never run again, and still decides.
    rows.append(row("ac+offload", 1.00, 19.0, reserved=20.0, offloaded_gib=1.0))
    assert report.references_in_doubt(ours, rows) == ["ac"]
    v = verdicts([result("llama1b-s4k", rows)])["B2"]
    assert v.status == "missed" and "vs ac+offload 1.000 s at 19.0 GiB (1.32x); under the same cap ac OOM" in v.detail
    # The report lists the second runs.
    text = report.markdown([result("llama1b-s4k", rows)], "t")
    assert "| ours-budget-0.7x | 21.00 | ac | OOM | - | - | - | - | - |" in text
    ours["capped_references"]["ac"]["allocator"] = "fixed"
    text = report.markdown([result("llama1b-s4k", rows)], "t")
    assert "| ours-budget-0.7x | 21.00 | ac | OOM | - | - | - | - | fixed |" in text


def test_references_in_doubt_leave_out_planner_rows_failed_rows_and_rows_that_do_not_fit() -> None:
    ours = budget("ours-budget-0.9x", 1.0, 26.0, 27.0)
    rows = [
        row("none", 1.0, 30.0, reserved=31.0),  # does not fit by allocated bytes
        row("ac", None, status="OOM"),
        row("ours-default", 0.9, 20.0, reserved=28.0, offloaded_gib=1.0),  # a planner row: never a reference
        row("sac", 1.1, 26.9, reserved=27.1),
        ours,
    ]
    assert report.references_in_doubt(ours, rows) == ["sac"]
    assert report.references_in_doubt({"mode": "ours-budget-0.9x"}, rows) == []  # no budget: nothing to cap


def test_b4_default_against_none() -> None:
    rows = [row("none", 0.100, 3.0), row("ours-default", 0.105, 3.0, offloaded_gib=0.0)]
    v = verdicts([result("small-h512", rows)])["B4"]
    assert v.status == "met" and v.detail == "small-h512: 1.050x, peak 3.0 vs 3.0 GiB"
    rows[1]["step_s"] = 0.1051
    assert verdicts([result("small-h512", rows)])["B4"].status == "missed"
    # Any workload over 1.05x misses B4; a default that fails where `none` fits misses it too.
    big = [row("none", 1.0, 30.0), row("ours-default", 1.0, 25.0, offloaded_gib=4.0)]
    assert verdicts([result("llama1b-s4k", big)])["B4"].status == "met"
    big[1] = row("ours-default", None, status="OOM")
    v = verdicts([result("llama1b-s4k", big)])["B4"]
    assert v.status == "missed" and "OOM where `none` fits" in v.detail
    # Where `none` does not fit, the default is not judged.
    no_none = [row("none", None, status="OOM"), row("ours-default", 2.0, 60.0, offloaded_gib=20.0)]
    assert verdicts([result("llama8b-lora-s8k", no_none)])["B4"].status == "n/a"


def test_b5_reserved_over_allocated_in_offloading_rows_only() -> None:
    rows = [
        row("none", 1.0, 30.0, reserved=40.0),  # no offloading: not judged
        row("off", 1.0, 30.0, reserved=40.0, offloaded_gib=0.0),  # offloads nothing: not judged
        row("ac", 1.2, 18.0, reserved=30.0),  # baselines are not judged
        row("streamed", 2.0, 20.0, reserved=22.0, offloaded_gib=10.0),  # 1.100: inclusive
        budget("ours-budget-0.7x", 1.2, 20.0, 21.0, reserved=21.0),
    ]
    v = verdicts([result("llama1b-s4k", rows)])["B5"]
    assert v.status == "met"
    assert "llama1b-s4k/streamed: 22.00 / 20.00 GiB = 1.100" in v.detail
    assert "/none" not in v.detail and "/off" not in v.detail and "/ac:" not in v.detail
    rows[3]["peak_reserved_gib"] = 22.1
    v = verdicts([result("llama1b-s4k", rows)])["B5"]
    assert v.status == "missed" and "= 1.105" in v.detail


# ---------------------------------------------------------------------------------------------- B3 (capacity)


def search(mode: str, longest: int, first_fail: int | None, status: str = "ok", capped: bool = False, **extra: Any):
    step = 2048
    probes = [{"seq": longest or step, "fits": bool(longest)}]
    upper = None if capped or first_fail is None else first_fail - step
    return {
        "mode": mode,
        "status": status,
        "step": step,
        "max_seq": 131072,
        "longest": longest,
        "first_fail": first_fail,
        "capped": capped,
        "upper": upper,
        "probes": probes,
        **extra,
    }


def capacity(model: str, cap: float, searches: list[dict]) -> dict:
    return {"model": CAPACITY_MODELS[model].as_dict(), "cap_gib": cap, "searches": searches}


def b3(results: list[dict]) -> report.Verdict:
    return {v.key: v for v in report.capacity_verdicts(results)}["B3"]


def test_b3_ours_at_least_the_best_of_ac_and_the_anchors() -> None:
    runs = [
        capacity(
            "llama1b",
            24,
            [
                search("none", 4096, 6144),
                search("ac", 10240, 12288),
                search("trl", 12288, 14336),
                search("torchtune", 0, 2048),
                search("ours-budget", 12288, 14336),
            ],
        )
    ]
    v = b3(runs)
    assert v.status == "met" and "ours 12288 vs ac 10240, torchtune 0, trl 12288" in v.detail  # a tie is enough
    runs[0]["searches"][-1] = search("ours-budget", 10240, 12288)
    assert b3(runs).status == "missed"  # TRL trains 12288, ours only 10240
    # `none` is no reference: only AC and the anchors.
    runs[0]["searches"] = [search("none", 40960, 43008), search("ac", 10240, 12288), search("ours-budget", 12288, None)]
    assert b3(runs).status == "met"


def test_b3_cut_short_searches_decide_only_when_their_bounds_do() -> None:
    # Ours fitted 20480 (search stopped before a failure): at least 20480. AC is 10240..14336.
    runs = [
        capacity(
            "llama1b",
            40,
            [
                search("ac", 10240, 16384, "incomplete: deadline"),
                search("ours-budget", 20480, None, "incomplete: deadline"),
            ],
        )
    ]
    assert b3(runs).status == "met"
    # Ours 12288..16384 against AC 10240..14336: either could be longer.
    runs[0]["searches"][1] = search("ours-budget", 12288, 18432, "incomplete: deadline")
    v = b3(runs)
    assert v.status == "undetermined" and "bounds overlap" in v.detail and "ours 12288..16384" in v.detail
    # Ours at most 8192 (failed at 10240) below AC's proven 10240: missed, even incomplete.
    runs[0]["searches"][1] = search("ours-budget", 6144, 10240, "incomplete: deadline")
    assert b3(runs).status == "missed"


def test_b3_small_vocab_needs_one_and_a_half_times_ac() -> None:
    def run(ours: dict, ac: dict) -> list[dict]:
        return [capacity("smallvocab-h1024", 24, [ac, ours])]

    ac = search("ac", 40960, 43008)
    assert b3(run(search("ours-budget", 61440, 63488), ac)).status == "met"  # exactly 1.5x
    v = b3(run(search("ours-budget", 59392, 61440), ac))
    assert v.status == "missed" and "vs 1.5x AC's 40960" in v.detail  # longer than AC, but < 1.5x
    # AC reached the search's maximum: the factor cannot be shown, whatever ours did.
    capped = search("ac", 131072, None, capped=True)
    v = b3(run(search("ours-budget", 131072, None, capped=True), capped))
    assert v.status == "undetermined" and "AC reached the search's maximum" in v.detail
    # The factor applies to the small-vocab model only.
    other = [capacity("llama1b", 24, [ac, search("ours-budget", 45056, 47104)])]
    assert b3(other).status == "met"


def test_b3_without_the_planner_or_references() -> None:
    runs = [
        capacity("llama1b", 24, [search("ac", 10240, 12288), {"mode": "ours-budget", "status": report.NO_BUDGET_API}])
    ]
    v = b3(runs)
    assert v.status == "n/a" and v.detail == "not measured: memory_budget not available"
    only_ours = [capacity("llama1b", 24, [search("ours-budget", 10240, 12288), {"mode": "ac", "status": "skipped"}])]
    assert b3(only_ours).status == "n/a"


def test_capacity_b5_and_report() -> None:
    ours = search("ours-budget", 12288, 14336, peak_alloc_gib=20.0, peak_reserved_gib=23.0, tokens_per_s=9000.0)
    runs = [capacity("llama1b", 24, [search("ac", 10240, 12288), ours])]
    v = {x.key: x for x in report.capacity_verdicts(runs)}["B5"]
    assert v.status == "missed" and "1.150" in v.detail
    text = report.capacity_markdown(runs, "unit")
    assert "| B3 | **met** |" in text and "| B5 | **missed** |" in text
    assert "| ours-budget | 12288, 9000 tok/s, 20.0/23.0 GiB |" in text
    assert "## llama1b" in text and "| mode | 24 GiB |" in text
    table = report.capacity_table(runs)
    assert "ours-budget" in table and "B3" in table
    # A search that ran with the allocator's fixed segments says so (our engine switches expandable ones on).
    fixed = search("ac", 10240, 12288, peak_alloc_gib=20.0, peak_reserved_gib=21.0, allocator="fixed")
    expandable = {**ours, "allocator": "expandable"}
    text = report.capacity_markdown([capacity("llama1b", 24, [fixed, expandable])], "unit")
    assert "| ac | 10240, 20.0/21.0 GiB, fixed segments |" in text
    assert "| ours-budget | 12288, 9000 tok/s, 20.0/23.0 GiB |" in text


@pytest.mark.parametrize("parts", [[(True, "a"), (None, "b")], [(None, "b")]])
def test_combine_reports_undetermined_only_without_a_miss(parts: list) -> None:
    assert report._combine("B3", parts).status == "undetermined"
    assert report._combine("B3", [*parts, (False, "c")]).status == "missed"
