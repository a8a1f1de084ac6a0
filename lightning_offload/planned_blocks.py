"""The model's repeated blocks as the memory-budget planner sees them: which run checkpointed (whole, or by their
parts), and what a measuring step learns about them (bytes saved and compute time per block).

A block checkpointed whole saves only its input but rebuilds all of its activations at once in backward; at long
sequences that rebuilt block is what limits the step (on an H200, a 24-layer small-vocab model under an 8 GiB cap:
whole-block checkpointing trained 49152 tokens and no more, with its inputs offloaded 65536). Checkpointed by its
parts (its children that hold weights: a decoder layer's attention, MLP and norms, each checkpointed on its own), a
block saves the input of every part, about four times as much (the planner offloads it), and rebuilds one part at a
time: the largest part's activations instead of the whole block's.

Torch only: no Lightning import.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Container
from typing import Any

import torch
from torch import nn

from lightning_offload.checkpointing import (
    apply_checkpointing,
    find_repeated_blocks,
    is_checkpointed,
    remove_checkpointing,
)
from lightning_offload.planner.profile import BlockSizes
from lightning_offload.policy import backward_running
from lightning_offload.recompute_policy import KeptBytes

_log = logging.getLogger("lightning_offload")


class PlannedBlocks:
    """The repeated blocks of ``model`` (none without a model or such a list): checkpoints the last ones on demand,
    whole or by their parts, and watches a measuring step's forward through them.

    Args:
        model: whose blocks (``find_repeated_blocks``).
        clock: times the blocks' compute (``mark()`` and ``compute_ms_between()`` of
            :class:`~lightning_offload.transfer.StreamedTransfer`); ``None``: not timed.
    """

    def __init__(self, model: nn.Module | None, clock: Any = None) -> None:
        self._model = model
        self.blocks = _blocks_of(model)
        # Modules the model holds in more than one place (one shared by every block): no block's parts.
        places = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False)) if model is not None else {}
        shared = {key for key, count in places.items() if count > 1}
        self.parts = [_parts_of(name, block, shared) for name, block in self.blocks]
        self.checkpointed: list[str] = []  # the blocks checkpointed (whole, or by their parts where ``split``)
        self.split = False
        self.light: list[str] = []  # the blocks checkpointed with elementwise recompute (their products kept)
        self._wrapped: list[str] = []  # the modules this object checkpointed: blocks, or their parts
        self._part_marks: dict[int, tuple[int, int]] = {}  # the second block's parts: positions before and after
        self._kept = KeptBytes()  # counts what the second block, run in full, would keep under elementwise recompute
        self._kept_active = False
        self._clock = clock
        self._marks: dict[int, tuple[int, int, int]] = {}  # block id -> (position before, after, input bytes)
        self._cast_marks: dict[int, tuple[int, int]] = {}  # block id -> weight-cast bytes saved before, after
        self._casts_cached = False  # the watched forward ran under autocast with its cache of casts on
        self._times: list[Any] = []  # timing marks: before the first block, after each block
        self._handles: list[Any] = []
        self._after_last: Callable[[], None] | None = None
        self._last_handle: Any = None

    def __len__(self) -> int:
        return len(self.blocks)

    def leave_to_the_user(self) -> bool:
        """Where the user checkpoints the blocks already (``apply_checkpointing``, or Hugging Face's
        ``gradient_checkpointing_enable``), or modules inside them (their MLPs, say), leave them to the user: take off
        this object's own wrappers and manage no block from now on (plans then only offload). Whether it did.

        A module inside a block counts too: checkpointing blocks by their parts would otherwise take over such a part
        (switching its ``recompute``) and, switching back or removed, take the user's wrapper off with its own."""
        if self._model is not None and _checkpoints_itself(self._model):
            theirs = [name for name, _ in self.blocks]
        else:
            ours = set(self._wrapped)
            theirs = [
                name
                for name, block in self.blocks
                if any(
                    is_checkpointed(module) and (f"{name}.{inner}" if inner else name) not in ours
                    for inner, module in block.named_modules()
                )
            ]
        if not theirs:
            return False
        self.remove()
        self.blocks, self.parts = [], []
        _log.info(
            "memory_budget: %s already checkpointed by the model or the user; the planner leaves them as they are and "
            "only offloads",
            theirs[0] if len(theirs) == 1 else f"{len(theirs)} blocks ({theirs[0]}, ...)",
        )
        return True

    @property
    def splittable(self) -> bool:
        """Whether every block has at least two parts to checkpoint apart (a block of one part gains nothing)."""
        return bool(self.parts) and all(len(parts) >= 2 for parts in self.parts)

    def checkpoint_last(self, count: int, split: bool = False, light: int = 0) -> None:
        """Run the last ``count`` blocks checkpointed (``split``: each by its parts), the ``light`` blocks before them
        checkpointed with elementwise recompute (their matrix products and attention kept), the others in full."""
        names = [name for name, _ in self.blocks]
        end = len(names) - count
        self._checkpoint(names[end:] if count else [], split, names[max(0, end - light) : end] if light else [])

    def checkpoint_all_but_one(self, split: bool = False) -> None:
        """Run every block checkpointed but one, a typical one: the second. The first block's input often needs no
        gradient (a frozen embedding under LoRA), so it saves less than the others (on an H200, Llama-8B LoRA's
        first block saved 0.12 GiB less than each later one: plans that took it for typical under-counted 24 kept
        blocks by 2.8 GiB). ``split``: each by its parts."""
        wanted = [name for i, (name, _) in enumerate(self.blocks) if i != 1] if len(self.blocks) > 1 else []
        self._checkpoint(wanted, split)

    def _checkpoint(self, wanted: list[str], split: bool, light: list[str] | None = None) -> None:
        model = self._model
        light = light or []
        if model is None or not self.blocks:
            return
        split = split and self.splittable and bool(wanted)
        # Checked only where something would change (every planned step asks): before wrapping a block the user wraps.
        if (wanted == self.checkpointed and split == self.split and light == self.light) or self.leave_to_the_user():
            return
        parts = dict(zip((name for name, _ in self.blocks), self.parts, strict=True))
        modules = [part for name in wanted for part, _ in parts[name]] if split else wanted
        remove_checkpointing(model, [n for n in self._wrapped if n not in modules and n not in light])
        if modules:
            apply_checkpointing(model, modules)
        if light:
            apply_checkpointing(model, light, recompute="elementwise")
        self.checkpointed, self.split, self.light, self._wrapped = wanted, split, light, modules + light

    def remove(self) -> None:
        """Leave the model as it was: no checkpointing of ours, no hooks."""
        self.unwatch()
        handle, self._last_handle, self._after_last = self._last_handle, None, None
        if handle is not None:
            handle.remove()
        if self._model is not None and self._wrapped:
            remove_checkpointing(self._model, self._wrapped)
        self.checkpointed, self.split, self.light, self._wrapped = [], False, [], []

    def after_last_block(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` whenever the last block's forward returns, outside backward (a checkpointed block's
        recompute does not count); ``None``: stop."""
        self._after_last = callback
        if callback is None or self._last_handle is not None or not self.blocks:
            return

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if self._after_last is not None and not backward_running():
                self._after_last()

        self._last_handle = self.blocks[-1][1].register_forward_hook(after)

    def watch(self, position: Callable[[], int], casts: Callable[[], int] | None = None) -> None:
        """Note, for the next forward, the saved-bytes ``position`` and the weight casts saved (``casts``, bytes so
        far) around every block (and time them), and the position around the parts of the second block. Blocks the
        user checkpoints are left to the user first (:meth:`leave_to_the_user`): a module may switch its own
        checkpointing on after the planner was made (in ``configure_model``, say)."""
        self.unwatch()
        self.leave_to_the_user()
        marks, times, clock, part_marks = self._marks, self._times, self._clock, self._part_marks
        cast_marks, cast_bytes = self._cast_marks, casts or (lambda: 0)
        marks.clear()
        times.clear()
        part_marks.clear()
        cast_marks.clear()
        self._casts_cached = False  # (read as the first block begins, under the forward's autocast)

        def before(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            first = _first_input(args, kwargs)
            nbytes = first.numel() * first.element_size() if first is not None else 0
            if clock is not None and not marks:
                times.append(clock.mark())
            if not marks and first is not None:
                self._casts_cached = torch.is_autocast_enabled(first.device.type) and torch.is_autocast_cache_enabled()
            marks.setdefault(id(module), (position(), 0, nbytes))
            cast_marks.setdefault(id(module), (cast_bytes(), 0))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            start, end, nbytes = marks.get(id(module), (0, 0, 0))
            if end == 0:  # not a recompute in backward
                marks[id(module)] = (start, position(), nbytes)
                cast_marks[id(module)] = (cast_marks.get(id(module), (0, 0))[0], cast_bytes())
                if clock is not None:
                    times.append(clock.mark())

        for _, block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(block.register_forward_hook(after))

        def part_before(module: nn.Module, args: Any) -> None:
            if not backward_running():
                part_marks.setdefault(id(module), (position(), 0))

        def part_after(module: nn.Module, args: Any, output: Any) -> None:
            start, end = part_marks.get(id(module), (0, 0))
            if end == 0 and not backward_running():
                part_marks[id(module)] = (start, position())

        for _, part in self.parts[1] if len(self.parts) > 1 else []:
            self._handles.append(part.register_forward_pre_hook(part_before))
            self._handles.append(part.register_forward_hook(part_after))

        # What the second block would keep under elementwise recompute: counted while it runs in full, once.
        self._kept.reset()
        if len(self.blocks) > 1 and self.blocks[1][0] not in (*self.checkpointed, *self.light):
            second = self.blocks[1][1]

            def count_before(module: nn.Module, args: Any) -> None:
                if not self._kept_active and not self._kept.nbytes and not backward_running():
                    self._kept.__enter__()
                    self._kept_active = True

            def count_after(module: nn.Module, args: Any, output: Any) -> None:
                self._stop_counting()

            self._handles.append(second.register_forward_pre_hook(count_before))
            # Always called, even when forward raises: the counting mode must not outlive the block.
            self._handles.append(second.register_forward_hook(count_after, always_call=True))

    def _stop_counting(self) -> None:
        if self._kept_active:
            self._kept_active = False
            self._kept.__exit__(None, None, None)

    def unwatch(self) -> None:
        self._stop_counting()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def sizes(self) -> BlockSizes:
        """What the watched forward saved per block (blocks checkpointed then: :attr:`checkpointed`)."""
        names = {id(module): name for name, module in self.blocks}
        cut = set(self.checkpointed)
        full = {key: m for key, m in self._marks.items() if names.get(key) not in cut and m[1] > m[0]}
        # The first block is not a typical one (see checkpoint_all_but_one): left out of the average where others ran.
        keys = [key for key in full if key != id(self.blocks[0][1])] or list(full)
        typical = [full[key] for key in keys]
        cut_marks = [m for key, m in self._marks.items() if names.get(key) in cut]
        block_bytes = sum(m[1] - m[0] for m in typical) // len(typical) if typical else 0
        casts = [self._cast_marks.get(key, (0, 0)) for key in keys]  # the weight casts of the same blocks run in full
        cast_bytes = sum(max(0, end - start) for start, end in casts) // len(casts) if casts else 0
        input_bytes = sum(m[2] for m in typical) // len(typical) if typical else 0
        first_input_bytes = input_bytes
        if cut_marks:
            first_input_bytes = sum(m[2] for m in cut_marks) // len(cut_marks)
            input_bytes = sum(m[1] - m[0] for m in cut_marks) // len(cut_marks)
        # The second block's parts, where it ran in full (a part called twice counts its first call).
        second_ran_full = len(self.blocks) > 1 and self.blocks[1][0] not in cut
        part_bytes = max((e - s for s, e in self._part_marks.values() if e > s), default=0) if second_ran_full else 0
        return BlockSizes(
            len(full) + len(cut_marks),
            len(cut_marks),
            block_bytes,
            input_bytes,
            split=self.split and bool(cut_marks),
            first_input_bytes=first_input_bytes,
            part_bytes=part_bytes,
            cut_bytes=sum(m[1] - m[0] for m in cut_marks),
            # A block that writes into a kept output in place cannot run so (backward would raise): no light blocks.
            kept_bytes=self._kept.nbytes if second_ran_full and not self._kept.mutated else 0,
            cast_bytes=cast_bytes,
            casts_cached=self._casts_cached,
        )

    def last_end(self) -> int:
        """The position where the watched forward's last block ended (0: no block ran, or none is watched)."""
        return max((end for _, end, _ in self._marks.values()), default=0)

    def compute_ms(self) -> float:
        """Compute time of the blocks in the watched forward (0: not timed)."""
        times = [t for t in self._times if t is not None]
        if self._clock is None or len(times) < 2 or len(times) != len(self._times):
            return 0.0
        return self._clock.compute_ms_between(times[0], times[-1])


def compiled_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` compiled with ``torch.compile`` (``module.compile()``, a compiled
    module held as a child, or a compiled ``forward``). A compiled module runs the graph traced when it was compiled:
    hooks and checkpointing added to its modules later may go unseen (on a CPU, forward hooks added to the blocks of a
    model compiled whole were never called), so a planner that watches and wraps blocks cannot plan it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was ever compiled in this process
        return []
    optimized = getattr(eval_frame, "OptimizedModule", ())

    def compiled(module: nn.Module) -> bool:
        # ``torch.compile(module)``, ``module.compile()``, or a compiled ``forward`` set on the instance (Lightning's
        # ``Trainer.fit(torch.compile(module))`` runs the module with ``module.forward`` compiled so).
        forward = module.__dict__.get("forward")
        return (
            isinstance(module, optimized)
            or getattr(module, "_compiled_call_impl", None) is not None
            or hasattr(forward, "_torchdynamo_orig_callable")
        )

    return [name for name, module in model.named_modules() if compiled(module)]


def compiled_across_blocks(model: nn.Module) -> list[str]:
    """The compiled modules of ``model`` (:func:`compiled_modules`) that hold two or more of its repeated blocks (the
    model itself, compiled whole; no blocks found: any compiled module that is the model). A compiled graph hands
    autograd what it saved only as it returns, and takes it all back as its backward begins: the activations of the
    blocks inside one graph are all on the device at its end, whatever is offloaded after."""
    compiled = compiled_modules(model)
    if not compiled:
        return []
    blocks = [name for name, _ in _blocks_of(model)]
    if not blocks:
        return [name for name in compiled if name == ""]

    def holds(outer: str, name: str) -> bool:
        return outer == "" or name.startswith(outer + ".")

    return [outer for outer in compiled if sum(holds(outer, name) for name in blocks) >= 2]


def _first_input(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A block's input: its first positional argument, or, called with keywords only (``hidden_states=...``), the
    first keyword tensor that needs a gradient (an activation, not a mask or a rotary table)."""
    if args:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad), None)


def _parts_of(name: str, block: nn.Module, shared: Container[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """A block's parts, by qualified name: its children that hold weights (what it computes with no weights of its
    own, residual additions, activations between parts, saves through the planner's hooks as it would anyway).
    Containers have no forward of their own and are not parts; nor are single linear or embedding layers, which save
    only their input anyway (checkpointed, they would save the same and compute twice). A block whose parts hold less
    than half its weights (its own forward does most of the work with plain linear layers) has none: checkpointed by
    them, it would offload nearly all it saves. Nor are modules the model holds in more than one place (``shared``:
    their ids), such as one shared by every block: a wrapper is the module's, so it would checkpoint every call of it,
    and under all blocks but one the module has no qualified name to wrap it by."""
    parts = [
        (f"{name}.{child_name}", child)
        for child_name, child in block.named_children()
        if not isinstance(child, nn.ModuleList | nn.ModuleDict | nn.Linear | nn.Embedding)
        and id(child) not in shared
        and any(True for _ in child.parameters())
    ]
    in_parts = sum(p.numel() for _, part in parts for p in part.parameters())
    return parts if 2 * in_parts >= sum(p.numel() for p in block.parameters()) else []


def _checkpoints_itself(model: nn.Module) -> bool:
    """Whether the model runs its own checkpointing in training: Hugging Face's ``gradient_checkpointing_enable()``
    sets ``gradient_checkpointing`` on the model or on its layers, depending on the version."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _blocks_of(model: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, by qualified name, in order (none when it has no such list)."""
    if model is None:
        return []
    try:
        _, blocks = find_repeated_blocks(model)
    except ValueError:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(b)], b) for b in blocks if id(b) in names]
