"""``python -m benchmarks.interleaved``: what our modes cost against plain steps and against AC, timed in alternating
steps.

The workload benchmark runs its rows one after another, so a small model's host-bound steps (12-18 ms for
small-h512 on an H200) drift by more than the difference being measured: its ``none`` row's own steps rose from 15 to
17.5 ms within one row, and five rows in one process (none / default / none / default / none) ran 13.1 / 15.6 / 18.2
/ 14.2 / 17.5 ms. Here every arm takes one step in turn (the order rotates each round), after each arm's warm-up (an
engine's measuring steps and plan trials included), so drift touches all arms alike; ratios of their medians are
what each costs.

Arms (each one that changes the model gets a copy of its own, with the same weights):

- ``none``: plain steps. ``default``: ``offload_activations()`` with no argument, on ``none``'s model.
- ``ac``: the benchmark's AC (Hugging Face's non-reentrant checkpointing of every decoder layer).
- ``ckpt``: our ``apply_checkpointing(model, "auto")`` of every block, no engine.
- ``ckpt+offload-<MiB>mib``: ``ckpt`` plus an engine offloading the first MiB saved in each forward (no planner;
  ``0mib``: its hooks on every saved tensor, nothing offloaded).

For every arm with an engine the tool also sums, per step, the host time spent inside the engine's entry points
(``install``, and the hooks ``pack`` and ``unpack``: ``engine_host_us``, the medians over the timed steps): what its
bookkeeping costs the host, apart from the noise of the step around it (on an H200, small-h512's steps moved by ~1 ms
between two processes, the engine's own time by a few percent).

There are no arms under a memory budget: the planner reads the process's allocator, where the other arms' weights,
optimizer states and cached blocks sit, and on an H200 it planned small-h512's 0.95x budget by parts with 0.32 GiB
offloaded (1.57x AC's time) where the benchmark's row, in a process of its own under a hard cap, ran 3 whole blocks
(0.99x AC's).

    python -m benchmarks.interleaved --workload small-h512 --arms none,default,ac,ckpt,ckpt+offload-10mib \
        --rounds 100 --out $OUT/interleaved.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import models
from benchmarks.workloads import WORKLOADS, tiny
from lightning_offload import offload_activations
from lightning_offload.checkpointing import apply_checkpointing

# The methods whose host time is summed per step: the engine's per-step install, and its datapath's hooks.
_ENTRY_POINTS = ("install", "pack", "unpack")
# Steps each arm runs before timing: the default engine's two measuring steps, its first planned step and one more.
_WARMUP_STEPS = 4
_ARM_PATTERNS = (
    r"none",
    r"default",
    r"ac",
    r"ckpt",
    r"ckpt\+offload-(\d+(?:\.\d+)?)mib",
)
_ARMS_HELP = "none, default, ac, ckpt, ckpt+offload-<MiB>mib"


@dataclass
class _Arm:
    name: str
    bench: models.BenchModel
    optimizer: torch.optim.Optimizer
    context: Callable[[], Any]
    engine: Any = None
    times: list[float] = field(default_factory=list)
    host: dict[str, list[float]] = field(default_factory=dict)  # seconds inside each engine entry point, per step
    _inside: dict[str, float] = field(default_factory=dict)  # ... summed over the step running now

    def __post_init__(self) -> None:
        if self.engine is None:
            return
        for entry in _ENTRY_POINTS:
            self.host[entry] = []
            owner = self.engine if entry == "install" else self.engine._path
            setattr(owner, entry, self._timed(entry, getattr(owner, entry)))

    def _timed(self, entry: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` (a bound method of the engine or its datapath), with the host time spent in it added to the step's
        sum. (The engine looks the hooks up on its datapath when it installs them: the instance attribute runs.)"""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._inside[entry] = self._inside.get(entry, 0.0) + time.perf_counter() - start

        return timed

    def step(self, ids: torch.Tensor) -> None:
        """One timed step; with an engine, the host time inside its entry points is noted too."""
        self._inside = {}
        self.times.append(self.bench.timed_step(self.context(), self.optimizer, ids))
        for entry in self.host:
            self.host[entry].append(self._inside.get(entry, 0.0))


