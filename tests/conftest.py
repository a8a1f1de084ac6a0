"""Shared fixtures: every test starts with an empty host pool and no saved-tensor hooks installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightning_offload import release_host_memory
from lightning_offload.host_pool import HostPool, pool_for
from tests.models import top_hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: compiles with a C++ toolchain (several seconds); deselect with -m 'not slow'"
    )


@pytest.fixture(autouse=True)
def clean_offload_state() -> Iterator[None]:
    """Idle pooled buffers are released before each test; a test that leaves hooks installed fails.

    (No ``gc.collect()`` here: after torch.compile is imported it costs ~0.3 s per test. Tests that read the pool
    compare against what it held when they started.)
    """
    release_host_memory()
    assert top_hooks() is None, "saved-tensor hooks leaked in from an earlier test"
    yield
    leaked = top_hooks() is not None
    while top_hooks() is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    assert not leaked, "the test left saved-tensor hooks installed"


@pytest.fixture
def cpu_pool() -> HostPool:
    """The process-wide pool the CPU test engines use."""
    return pool_for(torch.device("cpu"))
