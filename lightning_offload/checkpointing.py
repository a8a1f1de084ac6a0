"""Activation checkpointing of a model's repeated blocks, without touching the model's code.

Checkpointing and offloading compose: non-reentrant checkpointing saves each block's *inputs* outside its own
``saved_tensors_hooks`` (so an enclosing :func:`~lightning_offload.offload_activations` sees exactly those inputs)
and keeps everything saved inside the block out of reach of outer hooks (it recomputes them in backward). With
both, only ``2 * batch * seq * hidden`` bytes per block cross the link, a copy that hides behind the block's
compute for any realistic width.

Torch only: no Lightning import.

Example::

    apply_checkpointing(model)          # "auto": the decoder layers of a transformer
    with offload_activations(model=model):
        loss = model(x).sum()
    loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from lightning_offload.recompute_policy import selective_contexts

__all__ = [
    "RECOMPUTE",
    "apply_checkpointing",
    "candidate_blocks",
    "check_recompute",
    "checkpointed_modules",
    "find_repeated_blocks",
    "is_checkpointed",
    "parse_blocks",
    "remove_checkpointing",
    "select_blocks",
    "wrap_blocks",
]

BlockSelector = str | type[nn.Module]

# What backward reruns of a checkpointed block: everything, or all but its matrix products and attention.
RECOMPUTE = ("all", "elementwise")
_ALLOWED = (
    "'auto', a class name or module qualified name (str), an nn.Module subclass, or a non-empty sequence of "
    "class names / qualified names / nn.Module subclasses"
)
# Modules that only hold other modules: never a block themselves (naming a list means its children).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Keyword arguments through which layers receive a key/value cache. A layer that appends to its cache must not run
# twice (the backward recompute would append again and the recomputed shapes would no longer match), so under
# checkpointing the cache is dropped, as Hugging Face's own gradient checkpointing does.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class _CheckpointedForward:
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


def find_repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The model's stack of repeated blocks: the largest ``nn.ModuleList`` whose children share one class, or the
    largest run of two or more consecutive same-class children of an ``nn.Sequential``.

    "Largest" is by total parameter count, so a transformer's decoder layers win over small lists (heads, norms). A
    run inside an ``nn.Sequential`` (blocks stacked between an embedding and a head) counts only where it holds
    parameters: consecutive activations or dropouts are no blocks worth checkpointing.

    Args:
        model: the model to search.

    Returns:
        The container's qualified name (``""`` when it is ``model`` itself) and the blocks (for a ``Sequential``,
        only the run's children).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no such list or run exists.
    """
    _check_model(model, "find_repeated_blocks")
    found = _repeated_blocks(model)
    if found is None:
        raise ValueError(
            f"find_repeated_blocks: {type(model).__name__} has {_NO_REPEATED_BLOCKS}; pass apply_checkpointing(model, "
            "blocks=...) a class name, qualified name or nn.Module subclass "
            f"(candidate block classes: {candidate_blocks(model)})"
        )
    prefix, blocks = found
    return prefix, [module for _, module in blocks]


_NO_REPEATED_BLOCKS = (
    "no nn.ModuleList whose children all share one class, and no nn.Sequential with a run of two or more "
    "same-class children holding parameters"
)


def _repeated_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """:func:`find_repeated_blocks`'s container and blocks, each block by qualified name (a run inside an
    ``nn.Sequential`` does not start at its first child, so the names cannot be counted from 0); ``None``: none."""
    best: tuple[int, str, list[tuple[str, nn.Module]]] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            children = list(module.named_children())
            runs = [children] if children and len({type(child) for _, child in children}) == 1 else []
        elif isinstance(module, nn.Sequential):
            runs = [run for run in _same_class_runs(list(module.named_children())) if _size(run) > 0]
        else:
            continue
        for run in runs:
            size = _size(run)
            if best is None or size > best[0]:  # ties: the first in module order
                best = (size, name, [(_join(name, child_name), child) for child_name, child in run])
    return None if best is None else (best[1], best[2])


