"""The memory-budget planner with the engine, on the CPU: simulated copy streams and allocator counters faked from
what the engine keeps on the device. It measures one step, then keeps, offloads or checkpoints as the budget needs,
re-plans when a step passes the budget or the input changes, and leaves the model as it was."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from lightning_offload import OffloadOptions, offload_activations
from lightning_offload.budget import BudgetPlanner, default_budget
from lightning_offload.checkpointing import apply_checkpointing, checkpointed_modules
from lightning_offload.engine import OffloadEngine
from lightning_offload.host_pool import pool_for
from lightning_offload.planner import trials as plan_trials
from lightning_offload.planner.book import REMEMBERED_INPUTS
from lightning_offload.planner.candidates import cheapest_plan
from lightning_offload.planner.core import Planner
from lightning_offload.planner.inputs import no_larger
from lightning_offload.planner.profile import Plan, StepProfile
from lightning_offload.planner.state import export_plans, restore_plans
from lightning_offload.planner.trials import trial_plans
from lightning_offload.stats import OffloadStats
from lightning_offload.step_marks import StepMarks
from lightning_offload.streams import SimulatedStreams
from tests.models import LengthLM, Mix, assert_same_grads, length_tokens, sgd_update_recorded

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
WIDTH, BATCH, BLOCKS = 256, 64, 8
EVERY_BLOCK = [f"blocks.{i}" for i in range(BLOCKS)]
BLOCK_MS = 2.0


class Block(nn.Module):
    """Takes ``BLOCK_MS`` of simulated compute."""

    def __init__(self, sim: SimulatedStreams | None, backward_ms: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.sim = sim
        self.backward_ms = backward_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sim = self.sim
        if sim is not None:
            sim.advance(BLOCK_MS)
        out = x + self.down(torch.tanh(self.up(x)))
        if sim is not None and self.backward_ms and out.requires_grad:
            out.register_hook(lambda grad: sim.advance(self.backward_ms))  # backward's compute for this block
        return out


class Stack(nn.Module):
    """Repeated blocks (the planner may checkpoint them) and 1 ms of simulated compute for the loss."""

    def __init__(self, sim: SimulatedStreams | None = None, backward_ms: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(sim, backward_ms) for _ in range(BLOCKS))
        self.sim = sim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.sim is not None:
            self.sim.advance(1.0)
        return x.square().mean()


class FakeMemory:
    """Allocator counters: ``base`` bytes of weights and state, ``transient`` bytes of loss and workspace at the peak,
    plus the eligible saved bytes the engine kept on the device (all of them, in a step it did not hook)."""

    def __init__(self, base: int, transient: int, total: int = 100 * GiB) -> None:
        self.base, self.transient, self._total = base, transient, total
        self.engine: OffloadEngine | None = None
        self.unhooked_resident = 0  # what a step without hooks keeps (all activations): learnt from a hooked step
        # Or, where these are set, what the model saves on this input with the blocks checkpointed then.
        self.unhooked_model: nn.Module | None = None
        self.unhooked_input: torch.Tensor | None = None
        self._unhooked: dict[tuple[tuple[str, ...], tuple[int, ...]], int] = {}
        self._peak = 0
        self._finished: object = None
        self.peaks: list[int] = []

    def _resident(self) -> int:
        assert self.engine is not None
        stats = self.engine.collect_stats(wait=False)
        if stats is self._finished:
            return 0  # between steps: the previous step's activations are gone
        if stats.saved_tensors == 0:
            return self._unhooked_bytes()
        return stats.eligible_bytes - stats.offloaded_bytes

    def _unhooked_bytes(self) -> int:
        if self.unhooked_model is None or self.unhooked_input is None:
            return self.unhooked_resident
        names = tuple(checkpointed_modules(self.unhooked_model))
        key = (names, tuple(self.unhooked_input.shape))
        if key not in self._unhooked:
            self._unhooked[key] = activation_bytes(self.unhooked_input, checkpointed=list(names))
        return self._unhooked[key]

    def total(self) -> int:
        return self._total

    def allocated(self) -> int:
        now = self.base + self._resident()
        self._peak = max(self._peak, now)
        return now

    def peak(self) -> int:
        return max(self._peak, self.base + self.transient + self._resident())

    def reset_peak(self) -> None:
        """A step begins (the planner resets at every step): record the finished step's peak first."""
        assert self.engine is not None
        if self._finished is not None or self.engine.collect_stats(wait=False).saved_tensors:
            self.peaks.append(self.peak())
        self._finished = self.engine.collect_stats(wait=False)  # a new step begins; these counters are the last one's
        self._peak = 0


def planned_engine(
    budget: int | str,
    memory: FakeMemory,
    model: nn.Module,
    sim: SimulatedStreams,
    trials: bool = False,
    host_memory_limit: int | None = None,
) -> OffloadEngine:
    """An engine planning under ``budget``; without ``trials`` it runs the model's cheapest plan (what most tests here
    check), with them it times the plans worth comparing."""
    options = OffloadOptions.create(
        "test",
        memory_budget=budget,
        plan_trials=trials,
        compute_device="cpu",
        min_tensor_bytes=0,
        resident_tail_bytes=0,
        max_inflight_bytes=64 * KiB,
        prefetch_bytes=64 * KiB,
        host_memory_limit=host_memory_limit,
    )
    engine = OffloadEngine(options, model=model, streams=sim, memory=memory)
    memory.engine = engine
    return engine


MemoryT = TypeVar("MemoryT", bound=FakeMemory)


def planned_stack(
    budget: int | str,
    *,
    base: int,
    transient: int,
    unhooked_resident: int = 0,
    total: int = 100 * GiB,
    # mypy cannot check a TypeVar's default (python/mypy#3737): callers that omit it get FakeMemory.
    memory_type: type[MemoryT] = FakeMemory,  # type: ignore[assignment]
    lag: int | None = 0,
    bytes_per_ms: float = float(MiB),
    copies_take_time: bool = True,
    backward_ms: float = 0.0,
    host_memory_limit: int | None = None,
) -> tuple[SimulatedStreams, Stack, MemoryT, OffloadEngine]:
    """Build the setup most planner tests share: a simulated link, a ``Stack`` on it, fake allocator counters and an
    engine planning under ``budget`` (:func:`planned_engine`, the cheapest plan, no trials).

    What the tests vary is a parameter; the rest is what every one of them ran with, so a test reads as its own
    numbers, its steps and its assertions.

    Args:
        budget: the engine's ``memory_budget`` (bytes, or ``"auto"``: the device's own budget from ``total``).
        base: bytes of weights and optimizer state the counters report before any activation.
        transient: bytes of the loss and workspace on top at the step's peak.
        unhooked_resident: what a step without hooks keeps on the device (:attr:`FakeMemory.unhooked_resident`).
        total: the device's memory.
        memory_type: the counters' class: :class:`FakeMemory` or a subclass that adds to its peak or residents.
        lag: the simulated copies' lag (``None``: a copy runs only when waited for).
        bytes_per_ms: the simulated link's rate.
        copies_take_time: whether waiting for a copy advances the simulated clock.
        backward_ms: each block's simulated backward compute.
        host_memory_limit: the engine's cap on the host pool (``None``: no cap).

    Returns:
        The simulated streams, the model, the counters and the engine, built in that order: ``Stack`` seeds torch's
        generator, so an input a test draws after this call comes from that seed.
    """
    sim = SimulatedStreams(lag=lag, bytes_per_ms=bytes_per_ms, copies_take_time=copies_take_time)
    model = Stack(sim, backward_ms=backward_ms)
    memory = memory_type(base=base, transient=transient, total=total)
    memory.unhooked_resident = unhooked_resident
    engine = planned_engine(budget, memory, model, sim, host_memory_limit=host_memory_limit)
    return sim, model, memory, engine


def planned_at_twice_the_activations(
    x: torch.Tensor,
    memory_type: type[MemoryT] = FakeMemory,  # type: ignore[assignment]
) -> tuple[int, Stack, MemoryT, OffloadEngine]:
    """The planned setup many tests start from, after its three first steps (measured, then planned): a budget of
    twice the bytes forward saves on ``x``, no weights, a loss transient of 1.2x those bytes, a step without hooks
    keeping them all, a fast link. Returns the budget, the model, the counters and the engine."""
    act = activation_bytes(x)
    budget = act * 2
    _, model, memory, engine = planned_stack(
        budget,
        base=0,
        transient=act * 12 // 10,
        unhooked_resident=act,
        bytes_per_ms=float(64 * MiB),
        memory_type=memory_type,
    )
    run_steps(engine, model, x, 3)
    return budget, model, memory, engine


