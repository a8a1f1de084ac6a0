"""A recorded trace (:class:`~lightning_offload.planner.trace.Trace`) told again to a fresh
:class:`~lightning_offload.planner.core.Planner`: a trace recorded on a GPU replays on any machine, since the planner
reads nothing but what it is told. Tests replay recorded traces and assert that the planner still answers as it did
(or, after a deliberate change, how it differs)."""

from __future__ import annotations

from typing import Any

from lightning_offload.planner.core import Planner
from lightning_offload.planner.state import restore_plans
from lightning_offload.planner.steps import Observation, StepStart
from lightning_offload.planner.trace import TRACE_VERSION, directive_summary, key_from_json


def replay(trace: dict[str, Any]) -> tuple[Planner, list[dict[str, Any]]]:
    """Tell a fresh planner what ``trace`` (from :meth:`Trace.as_dict`) records; returns it and the summary of each
    directive it answered, in order (compare with the ``begin`` events' recorded ones)."""
    if trace.get("version") != TRACE_VERSION:
        raise ValueError(f"replay(trace): trace version {trace.get('version')!r}, expected {TRACE_VERSION}")
    planner = Planner(trace["budget"], trials=trace["trials"], frugal_first=trace["frugal_first"])
    answers: list[dict[str, Any]] = []
    for name, *args in trace["events"]:
        if name == "input":
            planner.input_changed(key_from_json(args[0]))
        elif name == "begin":
            # (Traces recorded before 2026-12-07 also hold whether segments were expandable, which no rule reads now.)
            answers.append(directive_summary(planner.begin(StepStart(args[0]["allocated"]))))
        elif name == "observe":
            planner.observe(Observation.from_dict(args[0]))
        elif name == "replan":
            planner.replan(args[0])
        elif name == "restore":
            restore_plans(planner, args[0])
        else:
            raise ValueError(f"replay(trace): unknown event {name!r}")
    return planner, answers
