"""``python -m benchmarks.zoo_capacity``: the longest batch-1 sequence that trains under a hard cap, on the zoo's rig.

Each probe runs one arm of one model at one sequence length in a fresh process (:func:`benchmarks.zoo.run_isolated`)
under ``set_per_process_memory_fraction`` at the cap through a plain PyTorch loop (``offload_activations``); it trains
if no batch raised: a planned probe runs until its plan is kept (at most ``--steps`` batches), the others 6 batches.
The arms:

- ``planned``: ``memory_budget`` = the cap (the planner measures, times plans and keeps one);
- ``ac``: HF activation checkpointing of every block, no offloading, the allocator as the user left it;
- ``ac-expandable``: the same with the allocator's expandable segments (what the engine switches to), so that the
  comparison is not one of fragmentation.

The search assumes that a sequence that trains, trains at every shorter length too: it bisects multiples of
``--seq-step`` between ``--seq-step`` and ``--max-seq``. Every probe is kept in the results.

    python -m benchmarks.zoo_capacity --model llama1b --cap-gib 40 --out benchmarks/out/capacity-llama1b-40.json
    python -m benchmarks.zoo_capacity --tiny           # the rig on the CPU (nothing is capped there)

Writes ``--out`` (JSON) and a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import zoo

ARMS = ("planned", "ac", "ac-expandable")
# Random-init shapes of the benchmark's capacity models (``benchmarks/workloads.py``) as zoo configurations.
_COMMON = {
    "family": "llama",
    "entry": "context",
    "batch": 1,
    "precision": "bf16",
    "optimizer": "adamw",
    "loss_inside": True,
    "fraction": None,
    "sanity": False,
    "val_every": 0,
    "accumulate": 1,
    "fits": 1,
    "index": 0,
}
MODELS: dict[str, dict[str, Any]] = {
    "llama1b": {"hidden": 2048, "layers": 16, "ffn": 8192, "heads": 32, "kv_heads": 8, "vocab": 128256, "tied": True},
    "smallvocab-h1024": {"hidden": 1024, "layers": 24, "ffn": 4096, "heads": 16, "kv_heads": 4, "vocab": 256},
}
_TINY = {"hidden": 64, "layers": 2, "ffn": 128, "heads": 4, "kv_heads": 2, "vocab": 512, "tied": False}


def config_of(model: str, seq: int, tiny: bool = False) -> dict[str, Any]:
    """The zoo configuration of capacity model ``model`` at batch 1 and ``seq`` tokens."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: expected one of {', '.join(MODELS)}")
    config = {**_COMMON, "tied": False, **MODELS[model], "seq": seq}
    if tiny:
        config.update(_TINY)
    config["name"] = f"{model}-b1x{seq}"
    return config


def probe(config: dict[str, Any], steps: int, tiny: bool, arm: str, cap: int | None) -> dict[str, Any]:
    """One arm at one length, in the calling (fresh) process: whether it trained under ``cap`` bytes
    (``None``: uncapped, the CPU), with the peak and what stopped it."""
    import torch

    from lightning_offload.device_memory import use_expandable_segments

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not tiny else torch.device("cpu")
    if device.type == "cuda" and cap is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
    if arm == "ac-expandable" and device.type == "cuda":
        use_expandable_segments(device)  # before anything is allocated: every segment expandable
    # The planned arm runs until its plan is kept (or ``steps`` batches): a length trains if no trial raised either.
    planned = arm == "planned"
    batches = steps if planned else min(steps, zoo.PLAIN_BATCHES)
    settle = zoo.SETTLE if planned else 0
    record = zoo.run_context(config, arm if planned else "ac", batches, cap, device, settle=settle)
    ran = len(record.kinds) >= batches or record.settled(zoo.SETTLE)
    return {
        "seq": config["seq"],
        "arm": arm,
        "trained": record.oom is None and record.error is None and ran,
        "peak_gib": record.peak / zoo.GiB,
        "oom": record.oom,
        "error": record.error,
        "plan": record.plan or None,
        "kinds": "".join(kind[:1] or "-" for kind in record.kinds),
    }


