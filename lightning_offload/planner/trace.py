"""What the planner was told and what it answered, step by step, as plain JSON-ready values (:class:`Trace`), and
:func:`replay`, which tells a fresh :class:`~lightning_offload.planner.core.Planner` the same and collects its answers.

A trace recorded on a GPU replays on any machine: the planner reads nothing but what it is told. Tests replay
recorded traces and assert that the planner still answers as it did (or, after a deliberate change, how it differs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from lightning_offload.planner.steps import Directive, Observation, StepStart

if TYPE_CHECKING:
    from lightning_offload.planner.core import Planner

TRACE_VERSION = 1
# Events kept per trace: the first ones (a replay must start where the planner started). About 2 per step: a
# 1000-step fit with a new length every few steps stays inside.
TRACED_EVENTS = 4096


def key_to_json(key: Hashable) -> Any:
    """An input's key as JSON values: tuples become lists; anything else but plain scalars its ``repr``."""
    if isinstance(key, tuple):
        return [key_to_json(k) for k in key]
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    return repr(key)


def key_from_json(value: Any) -> Hashable:
    """The key :func:`key_to_json` wrote (lists back to tuples)."""
    if isinstance(value, list):
        return tuple(key_from_json(v) for v in value)
    return value


def directive_summary(d: Directive) -> dict[str, Any]:
    """What a directive tells the driver, as JSON values: the phase, the plan (what it runs and its predicted peak) or
    how the measuring step runs, and whether the cache is emptied first."""
    out: dict[str, Any] = {"phase": d.phase.value, "empty_cache": d.empty_cache}
    if d.plan is not None:
        out["plan"] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(d.plan).items()}
    if d.measure is not None:
        out["measure"] = dataclasses.asdict(d.measure)
    return out


class Trace:
    """The events of one planner, oldest first, up to :data:`TRACED_EVENTS` (``truncated`` says that later ones were
    dropped)."""

    def __init__(self, budget: int, trials: bool, frugal_first: bool) -> None:
        self.settings = {"budget": budget, "trials": trials, "frugal_first": frugal_first}
        self.events: list[list[Any]] = []
        self.truncated = False

    def add(self, *event: Any) -> None:
        if len(self.events) >= TRACED_EVENTS:
            self.truncated = True
            return
        self.events.append(list(event))

    def input(self, key: Hashable) -> None:
        self.add("input", key_to_json(key))

    def begin(self, start: StepStart, directive: Directive) -> None:
        self.add("begin", dataclasses.asdict(start), directive_summary(directive))

    def observe(self, obs: Observation) -> None:
        self.add("observe", obs.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {"version": TRACE_VERSION, **self.settings, "truncated": self.truncated, "events": self.events}


def replay(trace: dict[str, Any]) -> tuple[Planner, list[dict[str, Any]]]:
    """Tell a fresh planner what ``trace`` (from :meth:`Trace.as_dict`) records; returns it and the summary of each
    directive it answered, in order (compare with the ``begin`` events' recorded ones)."""
    # (The core records traces: imported here, not at the top.)
    from lightning_offload.planner.core import Planner
    from lightning_offload.planner.state import restore_plans

    if trace.get("version") != TRACE_VERSION:
        raise ValueError(f"replay(trace): trace version {trace.get('version')!r}, expected {TRACE_VERSION}")
    planner = Planner(trace["budget"], trials=trace["trials"], frugal_first=trace["frugal_first"])
    answers: list[dict[str, Any]] = []
    for name, *args in trace["events"]:
        if name == "input":
            planner.input_changed(key_from_json(args[0]))
        elif name == "begin":
            answers.append(directive_summary(planner.begin(StepStart(**args[0]))))
        elif name == "observe":
            planner.observe(Observation.from_dict(args[0]))
        elif name == "replan":
            planner.replan(args[0])
        elif name == "restore":
            restore_plans(planner, args[0])
        else:
            raise ValueError(f"replay(trace): unknown event {name!r}")
    return planner, answers


def recorded_answers(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The directives a trace's planner answered, in order (its ``begin`` events)."""
    return [args[1] for name, *args in trace["events"] if name == "begin"]
