"""``python -m benchmarks.interleaved``: what ``offload_activations()`` (the default) costs where the model fits,
timed in alternating steps.

The workload benchmark runs its rows one after another, so a small model's host-bound steps (12-18 ms for
small-h512 on an H200) drift by more than the difference being measured: its ``none`` row's own steps rose from 15 to
17.5 ms within one row. Here plain steps and steps under the default engine alternate (after the engine's measuring
steps and a warm-up), so drift touches both alike; the ratio of their medians is the default's cost.

    python -m benchmarks.interleaved --workload small-h512 --pairs 100 --out $OUT/interleaved.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks import models
from benchmarks.workloads import WORKLOADS, tiny
from lightning_offload import offload_activations

# The default engine's two measuring steps, its first planned step and one more.
_WARMUP_STEPS = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small-h512", choices=sorted(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=100, help="timed (plain, default) step pairs")
    parser.add_argument("--tiny", action="store_true", help="shrink the model (a CPU run of the tool itself)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = parser.parse_args(argv)

    workload = tiny(WORKLOADS[args.workload]) if args.tiny else WORKLOADS[args.workload]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    bench = models.build(workload, device)
    ids = torch.randint(0, workload.vocab, (workload.batch, workload.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    optimizer = torch.optim.AdamW([p for _, p in bench.trainable()], lr=1e-5, **({"fused": True} if cuda else {}))
    engine = offload_activations() if cuda else offload_activations(compute_device="cpu")

    def step(context: Any) -> float:
        return bench.timed_step(context, optimizer, ids)

    try:
        for _ in range(_WARMUP_STEPS):
            step(engine)
            step(contextlib.nullcontext())
        plain: list[float] = []
        default: list[float] = []
        for index in range(2 * args.pairs):
            # Alternate which goes first, so neither always follows the other.
            if (index // 2) % 2 == index % 2:
                plain.append(step(contextlib.nullcontext()))
            else:
                default.append(step(engine))
        plan = engine.planner.plan if engine.planner is not None else None
    finally:
        engine.close()
    result = {
        "workload": workload.as_dict(),
        "pairs": args.pairs,
        "plain_ms": statistics.median(plain) * 1e3,
        "default_ms": statistics.median(default) * 1e3,
        "ratio": statistics.median(default) / statistics.median(plain),
        "plan": None
        if plan is None
        else f"ckpt {plan.checkpoint_blocks}{' by parts' if plan.split else ''}, offload {plan.offload_bytes} bytes",
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
