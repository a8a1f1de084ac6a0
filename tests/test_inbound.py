"""The way back's bookkeeping (:mod:`lightning_offload.inbound`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_offload.inbound import _running_node


def test_the_running_node_keeps_one_key_and_no_other_node_shares_it_where_recompute_makes_and_frees_nodes() -> None:
    """Bytes that a node used count as freed once another node runs, so the key must name the node itself. Blocks
    checkpointed with ``use_reentrant=True`` make their nodes during backward and free them after it: keyed by the
    ``id`` of the Python object torch makes to show a node, a node of the next block took a freed node's address and
    its key, and freed room was credited at random. (torch's own sequence number tells the nodes apart.)"""
    unpacked: list[tuple[tuple[int, int] | None, int]] = []

    def unpack(saved: torch.Tensor) -> torch.Tensor:
        key = _running_node()
        unpacked.append((key, torch._C._current_autograd_node()._sequence_nr()))
        return saved

    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    h = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        for _ in range(3):
            h = checkpoint(block, h, use_reentrant=True)
        h.sum().backward()  # (the hooks still on: the blocks' recomputed nodes unpack through them)
    nodes = {number for _, number in unpacked}
    assert len(nodes) == 3 + 3 * 4, unpacked  # each block's function, and its four recomputed nodes
    assert None not in {key for key, _ in unpacked}
    assert len({(key, number) for key, number in unpacked}) == len(nodes), unpacked  # one key per node ...
    assert len({key for key, _ in unpacked}) == len(nodes), unpacked  # ... that no other node has
