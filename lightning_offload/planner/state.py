"""The planner's plans as plain values (dicts, lists, numbers, strings), to carry them into a later fit or a
checkpoint: :func:`export_plans` and :func:`restore_plans`. Plain builtins, so that ``torch.load(weights_only=True)``
reads them back.

What is carried: each input that ran a plan (its measured profile, its plan and its trials' timings), and what planned
steps taught about the machine. What is not: steps in flight, inputs still measuring, lent plans. Whoever restores
checks first that the plans belong to this model, budget and device (the engine's fingerprint)."""

from __future__ import annotations

import dataclasses
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


def _record_state(rec: InputRecord) -> dict[str, Any] | None:
    """``rec`` as plain values, where it ran a plan of its own (``None``: still measuring, or lent)."""
    if rec.phase is Phase.MEASURING or rec.lent or rec.profile is None or rec.plan is None:
        return None
    return {
        "profile": dataclasses.asdict(rec.profile),
        "plan": dataclasses.asdict(rec.plan),
        "trials": rec.trials.as_state(),
        "measured": rec.measured,
        "full_block": None if rec.full_block is None else dataclasses.asdict(rec.full_block),
        "peaks": dataclasses.asdict(rec.peaks),
        "reserved_gap": rec.reserved_gap,
        "base": rec.base,
    }


def _record_from(state: dict[str, Any], trials_enabled: bool) -> InputRecord:
    full_block = state["full_block"]
    return InputRecord(
        PlanTrials.from_state(state["trials"], trials_enabled),
        profile=StepProfile(**state["profile"]),
        plan=_plan(state["plan"]),
        measure_left=0,
        measured=state["measured"],
        full_block=None if full_block is None else BlockSizes(**full_block),
        peaks=MeasuredPeaks(**state["peaks"]),
        reserved_gap=state["reserved_gap"],
        base=state["base"],
        settling=True,  # its first step checks the cache the steps before it left
    )


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
