"""``python -m benchmarks.planner_ablation``: which of the planner's rules act on recorded runs, and what they weigh.

Each rule of the pure planner (``lightning_offload/planner/``) is switched off in turn (the function that applies it
answers as if it never acted), and every recorded trace is told again to a fresh planner: a trace counts where any
directive then differs from the one it recorded. Beside each rule, the code lines of the functions that make it
(blanks, comments and docstrings left out). A rule that changes no trace is one no recorded run needed; one that
changes many is the behaviour those runs had.

A replay tells a trace's observations again: it shows what the planner would have decided, not what the steps would
then have done; a rule that acts only after a decision it changed counts once, at the first. With ``--all-recorded``,
the traces recorded before a later change (the planner now answers them otherwise) cannot count; the last column
names those of them that replay as recorded once the rule is off: the runs that rule was made for.

What a rule buys in time, where the recorded run can tell: for the input whose plan a rule's absence first changes,
the plan the recorded run ended that input's steps with, and the one the planner would have ended them with instead,
were often both timed in that run (trials time several plans of one input). The ratio of their step times (the median
of each plan's timed steps after its first, which settles) is the step time the rule saved (above 1) or cost (below 1)
there; the column gives its median and 90th percentile over the traces where both were timed, and their count. The
replay after a changed decision still hears the recorded steps, so this prices the decision, not the run it would
have led to.

    python -m benchmarks.planner_ablation                  # the traces under tests/data/traces/
    python -m benchmarks.planner_ablation --all-recorded   # and every trace under benchmarks/results/
    python -m benchmarks.planner_ablation --out table.md
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import statistics
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.planner_sensitivity import (
    TRACES,
    changed_traces,
    recorded_traces,
    replayed,
    short_name,
    write_table,
)

P = "lightning_offload.planner."


def _plan_aim_without_gap(budget: int, margin: int, reserved_gap: int) -> int:
    from lightning_offload.planner.aims import plan_aim

    return plan_aim(budget, margin, 0)


def _no_trials(enabled: bool) -> Any:
    from lightning_offload.planner.trials import PlanTrials

    return PlanTrials(False)


# rule -> the attributes that apply it, each replaced by what answers "never acted", and the functions that make it
# (for their code lines).
RULES: dict[str, tuple[list[tuple[str, str, Any]], list[str]]] = {
    "trials (plans timed against each other)": (
        [(P + "core", "PlanTrials", _no_trials)],
        [P + "trials.PlanTrials", P + "trials.trial_plans", P + "trials.family_trials", P + "choice.choose_plan"],
    ),
    "a step below a fastest plan that flushes": (
        [(P + "trials", "PlanTrials._below_flushing", lambda self, compared, candidates: None)],
        [P + "trials.PlanTrials._below_flushing"],
    ),
    "a kept plan that flushes gives way": (
        [(P + "trials", "PlanTrials.flushes_where_kept", lambda self: False)],
        [P + "trials.PlanTrials.flushes_where_kept", P + "trials.PlanTrials.instead_of_flushing"],
    ),
    "the kind of plan trials kept, taught to other inputs": (
        [(P + "choice", "_taught_plan", lambda *args: None)],
        [P + "choice._taught_plan"],
    ),
    "lent plans (a smaller input runs a kept plan unmeasured)": (
        [(P + "book", "InputBook.lend", lambda self, key: None)],
        [P + "book.InputBook.lend", P + "book.InputBook.misled", P + "inputs.no_larger", P + "inputs.size"],
    ),
    "slow forwards teach a cost per GiB offloaded": (
        [(P + "core", "learn_from_slow_forward", lambda rec, machine, *args: machine)],
        [P + "learning.learn_from_slow_forward"],
    ),
    "copy waits teach the link's share": (
        [(P + "core", "learn_from_copy_waits", lambda rec, machine, *args: machine)],
        [P + "learning.learn_from_copy_waits"],
    ),
    "faster compute moves the profile": (
        [(P + "core", "with_faster_compute", lambda profile, plan, obs: profile)],
        [P + "corrections.with_faster_compute"],
    ),
    "a planned step heavier than predicted corrects the model": (
        [(P + "core", "heavier_than_planned", lambda error, obs, budget: 0)],
        [P + "corrections.heavier_than_planned"],
    ),
    "a pressed step's reserved bytes widen the margin": (
        [(P + "corrections", "pressed_error", lambda plan, profile, obs, budget: 0)],
        [P + "corrections.pressed_error"],
    ),
    "a measuring step's pressed gap widens the aim": (
        [(P + "core", "plan_aim", _plan_aim_without_gap)],
        [P + "measure.pressed_gap", P + "aims.plan_aim"],
    ),
    "a step beginning above the measured base replans": (
        [(P + "core", "grown_base", lambda profile, allocated, budget: 0)],
        [P + "corrections.grown_base"],
    ),
    "a kept plan's first step empties a swollen cache": (
        [(P + "core", "cache_worth_emptying", lambda reserved, peak, room: False)],
        [P + "aims.cache_worth_emptying", P + "core.Planner.cache_worth_emptying"],
    ),
    "plans with elementwise recompute (light blocks)": (
        [(P + "profile", "StepProfile.lightenable", property(lambda self: False))],
        [],
    ),
    "plans by parts (attention, MLP, norms)": (
        [(P + "profile", "StepProfile.splittable", property(lambda self: False))],
        [],
    ),
}


def plan_key(directive: dict[str, Any]) -> tuple[Any, ...] | None:
    """What tells a directive's plan apart from another of the same input (``None``: a measuring step's)."""
    plan = directive.get("plan")
    if plan is None:
        return None
    return plan["offload_bytes"], plan["checkpoint_blocks"], plan.get("light_blocks"), plan.get("split")


def timed_plans(trace: dict[str, Any]) -> tuple[list[int], dict[tuple[int, Any], float]]:
    """Each ``begin`` event's input (its count of ``input`` events before it), and the step milliseconds of each
    ``(input, plan)`` the trace timed: the median of its timed steps after the first, which settles (all of them where
    it ran one), leaving out steps that ran out of memory."""
    inputs: list[int] = []
    steps: dict[tuple[int, Any], list[float]] = {}
    current, key = 0, None
    for name, *args in trace["events"]:
        if name == "input":
            current += 1
        elif name == "begin":
            inputs.append(current)
            key = plan_key(args[1])
        elif name == "observe" and key is not None:
            if args[0].get("step_ms", 0.0) > 0 and not args[0].get("out_of_memory"):
                steps.setdefault((current, key), []).append(args[0]["step_ms"])
            key = None
    return inputs, {k: statistics.median(v[1:] or v) for k, v in steps.items()}


def time_ratio(trace: dict[str, Any], answers: list[dict[str, Any]]) -> float | None:
    """For the input where ``answers`` first run another plan than ``trace`` recorded: the step time of the plan
    ``answers`` end that input's steps with, over that of the plan the trace ended them with, where the trace timed
    both (``None`` elsewhere, and where they end with the same plan)."""
    from lightning_offload.planner.trace import recorded_answers

    recorded = recorded_answers(trace)
    pairs = list(zip(answers, recorded, strict=False))
    first = next((i for i, (a, b) in enumerate(pairs) if plan_key(a) != plan_key(b)), None)
    if first is None:
        return None
    inputs, times = timed_plans(trace)
    last = max(i for i in range(len(pairs)) if inputs[i] == inputs[first])
    ends = [plan_key(d) for d in pairs[last]]
    if ends[0] == ends[1]:
        return None
    instead, kept = (times.get((inputs[last], key)) for key in ends)
    return instead / kept if instead and kept else None


def ratio_summary(ratios: list[float]) -> str:
    """Median and 90th percentile of step-time ratios, and their count."""
    if not ratios:
        return "-"
    ordered = sorted(ratios)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered):.2f}x, {p90:.2f}x ({len(ordered)})"


def attribute(module_name: str, path: str) -> tuple[Any, str, Any]:
    """What ``path`` (``"name"`` or ``"Class.name"``) of ``module_name`` names: its owner, its name and its value (a
    class's own, not one it inherits)."""
    owner: Any = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


@contextlib.contextmanager
def switched_off(patches: list[tuple[str, str, Any]]) -> Iterator[None]:
    """Each ``(module, "name" or "Class.name", value)`` set for the duration."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for module_name, path, value in patches:
            saved.append(attribute(module_name, path))
            setattr(saved[-1][0], saved[-1][1], value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def code_lines(qualified: str) -> int:
    """Code lines of a function, method or class (``module.Name`` or ``module.Class.method``)."""
    module_name, _, rest = qualified.rpartition(".")
    obj: Any
    try:
        obj = importlib.import_module(module_name)
        names: list[str] = [rest]
    except ModuleNotFoundError:
        module_name, _, cls = module_name.rpartition(".")
        obj, names = importlib.import_module(module_name), [cls, rest]
    for name in names:
        obj = getattr(obj, name)
    source = textwrap.dedent(inspect.getsource(obj))
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_ablation", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--all-recorded", action="store_true", help="also every trace under benchmarks/results/")
    args = parser.parse_args(argv)
    from lightning_offload.planner.trace import recorded_answers

    traces = {p.stem: json.loads(p.read_text()) for p in sorted(args.traces.glob("*.json"))}
    older: dict[str, dict[str, Any]] = {}  # recorded before a later change: the planner answers them otherwise now
    if args.all_recorded:
        recorded = recorded_traces()
        stale = set(changed_traces(recorded))
        older = {name: recorded[name] for name in stale}
        traces.update({name: trace for name, trace in recorded.items() if name not in stale})
    if changed_traces(traces):
        print("some traces do not replay as recorded even with every rule on", file=sys.stderr)
        return 1
    lines = [
        f"# The planner's rules against {len(traces)} recorded traces",
        "",
        "Traces whose replay answers otherwise with the rule switched off; code lines of the functions that make it.",
        "",
        "| rule | code lines | traces changed | step time instead, where timed: median, p90 (traces) | which |"
        " older runs it was made for |",
        "|---|---|---|---|---|---|",
    ]
    for rule, (patches, makers) in RULES.items():
        with switched_off(patches):
            # (Each trace replayed once: whether it changed, and what its change cost, from the same answers.)
            answers = {name: replayed(trace) for name, trace in traces.items()}
            changed = [name for name, said in answers.items() if said != recorded_answers(traces[name])]
            ratios = [r for name in changed if (r := time_ratio(traces[name], answers[name] or [])) is not None]
            made_for = sorted(set(older) - set(changed_traces(older)))
        weight = sum(code_lines(m) for m in makers) if makers else "-"
        shown = ", ".join(sorted({short_name(name) for name in changed})[:12])
        more = f" (+{len(changed) - 12})" if len(changed) > 12 else ""
        lines.append(
            f"| {rule} | {weight} | {len(changed)} | {ratio_summary(ratios)} | {shown or '-'}{more} "
            f"| {', '.join(made_for) or '-'} |"
        )
    return write_table(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
