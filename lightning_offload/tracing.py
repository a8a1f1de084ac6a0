"""Named ranges around the engine's copies and waits, for Nsight Systems (NVTX) and the PyTorch profiler.

``trace_range(name)`` marks a span of host code:

- an NVTX range (``torch.cuda.nvtx.range_push``/``range_pop``) once CUDA is initialised in this process, so an
  ``nsys profile`` timeline shows the engine's work next to the kernels and copies it launched;
- a ``torch.profiler.record_function`` range while a PyTorch profiler is recording, so its traces name the spans.

With neither (no CUDA in use, no profiler), it returns one shared ``nullcontext``: the cost is two flag reads, so it
can stay in hot paths such as the per-tensor pack and unpack hooks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler

__all__ = ["trace_range"]

_NOTHING: AbstractContextManager[None] = nullcontext()


def trace_range(name: str) -> AbstractContextManager[Any]:
    """A context manager that marks ``name`` for NVTX and the PyTorch profiler, or does nothing.

    Example::

        with trace_range("offload/d2h"):
            copy_to_host(tensor)

    Args:
        name: the range's name as Nsight and the profiler show it.

    Returns:
        A context manager; a shared no-op one when CUDA is not initialised and no profiler records.
    """
    # ``is_initialized`` is a flag read: true once this process created a CUDA context. Without one there is no
    # device timeline to annotate, and pushing NVTX ranges would be wasted work (or fail on a CPU-only build).
    nvtx = torch.cuda.is_initialized()
    # Read from the module on every call: the profiler flips this flag when it starts and stops.
    profiled = autograd_profiler._is_profiler_enabled
    if not (nvtx or profiled):
        return _NOTHING
    return _Range(name, nvtx=nvtx, profiled=profiled)


class _Range:
    """An NVTX range and/or a profiler ``record_function`` range around a ``with`` block."""

    __slots__ = ("_name", "_nvtx", "_pushed", "_record")

    def __init__(self, name: str, nvtx: bool, profiled: bool) -> None:
        self._name = name
        self._nvtx = nvtx
        self._pushed = False
        self._record = torch.profiler.record_function(name) if profiled else None

    def __enter__(self) -> _Range:
        if self._nvtx:
            torch.cuda.nvtx.range_push(self._name)
            self._pushed = True
        if self._record is not None:
            self._record.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Close in reverse order, and pop the NVTX range even when the profiler range fails to close.
        try:
            if self._record is not None:
                self._record.__exit__(exc_type, exc, tb)
        finally:
            if self._pushed:
                self._pushed = False
                torch.cuda.nvtx.range_pop()
