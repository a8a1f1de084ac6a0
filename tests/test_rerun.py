"""A step that ran out of memory under a memory budget runs again under the planner's correction (``run_step``)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_offload import offload_activations
from lightning_offload.engine import OffloadEngine
from lightning_offload.planner.trials import timing_key
from tests.test_budget import BATCH, WIDTH, FakeMemory, planned_at_twice_the_activations, reference_grads, run_steps

OOM = "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 80.00 GiB"


class CappedMemory(FakeMemory):
    """Counters of an allocator under a hard cap (``cap`` bytes; ``None``: none): :meth:`check` raises CUDA's error
    where the step's peak passed it. Counts the times its cache was emptied."""

    cap: int | None = None
    emptied = 0

    def check(self) -> None:
        if self.cap is not None and self.peak() > self.cap:
            raise torch.cuda.OutOfMemoryError(OOM)

    def release_cache(self) -> None:
        self.emptied += 1


def capped_step(engine: OffloadEngine, model: torch.nn.Module, x: torch.Tensor, memory: CappedMemory, where: str):
    """A training step that clears the gradients first and runs out of memory ``where`` ("forward": inside the engine's
    block; "backward": after it) where the cap is passed; it records each attempt's plan and peak."""
    attempts: list[tuple[tuple[int, bool, int, int], int]] = []

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with engine:
            loss = model(x)
            if where == "forward":
                memory.check()
        loss.backward()
        planner = engine.planner
        assert planner is not None and planner.plan is not None
        attempts.append((timing_key(planner.plan), memory.peak()))
        memory.check()
        return loss

    return step, attempts


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_ran_out_of_memory_runs_again_under_a_more_frugal_plan(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The cap sits just under the peak the plan reached: its next step runs out of memory, in its forward (inside
    the engine's block) or in its backward (outside it). The planner corrects itself and the step runs again, once,
    under a plan that offloads or checkpoints more, below the cap; the gradients are those of a plain step, bit for
    bit; the cache the failed step left is emptied before it runs again; what is said says so."""
    x = torch.randn(BATCH, WIDTH)
    _, model, memory, engine = planned_at_twice_the_activations(x, CappedMemory)
    run_steps(engine, model, x, 1)
    assert memory.emptied == 1  # (the first step begins in an emptied cache)
    memory.cap = memory.peaks[-1] - 1
    step, attempts = capped_step(engine, model, x, memory, where)
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        loss = engine.run_step(step)
    assert isinstance(loss, torch.Tensor)
    if where == "backward":
        assert len(attempts) == 2 and attempts[0][1] > memory.cap >= attempts[1][1]
    else:
        assert len(attempts) == 1 and attempts[0][1] <= memory.cap  # (recorded after forward passed the cap)
    assert memory.emptied == 2
    grads = reference_grads(x)
    assert all(torch.equal(grads[name], p.grad) for name, p in model.named_parameters())
    said = [r.getMessage() for r in caplog.records]
    assert any("the step ran out of memory (a request of" in text and "running it again under" in text for text in said)
    # The failure's own explanation ("... does not train at this input size") is not said: the step trained.
    assert not any("does not train at this input size" in text for text in said)


def test_a_step_that_no_plan_makes_fit_raises_once_the_plans_end(caplog: pytest.LogCaptureFixture) -> None:
    """Under a cap no step fits, each attempt runs out of memory: the step runs again while each correction makes
    the next one more frugal, and once none does the error is raised, explained in numbers as without running again."""
    x = torch.randn(BATCH, WIDTH)
    _, model, memory, engine = planned_at_twice_the_activations(x, CappedMemory)
    memory.cap = 0
    step, attempts = capped_step(engine, model, x, memory, "backward")
    with caplog.at_level(logging.WARNING, logger="lightning_offload"), pytest.raises(torch.cuda.OutOfMemoryError):
        engine.run_step(step)
    assert len(attempts) >= 2
    assert len({plan for plan, _ in attempts}) == len(attempts)  # never a plan again
    assert [peak for _, peak in attempts] == sorted((peak for _, peak in attempts), reverse=True)
    said = [r.getMessage() for r in caplog.records]
    assert sum("running it again under" in text for text in said) == len(attempts) - 1
    assert "does not train at this input size" in said[-1]


def test_without_a_planner_a_step_runs_once() -> None:
    """No memory budget, no planner: nothing would change, so an out-of-memory error is raised at once; other errors
    are never caught."""
    engine = offload_activations(compute_device="cpu", memory_budget=None, min_tensor_bytes=0)
    calls = []

    def fails(error: Exception) -> None:
        calls.append(error)
        raise error

    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.run_step(lambda: fails(torch.cuda.OutOfMemoryError(OOM)))
    x = torch.randn(BATCH, WIDTH)
    planned = planned_at_twice_the_activations(x, CappedMemory)[3]
    with pytest.raises(ValueError, match="not memory"):
        planned.run_step(lambda: fails(ValueError("not memory")))
    assert len(calls) == 2
    assert engine.run_step(lambda: 7) == 7


def test_in_several_processes_a_step_is_not_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process of several that ran a step again would run its collectives out of step with the others: the error
    is raised at once, though the planner still corrected its plan for the next step."""
    x = torch.randn(BATCH, WIDTH)
    _, model, memory, engine = planned_at_twice_the_activations(x, CappedMemory)
    run_steps(engine, model, x, 1)
    memory.emptied = 0  # (the first step began in an emptied cache)
    memory.cap = memory.peaks[-1] - 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *_: 2)
    step, attempts = capped_step(engine, model, x, memory, "backward")
    planner = engine.planner
    assert planner is not None and planner.plan is not None
    before = timing_key(planner.plan)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.run_step(step)
    assert len(attempts) == 1 and memory.emptied == 0
    assert planner.plan is not None and timing_key(planner.plan) != before