def reference_grads(x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = Stack()
    model(x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def run_steps(engine: OffloadEngine, model: nn.Module, x: torch.Tensor, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` steps (same batch, no update); per step: grads, whether hooks ran, offloaded bytes."""
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with engine:
            installed = engine.installed
            loss = model(x)
        loss.backward()
        stats = engine.stats
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append(
            {"grads": grads, "hooked": installed, "offloaded": stats.offloaded_bytes, "saved": stats.saved_tensors}
        )
    return out


def activation_bytes(x: torch.Tensor, frugal: bool = False, checkpointed: list[str] | None = None) -> int:
    """The eligible bytes one step of ``Stack`` saves (measured with an engine that only counts); ``frugal``: with
    every block but the second checkpointed, as a frugal measuring step runs; ``checkpointed``: with these blocks
    checkpointed."""
    model = Stack()
    if frugal:
        checkpointed = [f"blocks.{i}" for i in range(BLOCKS) if i != 1]
    if checkpointed:
        apply_checkpointing(model, checkpointed)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    # Autograd on, whatever the caller's mode: ``FakeMemory`` counts with this from wherever the planner reads it,
    # Lightning's validation (inference mode) included.
    with torch.inference_mode(False), torch.enable_grad():
        with engine:
            loss = model(x)
        loss.backward()
    return engine.stats.eligible_bytes


def test_a_model_that_fits_runs_without_hooks_after_the_measuring_steps() -> None:
    """Two measuring steps (the optimizer allocates its state in the first), then nothing installed at all."""
    _, model, _, engine = planned_stack(3 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    steps = run_steps(engine, model, x, 4)
    expected = reference_grads(x)
    assert [s["hooked"] for s in steps] == [True, True, False, False]
    assert [s["offloaded"] for s in steps][2:] == [0, 0]
    for s in steps:
        assert_same_grads(s["grads"], expected)
    assert engine.planner is not None and engine.planner.plan is not None
    assert engine.planner.plan.offload_bytes == 0 and engine.planner.plan.fits


def test_offloads_the_least_that_fits_when_copies_hide() -> None:
    """Forward's activations and the loss's transient exceed the budget by a third of the activations: the plan
    offloads about that (the earliest bytes, plus the margin and what copies in flight hold), and the next steps'
    peaks stay within the budget."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    budget = act * 2  # forward alone stays under the watermark (half the budget); with the transient, some must leave
    # The loss's transient comes on top of forward's saves; a fast link: every copy hides.
    _, model, memory, engine = planned_stack(
        budget, base=0, transient=act * 12 // 10, unhooked_resident=act, bytes_per_ms=float(64 * MiB)
    )
    steps = run_steps(engine, model, x, 4)
    plan = engine.planner.plan  # type: ignore[union-attr]
    assert plan is not None and plan.fits and plan.checkpoint_blocks == 0
    assert act // 4 <= plan.offload_bytes < act * 3 // 4
    assert all(s["hooked"] for s in steps)
    assert act // 4 <= steps[-1]["offloaded"] < act * 3 // 4  # the limit took effect
    assert max(memory.peaks[2:]) <= budget  # every planned step (after the two measuring steps) within the budget
    planner = engine.planner
    assert planner is not None and planner.profile is not None
    assert planner.profile.forward_peak > 0  # forward's peak (the loss's transient included), apart from the step's
    assert act <= planner.marks.forward_peak <= budget  # the last planned step's, as its backward began
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


def test_a_plan_that_offloads_without_the_model_says_once_that_checkpointing_needs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given no ``model=``, the planner can only offload: its first plan that does says so, once, naming the argument;
    with the model it says nothing of it."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    said = {}
    for given in (False, True):
        sim = SimulatedStreams(lag=0, bytes_per_ms=float(64 * MiB))
        model = Stack(sim)
        memory = FakeMemory(base=0, transient=act * 12 // 10)
        memory.unhooked_resident = act
        engine = planned_engine(act * 2, memory, model if given else None, sim)  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_offload"):
            run_steps(engine, model, x, 5)
        plan = engine.planner.plan  # type: ignore[union-attr]
        assert plan is not None and plan.offload_bytes > 0
        said[given] = [r.getMessage() for r in caplog.records if "model=" in r.getMessage()]
    assert len(said[False]) == 1, said
    assert said[False][0].startswith("offload_activations(): the plan offloads ")
    assert "pass offload_activations(model=model, ...)" in said[False][0]
    assert said[True] == []


def test_plans_offload_no_more_than_the_host_pool_can_hold() -> None:
    """Every copy of a forward is on the host as forward ends, and what does not fit there stays on the device. With
    ``host_memory_limit`` at half of what the cheapest plan offloads, the plan checkpoints blocks instead and offloads
    at most what the pool's buffers hold (size classes pad by up to an eighth); the planned steps stay within the
    budget, with the plain gradients."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    plans = {}
    for limit in (None, "half"):
        budget = act * 2
        host = None if limit is None else plans[None].offload_bytes // 2
        _, model, memory, engine = planned_stack(
            budget,
            base=0,
            transient=act * 12 // 10,
            unhooked_resident=act,
            bytes_per_ms=float(64 * MiB),
            host_memory_limit=host,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the frugal measuring steps fill the small pool
            steps = run_steps(engine, model, x, 5)
        planner = engine.planner
        assert planner is not None and planner.profile is not None and planner.plan is not None
        plans[limit] = plan = planner.plan
        assert plan.fits and max(memory.peaks[2:]) <= budget
        for step in steps:
            assert_same_grads(step["grads"], reference_grads(x))
        if host is not None:
            assert planner.profile.host_bytes == host
            assert plan.offload_bytes <= host * 8 // 9 and steps[-1]["offloaded"] <= host * 8 // 9
    assert plans[None].checkpoint_blocks == 0 and plans["half"].checkpoint_blocks > 0


def test_backward_fetches_nothing_ahead_until_it_has_left_the_head() -> None:
    """The loss's backward is where a step peaks: the measuring steps note how many bytes the head saves (the loss's
    input here), the peak up to where backward leaves it and what is allocated then; planned steps fetch no copy ahead
    while backward is in the head, and fetch ahead once it has left."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    _, model, _, engine = planned_stack(
        GiB + act * 2, base=GiB, transient=act * 12 // 10, unhooked_resident=act, bytes_per_ms=float(64 * MiB)
    )
    run_steps(engine, model, x, 3)
    planner, inbound = engine.planner, engine._path.inbound
    assert planner is not None and planner.profile is not None and inbound is not None
    profile = planner.profile
    assert profile.two_peaks and profile.head_bytes == BATCH * WIDTH * 4  # ``square`` saved the last block's output
    assert profile.head_peak >= GiB + act * 12 // 10  # forward and the loss's backward: the weights and the transient
    assert GiB <= profile.backward_base < profile.head_peak
    assert planner.plan is not None and planner.plan.offload_bytes > 0
    fetched_at: list[int] = []
    fetch = inbound._fetch

    def recording_fetch(copy: Any, stats: Any, on_demand: bool) -> torch.Tensor:
        if not on_demand:
            fetched_at.append(engine._path.log.backward_pos)
        return fetch(copy, stats, on_demand)

    inbound._fetch = recording_fetch  # type: ignore[method-assign]
    step = run_steps(engine, model, x, 1)[0]
    forward_end = engine._path.log.position  # positions move in forward only
    assert step["offloaded"] > 0 and fetched_at
    assert max(fetched_at) < forward_end - profile.head_bytes
    assert_same_grads(step["grads"], reference_grads(x))


def test_what_backward_starts_from_leaves_out_copies_still_on_their_way_out() -> None:
    """A measuring step offloads the head's bytes too, and its last copies out are still running as backward leaves
    the head: their sources are allocated then, but a plan keeps the head and lets go of every copy before it. What the
    blocks' backward starts from (``backward_base``) leaves them out."""

    class InFlightMemory(FakeMemory):
        """Sources of copies still on their way out are allocated too."""

        def _resident(self) -> int:
            outbound = self.engine._path.outbound if self.engine is not None else None
            return super()._resident() + (outbound.inflight_bytes if outbound is not None else 0)

    x = torch.randn(BATCH, WIDTH)
    # lag=None: copies run only when waited for
    _, model, _, engine = planned_stack(3 * GiB, base=GiB, transient=0, memory_type=InFlightMemory, lag=None)
    run_steps(engine, model, x, 1)
    planner = engine.planner
    assert planner is not None
    in_flight: list[int] = []
    left_head = planner.marks.left_head

    def recording_left_head(nbytes: int = 0) -> None:
        in_flight.append(nbytes)
        left_head(nbytes)

    planner.marks.left_head = recording_left_head  # type: ignore[method-assign]
    run_steps(engine, model, x, 1)
    profile = planner.profile
    assert profile is not None and profile.two_peaks
    assert in_flight and in_flight[0] > 0  # the frugal step's last copies were still running
    assert profile.backward_base == GiB  # the weights: every activation left, and no copy in flight counts


def test_planned_steps_let_go_of_every_copy_in_flight_as_forward_reaches_the_head() -> None:
    """Plans that count the head's backward apart count no copy on its way out there: as the last block returns, the
    compute stream waits for every copy still in flight and the queue lets go of their sources, before the loss's
    transient comes on top. Measuring steps do not (they know no head yet); gradients are unchanged."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    # lag=None: copies run only when waited for
    _, model, _, engine = planned_stack(
        GiB + act * 2, base=GiB, transient=act * 12 // 10, unhooked_resident=act, lag=None, bytes_per_ms=float(64 * MiB)
    )
    steps = run_steps(engine, model, x, 1)  # the first measuring step makes the queues
    outbound = engine._path.outbound
    assert outbound is not None
    let_go_all = outbound.let_go_all
    at_head: list[tuple[int, int]] = []  # per call: bytes in flight before and after

    def recording_let_go_all() -> None:
        before = outbound.inflight_bytes
        let_go_all()
        at_head.append((before, outbound.inflight_bytes))

    outbound.let_go_all = recording_let_go_all  # type: ignore[method-assign]
    steps += run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.profile is not None and planner.profile.two_peaks
    assert planner.plan is not None and planner.plan.offload_bytes > 0
    assert len(at_head) == 2  # the two planned steps, once each; not the measuring steps
    assert all(before > 0 and after == 0 for before, after in at_head)
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))
    engine.close()
    assert not model.blocks[-1]._forward_hooks


def test_the_block_measured_in_full_is_a_typical_one_not_the_first() -> None:
    """A model whose first block's input needs no gradient (a frozen embedding, LoRA) saves less in that block: the
    frugal measuring step runs the second block in full, so the profile's eligible bytes for the model without
    checkpointing are not under-counted by that difference once per block."""

    class FrozenInputBlock(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x + torch.sigmoid(x))  # sigmoid saves its output only where ``x`` needs a gradient

    def model_of(sim: SimulatedStreams | None) -> Stack:
        model = Stack(sim)
        model.blocks = nn.ModuleList(FrozenInputBlock(sim) for _ in range(BLOCKS))
        return model

    x = torch.randn(BATCH, WIDTH)
    counting = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    with counting:
        loss = model_of(None)(x)
    loss.backward()
    act = counting.stats.eligible_bytes
    sim = SimulatedStreams(lag=0)
    model = model_of(sim)
    engine = planned_engine(3 * GiB, FakeMemory(base=GiB, transient=0), model, sim)
    run_steps(engine, model, x, 2)
    profile = engine.planner.profile  # type: ignore[union-attr]
    assert profile is not None
    # Extrapolated from a typical block, the first block counts as typical too: one sigmoid output over, never under.
    assert profile.eligible == act + BATCH * WIDTH * 4


def test_checkpoints_blocks_when_the_link_is_too_slow_and_restores_the_model() -> None:
    """A slow link: offloading the excess would stall; the plan checkpoints the fewest (last) blocks instead and the
    gradients stay bit-equal. Removing the planner leaves no wrapper behind."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    budget = act * 2
    _, model, _, engine = planned_stack(
        budget, base=0, transient=act * 12 // 10, bytes_per_ms=float(16 * KiB), copies_take_time=False
    )
    steps = run_steps(engine, model, x, 4)
    plan = engine.planner.plan  # type: ignore[union-attr]
    assert plan is not None and plan.fits
    assert 0 < plan.checkpoint_blocks < BLOCKS
    wrapped = checkpointed_modules(model)
    assert wrapped == [f"blocks.{i}" for i in range(BLOCKS - plan.checkpoint_blocks, BLOCKS)]
    assert steps[-1]["saved"] < steps[0]["saved"]  # checkpointed blocks save only their inputs
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))
    engine.close()
    assert checkpointed_modules(model) == []
    assert not engine.installed


def test_the_measuring_steps_time_compute_not_the_waits_for_their_own_copies() -> None:
    """A budget below the weights' share trips the watermark at the first saved tensor: the measuring steps offload
    everything over a slow link and forward waits for those copies most of the time. The profile keeps forward's,
    a block's and backward's compute time only (backward less the recompute of the blocks the measuring step
    checkpointed), so copies do not look hidden behind a forward they slowed down, and the plan checkpoints blocks
    (2 ms each) rather than offloading (each byte costs far more than compute can hide)."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    budget = int(act / 0.7)  # the plan keeps about half the activations on the device
    sim, model, _, engine = planned_stack(
        budget,
        base=int(0.6 * budget),  # above the watermark (half the budget) from the start
        transient=0,
        lag=None,  # copies run when waited for, and take time
        bytes_per_ms=float(16 * KiB),
        backward_ms=2 * BLOCK_MS,
    )
    clock = []
    for frugal in (activation_bytes(x, frugal=True), activation_bytes(x, checkpointed=EVERY_BLOCK)):
        start = sim.clock_ms
        steps = run_steps(engine, model, x, 1)
        clock.append(sim.clock_ms - start)
        assert steps[0]["offloaded"] == frugal  # tripped at once: everything left
    run_steps(engine, model, x, 1)  # plans from the two measuring steps
    profile, plan = engine.planner.profile, engine.planner.plan  # type: ignore[union-attr]
    assert profile is not None and plan is not None
    compute = BLOCKS * BLOCK_MS + 1.0
    assert min(clock) > 3 * compute  # the measuring steps mostly waited for copies
    assert (BLOCKS - 1) * BLOCK_MS <= profile.forward_ms <= compute
    assert profile.block_share * profile.forward_ms / BLOCKS == pytest.approx(BLOCK_MS, rel=0.1)
    # Backward ran 8 blocks' backward (4 ms each) and 8 recomputes (2 ms each): the profile keeps the former.
    assert profile.backward_ms == pytest.approx(BLOCKS * 2 * BLOCK_MS, rel=0.1)
    assert profile.eligible == act  # as if nothing were checkpointed
    assert plan.fits and plan.checkpoint_blocks > 0


def offloading_over_a_slow_link(act: int) -> tuple[SimulatedStreams, Stack, OffloadEngine]:
    """The scenario the tests of planned steps that turn out slower start from: a budget of twice forward's ``act``
    saved bytes, a link of 512 KiB/ms (what the measuring steps see) and a long backward, so the first plan offloads
    and checkpoints nothing. Returns the simulated streams, the model and the engine."""
    sim, model, _, engine = planned_stack(
        act * 2,
        base=0,
        transient=act * 12 // 10,
        unhooked_resident=act,
        lag=None,
        bytes_per_ms=float(512 * KiB),
        backward_ms=2 * BLOCK_MS,
    )
    return sim, model, engine


def test_planned_steps_that_wait_for_copies_longer_than_predicted_shift_the_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The link turns out far slower than measured (say, another process shares it): planned steps wait for their
    copies much longer than the plan predicted. The planner lowers the link's share in its model to what explains the
    waits and plans again: less offloading, more checkpointing, the same gradients."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    sim, model, engine = offloading_over_a_slow_link(act)
    run_steps(engine, model, x, 3)
    first = engine.planner.plan  # type: ignore[union-attr]
    assert first is not None and first.offload_bytes > 0 and first.checkpoint_blocks == 0
    sim.bytes_per_ms = float(32 * KiB)  # 16x slower from now on
    planner = engine.planner
    assert planner is not None
    steps, plans = [], []
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        for _ in range(4):
            steps += run_steps(engine, model, x, 1)
            plans.append(planner.plan)
    assert planner.profile is not None and planner.profile.link_share < 0.5
    assert "waited" in caplog.text and "planning again" in caplog.text
    # The plan chosen for the slow link checkpoints and offloads less. (Its first step may then peak past its
    # prediction, which corrects it towards memory: that is the fit margin's business, not the link's.)
    assert any(p is not None and p.checkpoint_blocks > 0 and p.offload_bytes < first.offload_bytes for p in plans)
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


def test_planned_steps_whose_forward_computes_slower_with_copies_learn_their_cost(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies the link model calls hidden still slow compute down (they share the device's memory and the host's
    time): planned steps that offload and whose forward computes far slower than measured, two in a row, teach the
    planner a cost per GiB offloaded, and it plans again towards checkpointing; the gradients stay the same."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    _, model, engine = offloading_over_a_slow_link(act)
    run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.plan is not None and planner.profile is not None
    first = planner.plan
    assert first.offload_bytes > 0 and first.checkpoint_blocks == 0 and planner.profile.copy_ms_per_gib == 0.0
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "BLOCK_MS", 2 * BLOCK_MS)  # one slow forward: a hiccup, not a lesson
    run_steps(engine, model, x, 1)
    monkeypatch.setattr(module, "BLOCK_MS", BLOCK_MS)
    run_steps(engine, model, x, 2)
    assert planner.profile.copy_ms_per_gib == 0.0 and planner.plan == first
    monkeypatch.setattr(module, "BLOCK_MS", 2 * BLOCK_MS)  # forward computes twice as long from now on
    steps, plans = [], []
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        for _ in range(4):
            steps += run_steps(engine, model, x, 1)
            plans.append(planner.plan)
    assert planner.profile.copy_ms_per_gib > 0
    assert "computed" in caplog.text and "planning again" in caplog.text
    # (A plan's first step may peak past its prediction and be corrected towards memory: the fit margin's business.)
    assert any(p is not None and p.checkpoint_blocks > 0 and p.offload_bytes < first.offload_bytes for p in plans)
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


def test_planned_steps_whose_allocator_reserves_past_the_budget_move_the_plan_towards_memory() -> None:
    """The budget holds the allocator's reserved bytes too: a planned step that reserved past it (no hard cap stopped
    it), whatever it allocated, moves the plan towards memory by that much; reserving within the budget, or reserving
    nothing new, moves nothing."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    _, model, memory, engine = planned_stack(
        act * 2, base=0, transient=act * 12 // 10, unhooked_resident=act, bytes_per_ms=float(64 * MiB)
    )
    run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.plan is not None
    first = planner.plan
    memory.reserved_peak = lambda: planner.budget  # type: ignore[attr-defined]
    run_steps(engine, model, x, 2)
    assert (planner.plan.offload_bytes, planner.plan.checkpoint_blocks) == (
        first.offload_bytes,
        first.checkpoint_blocks,
    )
    # (Past the budget itself: plans sit the fit margin below it, so a small gap above the peak stays within it.)
    memory.reserved_peak = lambda: planner.budget + act // 4  # type: ignore[attr-defined]
    steps = run_steps(engine, model, x, 3)
    assert planner.plan.offload_bytes > first.offload_bytes or planner.plan.checkpoint_blocks > first.checkpoint_blocks
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))
    # The allocator keeps what it reserved: later steps that reserve nothing new are not counted again (counting the
    # cache of heavier steps at every step once made 8B LoRA's plans aim 25 GiB lower on an H200).
    cached = planner.budget + act
    memory.reserved = memory.reserved_peak = lambda: cached  # type: ignore[attr-defined]
    run_steps(engine, model, x, 2)  # the step that began before reserved bytes were known counts them
    assert planner.profile is not None
    correction = planner.profile.correction
    run_steps(engine, model, x, 4)
    assert planner.profile.correction == correction


def test_later_steps_correct_the_model_only_towards_memory() -> None:
    """Later steps measure their peak again: a heavier step (here a larger loss transient) makes the plan offload
    more and brings the peak back under the budget; a lighter step never relaxes it (under a hard cap the next step
    could then pass it)."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    # Forward alone stays under the watermark (half the budget); with the loss's transient on top, some must leave.
    budget, model, memory, engine = planned_at_twice_the_activations(x)
    first = engine.planner.plan  # type: ignore[union-attr]
    memory.transient -= act // 10  # lighter
    run_steps(engine, model, x, 2)
    lighter = engine.planner.plan  # type: ignore[union-attr]
    assert first is not None and lighter is not None
    assert (lighter.offload_bytes, lighter.checkpoint_blocks) == (first.offload_bytes, first.checkpoint_blocks)
    memory.transient += act // 4  # the loss's transient grows
    run_steps(engine, model, x, 3)
    grown = engine.planner.plan  # type: ignore[union-attr]
    assert first is not None and grown is not None and grown.offload_bytes > first.offload_bytes
    assert memory.peaks[-1] <= budget


def weights_on_the_device(x: torch.Tensor, bytes_per_ms: float = float(64 * MiB)) -> tuple[int, Stack, FakeMemory]:
    """Activation bytes of ``x``, a ``Stack`` on a simulated link (fast unless ``bytes_per_ms`` says otherwise), and
    counters with 4x those bytes of weights (backward leaves the head above zero, so plans count the head's backward
    apart) and a loss transient of 1.2x; a step without hooks keeps what the model saves with the blocks checkpointed
    then."""
    act = activation_bytes(x)
    model = Stack(SimulatedStreams(lag=0, bytes_per_ms=bytes_per_ms))
    memory = FakeMemory(base=4 * act, transient=act * 12 // 10)
    memory.unhooked_model, memory.unhooked_input = model, x
    return act, model, memory


def test_a_heavier_step_corrects_plans_that_count_the_heads_backward_apart() -> None:
    """The correction is the planner's own, not the measured step's peak: plans that count the loss's and the blocks'
    backward apart (weights on the device, so backward leaves the head above zero) take it too. (Added to the measured
    peak, which those plans do not read, it once corrected nothing.)"""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    sim = model.sim
    assert sim is not None
    budget = 6 * act
    engine = planned_engine(budget, memory, model, sim)
    run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.profile is not None and planner.profile.two_peaks
    first = planner.plan
    assert first is not None and planner.profile.correction == 0
    memory.transient += act // 4  # the loss's transient grows
    run_steps(engine, model, x, 3)
    grown = planner.plan
    assert grown is not None and planner.profile.correction >= act // 4 - budget * 0.02
    assert grown.offload_bytes > first.offload_bytes or grown.checkpoint_blocks > first.checkpoint_blocks
    assert memory.peaks[-1] <= budget


def slow_hooks(engine: OffloadEngine, sim: SimulatedStreams, ms: float, hook: str = "pack") -> None:
    """Every saved tensor the engine's datapath ``hook`` (``pack`` in forward, ``unpack`` in backward) sees costs ``ms``
    of simulated time: the host's Python per tensor, which the planner's model does not price."""
    path = engine._path
    original = getattr(path, hook)

    def slow(value: Any) -> Any:
        sim.advance(ms)
        return original(value)

    setattr(path, hook, slow)


def slow_hooked_engine(
    x: torch.Tensor, trials: bool, hook: str = "pack"
) -> tuple[int, Stack, FakeMemory, OffloadEngine]:
    """The budget, model, counters and engine of the trial tests: weights on the device, a budget of six
    times the activations, and ``hook`` costing 1 ms of simulated time per saved tensor (:func:`slow_hooks`)."""
    act, model, memory = weights_on_the_device(x)
    sim = model.sim
    assert sim is not None
    budget = 6 * act
    engine = planned_engine(budget, memory, model, sim, trials=trials)
    slow_hooks(engine, sim, ms=1.0, hook=hook)
    return budget, model, memory, engine


def test_trials_time_the_plans_worth_comparing_and_keep_the_fastest(caplog: pytest.LogCaptureFixture) -> None:
    """The model's cheapest plan offloads (its copies hide behind compute), but every saved tensor the hooks see costs
    time the model does not know of. The plans worth comparing run four steps each, timed from step start to step
    start, and the fastest is kept: one that offloads nothing (no hooks at all). Every step stays within the budget,
    the gradients are the same, and later steps keep the plan."""
    x = torch.randn(BATCH, WIDTH)
    budget, model, memory, engine = slow_hooked_engine(x, trials=True)
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        steps = run_steps(engine, model, x, 2)  # the measuring steps
        planner = engine.planner
        assert planner is not None and planner.profile is not None
        model_choice = cheapest_plan(planner.candidates())
        compared = trial_plans(planner.profile, planner.candidates())
        assert model_choice.offload_bytes > 0 and len(compared) >= 2
        assert any(p.offload_bytes == 0 for p in compared)
        tried = []
        for _ in range(4 * len(compared)):
            steps += run_steps(engine, model, x, 1)  # a step's plan is chosen as it begins
            assert planner.trying
            tried.append((planner.plan.offload_bytes, planner.plan.checkpoint_blocks))  # type: ignore[union-attr]
        steps += run_steps(engine, model, x, 3)
    assert tried == [(p.offload_bytes, p.checkpoint_blocks) for p in compared for _ in range(4)]
    assert not planner.trying
    chosen = planner.plan
    assert chosen is not None and chosen.offload_bytes == 0 and chosen.checkpoint_blocks > 0 and chosen.fits
    assert [s["hooked"] for s in steps[-3:]] == [False, False, False]
    assert f"fastest of {len(compared)} plans timed" in caplog.text
    assert max(memory.peaks[2:]) <= budget
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))


def flushing_where(
    x: torch.Tensor, flushing: Callable[[BudgetPlanner], bool], count: int
) -> tuple[int, FakeMemory, OffloadEngine, list[dict[str, Any]]]:
    """A slow-hooked engine with trials run ``count`` steps after its first, the allocator's counter of cache flushes
    rising in each step that ``flushing(planner)`` names as the step ends: the budget, memory, engine and the steps
    run."""
    budget, model, memory, engine = slow_hooked_engine(x, trials=True)
    steps = run_steps(engine, model, x, 1)  # the engine makes its planner at its first step (a measuring one)
    planner = engine.planner
    assert planner is not None
    flushes = [0]
    memory.alloc_retries = lambda: flushes[0]  # type: ignore[attr-defined]
    end_step = planner.end_step

    def flushing_end(*args: Any, **kwargs: Any) -> None:
        flushes[0] += flushing(planner)
        end_step(*args, **kwargs)

    planner.end_step = flushing_end  # type: ignore[method-assign]
    return budget, memory, engine, steps + run_steps(engine, model, x, count)


def test_trials_time_one_plan_more_where_the_fastest_flushed_the_allocators_cache(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The allocator's counter of cache flushes rises in every step of the plan that would be kept (a full hard cap):
    one more plan, predicted to peak lower, is timed after the others, and the faster of the two is kept."""
    x = torch.randn(BATCH, WIDTH)
    _, model, _, engine = slow_hooked_engine(x, trials=True)
    run_steps(engine, model, x, 40)
    unflushed = engine.planner.plan  # type: ignore[union-attr]
    assert unflushed is not None and not engine.planner.trying  # type: ignore[union-attr]

    def flushing(planner: BudgetPlanner) -> bool:
        plan = planner.plan
        same = plan is not None and plan_trials.timing_key(plan) == plan_trials.timing_key(unflushed)
        return same and not planner.measuring

    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        budget, memory, engine, steps = flushing_where(x, flushing, 40)
    planner = engine.planner
    assert planner is not None
    assert not planner.trying
    timed = {(k, nbytes, light): ms for k, nbytes, ms, light in planner.timed_plans}
    below = [key for key in timed if key != (unflushed.checkpoint_blocks, unflushed.offload_bytes, 0)]
    assert "the allocator flushed its cache in 3 of 3 steps" in caplog.text
    stepped = [
        p
        for p in planner.candidates()  # type: ignore[arg-type]
        if p.peak <= (1 - plan_trials.FLUSH_STEP_DOWN) * unflushed.peak and p.fits and not p.light_blocks
    ]
    added = min(stepped, key=lambda p: (p.extra_ms, -p.peak))
    assert (added.checkpoint_blocks, added.offload_bytes, 0) in below
    kept = planner.plan
    assert kept is not None
    assert timed[(kept.checkpoint_blocks, kept.offload_bytes, 0)] == min(timed.values())
    assert max(memory.peaks[2:]) <= budget
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))


def test_a_kept_plan_that_flushes_where_its_timed_steps_did_not_gives_way_to_the_next_fastest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through the engine: the allocator's counter of cache flushes rises in every planned step of the plan the trials
    kept, never in its timed ones. After its first step and three such, the next fastest plan timed runs, once."""
    x = torch.randn(BATCH, WIDTH)
    kept: list[Plan] = []  # the plans of the planned steps, in order

    def flushing(planner: BudgetPlanner) -> bool:
        plan = planner.plan
        if plan is None or planner.trying or planner.measuring:
            return False
        kept.append(plan)
        return plan_trials.timing_key(plan) == plan_trials.timing_key(kept[0])

    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        budget, memory, engine, steps = flushing_where(x, flushing, 40)
    planner = engine.planner
    assert planner is not None
    timed = {(k, nbytes, light): ms for k, nbytes, ms, light in planner.timed_plans}
    assert len(timed) > 1
    first = [p for p in kept if p == kept[0]]
    assert len(first) == 4 and kept[:4] == first  # its first planned step settles; the next three flushed
    other = kept[4]
    assert other != kept[0] and all(p == other for p in kept[4:])  # and stays
    ranked = sorted(timed.items(), key=lambda item: item[1])
    assert ranked[0][0] == (kept[0].checkpoint_blocks, kept[0].offload_bytes, kept[0].light_blocks)
    assert ranked[1][0] == (other.checkpoint_blocks, other.offload_bytes, other.light_blocks)
    assert "the plan the trials kept" in caplog.text and "runs instead" in caplog.text
    assert max(memory.peaks[2:]) <= budget
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))


class CachedBefore(FakeMemory):
    """Counters of a process whose allocator holds ``cached`` bytes, unused, that something before the engine left
    (a model trained earlier, a validation loop, an earlier engine), until its cache is emptied."""

    cached = 0

    def reserved(self) -> int:
        return self.allocated() + self.cached

    def reserved_peak(self) -> int:
        return self.peak() + self.cached

    def release_cache(self) -> None:
        self.cached = 0


def test_what_the_process_cached_before_the_planner_does_not_count_as_its_measuring_steps_fragments() -> None:
    """A planner made in a process whose allocator caches 20x the activations that an earlier workload left plans as
    in a fresh one: its first step begins in an emptied cache. (Counting that cache as the measuring step's own
    fragments, plans aimed below zero and the most frugal plan ran: on a GPU after other tests, -6.45 GiB under a
    13.31 GiB budget.)"""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    chosen = []
    for cached in (0, 20 * act):
        model = Stack(SimulatedStreams(lag=0, bytes_per_ms=float(64 * MiB)))
        memory = CachedBefore(base=4 * act, transient=act * 12 // 10)
        memory.unhooked_model, memory.unhooked_input, memory.cached = model, x, cached
        assert model.sim is not None
        engine = planned_engine(6 * act, memory, model, model.sim)
        run_steps(engine, model, x, 4)
        planner = engine.planner
        assert planner is not None and planner.plan is not None
        chosen.append((planner.plan, planner.core.plan_budget, memory.cached))
        engine.close()
    assert chosen[1] == chosen[0] and chosen[0][1] > 0, chosen  # the same plan and aim; nothing left cached


@pytest.mark.parametrize("trials", [True, False])
@pytest.mark.parametrize(
    ("budget_share", "reserved_share", "empties"), [(8, 1.3, True), (8, 1.05, False), (6, 1.3, False)]
)
def test_a_kept_plan_empties_the_cache_once_where_its_first_step_found_it_holding_far_more_than_its_peak(
    trials: bool, budget_share: int, reserved_share: float, empties: bool
) -> None:
    """The measuring steps and the plans under trial leave memory cached in a layout of their own. The first step of
    the plan kept after them (and of a plan of other blocks or bytes after a correction) reads how much the allocator
    holds: past 1.10x the step's peak, where the budget has room for 1.15x it, the cache is emptied once before the
    next step; never at a step that measures, times a plan or repeats the plan it checked. (A budget of 8x the
    activations leaves that room above this model's peak, ~6.2x them; 6x does not.)"""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    assert model.sim is not None
    engine = planned_engine(budget_share * act, memory, model, model.sim, trials=trials)
    slow_hooks(engine, model.sim, ms=1.0)
    run_steps(engine, model, x, 1)  # the engine makes its planner at its first step
    planner = engine.planner
    assert planner is not None
    released: list[int] = []
    memory.release_cache = lambda: released.append(planner.step + 1)  # type: ignore[attr-defined]
    memory.reserved = lambda: int(reserved_share * memory.peak())  # type: ignore[attr-defined]
    checked: list[int] = []  # the steps whose end asked whether the cache is worth emptying
    check = planner.core.cache_worth_emptying

    def recording_check(peak: int, reserved: int) -> bool:
        checked.append(planner.step)
        return check(peak, reserved)

    planner.core.cache_worth_emptying = recording_check  # type: ignore[method-assign]
    ran: list[tuple[int, int] | None] = []  # per step from the second: its plan's blocks and bytes (None: measured
    # or timed against others)
    begin = planner.begin_step

    def recording_begin(position: Any, casts: Any = None) -> Any:
        plan = begin(position, casts)
        ran.append((plan.checkpoint_blocks, plan.offload_bytes) if plan is not None and not planner.trying else None)
        return plan

    planner.begin_step = recording_begin  # type: ignore[method-assign]
    steps = run_steps(engine, model, x, 30)
    kept = [
        step for step, (before, now) in enumerate(itertools.pairwise(ran), start=3) if now is not None and now != before
    ]
    assert kept and not planner.trying
    assert checked == kept  # each kept plan's first step, and no other (no step that measured or timed a plan)
    assert released == ([step + 1 for step in kept] if empties else [])  # the step after each kept plan's first
    for step in steps[1:]:
        assert_same_grads(step["grads"], steps[0]["grads"])


def _held_cache(memory: FakeMemory) -> dict[str, int]:
    """Reserved-memory counters on ``memory``: the allocator keeps what it held (``held``, what a test plants stands
    for what earlier steps left cached) until its cache is emptied; ``peak`` is what it held since the last reset."""
    state = {"held": 0, "peak": 0, "releases": 0}

    def reserved() -> int:
        state["held"] = max(state["held"], memory.peak())
        state["peak"] = max(state["peak"], state["held"])
        return state["held"]

    def release() -> None:
        state["held"] = 0
        state["releases"] += 1

    reset = memory.reset_peak

    def reset_peak() -> None:  # as torch.cuda.reset_peak_memory_stats: the reserved peak restarts at what is held
        reset()
        state["peak"] = state["held"]

    memory.reserved = reserved  # type: ignore[attr-defined]
    memory.reserved_peak = lambda: max(state["peak"], reserved())  # type: ignore[attr-defined]
    memory.release_cache = release  # type: ignore[attr-defined]
    memory.reset_peak = reset_peak  # type: ignore[method-assign]
    return state


@pytest.mark.parametrize("owns_peaks", [True, False])
def test_emptying_the_cache_is_not_read_as_a_step_that_reserved_past_the_budget(owns_peaks: bool) -> None:
    """Under a budget with no hard cap, the cache may hold more than the budget when a kept plan's first step finds it
    worth emptying. A caller that owns the peak counters (the Lightning callback) resets them when it chooses (here
    every other step, after the step began, as with gradient accumulation): the reserved peak read after the cache was
    emptied still holds what it held before, and that must not count as the next step reserving past the budget."""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    assert model.sim is not None
    engine = planned_engine(8 * act, memory, model, model.sim)
    state = _held_cache(memory)
    for index in range(12):
        planner = engine.planner
        if planner is not None and planner.step == 2:
            state["held"] = int(8.3 * act)  # what the measuring steps left cached, past the budget
        model.zero_grad(set_to_none=True)
        with engine:
            if not owns_peaks and engine.planner is not None and engine.planner.step % 2 == 1:
                memory._peak = 0  # the caller's reset, once per optimizer step
                state["peak"] = state["held"]
            loss = model(x)
        loss.backward()
        if index == 0:
            assert engine.planner is not None
            engine.planner.owns_peaks = owns_peaks
    planner = engine.planner
    assert planner is not None and planner.profile is not None
    assert state["releases"] == 2  # as the planner's first step began (nothing of its own cached) and once after
    assert planner.profile.correction == 0


def test_a_replan_checks_the_cache_its_measuring_steps_left() -> None:
    """After ``replan()`` (a new input shape) the measuring steps run again and leave the cache in their own layout:
    the first step of the plan kept after them is checked as the first plan's was, even where it is the same plan."""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    assert model.sim is not None
    engine = planned_engine(8 * act, memory, model, model.sim)
    memory.reserved = lambda: int(1.3 * memory.peak())  # type: ignore[attr-defined]
    released: list[int] = []
    run_steps(engine, model, x, 1)
    planner = engine.planner
    assert planner is not None
    memory.release_cache = lambda: released.append(planner.step + 1)  # type: ignore[attr-defined]
    run_steps(engine, model, x, 9)
    first = list(released)
    plan = planner.plan
    planner.replan()
    run_steps(engine, model, x, 10)
    assert len(first) == 1 and len(released) == 2 and planner.plan == plan
    assert released[1] > 10


def test_the_cache_is_left_alone_where_the_budget_has_no_room_for_a_layout_mapped_afresh() -> None:
    """A layout mapped afresh may reserve more than the cached one (under a hard cap close to the peak, it reached the
    cap and flushed the cache in every step): emptying is considered only where the budget holds 1.15x the peak, and
    only where the allocator holds more than 1.10x it."""
    planner = Planner(20 * GiB)
    assert planner.cache_worth_emptying(17 * GiB, 19 * GiB)  # 20 >= 19.55 of room; 19 > 18.7 held
    assert not planner.cache_worth_emptying(int(17.5 * GiB), 19 * GiB)  # 20 < 20.1: no room
    assert not planner.cache_worth_emptying(0, 19 * GiB)  # no peak read
    assert not planner.cache_worth_emptying(17 * GiB, 18 * GiB)  # 18 <= 18.7 held


def test_without_trials_the_models_cheapest_plan_runs() -> None:
    """``plan_trials=False``: the plan chosen from the measured profile runs from the first planned step on, even where
    the hooks cost what the model does not know of."""
    x = torch.randn(BATCH, WIDTH)
    _, model, _, engine = slow_hooked_engine(x, trials=False)
    run_steps(engine, model, x, 2)
    planner = engine.planner
    assert planner is not None and planner.profile is not None
    expected = cheapest_plan(planner.candidates())
    steps = run_steps(engine, model, x, 4)
    assert not planner.trying and planner.plan is not None
    assert (planner.plan.offload_bytes, planner.plan.checkpoint_blocks) == (
        expected.offload_bytes,
        expected.checkpoint_blocks,
    )
    assert all(s["hooked"] for s in steps)


def test_a_correction_that_leaves_no_timed_plan_fitting_runs_the_kind_of_plan_the_trials_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After the trials, a step that peaks above its plan corrects the model towards memory. Where no timed plan fits
    any more, the cheapest plan of the kind the trials kept (here: checkpointing, no copies) that fits now runs,
    untimed: what the trials taught is the machine's, and the correction moved only memory. A faster step's timing
    alone changes nothing once plans were timed. (The hooks cost time in backward here: a forward slowed by them would
    teach the model a cost per GiB offloaded that leaves nothing but checkpointing to compare.) Where no plan of that
    kind fits, the plans that fit are timed again: zoo row 00's replay, in ``tests/planner/test_replay.py``."""
    x = torch.randn(BATCH, WIDTH)
    budget, model, memory, engine = slow_hooked_engine(x, trials=True, hook="unpack")
    run_steps(engine, model, x, 2)
    planner = engine.planner
    assert planner is not None and planner.profile is not None
    compared = trial_plans(planner.profile, planner.candidates())
    run_steps(engine, model, x, 4 * len(compared) + 1)
    chosen = planner.plan
    assert chosen is not None and not planner.trying and chosen.offload_bytes == 0
    assert len(compared) > 1 and any(p.offload_bytes for p in compared)
    planner.profile = dataclasses.replace(planner.profile, forward_ms=planner.profile.forward_ms / 2)
    run_steps(engine, model, x, 2)  # a faster forward than the profile's: the plan timed fastest stays
    assert planner.plan == chosen
    memory.transient += budget // 45  # the loss's transient grows: no timed plan fits any more
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        run_steps(engine, model, x, 2)
        assert planner.profile.correction > 0 and not planner.trying
        steps = run_steps(engine, model, x, 12)
    plan = planner.plan
    assert plan is not None and plan.fits and not planner.trying and plan != chosen
    assert plan.offload_bytes == 0 and plan.checkpoint_blocks > chosen.checkpoint_blocks
    assert "this input's trials kept a plan that offloads nothing, and none they timed fits now" in caplog.text
    assert "timing plan" not in caplog.text
    assert max(memory.peaks[-10:]) <= budget
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))


@pytest.mark.parametrize(
    ("gap_share", "pressed", "expected_margin"),
    [(0.01, "flushed", 0.05), (0.06, "flushed", 0.11), (0.06, "near the budget", None), (0.06, None, 0.05)],
)
def test_plans_aim_lower_where_the_pressed_measuring_step_reserved_far_past_its_peak(
    gap_share: float, pressed: str | None, expected_margin: float | None
) -> None:
    """A hard cap counts reserved bytes. Where the measuring step's allocator was pressed for room (it flushed its
    cache, or reserved past what plans aim for) and reserved more past its peak than the plans' margin (5% of the
    budget) allows, plans aim lower by one and a half times that gap and the 2% of the budget a planned step may peak
    above its prediction before it replans; a small gap leaves the margin as it was, and so does any
    gap the allocator cached far below the budget without flushing (room the budget left, which a flush would free)."""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    sim = model.sim
    assert sim is not None
    budget = 6 * act
    gap = int(gap_share * budget)
    flushes = itertools.count()
    if pressed == "near the budget":
        memory.reserved_peak = lambda: max(memory.peak() + gap, int(0.96 * budget))  # type: ignore[attr-defined]
    else:
        memory.reserved_peak = lambda: memory.peak() + gap  # type: ignore[attr-defined]
    # Every read of the counter sees one more flush, while flushing: the step's count rose.
    memory.alloc_retries = lambda: next(flushes) if pressed == "flushed" else 0  # type: ignore[attr-defined]
    engine = planned_engine(budget, memory, model, sim)
    run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.plan is not None and planner.plan.fits
    aim = planner.plan_budget
    if pressed == "near the budget":  # the gap is then from the measuring step's peak up to 96% of the budget
        assert aim == pytest.approx(
            budget - 1.5 * (0.96 * budget - planner.core.rec.peaks.peak) - 0.02 * budget, rel=1e-3
        )
        assert aim < budget * 0.91 and planner.plan.peak <= budget  # (no plan may fit that aim: the most frugal runs)
    else:
        assert aim == pytest.approx(budget * (1 - expected_margin), rel=1e-3)
        assert planner.plan.peak <= aim


def test_every_plan_aims_below_the_measuring_steps_pressed_gap() -> None:
    """The measuring steps' pressed gap (6% of the budget: plans aim 11% below it) holds for every plan, those that
    offload nothing too: here the plan that fits that aim offloads over a slow link, every step within the budget and
    with the plain gradients. (Plans that offload nothing once aimed only 7% below the budget with expandable segments;
    no recorded run's plan changed without that rule, and it went.)"""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x, bytes_per_ms=float(4 * KiB))  # a slow link: offloading costs more
    budget = int(6 * act * 0.92 / 0.915)  # every block checkpointed, nothing offloaded, predicts 91.5% of it
    flushes = itertools.count()
    engines = []  # the measuring steps reserve 6% of the budget past their peak, planned steps 3%
    gap = lambda: 0.06 if engines[0].planner.measuring else 0.03  # noqa: E731
    memory.reserved_peak = lambda: memory.peak() + int(gap() * budget)  # type: ignore[attr-defined]
    memory.alloc_retries = lambda: next(flushes)  # type: ignore[attr-defined]
    engine = planned_engine(budget, memory, model, model.sim)  # type: ignore[arg-type]
    engines.append(engine)
    steps = run_steps(engine, model, x, 5)
    planner = engine.planner
    assert planner is not None and planner.plan is not None
    assert planner.plan_budget == pytest.approx(0.89 * budget, rel=1e-3)
    assert all(c.peak <= planner.plan_budget for c in planner.candidates() if c.fits)
    assert planner.plan.offload_bytes > 0 and all(s["hooked"] for s in steps)
    assert max(memory.peaks[2:]) <= budget
    for step in steps:
        assert_same_grads(step["grads"], reference_grads(x))


def test_an_impossible_budget_is_reported_with_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    _, model, _, engine = planned_stack(GiB // 2, base=GiB, transient=MiB)  # the weights alone exceed it
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        run_steps(engine, model, torch.randn(BATCH, WIDTH), 3)
    text = caplog.text
    assert "memory_budget=0.50 GiB: 1.00 GiB are allocated before the step begins" in text  # said before any step
    assert "does NOT fit" in text and "Even the most frugal plan needs" in text
    assert "weights, gradients and optimizer state take 1.00 GiB" in text


def test_running_out_of_memory_under_a_budget_is_explained_in_numbers(caplog: pytest.LogCaptureFixture) -> None:
    """An out-of-memory error inside the engine's context (forward) under a budget: the engine drops what the step
    held and says which step failed, what it held as it began and its peak; the error itself propagates."""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=0)
    with caplog.at_level(logging.WARNING, logger="lightning_offload"), pytest.raises(torch.cuda.OutOfMemoryError):
        with engine:
            model(torch.randn(BATCH, WIDTH))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not engine.installed
    assert (
        "memory_budget=2.00 GiB: out of memory in a measuring step, the most frugal step there is (7 of 8 blocks "
        "checkpointed, every activation offloaded). Weights, gradients and optimizer state took 1.00 GiB as it began"
    ) in caplog.text
    assert run_steps(engine, model, torch.randn(BATCH, WIDTH), 1)[0]["hooked"]  # the next step measures again


def test_a_step_that_raised_is_not_counted_as_measured() -> None:
    """A measuring step that runs out of memory never ended: the steps after it measure again, and a replan (a new
    input, as the capacity search asks for after each probe) gets its two measuring steps in full. Counted as ended, the
    failed step took one of them: on an H200 Llama-1B's plan at 10240 tokens under 24 GiB came from a single measuring
    step, before the new optimizer had its state (2.37 of 6.97 GiB), and ran out of memory."""
    _, model, _, engine = planned_stack(GiB + 64 * MiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    run_steps(engine, model, x, 1)
    planner = engine.planner
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with engine:
            model(x)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    engine.replan(measuring_steps=2)
    measuring = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        with engine:
            measuring.append(engine.planner.measuring)  # type: ignore[union-attr]
            loss = model(x)
        loss.backward()
    assert planner is engine.planner and measuring == [True, True, False, False]


class SpikyMemory(FakeMemory):
    """Counters whose peak a test can raise for the current step (a transient the model did not predict)."""

    spike = 0

    def peak(self) -> int:
        return super().peak() + self.spike

    def reset_peak(self) -> None:
        super().reset_peak()
        self.spike = 0


def test_a_planned_step_that_ran_out_of_memory_moves_the_plan_towards_memory() -> None:
    """Under a hard cap, planned steps reach the cap and the next allocation fails; the loop skips the batch and goes
    on. Each failure corrects the plan by what the step peaked past its prediction and at least 2% of the budget (the
    failed allocation is not in the peak), so the next step offloads more: never the same plan again."""
    x = torch.randn(BATCH, WIDTH)
    budget, model, memory, engine = planned_at_twice_the_activations(x, SpikyMemory)
    planner = engine.planner
    assert planner is not None and planner.plan is not None and planner.profile is not None
    offloaded, corrections = [], []
    for _ in range(3):
        offloaded.append(planner.plan.offload_bytes)
        corrections.append(planner.profile.correction)
        model.zero_grad(set_to_none=True)
        with pytest.raises(torch.cuda.OutOfMemoryError), engine:
            model(x)
            memory.spike = budget - memory.peak() - 1  # the step reached the cap ...
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")  # ... and the next allocation failed
    assert offloaded == sorted(set(offloaded)), offloaded
    assert all(b - a >= 0.02 * budget for a, b in itertools.pairwise(corrections)), corrections


def test_a_measuring_step_that_ran_out_of_memory_below_its_watermark_is_measured_again_frugally() -> None:
    """Under the device's own budget the first measuring step keeps everything up to its watermark; here the loss's
    transient does not fit beside what it kept, below that watermark. The failed step is measured again, frugally
    (offloading from its first saved tensor): the steps after it train and a plan follows. (Measured again as it was,
    it would fail the same way for ever.)"""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    total = 100 * GiB
    _, model, memory, engine = planned_stack(
        "auto", base=80 * GiB, transient=0, total=total, memory_type=SpikyMemory, bytes_per_ms=float(64 * MiB)
    )
    failed = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        try:
            with engine:
                loss = model(x)
                stats = engine.collect_stats(wait=False)
                # The loss's logits, 20 GiB on top of what the step keeps: they fit only where activations left.
                need = 100 * GiB - act // 2 + stats.eligible_bytes - stats.offloaded_bytes
                memory.spike = min(need, total) - memory.peak()
                if need > total:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            loss.backward()
            failed.append(False)
        except torch.cuda.OutOfMemoryError:
            failed.append(True)
    planner = engine.planner
    assert failed == [True, False, False, False, False]
    assert planner is not None and planner.plan is not None and not planner.measuring


def test_a_replan_drops_the_measuring_step_still_open() -> None:
    """The callback replans at the batch whose shape changed, before the engine's step begins: the step of the old
    shape, still open (a step ends as the next begins), must not count as one of the new shape's measuring steps, nor
    lend the new one its block sizes."""

    def measured(first_batch: int) -> tuple[list[bool], int, int]:
        _, model, _, engine = planned_stack(GiB + 64 * MiB, base=GiB, transient=MiB)
        run_steps(engine, model, torch.randn(first_batch, WIDTH), 1)
        engine.replan()
        measuring = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with engine:
                measuring.append(engine.planner.measuring)  # type: ignore[union-attr]
                loss = model(torch.randn(4 * BATCH, WIDTH))
            loss.backward()
        profile = engine.planner.profile  # type: ignore[union-attr]
        assert profile is not None
        return measuring, profile.block_bytes, profile.eligible

    assert measured(BATCH) == measured(4 * BATCH)
    assert measured(BATCH)[0] == [True, True, False]


def test_a_frugal_measuring_step_that_fails_before_saving_anything_is_called_frugal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under a budget the user gives, a measuring step offloads from its first saved tensor: failing before it saved
    one (the optimizer's state, say), it is still the most frugal step there is, not "the first measuring step"."""
    _, _, _, engine = planned_stack(2 * GiB, base=GiB, transient=0)
    with caplog.at_level(logging.WARNING, logger="lightning_offload"), pytest.raises(torch.cuda.OutOfMemoryError):
        with engine:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "out of memory in a measuring step, the most frugal step there is" in caplog.text


def test_replan_measures_again() -> None:
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    assert [s["hooked"] for s in run_steps(engine, model, x, 3)] == [True, True, False]
    engine.replan()  # the optimizer's state exists by now: one measuring step is enough, where it pins nothing
    assert [s["hooked"] for s in run_steps(engine, model, x, 2)] == [True, False]
    engine.replan()  # a new shape: its measuring step allocates host buffers of new sizes, and measures once more
    assert [s["hooked"] for s in run_steps(engine, model, torch.randn(2 * BATCH, WIDTH), 3)] == [True, True, False]
    engine.replan(measuring_steps=2)  # a new optimizer too
    assert [s["hooked"] for s in run_steps(engine, model, x, 3)] == [True, True, False]
    with pytest.raises(ValueError, match=r"replan\(measuring_steps=0\): expected an int >= 1"):
        engine.replan(measuring_steps=0)


def step_on(engine: OffloadEngine, model: nn.Module, x: torch.Tensor, key: Any = None) -> dict[str, Any]:
    """One step on ``x``, named to the engine as ``key`` (its shape by default) first; its grads, whether it measured,
    and the eligible bytes of the profile it planned from (``None`` while measuring)."""
    engine.input_changed(tuple(x.shape) if key is None else key)
    model.zero_grad(set_to_none=True)
    with engine:
        planner = engine.planner
        assert planner is not None
        measuring = planner.measuring
        profile = planner.profile
        loss = model(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    eligible = None if measuring or profile is None else profile.eligible
    return {"grads": grads, "measuring": measuring, "eligible": eligible}


def test_an_input_met_before_runs_its_own_plan_without_measuring_again() -> None:
    """Inputs whose length changes from batch to batch: each new one is measured once, and one that comes back runs
    the plan made from its own profile at once (it measured at every change before: the most frugal step there is, at
    every step). The step before a change counts for the input it ran: it is not dropped. (The large input's first
    measuring step allocated host buffers of new sizes, so it measures once more when it comes back.)"""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    small, large = torch.randn(BATCH, WIDTH), torch.randn(2 * BATCH, WIDTH)
    order = [small, small, large, small, large, small, large, large]
    steps = [step_on(engine, model, x) for x in order]
    assert [s["measuring"] for s in steps] == [True, True, True, False, True, False, False, False]
    eligible = {len(x): activation_bytes(x) for x in (small, large)}
    assert [s["eligible"] for s in steps[5:]] == [eligible[len(x)] for x in order[5:]]
    assert steps[3]["eligible"] == eligible[len(small)]
    assert engine.planner is not None and engine.planner.input_key == tuple(large.shape)
    for x, s in zip(order, steps, strict=True):
        assert_same_grads(s["grads"], reference_grads(x))


def test_the_input_named_before_the_first_step_is_the_first_steps() -> None:
    """The planner is made as the first step begins: the input named before it is handed on, so the second step of the
    same input measures on as the second measuring step (every block checkpointed: the first ran one in full), not as
    a new input's first (one block in full again)."""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    step_on(engine, model, x)
    assert engine.planner is not None and engine.planner.input_key == tuple(x.shape)
    engine.input_changed(tuple(x.shape))
    with engine:
        checkpointed = checkpointed_modules(model)
        loss = model(x)
    loss.backward()
    assert engine.planner.measuring or engine.planner.profile is None
    assert sorted(checkpointed) == EVERY_BLOCK


def test_replan_forgets_the_plans_kept_for_other_inputs() -> None:
    """``replan()`` says the model or the optimizer changed: no input's plan is taken up again unmeasured."""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    small, large = torch.randn(BATCH, WIDTH), torch.randn(2 * BATCH, WIDTH)
    for x in (small, small, large, large):
        step_on(engine, model, x)
    engine.replan()
    assert [step_on(engine, model, x)["measuring"] for x in (small, small, large, large)] == [True, False, True, False]


def test_the_plan_trials_of_an_input_go_on_where_they_stopped_when_it_comes_back() -> None:
    """An input left while its plans were under trial keeps its timed steps: coming back, the same trials go on (they
    are not started over, nor is the input measured again)."""
    x = torch.randn(BATCH, WIDTH)
    _, model, _, engine = slow_hooked_engine(x, trials=True)
    for _ in range(4):  # two measuring steps, then trials
        step_on(engine, model, x, key="a")
    planner = engine.planner
    assert planner is not None and planner.trying
    plan = planner.plan
    step_on(engine, model, x, key="a")  # closed by the change below: it counts for "a"
    timed = planner.trial_steps
    assert sum(len(ms) for *_, ms in timed) >= 1
    assert step_on(engine, model, x, key="b")["measuring"]
    back = step_on(engine, model, x, key="a")
    assert not back["measuring"] and planner.trying and planner.plan == plan
    assert [entry[:3] for entry in planner.trial_steps] == [entry[:3] for entry in timed]
    assert [ms[: len(before)] for (*_, ms), (*_, before) in zip(planner.trial_steps, timed, strict=True)] == [
        before for *_, before in timed
    ]


def test_input_changed_is_refused_inside_the_block_and_for_a_key_that_cannot_be_kept() -> None:
    _, _, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    with pytest.raises(TypeError, match="unhashable"):
        engine.input_changed([BATCH, WIDTH])
    # A tensor hashes by identity and compares element by element: the same batch data in a new tensor would read as
    # a new input, and comparing two keys would raise mid-switch.
    with pytest.raises(TypeError, match=r"input_changed\(key=<tensor>\): expected the input's shapes"):
        engine.input_changed(torch.zeros(BATCH, WIDTH))
    with engine, pytest.raises(RuntimeError, match=r"input_changed\(\) inside the engine's block"):
        engine.input_changed((BATCH, WIDTH))


def test_under_the_devices_own_budget_the_measuring_step_offloads_from_its_watermark() -> None:
    """With ``memory_budget="auto"`` the first step keeps everything until allocated memory passes the budget less a
    tenth; from there on everything saved so far and after leaves: free where the model fits, safe where it does not.
    The next measuring step is frugal (the first one's peak was its watermark's): every block checkpointed (the first
    step said what a block saves in full), everything offloaded from the first saved tensor."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    total = 100 * GiB
    watermark = default_budget(total) - int(default_budget(total) * 0.10)
    for base, offloads in ((watermark - act // 2, True), (GiB, False)):
        _, model, memory, engine = planned_stack("auto", base=base, transient=0, total=total)
        # Every read of the counter is recorded (the engine reads none before its first step begins).
        seen: list[int] = []
        allocated = memory.allocated
        memory.allocated = lambda seen=seen, allocated=allocated: seen.append(allocated()) or seen[-1]  # type: ignore[method-assign]
        first = run_steps(engine, model, x, 1)[0]
        if offloads:
            assert first["offloaded"] == act
            tripped = next(i for i, value in enumerate(seen) if value > watermark)
            assert tripped > 3 and seen[tripped - 1] <= watermark  # checked as forward grew, tripped halfway
            seen.clear()
            assert run_steps(engine, model, x, 1)[0]["offloaded"] == activation_bytes(x, checkpointed=EVERY_BLOCK)
            assert max(seen) < watermark  # it tripped below the watermark of the first step
        else:
            assert first["offloaded"] == 0
            assert max(seen) <= watermark


def test_under_a_users_budget_the_measuring_steps_checkpoint_every_block_and_offload_everything() -> None:
    """A budget the user gives may be a hard cap, and what the loss and backward add is not known yet: both measuring
    steps offload everything from the first saved tensor and checkpoint the blocks: the first every block but the
    second (what a block saves in full), the next every block (the most frugal step there is, with the optimizer's
    state); then the plan takes over. The profile still describes the model without checkpointing."""
    x = torch.randn(BATCH, WIDTH)
    act, frugal = activation_bytes(x), activation_bytes(x, frugal=True)
    least = activation_bytes(x, checkpointed=EVERY_BLOCK)
    assert least < frugal < act
    _, model, _, engine = planned_stack(3 * GiB, base=GiB, transient=0)
    seen = []  # per step: blocks it ran checkpointed, bytes it offloaded
    for _ in range(3):
        offloaded = run_steps(engine, model, x, 1)[0]["offloaded"]
        seen.append((checkpointed_modules(model), offloaded))
    frugal_blocks = [f"blocks.{i}" for i in range(BLOCKS) if i != 1]
    assert seen == [(frugal_blocks, frugal), (EVERY_BLOCK, least), ([], 0)]  # then the plan keeps everything
    profile = engine.planner.profile  # type: ignore[union-attr]
    assert profile is not None and profile.eligible == act and profile.blocks == BLOCKS
    assert profile.block_bytes - profile.block_input_bytes == (act - frugal) // (BLOCKS - 1)


def test_default_budget_leaves_a_margin() -> None:
    assert default_budget(140 * GiB) == 140 * GiB - int(140 * GiB * 0.08)
    assert default_budget(16 * GiB) == 13 * GiB
    assert default_budget(2 * GiB) == GiB  # the 3 GiB margin would leave a negative budget: half of it instead


class CappedMemory(FakeMemory):
    """A process allowed half of a 100 GiB device (``torch.cuda.set_per_process_memory_fraction(0.5)``)."""

    def capacity(self) -> int:
        return self.total() // 2


def test_the_default_budget_is_what_the_process_may_use_under_its_memory_fraction() -> None:
    """On a shared GPU capped at half of its memory, the default budget is that half less a margin: the device's
    total would let plans keep activations the cap cannot hold."""
    assert BudgetPlanner(None, CappedMemory(base=GiB, transient=0)).budget == default_budget(50 * GiB)


def test_a_budget_above_what_the_process_may_use_is_a_warning_naming_both(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        planner = BudgetPlanner(60 * GiB, CappedMemory(base=GiB, transient=0))
    assert planner.budget == 60 * GiB  # the user's figure stands: said, not replaced
    assert "memory_budget=60.00 GiB is more than the 50.00 GiB this process may use" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        BudgetPlanner(40 * GiB, CappedMemory(base=GiB, transient=0))
    assert "more than" not in caplog.text


def test_planning_is_off_for_manual_overrides_and_without_device_memory() -> None:
    assert not OffloadOptions.create("t", max_offload_bytes=GiB).plans
    assert not OffloadOptions.create("t", mode="sync").plans
    assert not OffloadOptions.create("t", memory_budget=None).plans
    assert OffloadOptions.create("t", memory_budget="40GiB").memory_budget == 40 * GiB
    engine = offload_activations(compute_device="cpu")  # "auto" needs the CUDA allocator's counters
    with engine:
        pass
    assert engine.planner is None
    model = Stack()
    with pytest.warns(UserWarning, match=r"memory_budget is not used: .*no manual override"):
        engine = offload_activations(compute_device="cpu", model=model, checkpoint="auto", memory_budget="1GiB")
    assert not engine.options.plans  # checkpointing by hand switches planning off


@pytest.mark.parametrize(
    ("value", "expected"),
    [("40GiB", 40 * GiB), ("512 MiB", 512 * MiB), ("80GB", 80 * 10**9), ("1.5G", int(1.5 * GiB)), (1024, 1024)],
)
def test_memory_budget_accepts_sizes(value: Any, expected: int) -> None:
    assert OffloadOptions.create("t", memory_budget=value).memory_budget == expected


@pytest.mark.parametrize("value", ["40 parsecs", "-1GiB", 0, -5, True, 1.5, "GiB"])
def test_memory_budget_rejects_nonsense_naming_the_argument(value: Any) -> None:
    with pytest.raises(ValueError, match=r"offload_activations\(memory_budget=.*\): memory_budget must be 'auto'"):
        offload_activations(memory_budget=value)


def test_max_offload_bytes_auto_is_retired_with_a_pointer_to_memory_budget() -> None:
    with pytest.raises(ValueError, match="memory_budget="):
        offload_activations(max_offload_bytes="auto")


def test_planner_unit_without_engine() -> None:
    memory = FakeMemory(base=GiB, transient=0)
    planner = BudgetPlanner(None, memory)
    assert planner.budget == default_budget(100 * GiB)


def test_the_head_is_where_this_forwards_last_block_ended() -> None:
    """A measuring step holds back copies above where its forward's last block ended; a forward whose blocks all ran
    in an earlier forward (twice forward before one backward) holds nothing back."""
    planner = BudgetPlanner(GiB, PeakCounter(), Stack())
    position = 100
    planner.begin_step(lambda: position)
    assert planner.measuring
    model = planner._blocks._model
    assert model is not None
    model(torch.randn(4, WIDTH)).backward()  # the blocks' hooks mark positions (all 100 here)
    planner._blocks._marks = {key: (start, 200, nbytes) for key, (start, _, nbytes) in planner._blocks._marks.items()}
    assert planner.head_start(50, 300) == 200
    assert planner.head_start(250, 300) is None
    planner.remove()


def test_expandable_segments_switched_on_unless_the_user_configured_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_offload import device_memory as budget

    calls: list[str] = []
    monkeypatch.setattr(budget, "_switched", False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    # Cached fixed segments are returned as it switches: the next allocations must map expandable ones.
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not budget.use_expandable_segments(torch.device("cpu"))  # only CUDA's allocator
    assert calls == []
    assert budget.use_expandable_segments()
    assert calls == ["expandable_segments:True", "empty_cache"]
    assert not budget.use_expandable_segments()  # once per process
    monkeypatch.setattr(budget, "_switched", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the off-switch
    assert not budget.use_expandable_segments()
    assert calls == ["expandable_segments:True", "empty_cache"]


@pytest.mark.parametrize(
    ("switched", "env", "expected"),
    [
        (False, {}, False),
        (True, {}, True),
        (False, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}, True),
        (False, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        (False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ],
)
def test_expandable_segments_says_what_the_process_runs_with(
    monkeypatch: pytest.MonkeyPatch, switched: bool, env: dict[str, str], expected: bool
) -> None:
    """Switched on by an engine in this process, or asked for in the environment (the benchmark records it per row:
    plain rows after an offloading one inherit the setting)."""
    from lightning_offload import device_memory

    monkeypatch.setattr(device_memory, "_switched", switched)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert device_memory.expandable_segments() is expected


def test_the_allocator_is_left_alone_until_copies_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switching the allocator to expandable segments cost a small model 3 ms per 14 ms step on an H200 with nothing
    offloaded: the engine asks for it only once a step is about to offload, and only once."""
    import lightning_offload.datapath as datapath_module

    calls: list[str] = []
    monkeypatch.setattr(datapath_module, "use_expandable_segments", lambda device: calls.append(device.type) or True)
    x = torch.randn(BATCH, WIDTH)
    sim, model, _, fits = planned_stack("auto", base=GiB, transient=MiB)
    run_steps(fits, model, x, 4)  # measured below the watermark, then no hooks at all
    assert calls == []
    offloads = planned_engine(3 * GiB, FakeMemory(base=GiB, transient=MiB), model, sim)
    # A user's budget: the measuring steps offload from their first saved tensor, so the allocator switches as the
    # first step begins, before it allocates anything (what it allocated in fixed segments before its first copy
    # fragmented them: on an H200, small-h512's floor budget ran out of memory so).
    emptied: list[int] = []
    monkeypatch.setattr(StepMarks, "cache_emptied", lambda marks: emptied.append(offloads.planner.step))  # type: ignore[union-attr]
    offloads.install()
    assert calls == ["cpu"]
    assert emptied == [1]  # the first step's peaks count from the switch
    offloads.uninstall()
    run_steps(offloads, model, x, 3)
    assert set(calls) == {"cpu"}


class PeakCounter:
    """Allocator counters that report whatever peak the test sets."""

    def __init__(self) -> None:
        self.value = 0

    def total(self) -> int:
        return 100 * GiB

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        return self.value

    def reset_peak(self) -> None:
        pass


def test_a_planned_step_that_peaks_where_its_plan_predicted_keeps_the_plan() -> None:
    """A plan that checkpoints blocks peaks in backward with one block rebuilt, and its prediction counts that block:
    a step peaking there is no news (an H200 run read it as a heavier step and went to full offload at twice the step
    time). Only a peak above the prediction moves the plan, towards memory."""
    memory = PeakCounter()
    planner = BudgetPlanner(60 * GiB, memory)
    # What a measuring step of an 8B LoRA model at 8k tokens saw (no model here: the planner is driven directly).
    planner.profile = StepProfile(
        peak=25 * GiB,
        resident=0,
        eligible=72 * GiB,
        forward_ms=410.0,
        link_bytes_per_ms=55e6,
        blocks=32,
        block_bytes=2 * GiB,
        block_input_bytes=64 * MiB,
        block_share=0.95,
        backward_ms=560.0,
        prefetch_bytes=2 * GiB,
    )
    planner.core.rec.measure_left = 0
    planner.core._choose()
    plan = planner.plan
    assert plan is not None and plan.checkpoint_blocks > 0 and plan.fits
    # The candidates a diagnosis lists (one per number of checkpointed blocks) hold the chosen plan as their cheapest.
    candidates = planner.candidates()
    assert len(candidates) == 33 and min(c.extra_ms for c in candidates if c.fits) == plan.extra_ms

    def planned_step(peak: int) -> None:
        assert planner.begin_step(lambda: 0) == plan
        memory.value = peak
        eligible = 72 * GiB - plan.checkpoint_blocks * (2 * GiB - 64 * MiB)
        planner.end_step(OffloadStats(eligible_bytes=eligible, offloaded_bytes=plan.offload_bytes), 410.0, 700.0)

    planned_step(plan.peak)
    assert planner.plan == plan
    planned_step(plan.peak + 3 * GiB)  # heavier than predicted by 5% of the budget: more must go, at more cost
    heavier = planner.plan
    assert heavier is not None and heavier.extra_ms > plan.extra_ms
    assert (
        heavier.checkpoint_blocks * 2 * GiB + heavier.offload_bytes
        > plan.checkpoint_blocks * 2 * GiB + plan.offload_bytes
    )


class PartsBlock(nn.Module):
    """Two parts with residual additions between them, as a decoder layer's attention and MLP; ``BLOCK_MS`` of
    simulated compute."""

    def __init__(self, sim: SimulatedStreams | None) -> None:
        super().__init__()
        self.first, self.second, self.sim = Mix(WIDTH, 2), Mix(WIDTH, 2), sim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sim is not None:
            self.sim.advance(BLOCK_MS)
        x = x + self.first(x)
        return x + self.second(x)


def parts_stack(sim: SimulatedStreams | None) -> Stack:
    model = Stack(sim)
    torch.manual_seed(1)
    model.blocks = nn.ModuleList(PartsBlock(sim) for _ in range(BLOCKS))
    return model


def by_parts(*blocks: int) -> list[str]:
    return [f"blocks.{i}.{part}" for i in blocks for part in ("first", "second")]


def measuring_steps_by_parts(budget: int) -> tuple[list[list[str]], OffloadEngine]:
    """Three steps of the parts model under ``budget`` (1 GiB of weights, no transient): the modules each ran
    checkpointed; the gradients of every step equal the plain model's."""
    x = torch.randn(BATCH, WIDTH)
    reference = parts_stack(None)
    reference(x).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
    sim = SimulatedStreams(lag=0)
    model = parts_stack(sim)
    engine = planned_engine(budget, FakeMemory(base=GiB, transient=0), model, sim)
    seen = []
    for _ in range(3):
        step = run_steps(engine, model, x, 1)[0]
        seen.append(checkpointed_modules(model))
        assert_same_grads(step["grads"], expected)
    return seen, engine


def test_the_first_measuring_step_checkpoints_blocks_by_their_parts_and_measures_them() -> None:
    """Under a user's budget the first measuring step checkpoints every block but the second by its parts (one part
    rebuilt at a time, the most frugal step), and measures the second block and its parts in full. A block rebuilt
    whole fits the budget, so the second measuring step checkpoints them whole, as most plans run. The profile holds
    what each way saves: a part in full 3 rows (input, tanh's output), a block 6; whole-checkpointed 1 row (its input),
    by parts 2 (each part's input)."""
    seen, engine = measuring_steps_by_parts(3 * GiB)
    assert seen[:2] == [by_parts(0, *range(2, BLOCKS)), EVERY_BLOCK]
    profile = engine.planner.profile  # type: ignore[union-attr]
    row = BATCH * WIDTH * 4
    assert profile is not None and profile.blocks == BLOCKS and profile.splittable
    assert (profile.block_bytes, profile.part_bytes, profile.block_input_bytes, profile.split_input_bytes) == (
        6 * row,
        3 * row,
        row,
        2 * row,
    )


def test_where_a_block_rebuilt_whole_would_pass_the_budget_the_second_measuring_step_also_goes_by_parts() -> None:
    """The first measuring step peaked at the weights' 1 GiB; a block rebuilt whole adds 1.5 x its 3 rows beyond the
    largest part, past what plans aim for (5% below a budget of 1 GiB + 200 KiB): the second step also checkpoints
    by parts, and the profile measured that way still tells both ways apart."""
    seen, engine = measuring_steps_by_parts(int((GiB + 200 * KiB) / 0.95) - 100 * KiB)
    assert seen[:2] == [by_parts(0, *range(2, BLOCKS)), by_parts(*range(BLOCKS))]
    profile = engine.planner.profile  # type: ignore[union-attr]
    row = BATCH * WIDTH * 4
    assert profile is not None and profile.splittable
    assert (profile.block_bytes, profile.part_bytes, profile.block_input_bytes, profile.split_input_bytes) == (
        6 * row,
        3 * row,
        row,
        2 * row,
    )
    assert profile.eligible == BLOCKS * 6 * row + row  # extrapolated to no checkpointing; the loss saves a row


def test_a_frugal_measuring_step_expected_within_the_fit_margin_of_the_budget_is_announced_before_it_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first measuring step peaked at 1.5 GiB under a 1.59 GiB budget; the optimizer then allocated 0.08 GiB of
    state: the second, as frugal as any plan, should need 1.58 GiB. That is within the budget but within the fit
    margin below it (plans aim at 1.51 GiB, 5% below), where no plan may run: under a hard cap the allocator's
    fragments take such a step past it (zoo row 05 on an H100: 0.3 MB short of its 0.76 GiB cap, out of memory with
    0.13 GiB of fragments). The planner says so before the step, with the aim, not after it fails."""
    x = torch.randn(BATCH, WIDTH)
    _, model, memory, engine = planned_stack(GiB + 600 * MiB, base=GiB, transient=GiB // 2)
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        run_steps(engine, model, x, 1)
        memory.base += 80 * MiB
        assert "should need" not in caplog.text
        run_steps(engine, model, x, 1)
    assert "should need about 1.58 GiB" in caplog.text, caplog.text
    assert "within the fit margin below the budget (plans aim at 1.51 GiB)" in caplog.text
    assert "If this is a hard limit, it may run out of memory there" in caplog.text  # not "does not train": it may


def test_a_frugal_measuring_step_expected_to_pass_the_budget_is_announced_with_the_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first measuring step peaked at 1.5 GiB (1 GiB of weights, 0.5 GiB of the loss's transient) under a 1.6 GiB
    budget; the optimizer then allocated 0.25 GiB of state: the second, as frugal as any plan, should need 1.75 GiB,
    and the planner says so before it runs, naming what dominates. Without the optimizer's state nothing is said."""
    x = torch.randn(BATCH, WIDTH)
    for state, warned in ((GiB // 4, True), (0, False)):
        _, model, memory, engine = planned_stack(GiB + 600 * MiB, base=GiB, transient=GiB // 2)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_offload"):
            run_steps(engine, model, x, 1)
            memory.base += state  # the optimizer's state, allocated at the first step
            assert "should need" not in caplog.text
            run_steps(engine, model, x, 1)
        assert ("should need about 1.75 GiB" in caplog.text) == warned, caplog.text
        if warned:
            assert "the one before it peaked at 1.50 GiB by the end of its backward, and 0.25 GiB more" in caplog.text
            assert "Weights, gradients and optimizer state take 1.25 GiB" in caplog.text
            assert "other transients (the loss and logits among them; every activation leaves) 0.50 GiB" in caplog.text


def test_allocator_counters_are_read_from_one_copy_of_the_nested_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner and the callback read the allocator's counters several times a step: from torch's nested statistics
    (one read), not through ``torch.cuda.memory_allocated`` and its siblings, which flatten them all each call (~100 us
    of host time each on an H200's host, paid in full by a host-bound step)."""
    from lightning_offload import device_memory

    reads: list[int] = []
    nested = {
        "allocated_bytes": {"all": {"current": 3, "peak": 5}, "large_pool": {"current": 3, "peak": 5}},
        "reserved_bytes": {"all": {"current": 8, "peak": 13}},
        "num_alloc_retries": 2,
    }
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: reads.append(index) or nested, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    counters = device_memory.read_counters(torch.device("cuda", 1))
    assert counters == device_memory.AllocatorCounters(
        allocated=3, peak=5, reserved=8, reserved_peak=13, alloc_retries=2
    )
    assert reads == [1]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    device_memory.read_counters(torch.device("cuda"))  # no index: the current device
    assert reads == [1, 2]
    memory = device_memory.DeviceMemory(torch.device("cuda", 1))
    assert (memory.allocated(), memory.peak(), memory.reserved(), memory.reserved_peak(), memory.alloc_retries()) == (
        3,
        5,
        8,
        13,
        2,
    )
    # Before CUDA is initialized there is nothing to read: every counter is 0.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert device_memory.read_counters(torch.device("cuda", 0)) == device_memory.AllocatorCounters(0, 0, 0, 0, 0)


class SwitchingAllocator(PeakCounter):
    """Counters of an allocator whose reserved peak (9.8 GiB of a 10 GiB budget) was cached segments until the engine
    switched it and emptied its cache (the reserved peak then restarts at what is reserved: 1 GiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.value = 2 * GiB
        self.cached_peak = int(9.8 * GiB)

    def reserved(self) -> int:
        return GiB

    def reserved_peak(self) -> int:
        return max(self.cached_peak, GiB)

    def reset_peak(self) -> None:
        self.cached_peak = 0


@pytest.mark.parametrize("emptied", [True, False])
def test_the_segments_returned_as_a_step_begins_do_not_count_as_its_reserved_peak(emptied: bool) -> None:
    """The allocator emptied its cache as the first measuring step began (the switch to expandable segments): the
    segments it returned are not the step's reserved bytes, so the step does not read as pressed for room, and what
    plans aim for stays at the budget's margin."""
    memory = SwitchingAllocator()
    planner = BudgetPlanner(10 * GiB, memory)
    assert planner.begin_step(lambda: 0) is None  # a measuring step
    memory.cached_peak = int(9.8 * GiB)  # the counters still hold the cached segments' peak
    if emptied:
        planner.marks.cache_emptied()
    planner.end_step(OffloadStats(eligible_bytes=GiB, offloaded_bytes=GiB), forward_ms=10.0, link_bytes_per_ms=1e6)
    margin = 10 * GiB - planner.plan_budget
    pressed = int(1.5 * (int(9.8 * GiB) - 2 * GiB) + 0.02 * 10 * GiB)
    # (The fit margin's prior: 10% of the room the budget leaves above the step's base, none allocated here.)
    assert planner.fit_margin == int(0.1 * 10 * GiB)
    assert margin == (max(int(0.05 * 10 * GiB), planner.fit_margin) if emptied else max(pressed, planner.fit_margin))


def test_a_plan_that_does_not_fit_is_a_warning_with_what_it_needs_against_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A budget the weights fit but no plan does: said as a warning (seen without any logging set up) as the plan is
    chosen, before a hard cap would raise, with what the most frugal plan needs against the budget. A model without
    repeated blocks has no frugal measuring step to warn about: the plan is the first and only word of it."""
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(MiB))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
    memory = FakeMemory(base=GiB, transient=64 * MiB)
    engine = planned_engine(GiB + 32 * MiB, memory, model, sim)
    x = torch.randn(BATCH, WIDTH)
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        for _ in range(3):
            with engine:
                loss = model(x).square().mean()
            loss.backward()
    planner = engine.planner
    assert planner is not None and planner.plan is not None and not planner.plan.fits
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        "does NOT fit the budget of 1.03 GiB" in text and "Even the most frugal plan needs 1.06" in text
        for text in warned
    ), warned


def test_a_replans_measuring_step_is_not_taken_for_a_step_of_the_plan_it_arrives_at_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After :meth:`replan` the measuring step offloads everything with copies barely ahead of compute, so it waits
    for copies far longer than any plan. Where its profile leads to the very plan that ran before, that step must not
    count as a step of the plan: its waits would teach the model a link share of 1% for good (kept for every later
    measurement), and move the plan to checkpointing every block."""
    x = torch.randn(BATCH, WIDTH)
    act = activation_bytes(x)
    sim, model, engine = offloading_over_a_slow_link(act)
    run_steps(engine, model, x, 5)
    planner = engine.planner
    assert planner is not None and planner.plan is not None
    before = planner.plan
    assert before.offload_bytes > 0 and before.checkpoint_blocks == 0
    engine.replan()
    sim.bytes_per_ms = float(8 * KiB)  # the measuring step waits long for its copies (its measured link is the same)
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        run_steps(engine, model, x, 1)
        sim.bytes_per_ms = float(512 * KiB)
        steps = run_steps(engine, model, x, 3)
    assert planner.profile is not None and planner.profile.link_share == 1.0
    assert "waited" not in caplog.text
    assert planner.plan == before
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


@pytest.mark.parametrize("value", [1.5, True, "2", None])
def test_replan_refuses_a_measuring_step_count_that_is_not_an_int_naming_it(value: Any) -> None:
    """``replan(measuring_steps=1.5)`` measured two steps (1.5 counted down to 0.5), ``True`` one; neither is a count.
    Refused like 0, quoting the value, with the planner left as it was (no step dropped, nothing to measure)."""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    run_steps(engine, model, x, 3)
    planner = engine.planner
    assert planner is not None and planner.profile is not None
    with pytest.raises(ValueError, match=rf"replan\(measuring_steps={value!r}\): expected an int >= 1"):
        engine.replan(measuring_steps=value)
    assert planner.profile is not None and not run_steps(engine, model, x, 1)[0]["hooked"]  # still planned


def test_an_input_whose_measuring_step_ran_out_of_memory_measures_frugally_when_it_comes_back() -> None:
    """Under the device's own budget a new input's measuring step keeps everything up to its watermark; a longer input
    ran out of memory below it. Measured again it must be frugal (offload from its first saved tensor), also where
    another input, one that never tripped its watermark, ran in between: that one's state taken up again must not
    make the long input's next measuring step keep everything again (and fail the same way, at every return)."""
    short, long = torch.randn(BATCH, WIDTH), torch.randn(4 * BATCH, WIDTH)
    total = 100 * GiB
    _, model, memory, engine = planned_stack(
        "auto", base=80 * GiB, transient=0, total=total, memory_type=SpikyMemory, bytes_per_ms=float(64 * MiB)
    )
    act = activation_bytes(long)

    def step(x: torch.Tensor) -> bool:
        """One step on ``x``; whether it ran out of memory (the long input does where it kept over half its
        activations on the device: the loss's transient does not fit beside them)."""
        engine.input_changed(tuple(x.shape))
        model.zero_grad(set_to_none=True)
        try:
            with engine:
                loss = model(x)
                stats = engine.collect_stats(wait=False)
                if len(x) == len(long) and stats.eligible_bytes - stats.offloaded_bytes > act // 2:
                    memory.spike = total - memory.peak()
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            return True
        return False

    assert [step(x) for x in (short, short, short)] == [False, False, False]
    assert [step(x) for x in (long, short, long, long, short, long)] == [True, False, False, False, False, False]


def test_an_input_that_comes_back_after_as_many_others_as_are_kept_runs_its_plan_without_measuring() -> None:
    """The planner keeps the plans of up to ``REMEMBERED_INPUTS`` inputs besides the one running: an input that comes
    back after that many others ran (lengths bucketed into one more bucket than that, taken in turn) runs its own plan.
    (The input left was kept before the one coming back was taken up: the list, one over, forgot the least recently
    run, which was that input, and every input measured at every return.)"""
    memory = PeakCounter()
    planner = BudgetPlanner(60 * GiB, memory)
    keys = [f"bucket {i}" for i in range(REMEMBERED_INPUTS + 1)]
    measuring = []
    for key in keys[:1] + keys * 2:  # (the first input's two measuring steps, then one each)
        planner.input_changed(key)
        planner.begin_step(lambda: 0)
        measuring.append(planner.measuring)
        memory.value = 2 * GiB
        planner.end_step(OffloadStats(eligible_bytes=GiB), 10.0, link_bytes_per_ms=float(MiB))
    assert measuring[-len(keys) :] == [False] * len(keys)


def test_none_is_an_input_key_like_any_other() -> None:
    """``None`` names an input as any hashable key does: its plan is kept while another input runs, and taken up again
    when it comes back (it was taken for "no input named yet", so its measured plan was dropped at the first change
    and it measured once more)."""
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    measuring = []
    for key in [None, None, "other", "other", None]:
        engine.input_changed(key)
        with engine:
            assert engine.planner is not None
            measuring.append(engine.planner.measuring)
            loss = model(x)
        loss.backward()
    assert measuring == [True, True, True, False, False]
    assert engine.planner is not None and engine.planner.input_key is None


def cache_released_by_step() -> tuple[torch.Tensor, Stack, OffloadEngine, list[int]]:
    """The setup of the tests of cache emptying across inputs: an allocator that holds 1.3x its peak (worth emptying
    once a plan is kept), and one step of input "a" run (the engine makes its planner at its first step). Returns the
    input, the model, the engine and the list of steps before which the cache was emptied, filled as steps run."""
    x = torch.randn(BATCH, WIDTH)
    act, model, memory = weights_on_the_device(x)
    assert model.sim is not None
    engine = planned_engine(8 * act, memory, model, model.sim)
    memory.reserved = lambda: int(1.3 * memory.peak())  # type: ignore[attr-defined]
    step_on(engine, model, x, key="a")
    planner = engine.planner
    assert planner is not None
    released: list[int] = []
    memory.release_cache = lambda: released.append(planner.step + 1)  # type: ignore[attr-defined]
    return x, model, engine, released


def test_the_cache_found_worth_emptying_is_emptied_also_where_the_next_step_runs_another_input() -> None:
    """A kept plan's first step that finds the allocator holding far more than its peak empties the cache before the
    next step. Where that next step runs another input (lengths that change from batch to batch: nearly always), it is
    emptied all the same: what the allocator holds is the process's, not the input's. (The change of input dropped it,
    so with lengths that alternate the cache the measuring steps shaped was never emptied.)"""
    x, model, engine, released = cache_released_by_step()
    assert [step_on(engine, model, x, key="a")["measuring"] for _ in range(2)] == [True, False]
    step_on(engine, model, x, key="b")
    assert released == [4]  # before the fourth step, the first of "b"


def test_each_inputs_kept_plan_checks_the_cache_at_its_first_step_also_where_inputs_alternate() -> None:
    """The first step of a plan kept after measuring steps checks whether the cache they shaped is worth emptying.
    With inputs that alternate at every step, each input's measuring ends as the step of another input begins, and its
    plan's first step comes after that: it still checks (the change of input dropped the check, so with lengths that
    alternate it never ran)."""
    x, model, engine, released = cache_released_by_step()
    measuring = [step_on(engine, model, x, key=key)["measuring"] for key in ["b", "a", "b", "a", "b", "a"]]
    assert measuring == [True, True, False, False, False, False]
    # "b" plans from step 4 on, "a" from step 5: each first planned step checks, and the cache is emptied after it.
    assert released == [5, 6]


def test_a_short_inputs_plan_leaves_the_cache_a_longer_input_kept_needs() -> None:
    """With lengths that change from batch to batch, the allocator holds what the longest input kept needs. A shorter
    input's first planned step finds it holding far more than its own peak, but emptying the cache then returns
    memory only until that longer input comes back and maps it again (on an H200, the default budget with 17 lengths:
    the step after each such emptying ran up to 0.27 s slower than without the engine). The cache is emptied only
    where it holds far more than the highest peak of the inputs kept."""
    short, long = torch.randn(BATCH, WIDTH), torch.randn(3 * BATCH, WIDTH)
    act, model, memory = weights_on_the_device(short)
    assert model.sim is not None
    engine = planned_engine(16 * act, memory, model, model.sim)
    state = _held_cache(memory)
    order = [long] * 3 + [short] * 3 + [long, short] * 2
    for x in order:
        engine.end_step()  # (the step before is counted on its own input's bytes)
        memory.unhooked_input = x
        step_on(engine, model, x)
    assert memory.peaks and max(memory.peaks) > 1.2 * min(p for p in memory.peaks if p > 0)  # the inputs differ
    assert state["releases"] == 1  # only as the planner's first step began, before any input's plan


def planned_on_alternating_inputs() -> tuple[torch.Tensor, SimulatedStreams, Stack, OffloadEngine, BudgetPlanner, Plan]:
    """The setup of the tests of learning from steps of inputs that alternate: a ``Stack`` offloading over a slow link,
    run four times on each of two inputs "a" and "b" taken in turn (the same tensor), until each runs a kept plan that
    offloads. Returns the input, the link, the model, the engine, its planner and the plan it runs."""
    x = torch.randn(BATCH, WIDTH)
    sim, model, engine = offloading_over_a_slow_link(activation_bytes(x))
    for key in ["a", "b"] * 4:
        step_on(engine, model, x, key=key)
    planner = engine.planner
    assert planner is not None and planner.plan is not None and planner.profile is not None
    assert planner.plan.offload_bytes > 0 and not planner.trying
    return x, sim, model, engine, planner, planner.plan


def test_slow_forwards_with_copies_teach_their_cost_also_where_inputs_alternate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies slowing compute are learnt from two slow planned steps of the current plan in a row: with inputs that
    alternate at every step (lengths that change from batch to batch), those are the input's own two latest steps,
    not two consecutive steps of the run (which never ran the same input, so the cost was never learnt). One slow step
    of an input between two others still teaches nothing."""
    x, _, model, engine, planner, _ = planned_on_alternating_inputs()
    assert planner.profile is not None and planner.profile.copy_ms_per_gib == 0.0
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "BLOCK_MS", 2 * BLOCK_MS)  # one slow step of "a": a hiccup, not a lesson
    step_on(engine, model, x, key="a")
    monkeypatch.setattr(module, "BLOCK_MS", BLOCK_MS)
    for key in ["b", "a", "b"]:
        step_on(engine, model, x, key=key)
    assert planner.profile.copy_ms_per_gib == 0.0
    monkeypatch.setattr(module, "BLOCK_MS", 2 * BLOCK_MS)  # forward computes twice as long from now on
    steps = [step_on(engine, model, x, key=key) for key in ["a", "b"] * 3]
    assert planner.profile.copy_ms_per_gib > 0
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


def test_waits_for_copies_longer_than_predicted_shift_the_plan_also_where_inputs_alternate() -> None:
    """A planned step's waits are read a step or so after it ran: with inputs that alternate at every step, another
    input runs by then. The waits still teach the link's share (a property of the machine) and both inputs plan with
    it: less offloading, the same gradients."""
    x, sim, model, engine, planner, first = planned_on_alternating_inputs()
    assert first.checkpoint_blocks == 0
    sim.bytes_per_ms = float(32 * KiB)  # 16x slower from now on
    steps, plans = [], []
    for key in ["a", "b"] * 5:
        steps.append(step_on(engine, model, x, key=key))
        plans.append((key, planner.plan))
    assert planner.profile.link_share < 0.5
    # Both inputs plan with the slower link. (A plan's first step may peak past its prediction and be corrected towards
    # memory: the fit margin's business, not the link's.)
    for key in ["a", "b"]:
        assert any(
            k == key and p is not None and p.checkpoint_blocks > 0 and p.offload_bytes < first.offload_bytes
            for k, p in plans
        )
    for s in steps:
        assert_same_grads(s["grads"], reference_grads(x))


def lm_activation_bytes(tokens: torch.Tensor, checkpointed: tuple[str, ...] = ()) -> int:
    """The eligible bytes one step of :class:`~tests.models.LengthLM` saves on ``tokens`` with the modules
    ``checkpointed`` so (measured on a plain copy of the model with an engine that only counts). The random state is
    left as it was: the counters read this between a training loop's seeding and its step."""
    with torch.random.fork_rng():
        model = LengthLM()  # (it seeds the generator)
        if checkpointed:
            apply_checkpointing(model, list(checkpointed))
        counting = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
        with counting:
            loss = model(tokens)
        loss.backward()
    return counting.stats.eligible_bytes


class LengthMemory(FakeMemory):
    """:class:`FakeMemory` for :class:`~tests.models.LengthLM`: a step without hooks keeps what the model saves on the
    current input (``unhooked_input``) with the modules checkpointed then."""

    def _unhooked_bytes(self) -> int:
        assert self.unhooked_model is not None and self.unhooked_input is not None
        key = (tuple(checkpointed_modules(self.unhooked_model)), tuple(self.unhooked_input.shape))
        if key not in self._unhooked:
            self._unhooked[key] = lm_activation_bytes(self.unhooked_input, key[0])
        return self._unhooked[key]


LENGTHS = [48, 32, 48, 16, 32, 48, 16, 32, 48, 32, 16, 48]


def train_lengths(
    model: nn.Module,
    engine: OffloadEngine | None = None,
    memory: FakeMemory | None = None,
    lengths: Sequence[int] = LENGTHS,
) -> dict[str, list[Any]]:
    """SGD on :func:`~tests.models.length_tokens` batches of ``lengths``, each named to ``engine`` (when given) by its
    shape, the random generator seeded once first (dropout's masks): per step, the gradients and the weights after the
    update; with the engine, also each step's plan (``None`` while measuring), offloaded bytes, blocks checkpointed and
    the host pool's lent bytes as forward ended."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    pool = pool_for(torch.device("cpu"))
    out: dict[str, list[Any]] = {"grads": [], "weights": [], "plans": [], "offloaded": [], "wrapped": [], "lent": []}
    torch.manual_seed(100)
    for length in lengths:
        tokens = length_tokens(length)
        optimizer.zero_grad(set_to_none=True)
        if engine is None:
            loss = model(tokens)
        else:
            assert memory is not None
            engine.end_step()  # (the step before is counted on its own input's bytes)
            memory.unhooked_input = tokens
            engine.input_changed(tuple(tokens.shape))
            with engine:
                planner = engine.planner
                assert planner is not None
                out["plans"].append(None if planner.measuring else planner.plan)
                out["wrapped"].append(checkpointed_modules(model))
                loss = model(tokens)
                out["lent"].append(pool.lent_bytes)
        loss.backward()
        if engine is not None:
            out["offloaded"].append(engine.stats.offloaded_bytes)
        sgd_update_recorded(model, optimizer, out)
    return out


def test_an_input_is_no_larger_than_another_only_where_every_dimension_of_every_tensor_is_at_most_its_peer() -> None:
    """Inputs are compared as shapes: a key as the engine is told it (``tuple(batch.shape)``), or the shapes of each
    of a batch's tensors as the callback names them; keys of other kinds, or shapes of other ranks or tensor counts,
    are never no larger (their inputs are measured)."""
    assert no_larger((2, 32), (2, 48)) and no_larger((2, 48), (2, 48))
    assert not no_larger((4, 32), (2, 48)) and not no_larger((2, 48, 1), (2, 48))
    assert no_larger(((2, 32), (2, 32)), ((2, 48), (2, 48)))
    assert not no_larger(((2, 32), (2, 64)), ((2, 48), (2, 48)))
    assert not no_larger(((2, 32),), ((2, 48), (2, 48)))
    assert not no_larger("short", "long") and not no_larger(None, (2, 48)) and not no_larger(1.0, 2.0)
    assert no_larger((("ids", (2, 32)),), (("ids", (2, 48)),))  # named shapes, as the callback's keys hold them
    assert not no_larger((("text", (2, 32)),), (("audio", (2, 48)),))


def test_an_input_named_by_a_number_is_measured_and_never_runs_the_plan_of_a_higher_number() -> None:
    """Only a tuple is read as shapes (the engine's ``input_changed`` says so): inputs named by an int (a task's or a
    data loader's number) or a bool are not sizes, so a new one is measured even where a higher-numbered input's plan
    keeps everything."""
    assert not no_larger(0, 1) and not no_larger(False, True) and not no_larger((False, 8), (True, 8))
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    steps = [step_on(engine, model, x, key=key) for key in [1, 1, 1, 0]]
    assert steps[2]["eligible"] is not None  # input 1 runs its plan (it keeps everything: 0 took it up, unfixed)
    assert [s["measuring"] for s in steps] == [True, True, False, True]


def test_an_input_named_by_a_string_and_a_number_is_measured_and_never_runs_the_plan_of_a_higher_number() -> None:
    """A string in a key is a tensor's name only beside its shape, as the callback's keys hold them: a key such as
    ``("loader", 0)`` (a data loader's number, named by a string as the engine's ``input_changed`` advises for inputs
    that are not shapes) is no shape, so input ``("loader", 0)`` is measured even where ``("loader", 1)``'s plan keeps
    everything. (Names compared anywhere read it as a shape of one name and one dimension.) A name beside a shape
    still compares by that shape."""
    assert not no_larger(("loader", 0), ("loader", 1)) and not no_larger((("loader", 0),), (("loader", 1),))
    assert no_larger(("qa", (2, 32)), ("qa", (2, 48))) and not no_larger(("qa", (2, 64)), ("qa", (2, 48)))
    _, model, _, engine = planned_stack(2 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    steps = [step_on(engine, model, x, key=key) for key in [("loader", 1)] * 3 + [("loader", 0)]]
    assert steps[2]["eligible"] is not None  # input 1 runs its plan (it keeps everything: 0 took it up, unfixed)
    assert [s["measuring"] for s in steps] == [True, True, False, True]


def test_a_new_input_no_larger_than_one_whose_plan_keeps_everything_runs_that_plan_without_measuring() -> None:
    """A model that fits keeps every activation: a new input whose every dimension is at most that of an input whose
    plan keeps everything needs no more memory, so it runs that plan at once (no hooks, nothing offloaded) instead of
    a measuring step (on an H200, those cost 0.03-0.12 s more than a step without the engine at a length's first
    step). A longer input is measured; so is a shorter one where the only input above it offloads."""
    act = lm_activation_bytes(length_tokens(64))
    lengths = [48, 48, 32, 16, 64, 40, 48, 24]
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(16 * KiB))
    model = LengthLM(sim)
    memory = LengthMemory(base=4 * act, transient=act // 2)
    memory.unhooked_model = model
    engine = planned_engine("auto", memory, model, sim)  # the device's own budget: room for every length
    got = train_lengths(model, engine, memory, lengths)
    want = train_lengths(LengthLM(), lengths=lengths)
    for step in range(len(lengths)):
        assert_same_grads(got["grads"][step], want["grads"][step])
    measured = [length for length, plan in zip(lengths, got["plans"], strict=True) if plan is None]
    assert measured == [48, 48, 64]  # the first two steps, and the one input longer than any before it
    for plan in got["plans"][2:]:
        assert plan is None or not (plan.offload_bytes or plan.checkpoint_blocks or plan.light_blocks)
    assert got["offloaded"][2:4] == [0, 0] and got["offloaded"][5:] == [0, 0, 0]
    engine.close()

    # The first input's second measuring step (the optimizer has its state from the first step on) is not needed
    # either once a larger input measured after it keeps everything.
    model = LengthLM(sim)
    memory = LengthMemory(base=4 * act, transient=act // 2)
    memory.unhooked_model = model
    engine = planned_engine("auto", memory, model, sim)
    got = train_lengths(model, engine, memory, [48, 64, 48, 32])
    assert [plan is None for plan in got["plans"]] == [True, True, False, False]
    engine.close()

    # Under a budget where the longest input's plan offloads, a shorter new input is measured for a plan of its own.
    model = LengthLM(sim)
    memory = LengthMemory(base=4 * act, transient=act // 2)
    memory.unhooked_model = model
    engine = planned_engine(int(4.8 * act), memory, model, sim)
    got = train_lengths(model, engine, memory, [64, 64, 64, 48])
    assert got["plans"][2].offload_bytes > 0 and got["plans"][3] is None
    engine.close()


class HeavierAt48(LengthMemory):
    """:class:`LengthMemory` whose steps of 48 tokens hold ``extra`` bytes more: a shape that says less memory than
    the model's step takes at it."""

    extra = 0

    def _unhooked_bytes(self) -> int:
        assert self.unhooked_input is not None
        return super()._unhooked_bytes() + (self.extra if self.unhooked_input.shape[1] == 48 else 0)


def borrowing_engine(
    act: int, extra: int = 0, budget: int | str | None = None
) -> tuple[LengthLM, LengthMemory, OffloadEngine, torch.optim.Optimizer]:
    """An engine whose budget holds :class:`~tests.models.LengthLM` at 64 tokens whole, after two measuring steps of
    that length (its plan keeps everything) and one step of 48 tokens that ran that plan unmeasured (holding ``extra``
    bytes more than its shape says, which the planner reads as the next step begins); under ``budget``, 20 times
    what the model saves at 64 tokens where not given."""
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(16 * KiB))
    model = LengthLM(sim)
    memory = HeavierAt48(base=4 * act, transient=act // 2)
    memory.extra = extra
    memory.unhooked_model = model
    engine = planned_engine(int(20 * act) if budget is None else budget, memory, model, sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for length in [64, 64, 48]:
        run_length(model, engine, memory, optimizer, length)
    planner = engine.planner
    assert planner is not None and not planner.measuring and planner.plan is not None
    assert not planner.plan.offload_bytes and not planner.plan.checkpoint_blocks
    return model, memory, engine, optimizer


def run_length(
    model: nn.Module, engine: OffloadEngine, memory: LengthMemory, optimizer: torch.optim.Optimizer, length: int
) -> bool:
    """One SGD step of ``model`` on ``length`` tokens, named to ``engine``; whether it was a measuring step."""
    tokens = length_tokens(length)
    optimizer.zero_grad(set_to_none=True)
    engine.end_step()
    memory.unhooked_input = tokens
    engine.input_changed(tuple(tokens.shape))
    with engine:
        assert engine.planner is not None
        measuring = engine.planner.measuring
        loss = model(tokens)
    loss.backward()
    optimizer.step()
    return measuring


def test_the_lengths_of_an_h200_run_measure_only_the_first_steps_and_the_longest_under_the_device_budget() -> None:
    """The 48 lengths (8-16k tokens, 17 of them new as they came) of the dynamic-lengths benchmark's run on an H200
    under the default budget, replayed through the planner at 1/256 of their length: where the model fits, only the
    first two steps and the longest length measure (that run measured at 17 steps and ran 1.17x no engine)."""
    run = RESULTS / "2026-12-02" / "h200-v107-dyn-auto-512-input_changed.json"
    recorded = json.loads(run.read_text())
    assert recorded["input_changed"]["measuring_steps"] == 17
    lengths = [n // 256 for n in recorded["lengths"]]
    act = lm_activation_bytes(length_tokens(max(lengths)))
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(16 * KiB))
    model = LengthLM(sim)
    memory = LengthMemory(base=4 * act, transient=act // 2)
    memory.unhooked_model = model
    engine = planned_engine("auto", memory, model, sim)
    got = train_lengths(model, engine, memory, lengths)
    measured = [step for step, plan in enumerate(got["plans"]) if plan is None]
    assert measured == [0, 1, lengths.index(max(lengths))]
    engine.close()


@pytest.mark.parametrize("budget", ["auto", None], ids=["device-budget", "user-budget"])
def test_an_input_that_ran_a_larger_inputs_plan_and_peaked_past_it_is_measured_for_its_own(budget: str | None) -> None:
    """A plan lent by a larger input that keeps everything predicts that input's peak. A step of the smaller input
    that peaks past it (its memory is not what its shape said) says the lent profile is not this input's: the input
    is measured next time it runs (even where another input runs in between), not lent the plan again nor planned
    from the larger input's numbers plus a correction; then it runs its own plan."""
    act = lm_activation_bytes(length_tokens(64))
    # More than 64 tokens hold, by more than the misprediction a planned step is allowed (2% of the budget).
    extra = 2 * act if budget is None else 3 * GiB
    model, memory, engine, optimizer = borrowing_engine(act, extra=extra, budget=budget)
    assert not run_length(model, engine, memory, optimizer, 64)  # the lender keeps its plan
    assert run_length(model, engine, memory, optimizer, 48)
    assert not run_length(model, engine, memory, optimizer, 64)
    for _ in range(3):  # (a frugal measuring step that pinned host buffers measures once more)
        if not run_length(model, engine, memory, optimizer, 48):
            break
        assert not run_length(model, engine, memory, optimizer, 64)
    else:
        pytest.fail("the input of 48 tokens never ran a plan of its own")
    planner = engine.planner
    assert planner is not None and planner.plan is not None and planner.profile is not None
    assert planner.profile.eligible < lm_activation_bytes(length_tokens(64))  # its own profile, not the lender's
    engine.close()


def test_an_input_a_lent_plan_misled_never_borrows_again_even_after_more_inputs_than_are_kept_ran() -> None:
    """An input whose step under a larger input's plan peaked past it is measured, and is never lent a plan again: also
    where more inputs than the planner keeps ran before it came back (its state forgotten, it would have borrowed again
    and, under a hard cap, run out of memory at every such return)."""
    act = lm_activation_bytes(length_tokens(64))
    model, memory, engine, optimizer = borrowing_engine(act, extra=3 * GiB, budget="auto")
    for length in range(65, 66 + REMEMBERED_INPUTS):  # each measured, each a lender that keeps everything
        run_length(model, engine, memory, optimizer, length)
    assert run_length(model, engine, memory, optimizer, 48)
    engine.close()


def test_an_input_that_ran_a_larger_inputs_plan_and_ran_out_of_memory_is_measured_frugally() -> None:
    """A step of a lent plan that runs out of memory: the input's next step measures, offloading from its first saved
    tensor (the most frugal step there is), rather than planning again from the larger input's numbers."""
    act = lm_activation_bytes(length_tokens(64))
    model, memory, engine, optimizer = borrowing_engine(act)
    tokens = length_tokens(48)
    engine.end_step()
    engine.input_changed(tuple(tokens.shape))
    with pytest.raises(torch.cuda.OutOfMemoryError), engine:
        model(tokens)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
    planner = engine.planner
    assert planner is not None
    assert run_length(model, engine, memory, optimizer, 48)
    assert engine.stats.offloaded_bytes == engine.stats.eligible_bytes > 0
    engine.close()


@pytest.mark.parametrize(
    ("budget_share", "lag", "light", "trials"),
    [(4.0, 3, False, False), (4.8, 0, True, False), (4.8, None, True, False), (4.8, 3, True, True)],
    ids=["by-parts-lag3", "recompute-lag0", "recompute-lag-none", "trials-lag3"],
)
def test_lengths_that_change_and_come_back_train_as_without_the_engine_under_plans_that_recompute_and_offload(
    budget_share: float, lag: int | None, light: bool, trials: bool
) -> None:
    """The product's first rule with inputs whose length changes from batch to batch and comes back (48, 32, 48, 16,
    ...): each length measured once, then run on its own kept plan, on simulated copy streams whose copies run late
    (``lag``); where ``trials``, the plans worth comparing are timed against each other (each input's trials switch
    its plan from step to step). Under a budget the plans checkpoint blocks (by their parts, or whole with others
    recomputing their elementwise operations) and offload part of what is saved, and a shorter length's copies go to
    host buffers a longer one left idle (lent). Every step's gradients, and the weights after each SGD update, are
    bit-for-bit those of plain training, dropout's masks included."""
    act = lm_activation_bytes(length_tokens(max(LENGTHS)))
    sim = SimulatedStreams(lag=lag, bytes_per_ms=float(16 * KiB))  # a slow link: recompute is worth its time
    model = LengthLM(sim, dropout=0.1)
    memory = LengthMemory(base=4 * act, transient=act // 2)  # weights on the device, and the loss's transient
    memory.unhooked_model = model
    engine = planned_engine(int(budget_share * act), memory, model, sim, trials=trials)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the host pool never ran full
        got = train_lengths(model, engine, memory)
    want = train_lengths(LengthLM(dropout=0.1))
    for step, length in enumerate(LENGTHS):
        assert_same_grads(got["grads"][step], want["grads"][step])
        for name, weight in want["weights"][step].items():
            assert torch.equal(got["weights"][step][name], weight), f"step {step} (length {length}): {name}"
    # Every length came back and ran a plan (its own: they differ), not a measuring step.
    planned = [(length, plan) for length, plan in zip(LENGTHS, got["plans"], strict=True) if plan is not None]
    assert {length for length, _ in planned} == set(LENGTHS)
    assert len({plan for _, plan in planned}) > 1
    ran = [
        (plan, nbytes, wrapped)
        for plan, nbytes, wrapped in zip(got["plans"], got["offloaded"], got["wrapped"], strict=True)
        if plan is not None
    ]
    assert any(nbytes > 0 for _, nbytes, _ in ran), "no planned step offloaded"
    assert any(plan.checkpoint_blocks and wrapped for plan, _, wrapped in ran), "no planned step checkpointed"
    if light:
        assert any(plan.light_blocks for plan, _, _ in ran), "no planned step recomputed elementwise operations"
    else:
        assert any(plan.split for plan, _, _ in ran), "no planned step checkpointed blocks by their parts"
    assert max(got["lent"]) > 0, "no host buffer was lent"
    engine.close()
    assert checkpointed_modules(model) == []


def test_a_new_input_runs_the_kind_of_plan_another_inputs_trials_kept_without_timing_plans() -> None:
    """Every saved tensor the hooks bring back in backward costs time the model does not price (nor learns from
    forward's pace): the first input's trials time plans that copy against plans without and keep one without. A new
    input (a longer batch) then runs the cheapest plan without copies its trials would time, untimed: the same
    mispricing would make it time, and lose, the plans that copy again. Alone, the same input times plans that copy."""
    small, large = torch.randn(BATCH, WIDTH), torch.randn(BATCH + BATCH // 2, WIDTH)

    def plans_run(inputs: list[torch.Tensor]) -> tuple[list[int], int, BudgetPlanner]:
        _, model, _, engine = slow_hooked_engine(small, trials=True, hook="unpack")
        offloaded, trying = [], 0
        for x in inputs:
            step = step_on(engine, model, x)
            planner = engine.planner
            assert planner is not None
            if x is large and not step["measuring"]:
                assert planner.plan is not None
                offloaded.append(planner.plan.offload_bytes)
                trying += planner.trying
        return offloaded, trying, planner

    alone, tried_alone, planner = plans_run([large] * 30)
    assert not planner.trying and any(alone) and tried_alone > 0, "alone, the longer input times no plan that copies"
    after, tried_after, planner = plans_run([small] * 30 + [large] * 30)
    assert not planner.trying and planner.plan is not None and planner.plan.fits
    assert after and not any(after), after
    assert tried_after == 0  # no step of the new input was a trial
    assert len(after) == len(alone) + 1  # as a new input it measured once; alone, as the first, twice


def test_where_copies_won_a_new_input_runs_a_plan_that_copies_without_timing_plans() -> None:
    """Hooks that cost nothing: the first input's trials keep a plan that offloads (its copies hide behind compute,
    recompute does not). A new input then runs the cheapest plan that offloads among those its trials would time,
    untimed; alone, it times its plans (about 20 steps)."""
    small, large = torch.randn(BATCH, WIDTH), torch.randn(BATCH + BATCH // 2, WIDTH)

    def plans_run(inputs: list[torch.Tensor]) -> tuple[list[Plan], int, BudgetPlanner]:
        act, model, memory = weights_on_the_device(small)
        assert model.sim is not None
        engine = planned_engine(6 * act, memory, model, model.sim, trials=True)
        plans, trying = [], 0
        for x in inputs:
            step = step_on(engine, model, x)
            planner = engine.planner
            assert planner is not None
            if x is large and not step["measuring"]:
                assert planner.plan is not None and planner.plan.fits
                plans.append(planner.plan)
                trying += planner.trying
        assert not planner.trying
        return plans, trying, planner

    alone, tried_alone, _ = plans_run([large] * 30)
    assert tried_alone >= 8 and alone[-1].offload_bytes > 0
    after, tried_after, planner = plans_run([small] * 30 + [large] * 30)
    assert tried_after == 0
    assert {p.offload_bytes > 0 for p in after} == {True}
    # The lesson is carried with the plans (a resumed fit's new inputs run that kind too), through plain values.
    assert planner.core.lesson == (True, False)
    fresh = Planner(planner.core.budget)
    assert restore_plans(fresh, json.loads(json.dumps(export_plans(planner.core)))) == 2
    assert fresh.lesson == (True, False)


def lengths_under_a_budget(count: int) -> tuple[Stack, OffloadEngine, dict[int, torch.Tensor]]:
    """A model, a planned engine with trials and ``count`` inputs of lengths up to ``BATCH``, under a budget that the
    shorter lengths fit whole and the longer ones only with a plan."""
    lengths = [BATCH * k // count for k in range(1, count + 1)]
    act = activation_bytes(torch.randn(BATCH, WIDTH))
    sim = SimulatedStreams(lag=0, bytes_per_ms=float(1 << 20))
    model = Stack(sim)
    engine = planned_engine(act * 3 // 4, FakeMemory(base=0, transient=act // 4), model, sim, trials=True)
    return model, engine, {n: torch.randn(n, WIDTH) for n in lengths}


def test_twelve_lengths_at_random_time_plans_for_one_length_and_the_others_follow_its_lesson(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Twelve lengths drawn at random, some fitting whole and the others only with a plan: every length comes before
    the first one's trials end. One input times its plans at a time; the others run the model's cheapest plan until
    those trials end, then the kind of plan they kept, untimed. Measuring and trial steps stay under 10% of the steps,
    where each length timing its own plans spent 8.9% (7 lengths timed plans)."""
    model, engine, inputs = lengths_under_a_budget(12)
    lengths = list(inputs)
    rng = random.Random(0)
    tried: dict[int, int] = {}
    measuring = 0
    caplog.set_level(logging.DEBUG, logger="lightning_offload")
    for _ in range(1000):
        n = rng.choice(lengths)
        engine.input_changed((n, WIDTH))
        model.zero_grad(set_to_none=True)
        with engine:
            planner = engine.planner
            assert planner is not None
            measuring += planner.measuring
            tried[n] = tried.get(n, 0) + planner.trying
            assert planner.measuring or (planner.plan is not None and planner.plan.fits)
            loss = model(inputs[n])
        loss.backward()
    timed = [n for n, steps in tried.items() if steps]
    assert len(timed) == 1, tried
    assert measuring <= 2 * len(lengths)
    share = (measuring + sum(tried.values())) / 1000
    assert share < 0.10, share
    assert planner.core.lesson is not None
    # An input that waited is told so when its plan changes, not at every step that comes back to it.
    waited = [r for r in caplog.records if "another input's plans are under trial" in r.getMessage()]
    assert 0 < len(waited) <= 2 * len(lengths), len(waited)


@pytest.mark.parametrize("cache", [False, True])
def test_a_measuring_step_counts_the_weight_casts_of_the_blocks_it_runs_in_full(cache: bool) -> None:
    """Under bf16 autocast each block saves a bfloat16 cast of its two weights, which the engine never moves: the
    first measuring step counts them for the block it runs in full (the others are checkpointed), and the profile
    keeps them per block, with whether autocast's cache held them (Lightning's bf16-mixed turns it off). The
    gradients stay those of a step without the engine."""
    sim = SimulatedStreams(lag=0)
    model, x = Stack(sim), torch.randn(BATCH, WIDTH)
    engine = planned_engine(3 * GiB, FakeMemory(base=GiB, transient=0), model, sim)
    for _ in range(3):  # two measuring steps, then a planned one
        model.zero_grad(set_to_none=True)
        with engine, torch.autocast("cpu", torch.bfloat16, cache_enabled=cache):
            loss = model(x)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=cache):
        loss = model(x)
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    profile = engine.planner.profile  # type: ignore[union-attr]
    assert profile is not None
    # The second measuring step checkpointed every block: its peaks hold no block's casts, and a plan adds them all.
    assert (profile.cast_bytes, profile.cast_blocks, profile.casts_cached) == (2 * 2 * WIDTH * WIDTH * 2, 0, cache)
    assert not engine._path.casts.counting  # planned steps count nothing
