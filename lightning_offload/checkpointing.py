"""Activation checkpointing of a model's repeated blocks, without touching the model's code.

Checkpointing and offloading compose: non-reentrant checkpointing saves each block's *inputs* outside its own
``saved_tensors_hooks`` (so an enclosing :func:`~lightning_offload.offload_activations` sees exactly those inputs)
and keeps everything saved inside the block out of reach of outer hooks (it recomputes them in backward). With
both, only ``2 * batch * seq * hidden`` bytes per block cross the link, a copy that hides behind the block's
compute for any realistic width.

The public entry points: they select blocks (:mod:`lightning_offload.block_selection`) and wrap each in the checkpointed
forward (:mod:`lightning_offload.checkpointed_forward`), and take the wrappers off again.

Torch only: no Lightning import.

Example::

    apply_checkpointing(model)          # "auto": the decoder layers of a transformer
    with offload_activations(model=model):
        loss = model(x).sum()
    loss.backward()
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from lightning_offload.block_selection import (
    ALLOWED,
    BlockSelector,
    argument,
    candidate_blocks,
    check_model,
    find_repeated_blocks,
    is_ancestor,
    match,
    name_order,
    parse_blocks,
    selector_text,
)
from lightning_offload.checkpointed_forward import CheckpointedForward, is_checkpointed, wrap

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

# What backward reruns of a checkpointed block: everything, or all but its matrix products and attention.
RECOMPUTE = ("all", "elementwise")


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
    check_model(model, "apply_checkpointing")
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
        wrap(modules[name], recompute)


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
            name: wrapper.recompute for name, wrapper in wrappers.items() if isinstance(wrapper, CheckpointedForward)
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
            if isinstance(wrapper, CheckpointedForward):
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
        matches = match(model, selector, call)
        if not matches:
            raise ValueError(
                f"{call}: {selector_text(selector)} matches no module of {type(model).__name__} (by class name, "
                f"qualified name or type); candidate block classes: {candidate_blocks(model)}; "
                f"{argument(call)} must be {ALLOWED}"
            )
        for name, module in matches:
            selected.setdefault(id(module), name)
    names = sorted(selected.values(), key=name_order(model))
    # Outermost wins: a checkpointed block recomputes its whole body anyway.
    return [n for n in names if not any(is_ancestor(other, n) for other in names if other != n)]


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
    check_model(model, "remove_checkpointing")
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
        if isinstance(wrapper, CheckpointedForward):
            if wrapper.original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.original
            restored.append(name)
    return restored


def checkpointed_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` that :func:`apply_checkpointing` wrapped."""
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


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
