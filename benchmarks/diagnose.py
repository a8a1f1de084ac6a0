"""``python -m benchmarks.diagnose``: one workload under one memory budget, step by step, to see why a plan is slow.

Per step it prints the plan the engine ran, forward's and backward's device time and the part of each spent waiting
for copies, the step's peak, the pinned host memory and new host buffers; after the first planned step, the
candidate plans the planner chose from (one per number of checkpointed blocks: predicted peak, cost, whether it
fits). ``--profile-step N`` also runs step ``N`` under the PyTorch profiler and prints its busiest host calls and
device kernels. Everything printed is also written as JSON (``--out``).

On CUDA, each step's peak is also split by phase (:class:`PhasePeaks`): forward with the loss's forward (up to the
first unpack), the loss's and the head's backward (up to the first block rebuilt in backward, when one is), the rest of
backward, and the optimizer step. The planner still sees the whole step's peak.

    python -m benchmarks.diagnose --workload llama8b-lora-s8k --budget-gib 69.6 --steps 8 --profile-step 6
    python -m benchmarks.diagnose --workload smallvocab-h1024 --seq 45056 --budget-gib 8 --steps 6

``--max-offload-gib X`` runs the manual override instead (no budget, no cap, no planner: the first ``X`` GiB of
each forward leave), and ``--plain-steps N`` times ``N`` steps without the engine in the same process, alternating
with the engine's last ``N`` steps, to tell what offloading adds to forward, backward and the step:

    python -m benchmarks.diagnose --workload llama8b-lora-s8k --max-offload-gib 14.4 --steps 10 --plain-steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import models
from benchmarks.workloads import CAPACITY_MODELS, WORKLOADS, tiny
from lightning_offload import offload_activations
from lightning_offload.policy import backward_running

GiB = float(1 << 30)
_ALL = {**WORKLOADS, **CAPACITY_MODELS}


class PhasePeaks:
    """The device's peak allocated memory per phase of a step, for a planner that still sees the whole step's peak.

    Wraps the planner's allocator counters: every phase boundary resets the device's peak counter, and ``peak()``
    answers the largest of the phases so far, as the counter would have without the resets. Phases: ``forward``
    (up to backward's first unpack, the loss's forward included), ``loss_backward`` (up to the first block that runs
    its forward again in backward; absent when none does), ``backward`` (the rest of backward), ``optimizer``.
    """

    def __init__(self, memory: Any, blocks: list[torch.nn.Module]) -> None:
        self.memory = memory
        self.phases: dict[str, int] = {}
        self._phase = "forward"
        # On the blocks' parts: the engine's checkpointing replaces a block's ``forward``, so its rebuild in backward
        # runs the original one, which skips the block's own hooks but calls its parts (a block without parts: itself).
        parts = [part for block in blocks for part in (list(block.children()) or [block])]
        self._handles = [part.register_forward_pre_hook(self._block_started) for part in parts]

    def __getattr__(self, name: str) -> Any:  # total(), allocated(): the wrapped counters
        return getattr(self.memory, name)

    def peak(self) -> int:
        return max([self.memory.peak(), *self.phases.values()])

    def reset_peak(self) -> None:
        self.memory.reset_peak()
        self.phases, self._phase = {}, "forward"

    def next_phase(self, phase: str) -> None:
        """Close the current phase at the device's peak so far, and start ``phase``."""
        self.phases[self._phase] = max(self.phases.get(self._phase, 0), self.memory.peak())
        self.memory.reset_peak()
        self._phase = phase

    def _block_started(self, module: torch.nn.Module, args: Any) -> None:
        if self._phase == "loss_backward" and backward_running():
            self.next_phase("backward")

    def close(self) -> dict[str, float]:
        """End the step's last phase; the phases' peaks in GiB."""
        self.next_phase("forward")
        return {name: round(value / GiB, 2) for name, value in self.phases.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _split_phases(planner: Any, blocks: list[torch.nn.Module]) -> PhasePeaks:
    """Make ``planner`` (and the marks its datapath sets) count peaks through a :class:`PhasePeaks` that tells
    backward's start and end apart."""
    marks = planner.marks
    phases = PhasePeaks(planner.memory, blocks)
    planner.memory = marks.memory = phases
    started, finished = marks.backward_started, marks.backward_finished

    def backward_started() -> None:
        started()
        phases.next_phase("loss_backward")

    def backward_finished() -> None:
        finished()
        phases.next_phase("optimizer")

    marks.backward_started, marks.backward_finished = backward_started, backward_finished
    return phases


def _step_record(engine: Any, index: int, wall_s: float, device: torch.device) -> dict[str, Any]:
    """What step ``index`` ran and how long it waited (after a synchronization: every timing is done)."""
    transfer, planner = engine._path.transfer, engine.planner
    record: dict[str, Any] = {"step": index, "wall_s": round(wall_s, 4)}
    if hasattr(transfer, "forward_ms"):
        compute = transfer.forward_ms()
        record["fwd_ms"] = round(transfer.last_forward_ms, 1)
        record["fwd_wait_ms"] = round(transfer.last_forward_ms - compute, 1)
        record["bwd_compute_ms"] = round(transfer.backward_ms(), 1)
        record["stalls"] = transfer.last_stalls
    stats = engine.stats
    record.update(
        offloaded_gib=round(stats.offloaded_bytes / GiB, 2),
        eligible_gib=round(stats.eligible_bytes / GiB, 2),
        bwd_stall_ms=round(stats.stall_ms, 1),
        host_pinned_gib=round(stats.host_pinned_bytes / GiB, 2),
        host_allocations=stats.host_allocations,
    )
    if device.type == "cuda":
        peak = planner.memory.peak() if planner is not None else torch.cuda.max_memory_allocated(device)
        record["peak_gib"] = round(peak / GiB, 2)
        record["reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GiB, 2)
    if planner is not None:
        record["measuring"] = planner.measuring
        record["fwd_peak_gib"] = round(planner.marks.forward_peak / GiB, 2)  # the peak as backward began
        if planner.plan is not None:
            plan = planner.plan
            parts = " by parts" if plan.split else ""
            light = f"elementwise {plan.light_blocks}, " if plan.light_blocks else ""
            record["plan"] = f"{light}ckpt {plan.checkpoint_blocks}{parts}, offload {plan.offload_bytes / GiB:.2f} GiB"
        if planner.profile is not None:
            record["link_share"] = round(planner.profile.link_share, 3)
    return record


def _candidates(planner: Any) -> list[dict[str, Any]]:
    return [
        {
            "ckpt": c.checkpoint_blocks,
            "split": c.split,
            "light": c.light_blocks,
            "offload_gib": round(c.offload_bytes / GiB, 2),
            "peak_gib": round(c.peak / GiB, 2),
            "cost_ms": round(c.extra_ms, 1),
            "fits": c.fits,
            "inflight_cap": c.inflight_cap,
        }
        for c in planner.candidates()
    ]


def _profile_summary(prof: Any) -> dict[str, list[str]]:
    averages = prof.key_averages()
    by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    by_device = sorted(averages, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:15]
    return {
        "host": [f"{e.key[:60]:60s} {e.count:6d} calls {e.self_cpu_time_total / 1e3:9.1f} ms" for e in by_cpu],
        "device": [
            f"{e.key[:60]:60s} {e.count:6d} calls {getattr(e, 'self_device_time_total', 0) / 1e3:9.1f} ms"
            for e in by_device
        ],
    }


def _plain_step(bench: Any, optimizer: Any, ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One step without the engine: wall time, and forward's and backward's device time (CUDA events)."""
    if device.type != "cuda":
        return {"plain_wall_s": round(bench.timed_step(contextlib.nullcontext(), optimizer, ids), 4)}
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    events[0].record()
    loss = bench.loss(ids)
    events[1].record()
    loss.backward()
    events[2].record()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return {
        "plain_wall_s": round(time.perf_counter() - start, 4),
        "plain_fwd_ms": round(events[0].elapsed_time(events[1]), 1),
        "plain_bwd_ms": round(events[1].elapsed_time(events[2]), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=sorted(_ALL))
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the workload's)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--budget-gib", type=float, help="memory_budget, also set as a hard cap")
    what.add_argument("--max-offload-gib", type=float, help="max_offload_bytes (streamed, no planner, no cap)")
    parser.add_argument("--plain-steps", type=int, default=0, help="steps without the engine, alternating at the end")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile-step", type=int, default=None, help="run this step under the PyTorch profiler")
    parser.add_argument("--tiny", action="store_true", help="shrink the model (a CPU run of the tool itself)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = parser.parse_args(argv)
    if args.plain_steps and args.budget_gib is not None:
        # The planner's checkpointed blocks stay applied between steps: a step without the engine would not be plain.
        parser.error("--plain-steps: only with --max-offload-gib (the planner's blocks stay applied under a budget)")

    workload = _ALL[args.workload]
    workload = replace(workload, seq=args.seq) if args.seq else workload
    workload = tiny(workload) if args.tiny else workload
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    budget = int(args.budget_gib * GiB) if args.budget_gib is not None else None
    if cuda and budget is not None:  # before the weights: the cap bounds the whole process, as in capacity runs
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    torch.manual_seed(0)
    bench = models.build(workload, device)
    ids = torch.randint(0, workload.vocab, (workload.batch, workload.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    params = [p for _, p in bench.trainable()]
    optimizer = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if cuda else {}))
    knobs: dict[str, Any] = (
        {"memory_budget": budget} if budget is not None else {"max_offload_bytes": int(args.max_offload_gib * GiB)}
    )
    engine = offload_activations(
        **knobs, model=bench.module, measure_copies=cuda, compute_device=None if cuda else "cpu"
    )
    result: dict[str, Any] = {
        "workload": workload.as_dict(),
        "budget_gib": args.budget_gib,
        "max_offload_gib": args.max_offload_gib,
        "steps": [],
        "plain_steps": [],
    }
    # The plain steps alternate with the engine's last ones: drift between them touches both alike.
    plain_from = args.steps - args.plain_steps
    phases = None  # from the second step on: the engine makes its planner at its first
    try:
        for index in range(args.steps):
            profiler = None
            if index == args.profile_step and cuda:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                profiler = torch.profiler.profile(activities=activities)
                profiler.__enter__()
            if index >= plain_from:
                plain = _plain_step(bench, optimizer, ids, device)
                result["plain_steps"].append(plain)
                print(json.dumps(plain), flush=True)
            wall = bench.timed_step(engine, optimizer, ids)
            if profiler is not None:
                profiler.__exit__(None, None, None)
                result["profile"] = _profile_summary(profiler)
            record = _step_record(engine, index, wall, device)
            if phases is not None:
                record["phase_peaks_gib"] = phases.close()
            elif cuda and engine.planner is not None:
                phases = _split_phases(engine.planner, [block for _, block in engine.planner._blocks.blocks])
            result["steps"].append(record)
            print(json.dumps(record), flush=True)
            planner = engine.planner
            if planner is not None and planner.profile is not None and "candidates" not in result:
                if not planner.measuring and planner.plan is not None:
                    result["profile_measured"] = dataclasses.asdict(planner.profile)
                    result["candidates"] = _candidates(planner)
    except torch.cuda.OutOfMemoryError as err:
        result["oom"] = str(err)[:400]
        print("OOM:", str(err)[:400])
        planner = engine.planner
        if planner is not None and planner.profile is not None and "candidates" not in result:
            # The step that ran out: its plan, and what the planner chose it from.
            result["profile_measured"] = dataclasses.asdict(planner.profile)
            result["candidates"] = _candidates(planner)
            if planner.plan is not None:
                result["oom_plan"] = dataclasses.asdict(planner.plan)
                print("oom plan:", json.dumps(result["oom_plan"]))
    finally:
        if phases is not None:
            phases.remove()
        engine.close()
    if "profile_measured" in result:
        print("profile:", json.dumps(result["profile_measured"]))
        for candidate in result["candidates"]:
            print("  candidate", json.dumps(candidate))
    for key, lines in result.get("profile", {}).items():
        print(f"== busiest {key} entries")
        print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
