"""Plans carried into a later engine (a second fit, a resumed checkpoint): an input met again runs its plan without
measuring where the model, budget and device are the same, and measures afresh where any differs."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from lightning_offload.callback import ActivationOffloadCallback
from lightning_offload.carried_plans import fingerprint
from tests.test_budget import (
    BATCH,
    WIDTH,
    FakeMemory,
    SimulatedStreams,
    Stack,
    activation_bytes,
    planned_engine,
    step_on,
)


def _engine(budget: int, model: Stack, sim: SimulatedStreams, act: int):
    return planned_engine(budget, FakeMemory(base=0, transient=act // 4), model, sim, trials=True)


def _fitted(steps: int = 24) -> tuple[Stack, SimulatedStreams, int, int, list[dict]]:
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(1 << 20))
    model = Stack(sim)
    budget = act * 3 // 4
    engine = _engine(budget, model, sim, act)
    runs = [step_on(engine, model, x, key=(BATCH, WIDTH)) for _ in range(steps)]
    state = engine.plans_state()
    assert state is not None
    return model, sim, act, budget, [state, runs, x, engine.planner.plan]  # type: ignore[list-item, union-attr]


def test_a_second_engine_runs_the_carried_plan_without_measuring() -> None:
    model, sim, act, budget, (state, runs, x, plan) = _fitted()
    assert [r["measuring"] for r in runs[:2]] == [True, True] and not any(r["measuring"] for r in runs[2:])
    # Through torch.save and a weights-only load, as a checkpoint carries it.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    again = _engine(budget, model, sim, act)
    again.load_plans(loaded)
    later = [step_on(again, model, x, key=(BATCH, WIDTH)) for _ in range(3)]
    assert not any(r["measuring"] for r in later)
    assert again.planner is not None and again.planner.plan == plan
    assert not again.planner.trying  # the trials were over: not timed again
    assert all(torch.equal(a, b) for a, b in zip(later[-1]["grads"].values(), runs[-1]["grads"].values(), strict=True))


def test_plans_measured_under_another_budget_are_measured_afresh(caplog: pytest.LogCaptureFixture) -> None:
    model, sim, act, budget, (state, _, x, _) = _fitted(steps=4)
    other = _engine(budget + (1 << 20), model, sim, act)
    other.load_plans(state)
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        first = step_on(other, model, x, key=(BATCH, WIDTH))
    assert first["measuring"]
    assert "measured on another model, budget or device; measuring afresh" in caplog.text


def test_the_fingerprint_changes_with_the_parameters_trained_the_budget_and_the_device() -> None:
    model = Stack(None)
    cpu = torch.device("cpu")
    first = fingerprint(model, 1 << 30, cpu, 8 << 30)
    assert fingerprint(model, 1 << 30, cpu, 8 << 30) == first
    assert fingerprint(model, 2 << 30, cpu, 8 << 30) != first
    assert fingerprint(model, 1 << 30, cpu, 16 << 30) != first
    assert fingerprint(model, 1 << 30, torch.device("meta"), 8 << 30) != first
    next(model.parameters()).requires_grad_(False)
    assert fingerprint(model, 1 << 30, cpu, 8 << 30) != first


def test_plans_are_loaded_before_the_first_step_or_not_at_all() -> None:
    model, sim, act, budget, (state, _, x, _) = _fitted(steps=4)
    engine = _engine(budget, model, sim, act)
    step_on(engine, model, x, key=(BATCH, WIDTH))
    with pytest.raises(RuntimeError, match=r"OffloadEngine.load_plans\(state\): call it before the first step"):
        engine.load_plans(state)


def test_the_callback_keeps_the_plans_in_its_state_dict() -> None:
    _, _, _, _, (state, _, _, _) = _fitted(steps=4)
    callback = ActivationOffloadCallback(memory_budget="2GiB")
    assert callback.state_dict() == {}
    callback.load_state_dict({"plans": state})
    assert callback.state_dict() == {"plans": state}
