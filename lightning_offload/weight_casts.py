"""The weight casts a forward saves for backward: memory the engine never moves and checkpointing frees.

Under autocast, a matrix product casts its float32 weight to bfloat16 and saves the cast for backward. With autocast's
cache on (``torch.autocast``'s default), one cast per weight lives until autocast exits, whatever runs checkpointed.
With it off (Lightning's ``precision="bf16-mixed"`` turns it off), every call casts afresh: a block run in full holds
its casts until its backward, while a checkpointed block drops them and casts again in its recompute. A cast is a
parameter in disguise to the engine (moving it would copy the weight back and forth every step), so the saved bytes
the planner counts leave it out: a Llama block of width 3072 (101M weights) holds 0.19 GiB of casts when run in full
under Lightning's bf16-mixed, and a plan that ran 8 such blocks in full went unpredicted by that much per block.

Torch only: no Lightning import.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload import policy


class WeightCasts:
    """Counts, while :attr:`counting`, the bytes of the weight casts saved for backward, each storage once."""

    def __init__(self) -> None:
        self.counting = False
        self.nbytes = 0
        # Keyed by the storage object's identity and held weakly: a freed cast's address can be reused by the next.
        self._seen: dict[int, StorageWeakRef] = {}

    def start(self, counting: bool) -> None:
        """A new step: count from zero (``counting``: whether to count at all)."""
        self.counting, self.nbytes = counting, 0
        self._seen.clear()

    def saw(self, tensor: torch.Tensor, device: torch.device | None, params: policy.ParameterStorages) -> None:
        """``tensor`` is saved and stays: count it if it is a new cast of a weight on ``device``."""
        if tensor.device != device or not policy.plain_dense(tensor) or policy.backward_running():
            return
        root = tensor._base if tensor._base is not None else tensor
        if root.is_leaf:  # a weight itself, or a view of it: no memory of its own
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._seen or key in params or not policy.is_parameter_like(tensor):
            return
        self._seen[key] = StorageWeakRef(storage)
        self.nbytes += storage.nbytes()