def search(
    model: str, arm: str, cap: int | None, seq_step: int, max_seq: int, steps: int, timeout_s: float, tiny: bool
) -> dict[str, Any]:
    """The longest multiple of ``seq_step`` up to ``max_seq`` at which ``arm`` trains (0: not even ``seq_step``),
    by bisection, with every probe."""
    probes: list[dict[str, Any]] = []

    def trains(units: int) -> bool:
        config = config_of(model, units * seq_step, tiny)
        row = zoo.run_isolated(config, steps, tiny, timeout_s, run=functools.partial(probe, arm=arm, cap=cap))
        row.setdefault("seq", config["seq"])
        row.setdefault("arm", arm)
        row.setdefault("trained", False)  # timed out, or the child died
        probes.append(row)
        print(f"{model} {arm} {config['seq']:>6}: {'trains' if row['trained'] else 'fails'}", flush=True)
        return bool(row["trained"])

    low, high = 0, max_seq // seq_step  # low trains (0 trivially); above high is not tried
    if trains(high):
        low = high
    else:
        high -= 1
        while low < high:
            mid = (low + high + 1) // 2
            if trains(mid):
                low = mid
            else:
                high = mid - 1
    return {"longest_seq": low * seq_step, "probes": sorted(probes, key=lambda p: p["seq"])}


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table: each arm's longest sequence and its probes."""
    cap = "without a cap (the rig on the CPU)" if result["tiny"] else f"under a {result['cap_gib']} GiB cap"
    lines = [
        f"# Capacity: {result['model']} at batch 1 {cap}",
        "",
        f"{result['device']}, torch {result['torch']}; planned probes run until a plan is kept (at most "
        f"{result['steps']} batches), the others {zoo.PLAIN_BATCHES}; sequences in steps of {result['seq_step']} up "
        f"to {result['max_seq']}.",
        "",
        "| arm | longest sequence that trains | probes (tokens: trains / fails) |",
        "|---|---|---|",
    ]
    for arm, found in result["arms"].items():
        probes = ", ".join(f"{p['seq']}: {'trains' if p['trained'] else 'fails'}" for p in found["probes"])
        lines.append(f"| {arm} | {found['longest_seq']} | {probes} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo_capacity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama1b", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--cap-gib", type=float, default=40.0, help="the hard cap and the planned arm's budget")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--seq-step", type=int, default=2048)
    parser.add_argument("--max-seq", type=int, default=65536)
    parser.add_argument(
        "--steps",
        type=int,
        default=40,
        help=f"most batches of a planned probe (it ends once {zoo.SETTLE} in a row ran a kept plan; the checkpointed "
        f"arms run {zoo.PLAIN_BATCHES})",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one probe may take")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the rig, not the cap")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms {args.arms!r}: expected a comma-separated list of {', '.join(ARMS)}")
    if args.model not in MODELS:
        parser.error(f"--model {args.model!r}: expected one of {', '.join(MODELS)}")
    if args.seq_step < 1 or args.max_seq < args.seq_step:
        parser.error(f"--seq-step {args.seq_step} --max-seq {args.max_seq}: expected 1 <= seq-step <= max-seq")
    if args.tiny:
        args.seq_step, args.max_seq, args.steps = 16, 64, min(args.steps, 4)
    import torch  # in the parent: imported once, before any fork; CUDA is initialised only in the children

    if not args.tiny:
        import transformers  # noqa: F401
    cap = None if args.tiny else int(args.cap_gib * zoo.GiB)
    result: dict[str, Any] = {
        "model": args.model,
        "cap_gib": args.cap_gib,
        "seq_step": args.seq_step,
        "max_seq": args.max_seq,
        "steps": args.steps,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": "CPU (tiny)" if args.tiny else zoo._gpu_name(),
        "tiny": args.tiny,
        "arms": {},
    }
    for arm in arms:
        args_ = (args.model, arm, cap, args.seq_step, args.max_seq, args.steps, args.timeout, args.tiny)
        result["arms"][arm] = search(*args_)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        args.out.with_suffix(".md").write_text(text)
    broken = [p for found in result["arms"].values() for p in found["probes"] if p.get("error") and args.tiny]
    for p in broken:
        print(p["arm"], p["seq"], p["error"], p.get("traceback", ""), file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
