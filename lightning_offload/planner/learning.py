"""What a planned step's timings teach about the machine, read a step or so after it ran (a forward's compute time, its
waits for copies): copies slowing compute cost a price per GiB, and copies beside compute get less of the link than
measured alone. Both only ever move one way, towards checkpointing, so plans never swing back and forth.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from lightning_offload.planner.book import InputBook
from lightning_offload.planner.inputs import InputRecord
from lightning_offload.planner.measure import Machine
from lightning_offload.planner.offload_model import fit_link_share, offload_cost_ms
from lightning_offload.planner.steps import Notice
from lightning_offload.units import GiB

# Waits and slower forwards count as a misprediction beyond this much: copies and compute share memory bandwidth, and
# single steps vary.
NOISE_MS = 10.0
_STEPS_KEPT = 32  # recent steps that pinned host buffers, kept to tell the timings read late apart


class RecentSteps:
    """Recent step numbers (the latest ``_STEPS_KEPT`` at least): a set that forgets the oldest."""

    def __init__(self) -> None:
        self._steps: set[int] = set()

    def add(self, step: int) -> None:
        self._steps.add(step)
        if len(self._steps) > 2 * _STEPS_KEPT:
            self._steps = set(sorted(self._steps)[-_STEPS_KEPT:])

    def __contains__(self, step: object) -> bool:
        return step in self._steps


def record_that_ran(step: int, rec: InputRecord, book: InputBook) -> InputRecord | None:
    """The record whose plan step ``step`` ran, where that plan offloads: the current input's ``rec`` or one the
    ``book`` keeps (``None``: that plan ran no copies, so its timing says nothing of them)."""
    if rec.plan is not None and rec.profile is not None and rec.plan_since is not None and step >= rec.plan_since:
        return rec if rec.plan.offload_bytes > 0 else None
    return book.ran(step)


def learn_from_slow_forward(rec: InputRecord, machine: Machine, step: int, ms: float, notices: list[Notice]) -> Machine:
    """Step ``step`` of ``rec``'s plan (which offloads) computed its forward for ``ms``. Where it and the input's step
    before it computed clearly slower than the measured forward, copies slowed compute (memory bandwidth, the host's
    hooks): the machine learns that cost per GiB (on an H200, Llama-1B's forward took 83 ms instead of 57 with 2.2 GiB
    of copies). Two steps in a row, and the lesser of them: one slow forward (a host hiccup) is not a lesson."""
    assert rec.plan is not None and rec.profile is not None
    plan, profile, earlier = rec.plan, rec.profile, rec.slow_forward
    slower = ms - profile.forward_ms
    if slower <= NOISE_MS:
        return machine
    rec.slow_forward = (step, slower)
    if earlier is None or (earlier[0], step) not in itertools.pairwise(rec.plan_steps):
        return machine
    per_gib = min(slower, earlier[1]) / (plan.offload_bytes / GiB)
    if per_gib <= max(profile.copy_ms_per_gib, machine.copy_ms_per_gib):
        return machine
    notices.append(
        Notice(
            logging.INFO,
            f"memory_budget: a planned step's forward computed {slower:.1f} ms slower than measured with "
            f"{plan.offload_bytes / GiB:.2f} GiB offloaded: copies cost {per_gib:.1f} ms per GiB beside compute; "
            "planning again",
        )
    )
    return dataclasses.replace(machine, copy_ms_per_gib=per_gib)


def learn_from_copy_waits(rec: InputRecord, machine: Machine, step: int, ms: float, notices: list[Notice]) -> Machine:
    """Step ``step`` of ``rec``'s plan waited ``ms`` for copies. Where that is clearly longer than the plan's offloading
    was predicted to cost, copies beside compute get less of the link: the machine learns the share that explains
    the wait."""
    assert rec.plan is not None and rec.profile is not None
    plan, profile = rec.plan, rec.profile
    predicted = offload_cost_ms(profile, plan)
    if ms <= predicted + NOISE_MS:
        return machine
    share = fit_link_share(profile, plan, ms)
    if share >= min(profile.link_share, machine.link_share) - 0.01:
        return machine
    notices.append(
        Notice(
            logging.INFO,
            f"memory_budget: a planned step waited {ms:.1f} ms for copies (predicted {predicted:.1f} ms): copies get "
            f"{100 * share:.0f}% of the link beside compute, not {100 * profile.link_share:.0f}%; planning again",
        )
    )
    return dataclasses.replace(machine, link_share=share)
