"""What a training step holds before it saves a single activation: the weights, their gradients and the optimizer's
state. No plan changes it, and it is known before the first step (gradients and the optimizer's state are allocated
in that step), so a budget below it can be said before anything runs. Torch only: no Lightning import."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_offload.planner import words


@dataclass(frozen=True)
class RestingFloor:
    """Bytes a step holds on the device whatever its plan.

    Attributes:
        allocated: allocated on the device now (the weights, and whatever else the process holds).
        gradients: the gradients still to come (trainable weights on the device without a ``.grad`` yet).
        state: the optimizers' state still to come (0 where an optimizer's kind is not known: a lower bound).
        optimizers: the kinds of optimizer counted, for the message (``"AdamW"``).
        transient: what the optimizers' step allocates for a moment on top of the state (:func:`step_temporaries`).
    """

    allocated: int
    gradients: int
    state: int
    optimizers: tuple[str, ...] = ()
    transient: int = 0

    @property
    def total(self) -> int:
        return self.allocated + self.gradients + self.state + self.transient


def state_per_weight(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """How many values the size of a weight ``optimizer`` keeps per weight of ``group`` (0: none, or a kind not known,
    so that the floor stays a lower bound)."""
    optim = torch.optim
    if isinstance(optimizer, optim.Adam | optim.AdamW):
        return 3 if group.get("amsgrad") else 2  # both moments (and the running maximum)
    if isinstance(optimizer, optim.NAdam | optim.RAdam | optim.Adamax | optim.Adadelta | optim.Rprop):
        return 2
    if isinstance(optimizer, optim.Adagrad | optim.ASGD):
        return 1
    if isinstance(optimizer, optim.RMSprop):
        return 1 + (group.get("momentum", 0) > 0) + bool(group.get("centered"))
    if isinstance(optimizer, optim.SGD):
        return 1 if group.get("momentum", 0) > 0 else 0
    return 0


def step_temporaries(optimizer: torch.optim.Optimizer, group: dict, device: torch.device) -> int:
    """How many values the size of a weight ``optimizer``'s step allocates for a moment per weight of ``group`` on
    ``device``: Adam's and AdamW's multi-tensor step (the default on CUDA, unless fused) makes the square roots of the
    second moments of every weight at once. On an H200 the optimizer's step of 24 model-zoo configurations with AdamW
    peaked at weights, gradients, both moments and 1.01-1.08x the weights again for models of 0.8 GiB of weights or more
    (more for smaller ones, whose other allocations weigh); SGD's, at weights, gradients and momentum. 0 elsewhere (a
    kind not known, a fused or single-tensor step), so that the floor stays a lower bound."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or group.get("fused"):
        return 0
    foreach = group.get("foreach")
    return 1 if foreach or (foreach is None and device.type == "cuda" and not group.get("differentiable")) else 0


def resting_floor(
    allocated: int, device: torch.device, optimizers: Iterable[torch.optim.Optimizer] = (), params: Iterable = ()
) -> RestingFloor:
    """The floor of a step on ``device``: ``allocated`` bytes now, plus the gradients and optimizer state its first
    step will allocate for the weights of ``optimizers`` (each weight once) and of ``params`` (gradients only: no
    optimizer is known for them)."""
    seen: set[int] = set()
    gradients = state = transient = 0
    kinds: list[str] = []

    def to_come(param: object) -> bool:
        """Whether ``param`` is a trainable weight on ``device`` not counted yet (it is counted from now on)."""
        counts = (
            isinstance(param, torch.Tensor)
            and param.requires_grad
            and param.device.type == device.type
            and (device.index is None or param.device.index == device.index)
            and id(param) not in seen
        )
        if counts:
            seen.add(id(param))
        return counts

    for optimizer in optimizers:
        kinds.append(type(optimizer).__name__)
        for group in optimizer.param_groups:
            per_weight = state_per_weight(optimizer, group)
            temporaries = step_temporaries(optimizer, group, device)
            for param in group["params"]:
                if not to_come(param):
                    continue
                nbytes = param.numel() * param.element_size()
                gradients += nbytes if param.grad is None else 0
                state += per_weight * nbytes if not optimizer.state.get(param) else 0
                transient += temporaries * nbytes
    for param in params:
        if to_come(param) and param.grad is None:
            gradients += param.numel() * param.element_size()
    return RestingFloor(allocated, gradients, state, tuple(dict.fromkeys(kinds)), transient)


def floor_over(
    budget: int, allocated: int, device: torch.device, optimizers: Iterable[torch.optim.Optimizer], params: Iterable
) -> str | None:
    """What to say where the floor (:func:`resting_floor`) passes ``budget``; ``None`` where it does not."""
    floor = resting_floor(allocated, device, optimizers, params)
    if floor.total <= budget:
        return None
    return words.resting_floor_over(
        budget, floor.allocated, floor.gradients, floor.state, floor.optimizers, floor.transient
    )


def checked_optimizer(optimizer: object, call: str) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer=`` of ``call`` as a tuple (empty for ``None``), or a ``TypeError`` quoting the call."""
    if optimizer is None:
        return ()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{call}(optimizer={type(optimizer).__name__}): optimizer must be a torch.optim.Optimizer or None"
        )
    return (optimizer,)
