"""What may be offloaded: the eligibility rules, applied to every tensor autograd saves, and ``no_offload``."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_offload.copies import byte_span, copy_span

_local = threading.local()


@contextmanager
def no_offload() -> Iterator[None]:
    """Keep every tensor saved inside this block on its device, whatever offloading is active.

    Example::

        with offload_activations():
            h = body(x)
            with no_offload():
                loss = head(h)  # saved tensors stay on the GPU
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def offload_suppressed() -> bool:
    """Whether the calling thread is inside :func:`no_offload`."""
    return getattr(_local, "depth", 0) > 0


def backward_running() -> bool:
    """Whether autograd's backward is executing now (checkpoint recompute, double backward).

    Tensors saved then are needed again within microseconds, so offloading them only adds a round trip.
    """
    return torch._C._current_graph_task_id() != -1


class ParameterStorages:
    """The storages of a model's parameters and buffers, held by weak reference.

    Parameters are saved for backward directly and through views, transposes and casts; a view shares the
    parameter's storage, so identity of the (live) storage catches every one of them. Weak references key on
    the storage object itself, not its address, so a freed storage can never be confused with a new one.
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._keys: set[int] = set()
        self._refs: list[StorageWeakRef] = []
        self.update(tensors)

    def update(self, tensors: Iterable[torch.Tensor]) -> None:
        """Replace the set with the storages of ``tensors`` (called per step: FSDP and others swap storages)."""
        storages = [t.untyped_storage() for t in tensors if _has_storage(t)]
        keys = {storage._cdata for storage in storages}
        if keys == self._keys:
            # The same storages: the weak references held keep each of them from being freed and its address from
            # being reused, so equal keys are the same storages, and the references need not be made again.
            return
        self._refs = [StorageWeakRef(storage) for storage in storages]
        self._keys = keys

    def __contains__(self, storage_key: int) -> bool:
        return storage_key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


def parameters_and_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``model`` and its submodules, each once (tied weights too), in one walk of the
    module tree: ``[*model.parameters(), *model.buffers()]`` walks it twice through generators (a re-read per step
    took 142 us for a 4-layer Hugging Face Llama on a CPU, about half that with one walk)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:  # a module registered twice (shared blocks)
            continue
        seen.add(id(module))
        for tensors in (module._parameters, module._buffers):
            if tensors:
                for tensor in tensors.values():
                    if tensor is not None:
                        found[id(tensor)] = tensor
        stack.extend(child for child in module._modules.values() if child is not None)
    return list(found.values())


def _has_storage(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """Parameters, their views and their casts, recognisable without knowing the model.

    A leaf that requires grad is a parameter (or an input the caller holds anyway: moving it frees nothing);
    a view keeps its root in ``_base``; an autocast copy of a weight is a ``ToCopyBackward0`` whose next node
    accumulates into a leaf.
    """
    # The cheap test first: ``isinstance`` of ``Parameter`` is a metaclass hook, ten times an attribute read.
    if (tensor.is_leaf and tensor.requires_grad) or isinstance(tensor, torch.nn.Parameter):
        return True
    base = tensor._base
    if base is not None and ((base.is_leaf and base.requires_grad) or isinstance(base, torch.nn.Parameter)):
        return True
    node = tensor.grad_fn if base is None else base.grad_fn
    return _cast_of_leaf(node)


# Nodes that only re-type or re-view their input: a chain of them ending at a leaf is a weight in disguise
# (``bf16(w.t())`` under autocast, ``w.t().to(...)``, ``w.view(...).half()``).
_PASS_THROUGH = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ExpandBackward0",
        "AsStridedBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "AliasBackward0",
    }
)


def _cast_of_leaf(node: object, depth: int = 4) -> bool:
    saw_cast = False
    while node is not None and depth > 0:
        name = node.name()  # type: ignore[attr-defined]
        if name not in _PASS_THROUGH:
            return False
        saw_cast |= name == "ToCopyBackward0"
        parents = [nxt for nxt, _ in node.next_functions if nxt is not None]  # type: ignore[attr-defined]
        if len(parents) != 1:
            return False
        if type(parents[0]).__name__ == "AccumulateGrad":
            return saw_cast  # plain views of a leaf were caught through ``_base``; a cast makes a new storage
        node, depth = parents[0], depth - 1
    return False


def plain_dense(tensor: torch.Tensor) -> bool:
    """Plain strided tensors only: subclasses (DTensor, fake and functional tensors), sparse ones, and views that
    carry a lazy conjugate or negative bit (``x.conj()`` of a complex tensor, which a tensor rebuilt from the raw bytes
    would lose) stay put."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def offload_span(
    tensor: torch.Tensor, device: torch.device | None, min_bytes: int, params: ParameterStorages
) -> tuple[int, int, int, int] | None:
    """Where a saved tensor and its copy lie, ``(start, end, span start, span end)`` in bytes, or ``None`` if it stays.

    Tensors stay when they are not plain dense tensors of the compute device, when their span is smaller than
    ``min_bytes``, inside ``no_offload``, while backward runs, and when they are parameters (or views and casts of
    them, or share a storage with the model's parameters and buffers). The cheapest tests come first: most saved
    tensors of a small model stop after two attribute reads.
    """
    if tensor.device != device or not plain_dense(tensor):
        return None
    storage = tensor.untyped_storage()
    storage_nbytes = storage.nbytes()
    if storage_nbytes < min_bytes or offload_suppressed() or backward_running():
        return None
    # The model's own storages (a set lookup) before the walk up the graph that recognises parameters in disguise.
    if (len(params) and storage._cdata in params) or is_parameter_like(tensor):
        return None
    start, end = byte_span(tensor)
    lo, hi = copy_span(start, end, storage_nbytes)
    return None if hi - lo < min_bytes else (start, end, lo, hi)
