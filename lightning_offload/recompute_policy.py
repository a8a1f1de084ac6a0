"""Which results a block checkpointed with ``recompute="elementwise"`` keeps: those of matrix products and attention.

A transformer block spends nearly all its time in a few matrix products and its attention kernel, yet most of what it
saves for backward comes from the cheap operations around them: a norm's input in float32 and its normalized copy,
the MLP's activation and product (each as wide as the MLP), rotary embeddings, casts. Keeping the outputs of the
expensive operations and recomputing everything else in backward saves most of a block's activation memory for the
price of re-running the cheap kernels instead of the whole block. On an H200 that cost 0.45 (Llama-8B LoRA) to 0.81
(Llama-1B) of a whole recompute: torch's selective checkpointing dispatches every operation of such a block through
Python, in forward and again in the recompute, and on small kernels the host sets the pace.

A product whose inner dimension is small (a LoRA adapter's second factor, rank 8-64) costs next to nothing to redo
and is as wide as the layer's output: it is recomputed too.

Torch only: no Lightning import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["CHEAP_INNER_DIM", "KeptBytes", "keep_products", "selective_contexts"]

# A matrix product whose inner dimension is at most this is recomputed (rank of a LoRA adapter, say).
CHEAP_INNER_DIM = 64


@functools.cache
def _product_ops() -> dict[Any, int]:
    """Overload packets of the kept operations -> index of the argument whose last dimension is the inner one."""
    aten = torch.ops.aten
    products = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "_scaled_mm": 0, "convolution": -1}
    attention = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    kept: dict[Any, int] = {}
    for name, index in (*products.items(), *((name, -1) for name in attention)):
        if hasattr(aten, name):  # the set differs between torch versions
            kept[getattr(aten, name)] = index
    return kept


def keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpointing policy: keep matrix products (unless their inner dimension is at most
    :data:`CHEAP_INNER_DIM`), convolutions and attention kernels (unless they draw a dropout mask); recompute
    everything else."""
    index = _product_ops().get(getattr(op, "overloadpacket", op))
    if index is None or _draws_dropout(op, args, kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if index >= 0 and isinstance(args[index], torch.Tensor) and args[index].shape[-1] <= CHEAP_INNER_DIM:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _draws_dropout(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``op`` draws random numbers: a ``dropout_p`` argument above 0 (fused attention kernels).

    A kept result is not computed again in the recompute, so a kernel that drew its dropout mask from the random
    state in forward would not advance it there, and every random operation recomputed after it in the block (a
    LoRA adapter's dropout, a residual dropout) would draw another mask than forward did: silently wrong gradients.
    Recomputed instead, it draws what it drew in forward (checkpointing restores the random state first).
    """
    schema = getattr(op, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            value = args[index] if index < len(args) else kwargs.get("dropout_p", 0.0)
            return bool(value)
    return False


def selective_contexts() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a fresh pair of selective-checkpointing contexts
    that keep what :func:`keep_products` keeps."""
    return create_selective_checkpoint_contexts(keep_products)


class KeptBytes(TorchDispatchMode):
    """Counts, while active, the bytes a block checkpointed with ``recompute="elementwise"`` would keep: the outputs
    of the operations :func:`keep_products` keeps. Run over a block in full, it says what the block would hold on the
    device so (its input aside), without running it so.

    It also notes whether a later operation writes in place into memory a kept output lives in (``h = linear(x);
    h.mul_(2)``): selective checkpointing refuses a kept tensor that changed after it was kept, so backward would raise
    (``mutated``; the memory-budget planner then plans no light blocks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.mutated = False
        # The storages kept outputs live in, by the identity of the storage object (``_cdata``), held by weak reference:
        # the bytes are not held longer, and the weak reference keeps the identity from being reused. (Keyed by the
        # data's address, a kept output freed within the block, say after a residual addition, left its address
        # behind, and a tensor given that memory later and written in place noted the block as mutating a kept
        # output: no light blocks planned, at random, as the allocator reused memory or not.)
        self._storages: dict[int, StorageWeakRef] = {}

    def reset(self) -> None:
        self.nbytes, self.mutated = 0, False
        self._storages.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._storages and not self.mutated:
            self.mutated = any(_storage(t) in self._storages for t in _written(func, args, kwargs))
        out = func(*args, **kwargs)
        if keep_products(None, func, *args, **kwargs) == CheckpointPolicy.MUST_SAVE:
            outputs = [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]
            self.nbytes += sum(t.numel() * t.element_size() for t in outputs)
            for t in outputs:
                storage = t.untyped_storage()
                self._storages[storage._cdata] = StorageWeakRef(storage)
        return out


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (in-place and ``out=`` arguments), by its schema."""
    written: list[torch.Tensor] = []
    schema = getattr(func, "_schema", None)  # every operator overload has one; anything else writes nothing known
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor):
                written.append(value)
    return written


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
