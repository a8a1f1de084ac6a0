"""``trace_range``: NVTX and profiler ranges when someone listens, a shared no-op otherwise."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_offload.tracing import trace_range

needs_no_cuda_context = pytest.mark.skipif(torch.cuda.is_initialized(), reason="this process already uses CUDA")


@pytest.fixture
def nvtx_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Pretend CUDA is initialised and record the NVTX calls instead of making them (a CPU build has no NVTX)."""
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    return calls


def profiled_names(prof: profile) -> list[str]:
    return [event.name for event in prof.events()]


@needs_no_cuda_context
def test_without_cuda_or_profiler_it_is_one_shared_no_op() -> None:
    first, second = trace_range("offload/a"), trace_range("offload/b")
    assert first is second  # nothing allocated per call
    with first as value:
        assert value is None


@needs_no_cuda_context
def test_profiler_records_the_range_while_it_runs() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with trace_range("offload/test_range"):
            torch.ones(4).add_(1)
    names = profiled_names(prof)
    assert names.count("offload/test_range") == 1, names
    # Once the profiler stopped, the call is the no-op again.
    assert trace_range("offload/test_range") is trace_range("offload/other")


def test_nvtx_range_is_pushed_and_popped_around_the_block(nvtx_calls: list[tuple[str, str | None]]) -> None:
    with trace_range("offload/h2d"):
        assert nvtx_calls == [("push", "offload/h2d")]
    assert nvtx_calls == [("push", "offload/h2d"), ("pop", None)]


def test_nvtx_range_is_popped_when_the_block_raises(nvtx_calls: list[tuple[str, str | None]]) -> None:
    with pytest.raises(ValueError, match="boom"), trace_range("offload/stall"):
        raise ValueError("boom")
    assert nvtx_calls == [("push", "offload/stall"), ("pop", None)]


def test_nvtx_and_profiler_ranges_nest(nvtx_calls: list[tuple[str, str | None]]) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with trace_range("offload/outer"):
            with trace_range("offload/inner"):
                torch.ones(4).add_(1)
    assert nvtx_calls == [("push", "offload/outer"), ("push", "offload/inner"), ("pop", None), ("pop", None)]
    names = profiled_names(prof)
    assert "offload/outer" in names and "offload/inner" in names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_nvtx_ranges_on_cuda() -> None:
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with trace_range("offload/cuda_range"):
            torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()
    assert "offload/cuda_range" in profiled_names(prof)
