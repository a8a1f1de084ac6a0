"""The rule ablation's table stays in step with the planner: every rule it switches off names attributes that exist
(and are put back), and every function it weighs has code lines."""

from __future__ import annotations

import pytest

from benchmarks.planner_ablation import RULES, attribute, code_lines, ratio_summary, switched_off, time_ratio
from lightning_offload.planner.trace import recorded_answers


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_switches_off_and_back_and_weighs_its_functions(rule: str) -> None:
    patches, makers = RULES[rule]
    before = [attribute(module_name, path)[2] for module_name, path, _ in patches]
    with switched_off(patches):
        for (module_name, path, replacement), value in zip(patches, before, strict=True):
            assert attribute(module_name, path)[2] is replacement is not value
    assert [attribute(module_name, path)[2] for module_name, path, _ in patches] == before
    assert all(code_lines(maker) > 0 for maker in makers)


def _plan(offload: int) -> dict[str, object]:
    return {"offload_bytes": offload, "checkpoint_blocks": 2, "light_blocks": 0, "split": False}


def _trace(steps: list[tuple[str, int, float]]) -> dict[str, object]:
    events: list[list[object]] = [["input", []]]
    for phase, offload, ms in steps:
        events.append(["begin", {"allocated": 0}, {"phase": phase, "plan": _plan(offload)}])
        events.append(["observe", {"step_ms": ms, "out_of_memory": False}])
    return {"events": events}


def test_time_ratio_compares_the_plans_each_ends_the_input_with_by_their_settled_step_times() -> None:
    # Plan 1 timed 30 (settling), 10, 12; plan 2 timed 50 (settling), 20, 22: the run kept plan 1.
    trace = _trace(
        [("trying", 1, 30.0), ("trying", 1, 10.0), ("trying", 1, 12.0)] + [("trying", 2, m) for m in (50, 20, 22)]
    )
    trace["events"] += [["begin", {"allocated": 0}, {"phase": "planned", "plan": _plan(1)}]]
    recorded = recorded_answers(trace)
    instead = [{"phase": "planned", "plan": _plan(2)}] * len(recorded)  # without the rule: plan 2 throughout
    assert time_ratio(trace, instead) == pytest.approx(21.0 / 11.0)
    assert time_ratio(trace, recorded) is None  # nothing changed
    untimed = [{"phase": "planned", "plan": _plan(3)}] * len(recorded)
    assert time_ratio(trace, untimed) is None  # plan 3 never ran: no time to compare
    assert ratio_summary([1.0, 2.0, 1.5]) == "1.50x, 2.00x (3)"
    assert ratio_summary([]) == "-"
