"""The wrapper that makes one block run checkpointed: its instance ``forward`` replaced by one that runs the original
under non-reentrant checkpointing (key/value caches dropped, buffers the forward updated kept from updating again in
the recompute), and the test whether a module carries that wrapper.

Torch only: no Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from lightning_offload.recompute_policy import selective_contexts

__all__ = ["CheckpointedForward", "is_checkpointed", "wrap"]

# Keyword arguments through which layers receive a key/value cache. A layer that appends to its cache must not run
# twice (the backward recompute would append again and the recomputed shapes would no longer match), so under
# checkpointing the cache is dropped, as Hugging Face's own gradient checkpointing does.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class CheckpointedForward:
    """Replaces a module instance's ``forward``: runs the original forward under non-reentrant checkpointing.

    A small object instead of a closure so that ``copy.deepcopy`` and ``pickle`` of the model keep working: a
    closure would be shared by a deep copy (the copy would run the original model's forward), whereas this
    object's ``module`` reference is remapped by ``deepcopy``'s memo.

    Args:
        module: the module whose forward this replaces.
        original: the instance-level ``forward`` that was there before (``None``: the class's ``forward``).
        recompute: ``"all"`` (backward reruns the whole forward) or ``"elementwise"`` (the outputs of matrix
            products and attention are kept; see :mod:`lightning_offload.recompute_policy`).
    """

    def __init__(self, module: nn.Module, original: Any, recompute: str = "all") -> None:
        self.module = module
        self.original = original
        self.recompute = recompute

    def _forward(self) -> Any:
        if self.original is not None:
            return self.original
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._forward()
        # Without gradients nothing is saved, so checkpointing would only add overhead; in eval mode the caller
        # wants plain inference (and cache updates must happen exactly once).
        if not (self.module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if not getattr(self.module, "_can_checkpoint_with_cache", False):
            kwargs = _drop_cache(self.module, kwargs)
        # Keyword arguments go in through ``_KeywordCall``: ``checkpoint`` would otherwise swallow ones that share a
        # name with its own options. Tensors among them that need no gradient (masks, rotary tables) are shared by
        # every block and held by the model's forward anyway, so keeping them by reference costs no memory. Those that
        # need one are activations (Hugging Face calls a decoder layer's attention with ``hidden_states=...``): they
        # go in as inputs, which checkpointing saves, where an enclosing ``offload_activations`` sees them (held by
        # reference, they would stay on the device).
        activations = [key for key, value in kwargs.items() if isinstance(value, torch.Tensor) and value.requires_grad]
        selective = self.recompute == "elementwise"
        options: dict[str, Any] = {"context_fn": selective_contexts} if selective else {}
        # A forward that updates buffers (a BatchNorm's running statistics) would update them again in the recompute.
        # Left to the compiler when compiling: it accepts only dispatch modes as checkpoint contexts.
        if not torch.compiler.is_compiling() and any(True for _ in self.module.buffers()):
            options["context_fn"] = functools.partial(_BufferGuard(self.module).contexts, selective)
        inputs = [*args, *(kwargs[key] for key in activations)]
        # Checkpointing restores the random state (dropout's masks) only of the devices its tensor inputs are on: a
        # block called with keywords alone, none needing a gradient (the first block's attention part under LoRA, whose
        # embedding and norm are frozen), would recompute with other masks than its forward's, and its gradients would
        # be silently wrong. An empty tensor on each device only the by-reference keywords are on goes in too.
        markers = _device_markers(inputs, [value for key, value in kwargs.items() if key not in activations])
        return checkpoint(
            _KeywordCall(forward, kwargs, activations, len(args), len(markers)),
            *inputs,
            *markers,
            use_reentrant=False,
            **options,
        )


class _KeywordCall:
    """Calls ``forward`` with the positional arguments it is given, the last of which are the keyword arguments named
    ``keys`` (activations that checkpointing must save), and the other keyword arguments by reference."""

    def __init__(
        self, forward: Any, kwargs: dict[str, Any], keys: list[str], positional: int, markers: int = 0
    ) -> None:
        self.forward, self.keys, self.positional, self.markers = forward, keys, positional, markers
        self.others = {key: value for key, value in kwargs.items() if key not in keys}

    def __call__(self, *args: Any) -> Any:
        if self.markers:
            args = args[: -self.markers]  # the devices' markers (see _device_markers): no argument of the forward
        named = dict(zip(self.keys, args[self.positional :], strict=True))
        return self.forward(*args[: self.positional], **self.others, **named)


def _device_markers(inputs: list[Any], by_reference: list[Any]) -> list[torch.Tensor]:
    """An empty tensor on each accelerator that tensors among ``by_reference`` are on and none among ``inputs``: as
    inputs of ``checkpoint`` they make it save and restore those devices' random states."""

    def devices(values: list[Any]) -> dict[torch.device, None]:
        found = (leaf.device for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor))
        return dict.fromkeys(device for device in found if device.type not in ("cpu", "meta"))

    covered = devices(inputs)
    return [torch.empty(0, device=device) for device in devices(by_reference) if device not in covered]


class _BufferGuard:
    """Checkpoint contexts (``context_fn``) that keep a recompute from updating the buffers its forward updated.

    One guards one checkpointed call of ``module``. Its forward context notes which buffers the forward changed
    (wrote in place or replaced); its recompute context, entered around the recompute in backward (outside the
    selective-checkpointing one, whose recompute must see only the forward's operations), keeps those buffers as they
    are and puts them back afterwards, also when torch stops the recompute early. So running statistics and step counts
    advance once per forward, as without checkpointing.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.updated: list[str] = []

    def contexts(self, selective: bool) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        forward, recompute = selective_contexts() if selective else (contextlib.nullcontext(), contextlib.nullcontext())
        return self._forward(forward), self._recompute(recompute)

    @contextlib.contextmanager
    def _forward(self, inner: contextlib.AbstractContextManager) -> Iterator[None]:
        before = _buffer_states(self.module)
        with inner:
            yield
        after = _buffer_states(self.module)
        # BatchNorm writes its running mean and variance without bumping their version counters (its operator does
        # not declare them written), only that of its batch count: a module that changed one of its own buffers counts
        # as having changed them all.
        owners = {name.rpartition(".")[0] for name, state in after.items() if not _same_state(before.get(name), state)}
        self.updated = [name for name in after if name.rpartition(".")[0] in owners]

    @contextlib.contextmanager
    def _recompute(self, inner: contextlib.AbstractContextManager) -> Iterator[None]:
        buffers = dict(self.module.named_buffers())
        # The buffer objects as they are now, and their values: the recompute may replace them or write into them.
        kept = {name: (buffers[name], buffers[name].detach().clone()) for name in self.updated if name in buffers}
        try:
            with inner:
                yield
        finally:
            for name, (buffer, value) in kept.items():
                owner_name, _, attr = name.rpartition(".")
                owner = self.module.get_submodule(owner_name)
                if owner._buffers.get(attr) is not buffer:
                    owner._buffers[attr] = buffer
                with torch.no_grad():
                    buffer.copy_(value)


def _buffer_states(module: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each buffer of ``module`` by qualified name: the tensor and its version counter (bumped by in-place writes)."""
    return {name: (buffer, buffer._version) for name, buffer in module.named_buffers()}


def _same_state(before: tuple[torch.Tensor, int] | None, after: tuple[torch.Tensor, int]) -> bool:
    return before is not None and before[0] is after[0] and before[1] == after[1]


def _drop_cache(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    changed = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if kwargs.get("use_cache"):
        changed.append("use_cache")
    if not changed:
        return kwargs
    kwargs = dict(kwargs)
    for key in changed:
        kwargs[key] = False if key == "use_cache" else None
    _warn_cache_once(type(module).__name__, tuple(changed))
    return kwargs


@functools.cache
def _warn_cache_once(class_name: str, keys: tuple[str, ...]) -> None:
    # Every process of a distributed run trains the same model: one warning (rank zero's) says it all.
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    warnings.warn(
        f"apply_checkpointing: {class_name} was called with {list(keys)} in training; a checkpointed block runs "
        "twice, so its key/value cache is disabled there. Pass use_cache=False when training to silence this.",
        UserWarning,
        stacklevel=4,
    )


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`~lightning_offload.apply_checkpointing` wrapped ``module`` (by anyone)."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def wrap(module: nn.Module, recompute: str = "all") -> None:
    current = module.__dict__.get("forward")
    if isinstance(current, CheckpointedForward):
        current.recompute = recompute
        return
    # Set through ``__dict__``: ``nn.Module.__setattr__`` has no business with a plain callable, and this also
    # works for modules that override ``__setattr__``.
    module.__dict__["forward"] = CheckpointedForward(module, current, recompute)