def _same_class_runs(children: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """The maximal runs of two or more consecutive ``children`` of one class (lists and dicts, which have no forward
    of their own, are never blocks)."""
    runs: list[list[tuple[str, nn.Module]]] = []
    run: list[tuple[str, nn.Module]] = []
    for named in children:
        if run and type(named[1]) is type(run[-1][1]):
            run.append(named)
            continue
        if len(run) >= 2:
            runs.append(run)
        run = [] if isinstance(named[1], nn.ModuleList | nn.ModuleDict) else [named]
    if len(run) >= 2:
        runs.append(run)
    return runs


def _size(run: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, module in run for p in module.parameters())


def candidate_blocks(model: nn.Module) -> list[str]:
    """Class names that look like blocks worth checkpointing, for error messages and for choosing ``blocks``.

    A candidate is the class of a child of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential``, or a class
    with more than one instance in ``model``; containers themselves are not. Classes defined outside ``torch.nn``
    (a model's own layers) come first, each group in the order the model lists its modules.

    Args:
        model: the model to search.

    Returns:
        The class names, without repeats.
    """
    counts: dict[type[nn.Module], int] = {}
    in_container: set[type[nn.Module]] = set()
    for module in model.modules():
        counts[type(module)] = counts.get(type(module), 0) + 1
        if isinstance(module, _CONTAINERS):
            in_container.update(type(child) for child in module.children())
    found = [
        cls for cls, count in counts.items() if not issubclass(cls, _CONTAINERS) and (cls in in_container or count > 1)
    ]
    found.sort(key=lambda cls: cls.__module__.startswith("torch.nn."))  # stable: model order within each group
    return [cls.__name__ for cls in found]


def apply_checkpointing(
    model: nn.Module, blocks: BlockSelector | Sequence[BlockSelector] = "auto", recompute: str = "all"
) -> list[str]:
    """Checkpoint the selected blocks of ``model`` (non-reentrant), by replacing each block's ``forward``.

    The model's code is untouched: each selected module instance gets a ``forward`` that runs the original one
    under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, only while the module is training and
    gradients are enabled, so evaluation and inference run exactly as before. Applying twice wraps nothing twice.
    A selected module nested in another selected module is left alone (checkpointing it again saves nothing).
    Applying again with another ``recompute`` switches the wrapped modules to it.
    :func:`remove_checkpointing` undoes it; parameters, buffers and ``state_dict`` keys never change.

    Args:
        model: the model to modify in place.
        blocks: which modules to checkpoint. ``"auto"``: the children of :func:`find_repeated_blocks` (a
            transformer's decoder layers). A ``str``: modules whose class name or qualified name equals it (a
            qualified name of an ``nn.ModuleList`` selects its children). An ``nn.Module`` subclass: its
            instances. A sequence of these (names and classes mixed): their union.
        recompute: what backward reruns. ``"all"``: the whole forward (a block saves only its inputs).
            ``"elementwise"``: everything but the outputs of matrix products, convolutions and attention kernels,
            which are kept on the device (selective checkpointing; a transformer block then keeps roughly a third of
            what it saves unwrapped, and backward reruns only its cheap operations: on an H200, 0.45-0.8 of what a
            whole recompute costs, more on small models whose step the host sets). Gradients are the same either way.

    Returns:
        The qualified names of the checkpointed modules (also those that were already checkpointed).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``blocks`` is of another kind, a selector matches no module (the message lists
            :func:`candidate_blocks`), or ``recompute`` is not one of :data:`RECOMPUTE`.
    """
    _check_model(model, "apply_checkpointing")
    check_recompute(recompute, f"apply_checkpointing(recompute={recompute!r})")
    names = select_blocks(model, blocks)
    wrap_blocks(model, names, recompute)
    return names


def wrap_blocks(model: nn.Module, names: Iterable[str], recompute: str = "all") -> None:
    """Checkpoint the modules of ``model`` named ``names`` (as :func:`select_blocks` returned them), as
    :func:`apply_checkpointing` does; for callers that selected (and quoted their own call) first.

    The names are looked up as they are, not selected again: ``""`` (the model itself) is a valid name here but not
    a selector, and a qualified name could also equal some class's name.

    Raises:
        ValueError: a name is not a qualified name of a module of ``model``, or ``recompute`` is not one of
            :data:`RECOMPUTE`; nothing is wrapped then.
    """
    names = list(names)
    check_recompute(recompute, f"wrap_blocks(recompute={recompute!r})")
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown:
        raise ValueError(
            f"wrap_blocks(names={unknown!r}): names must be qualified names of modules of {type(model).__name__} "
            "(as select_blocks returns them)"
        )
    for name in names:
        _wrap(modules[name], recompute)


class WrappedBlocks:
    """The blocks one ``offload_activations(checkpoint=...)`` or ``fabric_offload(checkpoint=...)`` call checkpointed:
    taken off as its engine closes (the model left as it was) and put back if the engine is used again.

    Wraps ``names`` of ``model`` at once (:func:`wrap_blocks`; a block already wrapped switches to ``recompute``). Only
    the blocks it wrapped itself are taken off: one the user had checkpointed before stays checkpointed, with its own
    ``recompute`` back. Which blocks are the user's is looked at each time they are wrapped (a block the user
    checkpointed after the engine closed is theirs too).
    """

    def __init__(self, model: nn.Module, names: Iterable[str], recompute: str) -> None:
        self.names = list(names)
        self._model = weakref.ref(model)
        self._recompute = recompute
        self._own: list[str] = []  # wrapped here: taken off by remove()
        self._theirs: dict[str, str] = {}  # wrapped by the user before: their recompute, put back by remove()
        self.applied = False
        self._wrap(model)

    def _wrap(self, model: nn.Module) -> None:
        modules = dict(model.named_modules())
        present = [name for name in self.names if name in modules]
        wrappers = {name: modules[name].__dict__.get("forward") for name in present}
        self._theirs = {
            name: wrapper.recompute for name, wrapper in wrappers.items() if isinstance(wrapper, _CheckpointedForward)
        }
        self._own = [name for name in present if name not in self._theirs]
        wrap_blocks(model, present, self._recompute)
        self.applied = True

    def apply(self) -> None:
        """Wrap the blocks taken off by :meth:`remove` again (nothing where they are on, or the model is gone)."""
        model = self._model()
        if self.applied or model is None:
            return
        self._wrap(model)

    def remove(self) -> None:
        """Take off the wrappers this call put on, and give the user's blocks their own ``recompute`` back."""
        model = self._model()
        if not self.applied or model is None:
            return
        remove_checkpointing(model, self._own)
        modules = dict(model.named_modules())
        for name, recompute in self._theirs.items():
            wrapper = modules[name].__dict__.get("forward") if name in modules else None
            if isinstance(wrapper, _CheckpointedForward):
                wrapper.recompute = recompute
        self.applied = False


def check_recompute(recompute: Any, call: str, checkpoint: Any = "auto") -> None:
    """Raise unless ``recompute`` is one of :data:`RECOMPUTE` and, where it is not ``"all"``, blocks are selected
    (``checkpoint`` not ``None``); ``call`` is quoted in the message."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"{call}: recompute must be one of {', '.join(map(repr, RECOMPUTE))}")
    if recompute != "all" and checkpoint is None:
        raise ValueError(
            f"{call}: recompute applies to the blocks checkpoint= selects; pass checkpoint='auto' (or a selector) "
            "with it"
        )


def select_blocks(
    model: nn.Module, blocks: BlockSelector | Sequence[BlockSelector] = "auto", call: str | None = None
) -> list[str]:
    """The qualified names of the modules :func:`apply_checkpointing` would wrap; changes nothing.

    Args:
        model: the model to search.
        blocks: as for :func:`apply_checkpointing`.
        call: the call to quote in error messages (default ``apply_checkpointing(blocks=...)``).

    Returns:
        The outermost selected modules, in the order of ``model.named_modules()``.

    Raises:
        ValueError: ``blocks`` is of another kind, or a selector matches no module (the message lists
            :func:`candidate_blocks`).
    """
    call = call or f"apply_checkpointing(blocks={blocks!r})"
    selected: dict[int, str] = {}
    for selector in parse_blocks(blocks, call):
        matches = _match(model, selector, call)
        if not matches:
            raise ValueError(
                f"{call}: {_selector_text(selector)} matches no module of {type(model).__name__} (by class name, "
                f"qualified name or type); candidate block classes: {candidate_blocks(model)}; "
                f"{_argument(call)} must be {_ALLOWED}"
            )
        for name, module in matches:
            selected.setdefault(id(module), name)
    names = sorted(selected.values(), key=_name_order(model))
    # Outermost wins: a checkpointed block recomputes its whole body anyway.
    return [n for n in names if not any(_is_ancestor(other, n) for other in names if other != n)]


def remove_checkpointing(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Undo :func:`apply_checkpointing`: wrapped modules get their previous ``forward`` back.

    Args:
        model: the model to restore in place.
        names: restore only these qualified names (those one :func:`apply_checkpointing` call returned, say);
            names that are not wrapped or no longer exist are skipped. ``None``: every wrapped module.

    Returns:
        The qualified names of the modules restored.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``names`` is a single string (pass ``[name]``).
    """
    _check_model(model, "remove_checkpointing")
    if isinstance(names, str):
        # A string is an iterable of its characters: "layers.1" would restore nothing, "10" layers 1 and 0.
        raise TypeError(
            f"remove_checkpointing(names={names!r}): names must be an iterable of qualified names (such as "
            f"[{names!r}]) or None"
        )
    wanted = None if names is None else set(names)
    restored = []
    for name, module in model.named_modules():
        if wanted is not None and name not in wanted:
            continue
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            if wrapper.original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.original
            restored.append(name)
    return restored


def _check_model(model: Any, call: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}(model={type(model).__name__}): model must be a torch.nn.Module")


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_checkpointing` wrapped ``module`` (by anyone)."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def checkpointed_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` that :func:`apply_checkpointing` wrapped."""
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


def _wrap(module: nn.Module, recompute: str = "all") -> None:
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        current.recompute = recompute
        return
    # Set through ``__dict__``: ``nn.Module.__setattr__`` has no business with a plain callable, and this also
    # works for modules that override ``__setattr__``.
    module.__dict__["forward"] = _CheckpointedForward(module, current, recompute)


def parse_blocks(blocks: Any, call: str | None = None) -> list[BlockSelector]:
    """Check that ``blocks`` is a valid selector for :func:`apply_checkpointing`; return it as a list.

    Args:
        blocks: ``"auto"``, a class or qualified name, an ``nn.Module`` subclass, or a non-empty sequence of names
            and subclasses (mixed; ``"auto"`` only on its own).
        call: the call to quote in error messages (default ``apply_checkpointing(blocks=...)``).

    Raises:
        ValueError: ``blocks`` is of another kind.
    """

    def valid(item: Any) -> bool:
        return (isinstance(item, str) and item != "") or (isinstance(item, type) and issubclass(item, nn.Module))

    if isinstance(blocks, str) or isinstance(blocks, type):
        if valid(blocks):
            return [blocks]
    elif isinstance(blocks, Sequence) and len(blocks) > 0 and all(valid(b) and b != "auto" for b in blocks):
        return list(blocks)
    call = call or f"apply_checkpointing(blocks={blocks!r})"
    raise ValueError(f"{call}: {_argument(call)} must be {_ALLOWED}")


def _argument(call: str) -> str:
    """The argument the quoted ``call`` passed the selector as (``checkpoint`` in ``fabric_offload(checkpoint=3)``), so
    that the message names the argument the user wrote; ``blocks`` where the call names none."""
    named = re.match(r"\w+\((\w+)=", call)
    return named.group(1) if named else "blocks"


def _selector_text(selector: BlockSelector) -> str:
    return selector.__name__ if isinstance(selector, type) else repr(selector)


def _match(model: nn.Module, selector: BlockSelector, call: str) -> list[tuple[str, nn.Module]]:
    if selector == "auto":
        found = _repeated_blocks(model)
        if found is None:
            raise ValueError(
                f"{call}: 'auto' found {_NO_REPEATED_BLOCKS} in {type(model).__name__}; name the blocks by class "
                f"name, qualified name or nn.Module subclass (candidate block classes: {candidate_blocks(model)})"
            )
        return found[1]
    matches: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(selector, type):
            hit = isinstance(module, selector)
        else:
            hit = type(module).__name__ == selector or name == selector
        if not hit:
            continue
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            # Containers have no forward of their own: naming one means "its blocks".
            matches.extend((_join(name, child_name), child) for child_name, child in module.named_children())
        else:
            matches.append((name, module))
    return matches


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_ancestor(parent: str, child: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def _name_order(model: nn.Module) -> Any:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return lambda name: order.get(name, len(order))


# The callback's ``checkpoint`` option, in the words its docstring (and ``--help``) shows.
CHECKPOINT_DOCS = """\
        checkpoint: also apply non-reentrant activation checkpointing to the module's repeated blocks, so only
            each block's input is saved (and offloaded, where it hides behind the block's compute): ``"auto"``
            (the largest ``ModuleList`` of same-class blocks, or run of them in a ``Sequential``), a class name or
            module name, an ``nn.Module``
            subclass, or a list mixing names and classes. ``None``: leave the model as it is (the memory-budget
            planner may still checkpoint some blocks). A manual override: it switches the planner off. A selector
            that matches no module raises in ``setup`` (or, when the module builds its layers in its own ``setup``
            or ``configure_model``, in ``on_fit_start``, still before any batch), listing the candidate block
            classes. Wrappers (the planner's too) are removed at the end of the fit (``teardown``, or
            ``on_exception``), so the module's ``forward`` is afterwards what it was; ``state_dict`` keys never
            change.
        recompute: what backward reruns of the blocks ``checkpoint`` selects: ``"all"`` (their whole forward; only
            their inputs are saved) or ``"elementwise"`` (their matrix products and attention are kept on the device,
            everything else recomputed: more memory kept than ``"all"``, far less recompute; see
            :func:`~lightning_offload.apply_checkpointing`). Needs ``checkpoint``.
