"""Which results a block checkpointed with ``recompute="elementwise"`` keeps: those of matrix products and attention.

A transformer block spends nearly all its time in a few matrix products and its attention kernel, yet most of what it
saves for backward comes from the cheap operations around them: a norm's input in float32 and its normalized copy,
the MLP's activation and product (each as wide as the MLP), rotary embeddings, casts. Keeping the outputs of the
expensive operations and recomputing everything else in backward saves most of a block's activation memory for the
price of re-running memory-bound elementwise kernels (a few percent of the block's time) instead of the whole block.

A product whose inner dimension is small (a LoRA adapter's second factor, rank 8-64) costs next to nothing to redo
and is as wide as the layer's output: it is recomputed too.

Torch only: no Lightning import.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
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
    :data:`CHEAP_INNER_DIM`), convolutions and attention kernels; recompute everything else."""
    index = _product_ops().get(getattr(op, "overloadpacket", op))
    if index is None:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if index >= 0 and isinstance(args[index], torch.Tensor) and args[index].shape[-1] <= CHEAP_INNER_DIM:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_contexts() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a fresh pair of selective-checkpointing contexts
    that keep what :func:`keep_products` keeps."""
    return create_selective_checkpoint_contexts(keep_products)


class KeptBytes(TorchDispatchMode):
    """Counts, while active, the bytes a block checkpointed with ``recompute="elementwise"`` would keep: the outputs
    of the operations :func:`keep_products` keeps. Run over a block in full, it says what the block would hold on the
    device so (its input aside), without running it so."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if keep_products(None, func, *args, **(kwargs or {})) == CheckpointPolicy.MUST_SAVE:
            outputs = out if isinstance(out, tuple | list) else (out,)
            self.nbytes += sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
        return out
