"""The rule ablation's table stays in step with the planner: every rule it switches off names attributes that exist
(and are put back), and every function it weighs has code lines."""

from __future__ import annotations

import pytest

from benchmarks.planner_ablation import RULES, attribute, code_lines, switched_off


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_switches_off_and_back_and_weighs_its_functions(rule: str) -> None:
    patches, makers = RULES[rule]
    before = [attribute(module_name, path)[2] for module_name, path, _ in patches]
    with switched_off(patches):
        for (module_name, path, replacement), value in zip(patches, before, strict=True):
            assert attribute(module_name, path)[2] is replacement is not value
    assert [attribute(module_name, path)[2] for module_name, path, _ in patches] == before
    assert all(code_lines(maker) > 0 for maker in makers)
