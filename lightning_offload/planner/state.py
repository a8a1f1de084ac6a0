"""The planner's plans as plain values (dicts, lists, numbers, strings), to carry them into a later fit or a
checkpoint: :func:`export_plans` and :func:`restore_plans`. Plain builtins, so that ``torch.load(weights_only=True)``
reads them back.

What is carried: each input that ran a plan (its measured profile, its plan and its trials' timings), and what planned
steps taught about the machine. What is not: steps in flight, inputs still measuring, lent plans. Whoever restores
checks first that the plans belong to this model, budget and device (the engine's fingerprint)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_offload.planner.inputs import InputRecord
from lightning_offload.planner.measure import Machine, MeasuredPeaks
from lightning_offload.planner.profile import BlockSizes, Plan, StepProfile
from lightning_offload.planner.steps import Phase
from lightning_offload.planner.trace import key_from_json, key_to_json
from lightning_offload.planner.trials import PlanTrials

if TYPE_CHECKING:
    from lightning_offload.planner.core import Planner

PLANS_VERSION = 1


def _plan(values: dict[str, Any]) -> Plan:
    return Plan(**{**values, "phases": tuple(values.get("phases", ()))})


# What a restored record starts from instead of what the exported one held: the steps in flight and the run of its plan
# belong to the process that ran them. It measures nothing, and its first step checks the cache the steps before it
# left. Every other field of :class:`InputRecord` is carried (a test holds the two lists to the record's fields).
RESTARTED: dict[str, Any] = {
    "measure_left": 0,
    "frugal_next": False,
    "settling": True,
    "plan_since": None,
    "plan_steps": (),
    "slow_forward": None,
    "lent": False,
}
# Carried fields that are not plain values, read back from the dicts they were written as (``trials`` apart: it needs
# whether trials are enabled now).
_READERS: dict[str, Callable[[Any], Any]] = {
    "profile": lambda values: StepProfile(**values),
    "plan": _plan,
    "full_block": lambda values: BlockSizes(**values),
    "peaks": lambda values: MeasuredPeaks(**values),
}


def _plain(value: Any) -> Any:
    if isinstance(value, PlanTrials):
        return value.as_state()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _record_state(rec: InputRecord) -> dict[str, Any] | None:
    """``rec`` as plain values, where it ran a plan of its own (``None``: still measuring, or lent)."""
    if rec.phase is Phase.MEASURING or rec.lent or rec.profile is None or rec.plan is None:
        return None
    return {f.name: _plain(getattr(rec, f.name)) for f in dataclasses.fields(rec) if f.name not in RESTARTED}


def _record_from(state: dict[str, Any], trials_enabled: bool) -> InputRecord:
    carried = {
        name: value if value is None else _READERS.get(name, lambda plain: plain)(value)
        for name, value in state.items()
        if name != "trials"
    }
    return InputRecord(PlanTrials.from_state(state["trials"], trials_enabled), **carried, **RESTARTED)


def export_plans(planner: Planner) -> dict[str, Any]:
    """The plans of ``planner``'s inputs (the current one and those kept) and its machine, as plain values."""
    inputs = []
    records = [*planner.book.records()]
    if planner.input_key is not None or planner.runs_input(None):
        records.append((planner.input_key, planner.rec))
    for key, rec in records:
        state = _record_state(rec)
        if state is not None:
            inputs.append([key_to_json(key), state])
    return {
        "version": PLANS_VERSION,
        "budget": planner.budget,
        "machine": dataclasses.asdict(planner.machine),
        "lesson": None if planner.lesson is None else list(planner.lesson),
        "inputs": inputs,
    }


def restore_plans(planner: Planner, state: dict[str, Any]) -> int:
    """Give a fresh ``planner`` (no step run yet) the plans :func:`export_plans` wrote, under the same budget: an
    input met again runs its plan without measuring. Returns how many inputs it now knows (0: the state is of another
    version or budget, or the planner already ran steps; nothing is changed then)."""
    if state.get("version") != PLANS_VERSION or state.get("budget") != planner.budget or planner.step:
        return 0
    planner.trace.add("restore", state)
    planner.machine = Machine(**state["machine"])
    lesson = state.get("lesson")
    planner.lesson = None if lesson is None else (bool(lesson[0]), bool(lesson[1]))
    for key, rec_state in state["inputs"]:
        planner.book.keep(key_from_json(key), _record_from(rec_state, planner.rec.trials.enabled))
    return len(state["inputs"])
