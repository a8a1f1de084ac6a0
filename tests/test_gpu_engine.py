"""GPU tests of the engine: streams, events and pinned memory. Skipped without CUDA; run on the H200."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_offload import offload_activations
from lightning_offload.checkpointing import apply_checkpointing, remove_checkpointing
from lightning_offload.host_pool import pool_for
from lightning_offload.planner.candidates import plan_candidates
from lightning_offload.planner.trials import _TRIAL_MAX_STEPS, _TRIAL_ROUNDS
from tests import processes
from tests.models import Attention, assert_inplace_error_or_exact_grad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 1 << 30
EVERYTHING = {"min_tensor_bytes": 0, "resident_tail_bytes": 0, "memory_budget": None}
# Bit-for-bit comparisons need deterministic kernels: embedding backward and fused attention backward use atomics.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _deterministic() -> object:
    if not torch.cuda.is_available():
        yield
        return
    torch.use_deterministic_algorithms(True)
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_flash_sdp(flags[0])
    torch.backends.cuda.enable_mem_efficient_sdp(flags[1])


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, hidden: int = 1024, layers: int = 8, heads: int = 8, vocab: int = 4096) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), tokens.flatten())


def _grads(model: nn.Module, tokens: torch.Tensor, ctx: object | None, autocast: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        if ctx is None:
            loss = model(tokens)
        else:
            with ctx:  # type: ignore[attr-defined]
                loss = model(tokens)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().cuda()
    tokens = torch.randint(0, 4096, (4, 1024), device="cuda")
    return model, tokens


@pytest.mark.parametrize("mode", ["sync", "streamed"])
@pytest.mark.parametrize("autocast", [False, True])
def test_gradients_bit_identical(net: tuple[nn.Module, torch.Tensor], mode: str, autocast: bool) -> None:
    """Offloaded gradients equal the plain ones bit for bit, fp32 and bf16 autocast, over three steps."""
    model, tokens = net
    reference = _grads(model, tokens, None, autocast)
    again = _grads(model, tokens, None, autocast)
    assert all(torch.equal(a, b) for a, b in zip(reference, again, strict=True)), "reference is not deterministic"
    engine = offload_activations(mode=mode, model=model, **EVERYTHING)
    for _ in range(3):
        grads = _grads(model, tokens, engine, autocast)
        assert engine.stats.offloaded_bytes > 0
        for ref, got in zip(reference, grads, strict=True):
            assert torch.equal(ref, got)
    assert engine.stats.host_allocations == 0, "steady state must not allocate host memory"


def test_pool_is_pinned(net: tuple[nn.Module, torch.Tensor]) -> None:
    """Host buffers are page-locked, so copies are asynchronous."""
    model, tokens = net
    engine = offload_activations(model=model, **EVERYTHING)
    _grads(model, tokens, engine, True)
    pool = pool_for(torch.device("cuda"))
    buffers = [item.buffer for bucket in pool._free.values() for item in bucket]
    assert buffers and all(b.is_pinned() for b in buffers)


def test_side_stream_producer(net: tuple[nn.Module, torch.Tensor]) -> None:
    """A tensor produced on another stream is copied after it is complete: each hook orders its copy after the
    stream that is current when the tensor is saved."""
    torch.manual_seed(1)
    w = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    x = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()

    def run(ctx: object | None) -> torch.Tensor:
        w.grad = None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if ctx is None:
                y = (x @ w).sin() @ w
            else:
                with ctx:  # type: ignore[attr-defined]
                    for _ in range(3):
                        torch.cuda._sleep(1_000_000)  # the producer is still running when the hook fires
                    y = (x @ w).sin() @ w
            loss = y.square().mean()
        torch.cuda.current_stream().wait_stream(side)
        loss.backward()
        return w.grad.clone()

    assert torch.equal(run(None), run(offload_activations(**EVERYTHING)))


def test_peak_memory_lower() -> None:
    """Where activations dominate, offloading lowers the peak."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=12).cuda()
    tokens = torch.randint(0, 4096, (8, 2048), device="cuda")
    peaks = {}
    for name, ctx in (("none", None), ("streamed", offload_activations(model=model, memory_budget=None))):
        _grads(model, tokens, ctx, True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _grads(model, tokens, ctx, True)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    assert peaks["streamed"] < 0.6 * peaks["none"], peaks


def test_streamed_faster_than_sync() -> None:
    """Streams overlap copies with compute; sync mode serialises them."""
    torch.manual_seed(0)
    model = Net(hidden=2048, layers=8, heads=16).cuda()
    tokens = torch.randint(0, 4096, (4, 2048), device="cuda")
    times = {}
    for mode in ("sync", "streamed"):
        engine = offload_activations(mode=mode, model=model, memory_budget=None)
        for _ in range(2):
            _grads(model, tokens, engine, True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            _grads(model, tokens, engine, True)
        torch.cuda.synchronize()
        times[mode] = time.perf_counter() - start
    assert times["streamed"] < 0.8 * times["sync"], times


class SharedTableNet(nn.Module):
    """Blocks that all multiply by one table made before the first block, as rotary embeddings' cos and sin are: each
    block saves it again, so backward needs it first, at the top block, though forward saved it among its first."""

    def __init__(self, hidden: int = 1024, layers: int = 8, seq: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.register_buffer("angles", torch.linspace(0, 3, seq * hidden).view(seq, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(self.angles)
        for block in self.blocks:
            x = x + block(x * table)
        return x.square().mean()


def test_a_partial_offload_brings_a_tensor_every_block_saves_back_first() -> None:
    """The first bytes of forward leave, the shared table among them. The way back fetches it first (the top block
    needs it at once): nothing is fetched on demand (it was, behind every queued prefetch, a 73 ms stall per backward
    on 8B LoRA), and the gradients are the plain ones."""
    torch.manual_seed(0)
    model = SharedTableNet().cuda()
    x = torch.randn(4, 1024, 1024, device="cuda", requires_grad=True)

    def grads(ctx: object | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx if ctx is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
            loss = model(x)
        torch.cuda.synchronize()  # every copy out is done: each offloaded one must come back over the link
        loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()] + [x.grad.detach().clone()]

    reference = grads(None)
    engine = offload_activations(model=model, measure_copies=True, max_offload_bytes=300 << 20, **EVERYTHING)
    for _ in range(2):
        got = grads(engine)
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    stats = engine.stats
    assert 0 < stats.offloaded_bytes <= 300 << 20
    assert stats.fetched_on_demand_bytes == 0 and stats.prefetched_bytes == stats.offloaded_bytes


def test_stall_measured_and_retain_graph() -> None:
    """Stall time is reported in streamed mode; a second backward (retain_graph) refetches and agrees."""
    torch.manual_seed(0)
    model = Net(hidden=512, layers=4).cuda()
    tokens = torch.randint(0, 4096, (4, 512), device="cuda")
    engine = offload_activations(model=model, measure_copies=True, **EVERYTHING)
    with engine:
        loss = model(tokens)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss.backward()
    for a, p in zip(first, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
    stats = engine.stats
    assert stats.stall_ms >= 0.0 and stats.d2h_ms > 0 and stats.h2d_ms > 0
    assert stats.d2h_gbps() > 1.0


def test_allocator_reuse_cannot_corrupt_copies_in_flight() -> None:
    """A source whose copy out is in flight, and a buffer a copy back writes into, are never handed
    to new tensors early. Forward and backward each run while other work churns the allocator with garbage fills;
    the gradients still equal the plain ones."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=6).cuda()
    tokens = torch.randint(0, 4096, (4, 1024), device="cuda")
    reference = _grads(model, tokens, None, True)
    engine = offload_activations(model=model, max_inflight_bytes=None, **EVERYTHING)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16), engine:
            loss = model(tokens)
        junk = [torch.full((64 << 20,), float("nan"), device="cuda") for _ in range(8)]  # reuses freed blocks
        del junk
        loss.backward()
        for ref, p in zip(reference, model.parameters(), strict=True):
            assert torch.equal(ref, p.grad)


def test_a_backward_that_stops_short_leaves_later_steps_exact(net: tuple[nn.Module, torch.Tensor]) -> None:
    """``torch.autograd.grad`` to an activation halfway: its gradient is the plain one, the copies fetched back for
    the blocks below it are let go of unread (the compute stream waits for each first, since fetched spans carry no
    ``record_stream``), and the full steps after it are exact."""
    model, tokens = net
    embed, blocks = model.embed, model.blocks

    def halfway_grad(ctx: object | None) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16), contextlib.ExitStack() as stack:
            if ctx is not None:
                stack.enter_context(ctx)  # type: ignore[arg-type]
            x = embed(tokens)
            for i, block in enumerate(blocks):
                x = block(x)
                if i == len(blocks) // 2:
                    halfway = x
            loss = F.cross_entropy(model.head(x).flatten(0, 1).float(), tokens.flatten())
        (grad,) = torch.autograd.grad(loss, halfway)
        return grad

    reference, expected = halfway_grad(None), _grads(model, tokens, None, True)
    engine = offload_activations(model=model, **EVERYTHING)
    for _ in range(2):
        assert torch.equal(halfway_grad(engine), reference)
        assert engine.stats.prefetched_bytes > 0
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_grads(model, tokens, engine, True), expected, strict=True))


def _alone(*args: str, allocator_settings: bool = True) -> dict[str, Any]:
    """Run ``python -m args...`` from the repository root in a process of its own (a fresh allocator, nothing another
    test left allocated or cached) and return the JSON its last line prints; the test fails with the output's end where
    the process failed or ran past 300 s. Without ``allocator_settings`` the child runs without
    ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, so that the engine configures the allocator itself."""
    env = dict(os.environ)
    if not allocator_settings:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
    proc = processes.start([sys.executable, "-m", *args], env)
    out, in_time = processes.finish(proc, timeout=300)
    assert in_time and proc.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_offloading_everything_reserves_at_most_1_10x_what_it_allocates() -> None:
    """Everything offloaded, in a fresh process: the steps reserve no more than 1.10x what they allocate (the spans
    backward fetched back and freed serve the next allocations; on an H200 1.06x, and 1.08x when each span still
    carried ``record_stream``)."""
    result = _alone("tests.gpu.fresh_process", "reserved_when_offloading")
    assert result["offloaded_gib"] > 1.0, result
    assert result["reserved_gib"] <= 1.10 * result["allocated_gib"], result


def test_copy_streams_created_once_per_device_and_process() -> None:
    """The copy streams are created once per device and process, not per engine or step."""
    from lightning_offload.streams import CudaStreams

    first = CudaStreams(torch.device("cuda"))
    for _ in range(3):
        engine = offload_activations(**EVERYTHING)
        with engine:
            pass
    again = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    assert (again.d2h, again.h2d) == (first.d2h, first.h2d)


@pytest.mark.parametrize("mode", ["sync", "streamed"])
@pytest.mark.parametrize("tail", [0, 1 << 30])
def test_inplace_change_right_after_the_block_raises_or_is_exact(mode: str, tail: int) -> None:
    """The race of a copy still reading its source when compute writes it: 8192 x 8192 fp32 saved tensors changed
    in place right after the block. Plain autograd raises; the engine raises too, or gives the exact gradient of the
    unchanged values: never a silently wrong one."""
    torch.manual_seed(0)
    x = torch.randn(8192, 8192, device="cuda", requires_grad=True)
    a = x.sigmoid()
    (a * a.exp()).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    engine = offload_activations(mode=mode, min_tensor_bytes=0, resident_tail_bytes=tail, memory_budget=None)
    for _ in range(3):
        x.grad = None
        with engine:
            a = x.sigmoid()
            b = a.exp()
            loss = (a * b).sum()
        a.mul_(2)
        assert_inplace_error_or_exact_grad(loss, x, expected)
    torch.cuda.synchronize()


def _seeded_net(layers: int, batch: int) -> tuple[Net, torch.Tensor, int, list[torch.Tensor]]:
    """A seeded ``Net`` of ``layers`` blocks on CUDA, ``batch`` rows of 2048 tokens, and its plain step's peak and
    gradients (after a step that warms the kernels up)."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=layers).cuda()
    tokens = torch.randint(0, 4096, (batch, 2048), device="cuda")
    _grads(model, tokens, None, True)
    plain_peak, reference = _step_peak(model, tokens, None)
    return model, tokens, plain_peak, reference


def _step_peak(model: nn.Module, tokens: torch.Tensor, engine: object | None) -> tuple[int, list[torch.Tensor]]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    grads = _grads(model, tokens, engine, True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), grads


def _step_rise(model: nn.Module, tokens: torch.Tensor, engine: object | None) -> int:
    """How far one step's peak rises above what was allocated as it began: unlike the absolute peak, it does not
    count what earlier tests left allocated and was freed between two steps (on an H100, after a failed test, 0.6-1.3
    GB that the garbage collector had not held)."""
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    peak, _ = _step_peak(model, tokens, engine)
    return peak - start


@pytest.mark.parametrize("share", [0.85, 0.6])
def test_memory_budget_keeps_every_planned_step_under_budget(share: float) -> None:
    """A budget below the plain peak: after the two measuring steps every step's peak is within the budget, under a hard
    cap at the budget (an allocation past it raises), the plans under trial's included, and the gradients equal the
    plain ones; the trials end on a plan that fits, within the steps their rules allow (each plan at most
    ``_TRIAL_MAX_STEPS`` steps, the plans of a round and one below a flushing fastest, at most ``_TRIAL_ROUNDS``
    rounds)."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=12).cuda()
    tokens = torch.randint(0, 4096, (8, 2048), device="cuda")
    _grads(model, tokens, None, True)
    plain_peak, reference = _step_peak(model, tokens, None)
    budget = int(share * plain_peak)
    total = torch.cuda.get_device_properties(0).total_memory
    engine = offload_activations(model=model, memory_budget=budget)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        peaks = []
        # Two measuring steps; trials of up to 5 plans (3 without light blocks, 2 with) and one below a flushing
        # fastest, each at most _TRIAL_MAX_STEPS steps, in at most _TRIAL_ROUNDS rounds; then two of the plan kept.
        most_trial_steps = _TRIAL_ROUNDS * (5 + 1) * _TRIAL_MAX_STEPS
        kept_steps = 0
        while kept_steps < 2:
            assert len(peaks) < 2 + most_trial_steps + 2, "the trials ran past what their rules allow"
            peak, grads = _step_peak(model, tokens, engine)
            peaks.append(peak)
            for ref, got in zip(reference, grads, strict=True):
                assert torch.equal(ref, got)
            planner = engine.planner
            assert planner is not None
            kept_steps = kept_steps + 1 if len(peaks) > 2 and not planner.trying else 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert engine.planner is not None and engine.planner.plan is not None and engine.planner.plan.fits
    assert max(peaks[2:]) <= budget, (peaks, budget, engine.planner.plan)  # after the two measuring steps


def test_a_step_that_ran_out_of_memory_mid_backward_runs_again_with_the_plain_gradients() -> None:
    """CUDA's own out-of-memory error in the middle of a planned step's backward, with copies in flight: the engine
    drops what the step held, the planner corrects its plan (by a request larger than the device) and ``run_step``
    runs the step again, more frugally, in a cache emptied of the failed step's blocks; its gradients are the plain
    ones, bit for bit, and the next steps train as usual. In a process of its own: in this one, what earlier tests
    left allocated and cached shapes the planner's first plans (on an H100, a measuring step pressed by another test's
    cache aimed every plan below zero, so the step that failed already ran the most frugal plan, and the error stood,
    as designed)."""
    result = _alone("tests.gpu.fresh_process", "rerun_after_cuda_oom", allocator_settings=False)
    assert result["lighter_than_every_block"], result  # a more frugal plan was left to run again under
    assert result["failed"] and result["runs"] == 2 and result["plan_changed"], result
    assert result["gradients_equal"] and result["next_gradients_equal"], result


def rerun_after_cuda_oom() -> dict[str, object]:
    """What ``test_a_step_that_ran_out_of_memory_mid_backward_runs_again_with_the_plain_gradients`` checks, from a
    fresh process (``tests.gpu.fresh_process``). The warm-up runs until a plan runs that checkpoints fewer than every
    block: a measuring step is as frugal as any plan, and so is a plan that checkpoints every block, so a step that
    failed there would have nothing more frugal left to run again under."""
    model, tokens, plain_peak, reference = _seeded_net(layers=8, batch=8)
    engine = offload_activations(model=model, memory_budget=int(0.8 * plain_peak))
    for _ in range(40):
        _grads(model, tokens, engine, True)
        planner = engine.planner  # (made as the first step begins)
        assert planner is not None
        if planner.plan is not None and not planner.measuring and planner.plan.checkpoint_blocks < len(model.blocks):
            break
    failed, runs = [False], []
    total = torch.cuda.get_device_properties(0).total_memory

    def fail_once(*_: object) -> None:
        if not failed[0]:
            failed[0] = True
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # CUDA raises its own error

    handle = model.blocks[4].up.weight.register_hook(fail_once)  # (its gradient comes mid-backward)
    before = planner.plan
    try:
        grads = engine.run_step(lambda: runs.append(planner.plan) or _grads(model, tokens, engine, True))
    finally:
        handle.remove()
    result = {
        "plan_before": str(before),
        "lighter_than_every_block": before is not None and before.checkpoint_blocks < len(model.blocks),
        "failed": failed[0],
        "runs": len(runs),
        "plan_changed": planner.plan != before,
        "gradients_equal": all(torch.equal(ref, got) for ref, got in zip(reference, grads, strict=True)),
        "next_gradients_equal": all(
            torch.equal(ref, got) for ref, got in zip(reference, _grads(model, tokens, engine, True), strict=True)
        ),
    }
    engine.close()
    return result


def test_a_second_model_in_one_process_plans_as_in_a_fresh_process() -> None:
    """A model trained under a budget, then dropped, leaves its cache in the process (expandable segments are never
    unmapped but by emptying the cache); a second, smaller model under a budget below that cache then plans as in a
    fresh process: its plans aim above half its budget and it runs a plan lighter than every block checkpointed.
    (Counting the first model's cache as the second's fragments, plans aimed below zero.) In a process of its own."""
    result = _alone("tests.gpu.fresh_process", "second_model_under_budget", allocator_settings=False)
    assert result["cached_before"] > result["budget"], result  # the case: more cached than the second model's budget
    assert result["aim"] > result["budget"] // 2, result
    assert result["checkpoint_blocks"] < result["blocks"], result


def second_model_under_budget() -> dict[str, object]:
    """What ``test_a_second_model_in_one_process_plans_as_in_a_fresh_process`` checks, from a fresh process
    (``tests.gpu.fresh_process``): an 8-block model trained under a budget and dropped, then a 4-block
    one under 0.8x its plain peak, its cheapest plan (no trials, so that timings do not choose)."""
    first, tokens, plain_peak, _ = _seeded_net(layers=8, batch=8)
    engine = offload_activations(model=first, memory_budget=int(0.8 * plain_peak))
    for _ in range(6):
        _grads(first, tokens, engine, True)
    engine.close()
    del first, tokens, engine
    gc.collect()
    torch.cuda.synchronize()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    second, tokens, plain_peak, _ = _seeded_net(layers=4, batch=2)
    budget = int(0.8 * plain_peak)
    engine = offload_activations(model=second, memory_budget=budget, plan_trials=False)
    for _ in range(4):
        _grads(second, tokens, engine, True)
    planner = engine.planner
    assert planner is not None and planner.plan is not None
    result = {
        "cached_before": cached,
        "budget": budget,
        "aim": planner.core.plan_budget,
        "plan": str(planner.plan),
        "checkpoint_blocks": planner.plan.checkpoint_blocks,
        "blocks": len(second.blocks),
    }
    engine.close()
    return result


class PartsBlock(nn.Module):
    """A decoder layer as Hugging Face writes them: attention, MLP and norms as modules of their own."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads, "sdpa")
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def reserved_when_offloading() -> dict[str, float]:
    """Peak reserved and allocated memory over three steps that offload everything (after two that warm up), in a
    fresh process: what ``test_offloading_everything_reserves_at_most_1_10x_what_it_allocates`` checks."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=12).cuda()
    tokens = torch.randint(0, 4096, (8, 2048), device="cuda")
    engine = offload_activations(model=model, **EVERYTHING)
    for _ in range(2):
        _grads(model, tokens, engine, True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        _grads(model, tokens, engine, True)
    torch.cuda.synchronize()
    return {
        "offloaded_gib": engine.stats.offloaded_bytes / GiB,
        "allocated_gib": torch.cuda.max_memory_allocated() / GiB,
        "reserved_gib": torch.cuda.max_memory_reserved() / GiB,
    }


def allocations_under_a_users_budget() -> dict[str, object]:
    """Fixed segments cached before training (as a process holds them after loading a model or running validation),
    then training under a budget the user gives: what the allocator holds after. Run in a fresh process, whose
    allocator starts with fixed segments (``tests.gpu.fresh_process``); returns what the test checks."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=8).cuda()
    tokens = torch.randint(0, 4096, (8, 2048), device="cuda")
    plain_peak, _ = _step_peak(model, tokens, None)
    model.zero_grad(set_to_none=True)
    # A free 512 MiB fixed segment in the cache: the next allocations of its size would be served from it.
    torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    cached_fixed = _fixed_segments(free_only=True)
    fixed_before = _fixed_segments()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine = offload_activations(model=model, memory_budget=int(0.7 * plain_peak))
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16), engine:
            loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    engine.close()
    return {
        "cached_fixed_before": sum(cached_fixed.values()),
        "cached_fixed_after": sum(_fixed_segments(free_only=True).values()),
        # Cached before training and still there after: kept unused, or taken by the training's allocations.
        "cached_fixed_kept": len(set(cached_fixed) & set(_fixed_segments())),
        "fixed_segments_made_while_training": len(set(_fixed_segments()) - set(fixed_before)),
        "optimizer_state_tensors": sum(len(state) for state in optimizer.state.values()),
    }


def _fixed_segments(free_only: bool = False) -> dict[int, int]:
    """The fixed (not expandable) segments of the device, address to bytes; ``free_only``: those holding nothing
    (cached, ready to serve the next allocations)."""
    return {
        s["address"]: s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if not s.get("is_expandable") and (s["allocated_size"] == 0 or not free_only)
    }


def train_by_parts_under_a_cap() -> dict[str, object]:
    """A small vocabulary and long rows: the blocks' backward, with a block rebuilt whole, is the step's peak. Under a
    budget below the most frugal whole-block plan (every block checkpointed, every input offloaded), the planner
    checkpoints the blocks by their parts. Trains six steps under a hard cap at that budget; returns what the test
    checks (its test runs it in a process of its own, ``tests.gpu.by_parts_under_cap``)."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=8, vocab=256).cuda()
    model.blocks = nn.ModuleList(PartsBlock(1024, 8) for _ in range(8)).cuda()
    tokens = torch.randint(0, 256, (16, 1024), device="cuda")
    _grads(model, tokens, None, True)
    plain_peak, reference = _step_peak(model, tokens, None)
    # The model's numbers, measured under a loose budget: the most frugal plan of each way.
    probe = offload_activations(model=model, memory_budget=plain_peak)
    for _ in range(2):
        _step_peak(model, tokens, probe)
    profile = probe.planner.profile  # type: ignore[union-attr]
    probe.close()
    assert profile is not None and profile.splittable, profile
    frugal = plan_candidates(profile, 1)
    whole, by_parts = frugal[profile.blocks], frugal[-1]
    budget = by_parts.peak + 3 * (whole.peak - by_parts.peak) // 4
    total = torch.cuda.get_device_properties(0).total_memory
    engine = offload_activations(model=model, memory_budget=budget)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(budget / total)
    peaks, equal = [], True
    try:
        for _ in range(2 + 4):
            peak, grads = _step_peak(model, tokens, engine)
            peaks.append(peak)
            equal = equal and all(torch.equal(ref, got) for ref, got in zip(reference, grads, strict=True))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        engine.close()
    plan = engine.planner.plan  # type: ignore[union-attr]
    assert plan is not None
    return {
        "whole_gib": whole.peak / GiB,
        "by_parts_gib": by_parts.peak / GiB,
        "budget_gib": budget / GiB,
        "peaks_gib": [p / GiB for p in peaks],
        "split": plan.split,
        "fits": plan.fits,
        "grads_equal": equal,
    }


def test_a_budget_only_checkpointing_by_parts_meets_trains_under_a_hard_cap() -> None:
    """Below the most frugal whole-block plan, the blocks checkpointed by their parts train under a hard cap at the
    budget, within it, with the plain gradients. In a process of its own, as a training run is: in this one, segments
    that earlier tests left partly used (2.1 GiB on an H200) could not be released under the cap."""
    result = _alone("tests.gpu.by_parts_under_cap")
    # Whole, a block rebuilds its attention and MLP at once: on an H200 the two frugal plans were 0.33 GB apart at
    # 8 rows of 1024 tokens, 0.6 GiB at 16.
    assert result["by_parts_gib"] < result["whole_gib"] - 0.375, result
    # (Whether the plan reports that it fits is the fit margin's call: this budget sits within it of the floor.)
    assert result["split"] and result["grads_equal"], result
    assert max(result["peaks_gib"]) <= result["budget_gib"], result


def test_a_users_budget_trains_in_expandable_segments_from_its_first_step() -> None:
    """Under a budget the user gives, the allocator switches to expandable segments before the first step allocates
    anything, and the fixed segments the process had cached unused are returned as it switches: training then makes no
    fixed segment (only the free room of fixed segments that hold weights is reused). Switched at the first copy with
    the cache kept, cached fixed segments took the next allocations (on an H200, small-h512's optimizer state went into
    an earlier fixed segment, whose holes no flush could return). In a process of its own: the allocator's setting is
    the process's, and this one switched long ago."""
    result = _alone("tests.gpu.fresh_process", "allocations_under_a_users_budget", allocator_settings=False)
    assert result["cached_fixed_before"] >= 512 << 20, result
    assert result["cached_fixed_after"] == 0 and result["cached_fixed_kept"] == 0, result
    assert result["fixed_segments_made_while_training"] == 0, result
    assert result["optimizer_state_tensors"] > 0, result


def test_default_budget_costs_nothing_where_the_model_fits() -> None:
    """``offload_activations(model=model)`` on a model that fits: after the measuring step no hooks are installed,
    nothing is offloaded, and the peak is the plain one."""
    torch.manual_seed(0)
    model = Net(hidden=512, layers=4).cuda()
    tokens = torch.randint(0, 4096, (4, 1024), device="cuda")
    _grads(model, tokens, None, True)
    plain_rise = _step_rise(model, tokens, None)
    engine = offload_activations(model=model)
    for _ in range(4):
        rise = _step_rise(model, tokens, engine)
    assert engine.planner is not None and engine.planner.plan is not None
    assert engine.planner.plan.offload_bytes == 0 and engine.planner.plan.checkpoint_blocks == 0
    assert engine.stats.offloaded_bytes == 0 and engine.stats.saved_tensors == 0  # no hooks at all
    assert rise == plain_rise


def test_a_kept_plan_returns_once_what_the_steps_before_it_left_cached() -> None:
    """Memory cached by the time a kept plan's first step ends (here a tensor of 2.5x the step's peak, freed after
    it) stays reserved for good under expandable segments. Where the budget has room, the planner finds the allocator
    holding more than 1.10x the step's peak as that step ends, and the cache is emptied once, before the next step,
    never again; the gradients stay the plain ones."""
    model, tokens, plain_peak, reference = _seeded_net(layers=12, batch=4)
    # (What the allocator holds counts against the budget: the freed tensor below stays under it.)
    engine = offload_activations(model=model, memory_budget=int(4 * plain_peak))
    for _ in range(3):  # the measuring steps, then the first planned step (the plan is chosen as it begins)
        _step_peak(model, tokens, engine)
    planner = engine.planner
    assert planner is not None and planner.plan is not None and not planner.measuring
    checks: list[tuple[int, bool]] = []
    releases: list[int] = []
    check, release = planner.core.cache_worth_emptying, planner.memory.release_cache

    def recorded_check(peak: int, reserved: int) -> bool:
        checks.append((planner.step, check(peak, reserved)))
        return checks[-1][1]

    def recorded_release() -> None:
        releases.append(planner.step + 1)
        release()

    planner.core.cache_worth_emptying = recorded_check  # type: ignore[method-assign]
    planner.memory.release_cache = recorded_release
    junk = torch.empty(5 * plain_peak // 2, dtype=torch.uint8, device="cuda")
    del junk
    held = torch.cuda.memory_reserved()
    for _ in range(8):
        _, grads = _step_peak(model, tokens, engine)
        for ref, got in zip(reference, grads, strict=True):
            assert torch.equal(ref, got)
    assert len(checks) == 1 and checks[0][1], (checks, held / GiB, planner.plan)
    assert releases == [checks[0][0] + 1]
    assert torch.cuda.memory_reserved() < held - plain_peak / 2, (torch.cuda.memory_reserved() / GiB, held / GiB)


def test_hand_tuned_offloading_returns_what_its_first_step_left_cached() -> None:
    """Without a memory budget the engine reads the allocator as it installs after the first optimizer step: memory the
    first step left cached (here a tensor of twice the step's peak, freed after it) is returned then, and the
    gradients stay the plain ones."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=12).cuda()
    tokens = torch.randint(0, 4096, (4, 2048), device="cuda")
    _grads(model, tokens, None, True)
    plain_peak, reference = _step_peak(model, tokens, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps (torch's hook sees them), changes nothing
    engine = offload_activations(model=model, **EVERYTHING)
    _step_peak(model, tokens, engine)
    optimizer.step()
    junk = torch.empty(2 * plain_peak, dtype=torch.uint8, device="cuda")
    del junk
    held = torch.cuda.memory_reserved()
    reserved = []
    for _ in range(4):
        _, grads = _step_peak(model, tokens, engine)
        optimizer.step()
        reserved.append(torch.cuda.memory_reserved())
        for ref, got in zip(reference, grads, strict=True):
            assert torch.equal(ref, got)
    engine.close()
    assert reserved[0] < held - plain_peak, ([r / GiB for r in reserved], held / GiB)
    settling = engine._path.settling
    assert settling is not None and settling.releases >= 1


def test_elementwise_recompute_with_streamed_offloading_gives_the_plain_gradients() -> None:
    """Every block with elementwise recompute (products and attention kept on the device, the rest recomputed), alone
    and with the streamed engine offloading what it sees (the blocks' inputs, the head's tensors): the plain gradients
    bit for bit on deterministic kernels, below the plain peak."""
    torch.manual_seed(0)
    model = Net(hidden=1024, layers=8).cuda()
    tokens = torch.randint(0, 4096, (4, 1024), device="cuda")
    _grads(model, tokens, None, True)
    plain_peak, reference = _step_peak(model, tokens, None)
    apply_checkpointing(model, recompute="elementwise")
    try:
        light_peak, light = _step_peak(model, tokens, None)
        engine = offload_activations(mode="streamed", **EVERYTHING)
        _, offloaded = _step_peak(model, tokens, engine)
        engine.close()
    finally:
        remove_checkpointing(model)
    assert light_peak < plain_peak
    assert engine.stats.offloaded_bytes > 0
    for grads in (light, offloaded):
        assert all(torch.equal(ref, got) for ref, got in zip(reference, grads, strict=True))


@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_a_compiled_model_gives_the_gradients_it_gives_without_offloading(how: str) -> None:
    """``torch.compile`` (inductor) on the whole model, or on each block: the compiled graphs hand their saved tensors
    to the hooks as they return, and the streamed engine's gradients equal the compiled model's without it, bit for
    bit, over two steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(hidden=512, layers=4).cuda()
    tokens = torch.randint(0, 4096, (4, 1024), device="cuda")
    for module in [model] if how == "whole" else list(model.blocks):
        module.compile()
    try:
        reference = _grads(model, tokens, None, True)
        engine = offload_activations(mode="streamed", model=model, **EVERYTHING)
        for _ in range(2):
            grads = _grads(model, tokens, engine, True)
            assert engine.stats.offloaded_bytes > 0
            for ref, got in zip(reference, grads, strict=True):
                assert torch.equal(ref, got)
    finally:
        torch._dynamo.reset()
