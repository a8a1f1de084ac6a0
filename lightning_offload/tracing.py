"""Named ranges around copies and stalls, for the PyTorch profiler and Nsight (NVTX), free when nobody listens."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def trace_range(name: str) -> AbstractContextManager[object]:
    """A ``record_function`` range while a profiler runs (so traces show the copies), else nothing at all."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return nullcontext()