def _arm_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"--arms: give at least one of {_ARMS_HELP}")
    for name in names:
        if not any(re.fullmatch(pattern, name) for pattern in _ARM_PATTERNS):
            raise argparse.ArgumentTypeError(f"--arms: unknown arm {name!r}; allowed: {_ARMS_HELP}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--arms: {text!r} names an arm twice")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small-h512", choices=sorted(WORKLOADS))
    parser.add_argument("--arms", type=_arm_names, default=["none", "default"], help=f"comma-separated: {_ARMS_HELP}")
    parser.add_argument("--rounds", "--pairs", type=int, default=100, help="timed steps per arm")
    parser.add_argument(
        "--min-tensor-bytes", type=int, default=None, help="the engines' min_tensor_bytes (default: the engine's)"
    )
    parser.add_argument("--tiny", action="store_true", help="shrink the model (a CPU run of the tool itself)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = parser.parse_args(argv)

    workload = tiny(WORKLOADS[args.workload]) if args.tiny else WORKLOADS[args.workload]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    plain = models.build(workload, device)
    ids = torch.randint(0, workload.vocab, (workload.batch, workload.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    engine_kwargs: dict[str, Any] = {} if cuda else {"compute_device": "cpu"}
    if args.min_tensor_bytes is not None:
        engine_kwargs["min_tensor_bytes"] = args.min_tensor_bytes

    def optimizer_for(bench: models.BenchModel) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in bench.trainable()], lr=1e-5, **({"fused": True} if cuda else {}))

    plain_optimizer = optimizer_for(plain)
    arms: list[_Arm] = []
    try:
        for name in args.arms:
            arms.append(_make_arm(name, plain, plain_optimizer, optimizer_for, engine_kwargs))
        for arm in arms:  # warm up one arm at a time
            for _ in range(_WARMUP_STEPS):
                arm.bench.timed_step(arm.context(), arm.optimizer, ids)
        for index in range(args.rounds):
            shift = index % len(arms)  # each arm goes first as often as the others
            for arm in arms[shift:] + arms[:shift]:
                arm.step(ids)
        result = _result(workload, args.rounds, arms)
    finally:
        for arm in arms:
            if arm.engine is not None:
                arm.engine.close()
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def _make_arm(
    name: str,
    plain: models.BenchModel,
    plain_optimizer: torch.optim.Optimizer,
    optimizer_for: Callable[[models.BenchModel], torch.optim.Optimizer],
    engine_kwargs: dict[str, Any],
) -> _Arm:
    if name == "none":
        return _Arm(name, plain, plain_optimizer, contextlib.nullcontext)
    if name == "default":  # what a user gets: no argument, the user's own model
        engine = offload_activations(**{k: v for k, v in engine_kwargs.items() if k == "compute_device"})
        return _Arm(name, plain, plain_optimizer, lambda: engine, engine)
    bench = _copy(plain)
    optimizer = optimizer_for(bench)
    if name == "ac":
        bench.enable_ac()
        return _Arm(name, bench, optimizer, contextlib.nullcontext)
    apply_checkpointing(bench.module, "auto")  # ckpt, ckpt+offload-<MiB>mib
    if name == "ckpt":
        return _Arm(name, bench, optimizer, contextlib.nullcontext)
    limit = int(float(name.removeprefix("ckpt+offload-").removesuffix("mib")) * 2**20)
    # The first bytes saved leave, as a planner's offload limit sends them (no resident tail held back).
    engine = offload_activations(
        memory_budget=None, max_offload_bytes=limit, resident_tail_bytes=0, model=bench.module, **engine_kwargs
    )
    return _Arm(name, bench, optimizer, lambda: engine, engine)


def _copy(bench: models.BenchModel) -> models.BenchModel:
    """Another model with the same weights (its own parameters: checkpointing wrappers change the module)."""
    module = copy.deepcopy(bench.module)
    hf_base = None
    if bench.hf_base is not None:
        hf_base = module.get_base_model() if bench.lora == "peft" else module
    return models.BenchModel(module=module, impl=bench.impl, lora=bench.lora, hf_base=hf_base)


def _plan_text(engine: Any) -> str | None:
    planner = getattr(engine, "planner", None) if engine is not None else None
    plan = getattr(planner, "plan", None)
    if plan is None:
        return None
    return f"ckpt {plan.checkpoint_blocks}{' by parts' if plan.split else ''}, offload {plan.offload_bytes} bytes"


def _host_us(arm: _Arm) -> dict[str, float] | None:
    """Median host microseconds per step inside each engine entry point, and of their sum (``None``: no engine)."""
    if not arm.host:
        return None
    out = {entry: statistics.median(seconds) * 1e6 for entry, seconds in arm.host.items()}
    out["total"] = statistics.median(map(sum, zip(*arm.host.values(), strict=True))) * 1e6
    return out


def _result(workload: Any, rounds: int, arms: list[_Arm]) -> dict[str, Any]:
    medians = {arm.name: statistics.median(arm.times) for arm in arms}
    result: dict[str, Any] = {
        "workload": workload.as_dict(),
        "rounds": rounds,
        "arms": {
            arm.name: {
                "median_ms": medians[arm.name] * 1e3,
                "times_ms": [t * 1e3 for t in arm.times],
                "plan": _plan_text(arm.engine),
                "offloaded_bytes": arm.engine.stats.offloaded_bytes if arm.engine is not None else 0,
                "engine_host_us": _host_us(arm),
            }
            for arm in arms
        },
    }
    for reference in ("none", "ac"):
        if reference in medians:
            result[f"ratio_to_{reference}"] = {name: m / medians[reference] for name, m in medians.items()}
    if "none" in medians and "default" in medians:  # the figure the first version of this tool wrote
        result["plain_ms"], result["default_ms"] = medians["none"] * 1e3, medians["default"] * 1e3
        result["ratio"] = medians["default"] / medians["none"]
    return result


if __name__ == "__main__":
    raise SystemExit(main())
