"""The plans the callback keeps between fits (``KeptPlans``): taken from an engine as a fit ends, given to the next,
and carried in the checkpoint state, read from the running engine while a fit runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_offload.kept_plans import KeptPlans


class FakeEngine:
    """An engine's plan-carrying side: its plans as plain values, and what it was given."""

    def __init__(self, plans: dict[str, Any] | None = None, stepped: bool | None = None) -> None:
        self.plans = plans
        self.planner = None if stepped is None else SimpleNamespace(step=int(stepped))
        self.loaded: list[dict[str, Any] | None] = []

    def plans_state(self) -> dict[str, Any] | None:
        return self.plans

    def load_plans(self, state: dict[str, Any] | None) -> None:
        self.loaded.append(state)


def test_nothing_planned_leaves_an_empty_state() -> None:
    kept = KeptPlans()
    assert kept.state_dict(None) == {}
    assert kept.state_dict(FakeEngine(plans=None)) == {}  # type: ignore[arg-type]


def test_plans_kept_as_a_fit_ends_go_to_the_next_fits_engine_and_into_checkpoints() -> None:
    kept = KeptPlans()
    kept.keep(FakeEngine(plans={"fingerprint": "a"}))  # type: ignore[arg-type]
    assert kept.state_dict(None) == {"plans": {"fingerprint": "a"}}
    later = FakeEngine(plans={"fingerprint": "b"})
    kept.give(later)  # type: ignore[arg-type]
    assert later.loaded == [{"fingerprint": "a"}]
    assert kept.state_dict(later) == {"plans": {"fingerprint": "b"}}  # a running fit's engine has the newest


def test_a_checkpoints_plans_reach_an_engine_only_before_its_first_step() -> None:
    state = {"plans": {"fingerprint": "c"}}
    fresh, unplanned, stepped = FakeEngine(stepped=False), FakeEngine(stepped=None), FakeEngine(stepped=True)
    for engine in (fresh, unplanned, stepped):
        kept = KeptPlans()
        kept.load_state_dict(state, engine)  # type: ignore[arg-type]
        assert kept.state == {"fingerprint": "c"}  # kept for the next fit all the same
    assert fresh.loaded == unplanned.loaded == [{"fingerprint": "c"}] and stepped.loaded == []
    kept = KeptPlans()
    kept.load_state_dict({}, None)
    assert kept.state is None and kept.state_dict(None) == {}
