"""``python -m benchmarks.grad_check``: are a workload's gradients with the engine bit-equal to a plain step's?

One model, one batch, the same weights throughout (no optimizer step): a plain step's gradients are the reference,
a second plain step says whether the workload's kernels are deterministic at all, then each arm's gradients are
compared with the reference, parameter by parameter. Arms: ``default`` (``offload_activations(model=...)``, its first
four steps: two measuring, then its plan), ``keep`` (the engine's hooks on every saved tensor, nothing offloaded),
``manual`` (no budget, the default options: everything but the resident tail leaves), ``all`` (every saved tensor
leaves, however small) and ``all-sync`` (the same, copied on the compute stream). Prints, per arm and step, the
largest relative difference (max |g - g_plain| / max |g_plain| over a parameter) and the parameters that differ;
writes them as JSON (``--out``).

Attention's fused backward kernels may accumulate a gradient with atomic adds, whose order varies from run to run:
``--plain-repeats N`` runs the plain step N times (a workload whose own steps differ cannot be bit-equal with the
engine either), and ``--attention math`` runs everything with torch's matrix-product attention, which has none.

    python -m benchmarks.grad_check --workload small-h512 --out grads.json
    python -m benchmarks.grad_check --workload small-h512 --plain-repeats 8 --attention math
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.models import build
from benchmarks.workloads import WORKLOADS, tiny
from lightning_offload import offload_activations

ARMS: dict[str, dict[str, Any]] = {
    "keep": {"memory_budget": None, "max_offload_bytes": 0},
    "manual": {"memory_budget": None},
    "all": {"memory_budget": None, "resident_tail_bytes": 0, "min_tensor_bytes": 0},
    # The same copies on the compute stream: where ``all`` differs and this does not, the copy streams' ordering is
    # at fault, not the bytes or where they are put back.
    "all-sync": {"memory_budget": None, "resident_tail_bytes": 0, "min_tensor_bytes": 0, "mode": "sync"},
}


def differences(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter whose gradient differs from the reference: max |g - g_ref| / max |g_ref|."""
    out = {}
    for name, ref in reference.items():
        got = grads[name]
        if not torch.equal(got, ref):
            out[name] = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_check", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="small-h512", choices=sorted(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plain-repeats", type=int, default=1, help="plain steps compared with the first")
    parser.add_argument(
        "--attention", default="default", choices=("default", "math"), help="math: matrix-product attention only"
    )
    args = parser.parse_args(argv)
    if args.plain_repeats < 1:
        parser.error(f"--plain-repeats must be at least 1, got {args.plain_repeats}")
    backends = contextlib.nullcontext()
    if args.attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = sdpa_kernel(SDPBackend.MATH)
    with backends:
        results = check(args.workload, args.plain_repeats)
    results["attention"] = args.attention
    for name, value in results.items():
        if isinstance(value, dict):
            worst = max(value.values(), default=0.0)
            print(f"{name:18s} largest {worst:.3g} in {len(value)} parameter(s) {sorted(value)[:4]}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def check(workload_name: str, plain_repeats: int) -> dict[str, Any]:
    """Every arm's differences from the first plain step (see the module's docstring)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    workload = WORKLOADS[workload_name] if cuda else tiny(WORKLOADS[workload_name])
    torch.manual_seed(0)
    bench = build(workload, device)
    model = bench.module
    ids = torch.randint(0, 256, (workload.batch, workload.seq), device=device)

    def step(engine: Any = None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if engine is None:
            loss = bench.loss(ids)
        else:
            with engine:
                loss = bench.loss(ids)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}

    compute = None if cuda else "cpu"
    reference = step()
    results: dict[str, Any] = {"workload": workload_name, "device": str(device)}
    for repeat in range(plain_repeats):
        results["plain again" if repeat == 0 else f"plain again {repeat + 1}"] = differences(step(), reference)
    engine = offload_activations(model=model, compute_device=compute)
    for index in range(4):
        results[f"default step {index + 1}"] = differences(step(engine), reference)
    engine.close()
    for arm, kwargs in ARMS.items():
        engine = offload_activations(model=model, compute_device=compute, **kwargs)
        results[arm] = differences(step(engine), reference)
        results[f"{arm} offloaded GiB"] = engine.stats.offloaded_bytes / 2**30
        engine.close()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
