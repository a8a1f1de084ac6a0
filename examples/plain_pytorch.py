"""Activation offloading in a plain PyTorch training loop: the context manager, no Lightning.

Trains the demo transformer (``examples/demo_model.py``) for a few steps, first without offloading, then inside
``offload_activations``, and prints what was offloaded and the peak memory of each. On a GPU the engine gets a memory
budget below the peak without offloading (70% of it unless ``--memory-budget-gib`` says otherwise), as a model that
does not fit would: under the default budget (the GPU's memory) a model that fits keeps everything and offloads
nothing. Without a GPU it runs on the CPU with ``compute_device="cpu"`` (the engine copies CPU tensors into host
buffers; no budget: planning needs CUDA), where CUDA peaks do not exist.

Examples::

    python examples/plain_pytorch.py
    python examples/plain_pytorch.py --memory-budget-gib 4
    python examples/plain_pytorch.py --mode sync --steps 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model import DecoderOnlyTransformer

from lightning_offload import OffloadEngine, no_offload, offload_activations

GiB = 1 << 30


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train without and with offloading; returns the offloaded GiB per step and, on CUDA, both peaks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["streamed", "sync", "off"], default="streamed")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is present")
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="the engine's memory_budget on a GPU (default: 70%% of the peak without offloading; streamed mode only)",
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    # GPU: activations of ~3 GiB; CPU: a smoke-sized model.
    dim, layers, seq, batch, vocab = (1024, 8, 2048, 4, 32000) if cuda else (64, 2, 128, 4, 256)
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(vocab, dim, layers, heads=8 if cuda else 4, max_seq_len=seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(vocab, (batch, seq + 1), device=device)

    def forward_backward(context: OffloadEngine | None) -> None:
        optimizer.zero_grad(set_to_none=True)  # first: a step run again must not add its gradients twice
        if context is None:
            logits = model(tokens[:, :-1])
        else:
            # Under a memory budget a new input shape is measured before it is planned, and one met before runs its
            # own plan: name each step's input before entering the engine (here the shape never changes).
            context.input_changed(tuple(tokens[:, :-1].shape))
            with context:  # activations saved in here go to host memory
                logits = model(tokens[:, :-1])
        # The loss's saved tensors are needed first in backward: keep them on the device explicitly.
        with no_offload():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()  # offloaded activations come back (prefetched in "streamed" mode) as backward needs them

    def step(context: OffloadEngine | None) -> None:
        if context is None:
            forward_backward(None)
        else:  # run again, more frugally, where it ran out of memory under the budget
            context.run_step(lambda: forward_backward(context))
        optimizer.step()

    def peak_of(context: OffloadEngine | None) -> float:
        step(context)  # warm-up: optimizer state, pinned buffers
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            step(context)
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / GiB
        return float("nan")

    baseline = peak_of(None)
    # Create the engine once and enter it every step: streams, the host pool and its profile carry over.
    options: dict[str, object] = {}
    if not cuda:
        options = {"compute_device": "cpu", "min_tensor_bytes": 16 << 10, "resident_tail_bytes": 0}
    elif args.mode == "streamed":  # a budget below what the model needs, so the planner must save memory
        budget_gib = args.memory_budget_gib if args.memory_budget_gib is not None else 0.7 * baseline
        options = {"memory_budget": int(budget_gib * GiB)}
        print(f"memory_budget: {budget_gib:.2f} GiB (the step peaks at {baseline:.2f} GiB without offloading)")
    engine = offload_activations(mode=args.mode, model=model, **options)
    offloaded_peak = peak_of(engine)
    stats = engine.stats  # the latest step's counters
    # Under a budget the planner may keep everything and checkpoint blocks instead: such a step installs no hooks,
    # so its counters are zero and only the plan says what it did.
    planner = engine.planner
    plan = planner.plan.describe(planner.budget) if planner is not None and planner.plan is not None else None
    engine.close()  # leave the model as it was (a memory-budget plan may have checkpointed some of its blocks)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (compute_device=cpu)'}, mode {args.mode!r}")
    if plan is not None:
        print(f"plan: {plan}")
    print(
        f"latest step: {stats.saved_tensors} tensors saved through the hooks, {stats.offloaded_tensors} offloaded "
        f"({stats.offloaded_bytes / GiB:.4f} GiB), {stats.resident_bytes / GiB:.4f} GiB kept resident, "
        f"{stats.prefetched_bytes / GiB:.4f} GiB prefetched, {stats.fetched_on_demand_bytes / GiB:.4f} GiB on demand, "
        f"host pool {stats.host_pinned_bytes / GiB:.4f} GiB"
    )
    if cuda:
        print(f"peak allocated: {baseline:.2f} GiB without offloading, {offloaded_peak:.2f} GiB with")
    else:
        print("peak allocated: CUDA peaks do not exist on the CPU")
    return {
        "offloaded_gib": stats.offloaded_bytes / GiB,
        "peak_plain_gib": baseline,
        "peak_offload_gib": offloaded_peak,
    }


if __name__ == "__main__":
    main()