"""


class RunCheckpointing:
    """Checkpointing one caller applies for the length of a run and removes after it; the selector checked first.

    Args:
        blocks: as for :func:`apply_checkpointing`.
        call: the call to quote in error messages.
        recompute: as for :func:`apply_checkpointing`.
    """

    def __init__(self, blocks: BlockSelector | Sequence[BlockSelector], call: str, recompute: str = "all") -> None:
        parse_blocks(blocks, call)
        check_recompute(recompute, call)
        self.blocks, self.call, self.recompute = blocks, call, recompute
        self.applied: list[str] = []  # wrappers added by this run (the model's own stay when the run ends)

    def check(self, model: nn.Module) -> None:
        """Raise, listing the candidate block classes, when a selector matches no module of ``model``."""
        select_blocks(model, self.blocks, call=self.call)

    def apply(self, model: nn.Module) -> None:
        # Modules the model wraps already are its own: left exactly as they are (their recompute too), so the run
        # ends with the model as it found it.
        already = set(checkpointed_modules(model))
        self.applied = [name for name in select_blocks(model, self.blocks, call=self.call) if name not in already]
        if self.applied:
            wrap_blocks(model, self.applied, self.recompute)

    def remove(self, model: nn.Module) -> None:
        if self.applied:
            remove_checkpointing(model, self.applied)
            self.applied = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "applied": []}  # a copy applied nothing, so it has nothing to remove
