"""The streamed mode's bookkeeping on the CPU, on simulated copy streams: throttle, retire, prefetch order and plan,
in-flight reuse, and in-place changes at every phase. A simulated copy runs only when something waits for it (or once
``lag`` operations queue behind it), reading its source then, so an ordering mistake shows up as a wrong value."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_offload import OffloadOptions
from lightning_offload import datapath as datapath_module
from lightning_offload.engine import OffloadEngine
from lightning_offload.streams import SimulatedStreams
from lightning_offload.transfer import producer_stream
from tests.models import CASES, assert_inplace_error_or_exact_grad, assert_same_grads, build, train_step

KiB, MiB = 1 << 10, 1 << 20


def streamed_engine(sim: SimulatedStreams, **kwargs: Any) -> OffloadEngine:
    options: dict[str, Any] = {
        "mode": "streamed",
        "compute_device": "cpu",
        "min_tensor_bytes": 0,
        "resident_tail_bytes": 0,
    }
    options.update(kwargs)
    return OffloadEngine(OffloadOptions.create("test", **options), streams=sim)


def step_after_the_way_out(engine: OffloadEngine, sim: SimulatedStreams, model: nn.Module, loss_of: Any) -> None:
    """One training step whose copies out are done before backward: every offloaded copy must come back over the
    link. ``loss_of()`` runs forward under the engine."""
    model.zero_grad(set_to_none=True)
    with engine:
        loss = loss_of()
    sim.synchronize()
    loss.backward()


class Chain(nn.Module):
    """``n`` linear + tanh layers whose widths grow: every saved activation has its own size, in save order."""

    def __init__(self, n: int = 6, width: int = 64, growth: int = 0) -> None:
        super().__init__()
        widths = [width + growth * i for i in range(n + 1)]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


@pytest.mark.parametrize("lag", [0, 3, None])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_grads_bit_equal_whatever_the_copy_timing(case: Any, lag: int | None) -> None:
    """Copies done at once, a few operations late, or only when waited for: the gradients never change."""
    model = build(case)
    batch = case.make_batch()
    expected = train_step(model, batch)
    sim = SimulatedStreams(lag=lag)
    engine = streamed_engine(sim)
    for _ in range(2):
        assert_same_grads(train_step(model, batch, engine), expected)
        assert engine.stats.offloaded_bytes > 0


def test_throttle_bounds_the_bytes_in_flight() -> None:
    """Copies that never finish on their own: the compute stream waits for the oldest once the cap is passed, so
    no more than the cap (plus the copy that crossed it) is ever queued on the way out."""
    cap = 100 * KiB
    sim = SimulatedStreams(lag=None)
    engine = streamed_engine(sim, max_inflight_bytes=cap)
    model = Chain(n=12, width=128)
    x = torch.randn(64, 128)  # 32 KiB per activation
    with engine:
        loss = model(x)
    assert engine.stats.offloaded_bytes > 4 * cap  # far more left than the cap
    assert sim.max_queued_bytes["d2h"] <= cap + 32 * KiB
    assert engine.stats.inflight_bytes <= cap + 32 * KiB
    loss.backward()


def test_without_a_cap_nothing_waits() -> None:
    """The same forward without a cap (copies lag forward freely): every copy is still queued at the end."""
    sim = SimulatedStreams(lag=None)
    engine = streamed_engine(sim, max_inflight_bytes=1 << 40)
    with engine:
        loss = Chain(n=12, width=128)(torch.randn(64, 128))
    assert sim.max_queued_bytes["d2h"] == engine.stats.offloaded_bytes
    loss.backward()
    # Backward read every source in place (their copies never ran): nothing came back over the link.
    stats = engine.stats
    assert stats.prefetched_bytes == stats.fetched_on_demand_bytes == 0


def test_prefetch_brings_copies_back_in_reverse_save_order_before_need() -> None:
    """The way back serves the latest-saved copy first, and starts ahead of need: backward asks for almost nothing
    on demand."""
    sim = SimulatedStreams(lag=0)  # the way out completes at once: every copy must come back over the link
    engine = streamed_engine(sim, prefetch_bytes=1 << 30)
    model = Chain(n=6, width=64, growth=16)
    for _ in range(3):  # the later steps have a measured forward (a link model) and a warm pool
        sim.log.clear()
        with engine:
            loss = model(torch.randn(32, 64))
        loss.backward()
    stats = engine.stats
    assert stats.prefetched_bytes > 0
    assert stats.fetched_on_demand_bytes < stats.prefetched_bytes
    out = [n for name, n in sim.log if name == "d2h"]
    back = [n for name, n in sim.log if name == "h2d"]
    assert len(set(out)) == len(out) > 4  # distinct sizes identify the copies
    assert back == out[::-1]


class SharedTable(nn.Module):
    """Blocks that all multiply by one table made before the first block (as rotary embeddings' cos and sin are):
    every block saves it again, so backward needs it first, at the top block, though it was saved first."""

    def __init__(self, n: int = 6, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.register_buffer("angles", torch.linspace(0, 3, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(self.angles) + 0.0  # a fresh tensor each forward, saved by every block's product
        for layer in self.layers:
            x = torch.tanh(layer(x) * table)
        return x.sum()


def test_a_tensor_every_block_saves_comes_back_first_and_backward_walks_from_the_top() -> None:
    """The table is saved at the bottom of forward and again by every block. The way back fetches it first (the top
    block needs it at once), not last behind every other copy (then the top block waited for the whole queue: on an
    H200, 73 ms of 8B LoRA's backward), and backward's position stays at the block it runs, not at the table's first
    save, so prefetches of the blocks below keep their planned starts. Gradients are unchanged."""
    model = SharedTable()
    x = torch.randn(1024, 64)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    table_bytes, activation = 64 * 4, 1024 * 64 * 4  # sizes tell the copies apart
    sim = SimulatedStreams(lag=0)
    # The input, the table and the first two blocks' activations leave; the rest stays.
    engine = streamed_engine(sim, max_offload_bytes=table_bytes + 3 * activation, prefetch_bytes=1 << 30)
    positions = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        sim.log.clear()
        with engine:
            loss = model(x)
        if step:
            top = engine._path.log.position
            # After the top block's backward: where backward stands.
            model.layers[-1].weight.register_hook(lambda g: positions.append(engine._path.log.backward_pos) or g)
        loss.backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
    stats = engine.stats
    assert stats.offloaded_bytes >= table_bytes and stats.fetched_on_demand_bytes == 0
    back = [n for name, n in sim.log if name == "h2d"]
    out = [n for name, n in sim.log if name == "d2h"]
    assert out[:2] == [activation, table_bytes] and back[0] == table_bytes  # saved among the first, fetched first
    assert positions and positions[0] >= top - 2 * activation  # near the top, not at the table's first save


def test_a_tensor_every_block_saves_does_not_hold_the_prefetch_cap_after_the_copies_behind_it_are_used() -> None:
    """The table comes back first and stays on the device until the bottom block uses it last; the copies fetched
    after it are used and released one by one. Only what still waits counts against ``prefetch_bytes``, so the cap
    keeps admitting copies ahead of need: nothing is fetched on demand."""
    activation = 1024 * 64 * 4
    model = SharedTable(n=8)
    x = torch.randn(1024, 64)
    sim = SimulatedStreams(lag=0)
    engine = streamed_engine(sim, max_offload_bytes=6 * activation + 256, prefetch_bytes=2 * activation)
    for _ in range(2):
        step_after_the_way_out(engine, sim, model, lambda: model(x))
    stats = engine.stats
    assert stats.offloaded_bytes == 6 * activation + 256
    assert stats.fetched_on_demand_bytes == 0 and stats.prefetched_bytes == stats.offloaded_bytes


def test_two_forwards_awaiting_one_backward_come_back_latest_forward_first() -> None:
    """Two forwards under the engine, then one backward through both (a loss over two passes): backward needs the
    second forward's copies first, so they come back first, in the reverse of their save order, and the gradients
    are unchanged."""
    model = Chain(n=4, width=64, growth=16)
    a_in, b_in = torch.randn(32, 64), torch.randn(7, 64)  # two batch sizes: every copy has its own size
    (model(a_in) + model(b_in)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    sim = SimulatedStreams(lag=0)
    engine = streamed_engine(sim, prefetch_bytes=1 << 30)
    for _ in range(3):  # later steps have a measured link and a warm pool
        model.zero_grad(set_to_none=True)
        sim.log.clear()
        with engine:
            a = model(a_in)
        with engine:
            b = model(b_in)
        (a + b).backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
    out = [n for name, n in sim.log if name == "d2h"]
    back = [n for name, n in sim.log if name == "h2d"]
    assert len(set(out)) == len(out) and back == out[::-1]
    # At most the copy backward needs first (before any prefetch ran: the second forward's last) came on demand.
    assert engine.stats.fetched_on_demand_bytes <= 7 * 128 * 4


def test_a_forward_that_never_runs_backward_leaves_nothing_queued_for_later_steps() -> None:
    """Each step also runs a forward it only logs (its graph is dropped without a backward). Its copies must not
    stay queued below the next forwards' ones: the queue holds at most what the live graphs still wait for."""
    model = Chain(n=6, width=64)
    x = torch.randn(256, 64)
    sim = SimulatedStreams(lag=0)
    engine = streamed_engine(sim, prefetch_bytes=256 * 64 * 4)
    lengths = []
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        with engine:
            logged = model(x)  # a value to log; its graph goes away unused
        with engine:
            loss = model(x)
        loss.backward()
        del logged
        lengths.append(len(engine._path.inbound.queue))  # type: ignore[union-attr]
    copies = engine.stats.offloaded_tensors or 1
    assert max(lengths) <= copies and lengths[-1] == lengths[1], lengths


def test_copies_past_the_limit_stay_at_once_and_the_tail_still_sends_the_earlier_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a byte limit and a resident tail, the copies within the limit wait for the tail to pass them and then
    leave; those past it stay from their save on, without asking for the stream that made them (a host cost per
    saved tensor that only a copy going out needs). Gradients are unchanged."""
    torch.manual_seed(0)
    model = Chain(n=8, width=64)
    x = torch.randn(64, 64)  # every saved activation 16 KiB, each its own storage
    expected = train_step(model, x)
    act = 64 * 64 * 4
    sim = SimulatedStreams(lag=2)
    engine = streamed_engine(sim, max_offload_bytes=3 * act, resident_tail_bytes=2 * act)
    for _ in range(2):
        grads = train_step(model, x, engine)
        assert_same_grads(grads, expected)
        assert engine.stats.offloaded_bytes == 3 * act
        assert engine.stats.resident_bytes == engine.stats.eligible_bytes - 3 * act > 0
    asked = []
    monkeypatch.setattr(
        datapath_module, "producer_stream", lambda transfer: asked.append(1) or producer_stream(transfer)
    )
    with engine:
        loss = model(x)
    copies = list(engine._path.log.step_copies())
    assert [c.state.name for c in copies] == ["OFFLOADED"] * 3 + ["RESIDENT"] * (len(copies) - 3)
    assert len(asked) == 3  # only the copies within the limit asked which stream made them
    loss.backward()


def test_sources_of_finished_copies_are_let_go_during_forward_past_the_limit() -> None:
    """Saves past the byte limit stay, but each is still where the way out lets go of the device sources whose copies
    to the host are done: by the end of forward nothing offloaded is held on the device twice."""
    torch.manual_seed(0)
    model = Chain(n=8, width=64)
    x = torch.randn(64, 64)
    act = 64 * 64 * 4
    sim = SimulatedStreams(lag=0)  # copies run as they are queued: done by the next save
    engine = streamed_engine(sim, max_offload_bytes=2 * act, max_inflight_bytes=1 << 30)
    expected = train_step(model, x)
    outbound = engine._path.outbound
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with engine:
            loss = model(x)
            assert engine.stats.offloaded_bytes == 2 * act
            outbound = engine._path.outbound
            assert outbound is not None and outbound.inflight_bytes == 0 and not outbound.inflight
        loss.backward()
        assert_same_grads({n: p.grad for n, p in model.named_parameters()}, expected)


def test_prefetch_cap_limits_what_is_fetched_ahead() -> None:
    """With ``prefetch_bytes`` at one copy, at most one copy is fetched ahead of need at any time."""
    sim = SimulatedStreams(lag=0)
    size = 64 * 64 * 4
    engine = streamed_engine(sim, prefetch_bytes=size)
    with engine:
        loss = Chain(n=8, width=64)(torch.randn(64, 64))
    loss.backward()
    assert sim.max_queued_bytes["h2d"] <= size


def test_prefetch_reaches_past_the_cap_into_what_backward_freed() -> None:
    """A partial offload keeps the latest activations on the device; once backward has used (and freed) more of them
    than the gradients it allocates take, copies come back ahead of need beyond ``prefetch_bytes``, never beyond what
    was freed: the peak does not move, and the copies needed last are not held back by a fixed cap."""
    size = 1024 * 64 * 4  # one saved activation
    model = Chain(n=8, width=64)
    x = torch.randn(1024, 64)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ahead = {}
    for with_model in (False, True):
        sim = SimulatedStreams(lag=None)  # copies run when waited for: fetched-ahead bytes queue up
        options = OffloadOptions.create(
            "test", mode="streamed", compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0,
            max_offload_bytes=4 * size, prefetch_bytes=size,
        )  # fmt: skip
        engine = OffloadEngine(options, model=model if with_model else None, streams=sim)
        for _ in range(3):
            step_after_the_way_out(engine, sim, model, lambda: model(x))
        stats = engine.stats
        resident = stats.eligible_bytes - stats.offloaded_bytes
        assert stats.offloaded_bytes == 4 * size and resident > 2 * size + grad_bytes
        ahead[with_model] = sim.max_queued_bytes["h2d"]
        assert ahead[with_model] <= max(size, resident - grad_bytes)
    assert ahead[False] <= size < ahead[True]


def test_retire_lets_go_of_finished_copies_at_the_block_end() -> None:
    """Copies the device has finished are released when the block ends, not at the next step."""
    sim = SimulatedStreams(lag=0)
    engine = streamed_engine(sim)
    with engine:
        loss = Chain()(torch.randn(8, 64))
    assert engine.collect_stats(wait=False).inflight_bytes == 0
    loss.backward()


def _true_grad(x: torch.Tensor, doubled_before_use: bool) -> torch.Tensor:
    """The gradient of what the test computes, with every saved value as it was when saved."""
    x = x.detach().requires_grad_()
    a = x.sigmoid()
    b = a.exp()
    ((2 * a if doubled_before_use else a) * b).sum().backward()
    return x.grad


@pytest.mark.parametrize("mode", ["sync", "streamed"])
@pytest.mark.parametrize("lag", [0, 2, None])
@pytest.mark.parametrize("phase", ["during_forward", "after_block", "after_copies_done", "during_backward"])
def test_inplace_change_raises_or_uses_the_saved_values(mode: str, lag: int | None, phase: str) -> None:
    """A saved tensor changed in place between its save and its use in backward: autograd's error, or exactly the
    gradient of the unchanged value, whether the change comes while the tensor is resident, while its copy is in
    flight, or after the copy finished. Never anything else."""
    x = torch.randn(256, 256)
    expected = _true_grad(x, doubled_before_use=phase == "during_forward")
    sim = SimulatedStreams(lag=lag)
    engine = streamed_engine(sim, mode=mode)
    x = x.detach().requires_grad_()
    victim: list[torch.Tensor] = []

    def change_in_place(grad: torch.Tensor) -> torch.Tensor:
        victim[0].mul_(2)
        return grad

    with engine:
        a = x.sigmoid()  # saved by sigmoid's backward (its output) and by mul
        b = a.exp()
        if phase == "during_forward":
            a.mul_(2)  # after sigmoid and exp saved their outputs, before mul saves ``a``
        loss = (a * b).sum()
    if phase == "after_block":
        a.mul_(2)
    elif phase == "after_copies_done":
        sim.synchronize()
        engine.uninstall()  # lets go of the finished copies
        a.mul_(2)
    elif phase == "during_backward":
        victim.append(a)
        loss.register_hook(change_in_place)
    assert_inplace_error_or_exact_grad(loss, x, expected)


def test_inplace_change_while_the_copy_is_in_flight_raises() -> None:
    """The GPU race, on the CPU: the copy out has not run when the tensor is changed; backward must raise."""
    sim = SimulatedStreams(lag=None)
    engine = streamed_engine(sim)
    x = torch.randn(128, 128, requires_grad=True)
    with engine:
        a = x.sigmoid()
        loss = a.exp().sum()
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_copies_come_back_before_their_planned_start_into_what_backward_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planned starts lag (here: each copy is planned to start only where backward needs it), but backward has
    freed more kept activations than the offloaded copies take: they come back ahead of need into that room, three of
    the four at once, past the one-copy cap (a kept activation counts as freed once the node that used it has run),
    nothing on demand, and the gradients are unchanged."""
    monkeypatch.setattr("lightning_offload.inbound.plan_prefetch", lambda ends, sizes, lead: list(ends))
    size = 1024 * 64 * 4  # one saved activation
    model = Chain(n=8, width=64)
    x = torch.randn(1024, 64)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    sim = SimulatedStreams(lag=None)  # copies run when waited for: fetched-ahead bytes queue up
    options = OffloadOptions.create(
        "test", mode="streamed", compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0,
        max_offload_bytes=4 * size, prefetch_bytes=size,
    )  # fmt: skip
    engine = OffloadEngine(options, model=model, streams=sim)
    for _ in range(2):
        step_after_the_way_out(engine, sim, model, lambda: model(x))
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
    stats = engine.stats
    assert stats.offloaded_bytes == 4 * size and stats.fetched_on_demand_bytes == 0
    assert sim.max_queued_bytes["h2d"] == 3 * size  # on their way back together, past the cap


class _HeadLoss(torch.autograd.Function):
    """A loss whose backward unpacks a large saved tensor and notes what the way back had fetched ahead by then."""

    seen: ClassVar[list[int]] = []
    engine: ClassVar[OffloadEngine | None] = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        scale = x[:, :1].exp()  # a small tensor the node saves first (below the large one)
        logits = x.repeat(1, 8)  # the head's large saved tensor (a loss's logits), saved last
        ctx.save_for_backward(scale, logits)
        return logits.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # Unpacks both, the small one first: the large one's bytes are not room while this node runs.
        _, logits = ctx.saved_tensors
        if _HeadLoss.engine is not None:
            # The node still runs: its saved tensor is alive, and it allocates its gradient before that goes.
            _HeadLoss.seen.append(_HeadLoss.engine.collect_stats(wait=False).prefetched_bytes)
        return grad.expand_as(logits)[:, : logits.shape[1] // 8] * 8


def test_bytes_a_node_still_holds_are_not_room_for_copies_until_it_has_run() -> None:
    """The head's backward unpacks its large saved tensor: while it runs, that tensor and the gradient it allocates
    both live, so no copy comes back into its bytes yet (only the one ``prefetch_bytes`` allows); once backward
    unpacks what was saved below it, they are room, and the offloaded copies come back ahead of need (past the
    one-copy cap), with the gradients unchanged."""
    size = 1024 * 64 * 4  # one saved activation
    model = Chain(n=6, width=64)
    x = torch.randn(1024, 64)

    def loss_of(inputs: torch.Tensor) -> torch.Tensor:
        h = inputs
        for layer in model.layers:
            h = torch.tanh(layer(h))
        return _HeadLoss.apply(h)

    loss_of(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    sim = SimulatedStreams(lag=None)
    options = OffloadOptions.create(
        "test", mode="streamed", compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0,
        max_offload_bytes=3 * size, prefetch_bytes=size,
    )  # fmt: skip
    engine = OffloadEngine(options, model=model, streams=sim)
    _HeadLoss.engine = engine
    try:
        for _ in range(2):
            _HeadLoss.seen.clear()
            step_after_the_way_out(engine, sim, model, lambda: loss_of(x))
            assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
    finally:
        _HeadLoss.engine = None
    # While the head's own bytes were held, only what ``prefetch_bytes`` allows came back, nothing into them.
    assert len(_HeadLoss.seen) == 1 and _HeadLoss.seen[0] <= size
    stats = engine.stats
    assert stats.offloaded_bytes == 3 * size and stats.prefetched_bytes == 3 * size
    assert sim.max_queued_bytes["h2d"] > size


def test_a_span_fetched_back_and_never_used_is_released_after_its_copy() -> None:
    """A backward that stops short (``torch.autograd.grad`` to an activation halfway) leaves copies fetched ahead that
    backward never read. Fetched spans carry no ``record_stream`` (that kept every freed span's block unusable until
    the copy stream drained), so letting go of an unread one must order the compute stream after the copy into it:
    once the graph is gone, no copy back to the device may still be pending."""
    sim = SimulatedStreams(lag=None)  # copies run only when something waits for them
    engine = streamed_engine(sim, prefetch_bytes=1 << 30)
    layers = Chain(n=8, width=64).layers
    x = torch.randn(256, 64)
    for _ in range(2):  # the second step plans its prefetch with a measured forward
        with engine:
            h = x
            for i, layer in enumerate(layers):
                h = torch.tanh(layer(h))
                if i == 3:
                    halfway = h
            loss = h.sum()
        sim.synchronize()  # the way out is done: what comes back must cross the link again
        torch.autograd.grad(loss, halfway)
        assert engine.stats.prefetched_bytes > 0
        assert sim.h2d.done < sim.h2d.queued  # copies for the layers below `halfway` came back, unread
        del loss, h, halfway
        assert sim.h2d.done == sim.h2d.queued
