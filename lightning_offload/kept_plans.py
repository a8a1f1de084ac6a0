"""The plans ``ActivationOffloadCallback`` keeps between fits: taken from a fit's engine as the fit ends, given to the
next fit's engine, and carried in (and restored from) the callback's checkpoint state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_offload.engine import OffloadEngine


class KeptPlans:
    """The planner's plans kept across fits, as plain values (see :meth:`OffloadEngine.plans_state`)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None  # the last fit's plans, for the next (and checkpoints)

    def give(self, engine: OffloadEngine) -> None:
        """Give a fit's new engine the plans kept: an earlier fit's (or a checkpoint's), measured again where they
        differ.

        Args:
            engine: the engine just built, before its first step.
        """
        engine.load_plans(self.state)

    def keep(self, engine: OffloadEngine) -> None:
        """Keep the plans of a fit's engine as the fit ends.

        Args:
            engine: the engine of the fit that ends.
        """
        self.state = engine.plans_state()

    def state_dict(self, engine: OffloadEngine | None) -> dict[str, Any]:
        """The callback's checkpoint state: the plans of the running fit's engine, else those kept.

        Args:
            engine: the running fit's engine (``None`` outside a fit).

        Returns:
            ``{"plans": ...}``, or ``{}`` where nothing was planned.
        """
        plans = engine.plans_state() if engine is not None else self.state
        return {"plans": plans} if plans is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any], engine: OffloadEngine | None) -> None:
        """Keep the plans of a checkpoint's state, and give them to the running fit's engine before its first step.

        Args:
            state_dict: what :meth:`state_dict` returned.
            engine: the running fit's engine (``None`` outside a fit: the next fit's engine takes them).
        """
        self.state = state_dict.get("plans")
        if engine is not None and (engine.planner is None or not engine.planner.step):
            engine.load_plans(self.state)
