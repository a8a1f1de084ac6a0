"""What the planner was told and what it answered, step by step, as plain JSON-ready values (:class:`Trace`);
:mod:`~lightning_offload.planner.replay` tells a fresh planner the same and collects its answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from lightning_offload.planner.steps import Directive, Observation, StepStart

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
    dropped).

    A step's records are frozen dataclasses, kept as they are and turned into JSON values only when asked
    (:meth:`as_dict`): the conversion costs a few hundred microseconds a step, which a host-bound step of a few
    milliseconds would pay on every step."""

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
        self.add("begin", start, directive)

    def observe(self, obs: Observation) -> None:
        self.add("observe", obs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": TRACE_VERSION,
            **self.settings,
            "truncated": self.truncated,
            "events": [[name, *map(_json_value, args)] for name, *args in self.events],
        }


def _json_value(value: Any) -> Any:
    """An event's argument as JSON values: the records of a step converted, anything else as it was added."""
    if isinstance(value, Directive):
        return directive_summary(value)
    if isinstance(value, (StepStart, Observation)):
        return dataclasses.asdict(value)
    return value


def recorded_answers(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The directives a trace's planner answered, in order (its ``begin`` events)."""
    return [args[1] for name, *args in trace["events"] if name == "begin"]
