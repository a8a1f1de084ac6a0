"""What the planner says, worded in one place: each function returns one notice's text (sizes in bytes)."""

from __future__ import annotations

from collections.abc import Hashable

from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.units import GiB


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def budget_taken(budget: int, base: int) -> str:
    return (
        f"memory_budget={_gib(budget)}: {_gib(base)} are allocated before the step begins (weights, gradients, "
        "optimizer state): no plan can keep the step within the budget"
    )


def resting_floor_over(
    budget: int, allocated: int, gradients: int, state: int, optimizers: tuple[str, ...], transient: int = 0
) -> str:
    """Before the first step: the weights (``allocated``), the ``gradients`` and the ``state`` of ``optimizers`` to
    come, and what their step allocates for a moment (``transient``), already pass the budget."""
    total = allocated + gradients + state + transient
    held = f"{_gib(allocated)} allocated now (the weights), {_gib(gradients)} of gradients"
    held += f" and {_gib(state)} of {' and '.join(optimizers)}'s state to come" if state else " to come"
    if transient:
        held += f", and {_gib(transient)} its step allocates for a moment"
    return (
        f"memory_budget={_gib(budget)}: before any activation, a training step holds at least {_gib(total)}: {held}. "
        "No plan can keep the step within the budget: a budget above that, fewer trainable weights (adapters such as "
        "LoRA, say) or an optimizer that keeps less state"
    )


def base_grew(budget: int, grown: int) -> str:
    return (
        f"memory_budget={_gib(budget)}: the step begins with {_gib(grown)} more allocated than the measured one "
        "(gradients, optimizer state); planning again"
    )


def lent_plan_misled(key: Hashable, heavier: int | None) -> str:
    """A step of ``key`` under a larger input's plan peaked ``heavier`` bytes past it (``None``: ran out of memory)."""
    what = "ran out of memory under" if heavier is None else f"peaked {_gib(heavier)} past"
    return f"memory_budget: a step of input {key} {what} a larger input's plan; measuring it"


def lent_plan(key: Hashable, lender: Hashable) -> str:
    return f"memory_budget: input {key} runs the plan of input {lender}, which keeps everything"


def plan_chosen(budget: int, trial: str, plan: Plan, margin: int, base: int, profile: StepProfile) -> str:
    """The plan chosen (``trial``: what its trials say, or nothing); where it does not fit, why the step may fail:
    ``base`` bytes of weights, gradients and optimizer state, and the ``profile``'s other transients."""
    text = f"memory_budget={_gib(budget)}: {trial}{plan.describe(budget)}"
    if plan.fits:
        return text
    if plan.peak > max(budget, plan.activation_peak):
        return text + (
            f": the optimizer's step peaked at {_gib(plan.peak)} after backward, past the budget whatever the plan "
            f"(activations are gone by then; weights, gradients and optimizer state take {_gib(base)})"
        )
    transients = profile.peak + profile.correction - profile.resident - base
    return text + (
        f", within the fit margin of {_gib(margin)} below it (what this model's predictions and the allocator's "
        "fragments may miss by): the step may run out of memory under a hard limit. Even the most frugal plan needs "
        f"{_gib(plan.peak)}: weights, gradients and optimizer state take {_gib(base)} and the step's other transients "
        f"(the loss and logits among them) {_gib(transients)}"
    )


def frugal_step_passes(budget: int, expected: int, held: int, grown: int, base: int, aim: int) -> str:
    # Past the budget it cannot run under a hard limit; within the margin below it, it may (the estimate counts one
    # block run in full, which plans need not) or the allocator's fragments may take it past.
    within = expected <= budget
    where = f", within the fit margin below the budget (plans aim at {_gib(aim)})" if within else ""
    verdict = (
        "it may run out of memory there (the allocator's fragments count against a hard limit), and then"
        if within
        else "then"
    )
    return (
        f"memory_budget={_gib(budget)}: the next step, measuring and as frugal as any plan, should need about "
        f"{_gib(expected)}{where}: the one before it peaked at {_gib(held)} by the end of its backward, and "
        f"{_gib(grown)} more are allocated now (the optimizer's state). Weights, gradients and optimizer state take "
        f"{_gib(base)}; the step's other transients (the loss and logits among them; every activation leaves) "
        f"{_gib(expected - base)}. If this is a hard limit, {verdict} the model does not train at this input size "
        "within it: a shorter sequence or a smaller batch, or a budget above that"
    )


def emptying_cache(budget: int, reserved: int, peak: int) -> str:
    return (
        f"memory_budget={_gib(budget)}: the kept plan's first step found {_gib(reserved)} reserved for a {_gib(peak)} "
        "peak; emptying the cache once"
    )


def kept_plan_flushed(kept_ms: float, other_ms: float) -> str:
    """Why the trials' next fastest plan runs: the one they kept flushed the cache where its timed steps did not."""
    return (
        f"the plan the trials kept ({kept_ms:.1f} ms a step as timed) flushed the allocator's cache in its steps "
        f"since, which its timed steps did not: the next fastest plan timed ({other_ms:.1f} ms) runs instead: "
    )


_UNTIMED = "not timed ("


def taught_by_other_trials(kind: tuple[bool, bool]) -> str:
    """Why a new input runs a plan untimed: the kind of plan (offloads, light blocks) another input's trials kept."""
    what = _kind_words(kind)
    return f"{_UNTIMED}another input's trials kept a plan that {what}, and this input's trials would time one): "


def _kind_words(kind: tuple[bool, bool]) -> str:
    offloads, light = kind
    return ("offloads" if offloads else "offloads nothing") + (
        " and recomputes elementwise operations" if light else ""
    )


def taught_before_correction(kind: tuple[bool, bool]) -> str:
    """Why a corrected input runs a plan untimed: the kind of plan its own trials kept before the correction."""
    return f"{_UNTIMED}this input's trials kept a plan that {_kind_words(kind)}, and none they timed fits now): "


def trials_elsewhere() -> str:
    """Why a new input runs the model's plan untimed: another input's plans are under trial."""
    return f"{_UNTIMED}another input's plans are under trial; what they teach decides this input's plan): "


def untimed(trial: str) -> bool:
    """Whether ``trial`` says a plan runs untimed (:func:`taught_by_other_trials`, :func:`trials_elsewhere`)."""
    return trial.startswith(_UNTIMED)
