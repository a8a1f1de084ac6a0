"""Finding and naming the blocks to checkpoint: a model's repeated blocks, the classes that look like blocks, and the
selectors (``"auto"``, class and qualified names, ``nn.Module`` subclasses) that pick modules of a model.

Torch only: no Lightning import.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = [
    "ALLOWED",
    "BlockSelector",
    "argument",
    "candidate_blocks",
    "check_model",
    "find_repeated_blocks",
    "is_ancestor",
    "match",
    "name_order",
    "parse_blocks",
    "selector_text",
]

BlockSelector = str | type[nn.Module]
ALLOWED = (
    "'auto', a class name or module qualified name (str), an nn.Module subclass, or a non-empty sequence of "
    "class names / qualified names / nn.Module subclasses"
)
# Modules that only hold other modules: never a block themselves (naming a list means its children).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


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
    check_model(model, "find_repeated_blocks")
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


def check_model(model: Any, call: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}(model={type(model).__name__}): model must be a torch.nn.Module")


def parse_blocks(blocks: Any, call: str | None = None) -> list[BlockSelector]:
    """Check that ``blocks`` is a valid selector for :func:`lightning_offload.apply_checkpointing`; return it as a list.

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
    raise ValueError(f"{call}: {argument(call)} must be {ALLOWED}")


def argument(call: str) -> str:
    """The argument the quoted ``call`` passed the selector as (``checkpoint`` in ``fabric_offload(checkpoint=3)``), so
    that the message names the argument the user wrote; ``blocks`` where the call names none."""
    named = re.match(r"\w+\((\w+)=", call)
    return named.group(1) if named else "blocks"


def selector_text(selector: BlockSelector) -> str:
    return selector.__name__ if isinstance(selector, type) else repr(selector)


def match(model: nn.Module, selector: BlockSelector, call: str) -> list[tuple[str, nn.Module]]:
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


def is_ancestor(parent: str, child: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


def name_order(model: nn.Module) -> Any:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return lambda name: order.get(name, len(order))
