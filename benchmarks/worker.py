"""One workload, every mode, in one process: ``python -m benchmarks.worker --workload NAME ...``.

Protocol: each mode starts from the same weights and a fresh optimizer, runs ``warmup`` steps and
then ``steps`` timed steps with a device synchronization around each; peak memory is read over the timed steps
after resetting the counters; the first step's gradients are compared with those of ``none``. The JSON result
is rewritten after every mode, so a crash or a timeout still leaves the rows measured so far.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import anchors, models, report
from benchmarks.workloads import (
    FLOOR_HEADROOM,
    MODES,
    WORKLOADS,
    Mode,
    Workload,
    engine_kwargs,
    ordered,
    planner_available,
    tiny,
    worker_modes,
)
from lightning_offload import offload_activations, release_host_memory
from lightning_offload.checkpointing import apply_checkpointing, remove_checkpointing
from lightning_offload.device_memory import read_counters
from lightning_offload.planner.trials import timing_key

GiB = 1 << 30
GC_FREEZE_VARIABLE = "BENCH_GC_FREEZE"  # "1": freeze the collector's view after the model is built
# GiB: a hard cap for the rows without a budget of their own, `none` (the reference: budgets are fractions of its
# peak) and the default (it plans for the device) excepted. An experiment: does AC fit under a budget row's cap?
BASELINE_CAP_VARIABLE = "BENCH_CAP_GIB"
# What a budget row keeps of a reference's run under its cap.
_CAPPED_KEYS = (
    "status",
    "step_s",
    "peak_alloc_gib",
    "peak_reserved_gib",
    "alloc_flushes_per_step",
    "oom_step",
    "allocator",
)
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


# ---------------------------------------------------------------------------------------------- device helpers


def memory_budget_available() -> bool:
    """Whether the engine takes ``memory_budget`` (the planner); rows that need it say so when it does not."""
    return planner_available()


NO_BUDGET_API = "not measured: memory_budget not available"
# Warm-up steps of a row whose engine plans under a memory budget (see ``_measure``), and of one whose engine does not.
PLANNER_WARMUP = 3
SETTLED_WARMUP = 3
# Planner rows keep warming up (up to this many steps) while their plan changes, is being timed against others or they
# pin new host buffers: what a long run sees is the settled plan, and one step that pins 15 GiB takes seconds. Two
# measuring steps and up to six plans under trial for four or five steps each come first. (At 20, the rows of
# Llama-8B LoRA timed the last trials, of slower plans, in their first two or three timed steps: on an H200, the 70 GiB
# row read 1162, 1163, 1148 and 1100 ms, its settled plan 1100.) A row that still times unsettled steps says how many.
PLANNER_MAX_WARMUP = 40


def budget_bytes(mode: Mode, rows: dict[str, dict[str, Any]]) -> tuple[float | None, str]:
    """The budget of a budget row from the rows measured before it in the same process, or ``None`` and why not.

    A fraction is of `none`'s peak allocated memory; ``"floor"`` is :data:`FLOOR_HEADROOM` x the peak of
    `ac+offload` (checkpointing and offloading: the least memory our hand-tuned rows reach).
    """
    if isinstance(mode.budget, float):
        none = rows.get("none", {})
        if none.get("status") != "ok" or none.get("peak_alloc_gib") is None:
            return None, "no peak of `none` to take a fraction of"
        return mode.budget * none["peak_alloc_gib"] * GiB, ""
    if mode.budget == "floor":
        both = rows.get("ac+offload", {})
        if both.get("status") != "ok" or both.get("peak_alloc_gib") is None:
            return None, "no peak of `ac+offload` to set the floor"
        return FLOOR_HEADROOM * both["peak_alloc_gib"] * GiB, ""
    if isinstance(mode.budget, str) and mode.budget.endswith("gib"):
        return float(mode.budget[: -len("gib")]) * GiB, ""
    return None, f"budget {mode.budget!r} is for capacity runs"


@contextlib.contextmanager
def memory_cap(device: torch.device, cap_bytes: float | None) -> Iterator[None]:
    """A hard cap on this process's device memory (the caching allocator refuses to reserve beyond it).

    ``set_per_process_memory_fraction`` caps what the allocator may *reserve*, so a row that fits under it never
    held more than ``cap_bytes`` of device memory, fragmentation included.
    """
    if device.type != "cuda" or cap_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


# A capped row whose process holds more than this share of the cap reserved but unallocated reloads its weights; an
# uncapped row, more than this many bytes (on an H200, earlier rows left small-h512's uncapped rows a 500 MiB segment
# pinned by cuBLAS's workspace: 0.48 GiB reserved and unallocated, 1.15x its offloading row's peak allocated).
_FRAGMENTS_SHARE = 0.02
_UNCAPPED_FRAGMENTS_BYTES = 64 * 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device, host_cache: bool = False) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Pinned blocks cached by torch's host allocator (save_on_cpu, the anchors, the link test) would otherwise
        # stay pinned for the rest of the process and squeeze the RAM the next modes may use. Between two anchors
        # they are kept: re-pinning tens of GiB costs ~0.4 s/GiB that neither anchor pays in steady state.
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if host_cache and empty_host is not None:
            empty_host()


def _unsettled(ran: list[tuple[Any, int, bool]]) -> bool:
    """Whether the latest step ran a plan other than the step before it, one under trial, or pinned new host
    buffers."""
    return len(ran) >= 2 and (ran[-1][1] > 0 or ran[-1][0] != ran[-2][0] or ran[-1][2])


class _Clock:
    """Phase boundaries of one step: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if self.cuda else []
        self.times: list[float] = [0.0] * 4
        self.index = 0

    def mark(self) -> None:
        if self.cuda:
            self.events[self.index].record()
        else:
            self.times[self.index] = time.perf_counter()
        self.index += 1

    def phases(self) -> tuple[float, float, float]:
        """Forward, backward and optimizer seconds (after the step was synchronized)."""
        if self.cuda:
            ev = self.events
            return tuple(ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(3))  # type: ignore[return-value]
        t = self.times
        return (t[1] - t[0], t[2] - t[1], t[3] - t[2])


class _CollectorClock:
    """Python's garbage collections while it is open: how many of each generation and the milliseconds they took.
    Elementwise recompute leaves cyclic garbage in every step (torch's pytree, called by its selective
    checkpointing), and a full collection walks every object the process tracks (a model, Lightning, the
    libraries). (On an H200, Llama-8B LoRA's rows with light blocks spent 2-6 ms a step collecting, nearly all in
    generation 0: not what made some rows slower than their trials, which was trial steps timed as the row's.)"""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __enter__(self) -> _CollectorClock:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.ms[generation] += (time.perf_counter() - self._started) * 1e3


def allocator_segments() -> str | None:
    """The CUDA allocator's segments in this process now: ``"expandable"`` (an offloading engine switched them on, or
    the environment asked for them) or ``"fixed"``; ``None`` where the package under test cannot say. Plain rows that
    run after an offloading row in one process inherit expandable segments (AC's capacity on Llama-1B at 80 GiB on an
    H200: 45056 tokens so, 40960 with fixed segments)."""
    try:
        from lightning_offload.device_memory import expandable_segments
    except ImportError:
        return None
    return "expandable" if expandable_segments() else "fixed"


def segment_summary(device: torch.device) -> list[dict[str, Any]]:
    """The allocator's segments now, by kind (pool, expandable or fixed): how many, their bytes, the bytes allocated
    in them and their largest free block. Where a capped row runs out of memory, it says whether the bytes reserved
    but unallocated are holes in fixed segments (which no flush returns while anything lives in them) or unmapped
    room in expandable ones."""
    kinds: dict[tuple[str, bool], dict[str, Any]] = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) != index:
            continue
        key = (str(segment.get("segment_type")), bool(segment.get("is_expandable")))
        kind = kinds.setdefault(
            key, {"pool": key[0], "expandable": key[1], "segments": 0, "bytes": 0, "allocated": 0, "largest_free": 0}
        )
        free = [block["size"] for block in segment.get("blocks", []) if block.get("state") == "inactive"]
        kind["segments"] += 1
        kind["bytes"] += segment["total_size"]
        kind["allocated"] += segment["allocated_size"]
        kind["largest_free"] = max(kind["largest_free"], *free, 0)
    return sorted(kinds.values(), key=lambda kind: -kind["bytes"])


def measure_link(device: torch.device, nbytes: int = GiB, reps: int = 3) -> dict[str, float] | None:
    """Pinned host <-> device bandwidth in GB/s: each way alone and both at once (on two streams)."""
    if device.type != "cuda":
        return None
    buf = {
        "dev_a": torch.empty(nbytes, dtype=torch.uint8, device=device),
        "dev_b": torch.empty(nbytes, dtype=torch.uint8, device=device),
        "host_a": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "host_b": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
    }
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(fn: Callable[[], None]) -> float:
        fn()  # warm-up: first touches of the pages and the copy engines
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    def d2h() -> None:
        buf["host_a"].copy_(buf["dev_a"], non_blocking=True)

    def h2d() -> None:
        buf["dev_b"].copy_(buf["host_b"], non_blocking=True)

    def both() -> None:
        current = torch.cuda.current_stream(device)
        s1.wait_stream(current)
        s2.wait_stream(current)
        with torch.cuda.stream(s1):
            d2h()
        with torch.cuda.stream(s2):
            h2d()

    d2h_s, h2d_s, both_s = timed(d2h), timed(h2d), timed(both)
    result = {
        "d2h_gbps": nbytes / d2h_s / 1e9,
        "h2d_gbps": nbytes / h2d_s / 1e9,
        "both_gbps": 2 * nbytes / both_s / 1e9,
    }
    buf.clear()
    _free(device, host_cache=True)
    return result


def environment(device: torch.device, anchor_versions: dict[str, str | None]) -> dict[str, Any]:
    """What the numbers were measured on."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "driver": _driver_version() if device.type == "cuda" else None,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("transformers", "peft"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # optional
            env[name] = None
    env["anchors"] = anchor_versions
    env["model_impl"] = models.backend()
    env["memory_budget_api"] = memory_budget_available()
    return env


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------- the model


@contextlib.contextmanager
def _hooks_restored(model: torch.nn.Module) -> Iterator[None]:
    """Remove, on exit, every module hook registered inside (anchors register some and never remove them)."""
    before = {id(m): {name: set(getattr(m, name, {})) for name in _HOOK_DICTS} for m in model.modules()}
    try:
        yield
    finally:
        for module in model.modules():
            known = before.get(id(module), {})
            for name in _HOOK_DICTS:
                hooks = getattr(module, name, None)
                if hooks is None:
                    continue
                for key in [k for k in hooks if k not in known.get(name, set())]:
                    del hooks[key]


# ---------------------------------------------------------------------------------------------- the runner


class Runner:
    """Runs the modes of one workload in this process and collects one row per mode."""

    def __init__(
        self, workload: Workload, steps: int, warmup: int, tiny_run: bool, anchor_steps: int, anchor_warmup: int
    ) -> None:
        self.workload = workload
        self.steps = steps
        self.warmup = warmup
        self.anchor_steps = anchor_steps
        self.anchor_warmup = anchor_warmup
        self.tiny = tiny_run
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        torch.manual_seed(0)
        self.bench = models.build(workload, self.device)
        self.model = self.bench.module
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, workload.vocab, (workload.batch, workload.seq), generator=generator).to(self.device)
        self.trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # Only trainable tensors change during a mode; the frozen base (LoRA) is never touched.
        self.initial = {n: self._to_host(p.detach()) for n, p in self.trainable}
        self.reference_grads: dict[str, torch.Tensor] | None = None
        self.rows: dict[str, dict[str, Any]] = {}  # measured so far: budgets are fractions of their peaks
        self.step_index = 0  # the step being run (for an out-of-memory report)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.cuda)
        host.copy_(tensor)
        return host

    # ---------------------------------------------------------------- one mode

    def run(self, mode: Mode, cap_gib: float | None = None) -> dict[str, Any]:
        """Measure ``mode`` and keep its row (budgets of later rows are taken from it); with ``cap_gib``, a row
        without a budget of its own runs under that hard cap instead, and is not kept (a B2 reference's second run,
        :meth:`run_capped_references`)."""
        row: dict[str, Any] = {
            "mode": mode.name,
            "group": mode.group,
            "checkpoint": mode.checkpoint,
            "sweep": mode.sweep,
            "status": "ok",
        }
        if mode.engine is not None:
            row["knobs"] = engine_kwargs(mode, self.tiny)
        if mode.budget is not None and not memory_budget_available():
            row["status"] = NO_BUDGET_API
            return row
        if mode.needs_cuda and not self.cuda:
            row["status"] = "skipped: needs CUDA"
            return row
        budget = None
        if mode.budget is not None:
            budget, why = budget_bytes(mode, self.rows)
            if budget is None:
                row["status"] = f"not measured: {why}"
                return row
            row["budget_gib"] = budget / GiB
            row["knobs"] = {"memory_budget": budget}
        engine = None
        optimizer = None
        cap = budget
        if cap is None and cap_gib is not None:
            cap = cap_gib * GiB
            row["cap_gib"] = cap_gib
        if cap is None and os.environ.get(BASELINE_CAP_VARIABLE) and mode.name != "none" and not mode.default:
            cap = float(os.environ[BASELINE_CAP_VARIABLE]) * GiB
            row["cap_gib"] = cap / GiB
        row["fresh_segments"] = self._fresh_segments(cap)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(_free, self.device, host_cache=False)
            cleanup.enter_context(_hooks_restored(self.model))
            try:
                step_context, engine = self._prepare(mode, cleanup)
            except anchors.AnchorUnavailable as err:
                row["status"] = f"not available: {err}"[:500]
                return row
            except Exception as err:  # an anchor that imports but cannot be set up: a row, not a crash
                traceback.print_exc()
                row["status"] = f"error: {type(err).__name__}: {err}"[:500]
                return row
            try:
                optimizer = self._fresh_start(mode)
                # After the fresh start emptied the cache: the cap bounds everything the row reserves.
                with memory_cap(self.device, cap):
                    self._measure(mode, row, step_context, optimizer, engine)
            except torch.cuda.OutOfMemoryError as err:
                row["status"] = "OOM"
                # Where it ran out (warm-up steps come first, so a planner's measuring steps are 0 and 1) and the
                # allocator's account of it.
                row["oom_step"] = self.step_index
                row["oom_error"] = str(err)[:600]
                if self.cuda:
                    row["oom_segments"] = segment_summary(self.device)
                self._after_failure(engine)
            except Exception as err:
                traceback.print_exc()
                row["status"] = f"error: {type(err).__name__}: {err}"[:500]
                self._after_failure(engine)
            finally:
                del optimizer
                self.model.zero_grad(set_to_none=True)
        if budget is not None:
            row["oom"] = row["status"] == "OOM"
        if cap_gib is None:
            self.rows[mode.name] = row
        return row

    def run_capped_references(self, rows: list[dict[str, Any]], written: Callable[[], None]) -> None:
        """B2 compares a budget row with every other row whose peak allocated fits under its budget; one whose peak
        reserved does not may still fail under the budget's hard cap (on an H200, AC ran out of memory under
        small-h512's 2.03 GiB cap with 1.8 GiB allocated at its peak). Run each such row again under that cap and
        note how it went in the budget row's ``capped_references`` (status, step time, peaks, the allocator's flushes
        per step). ``written`` saves the result after each run."""
        floors = [row["budget_gib"] for row in rows if row["mode"] == "ours-budget-floor" and row.get("budget_gib")]
        for budget_row in rows:
            if budget_row.get("status") != "ok" or budget_row.get("budget_gib") is None:
                continue
            if floors and budget_row["budget_gib"] < floors[0]:
                continue  # below the plan floor: B2 does not count it
            for name in report.references_in_doubt(budget_row, rows):
                started = time.perf_counter()
                capped = self.run(MODES[name], cap_gib=budget_row["budget_gib"])
                capped["wall_s"] = time.perf_counter() - started
                # Whether it ran in fixed or expandable segments decides whether it fits (on an H200, AC under
                # small-h512's 2.03 GiB cap: out of memory with fixed segments, 1.93 GiB reserved with expandable).
                capped.setdefault("allocator", allocator_segments() if self.cuda else None)
                budget_row.setdefault("capped_references", {})[name] = {key: capped.get(key) for key in _CAPPED_KEYS}
                print(f"{_progress(self.workload.name, capped)} under {budget_row['mode']}'s cap", flush=True)
                written()

    def _fresh_segments(self, cap: float | None) -> bool:
        """Start a row as a process of its own would (one that set its cap, if any, before loading the model): where
        earlier rows left more than :data:`_FRAGMENTS_SHARE` of the cap (uncapped: :data:`_UNCAPPED_FRAGMENTS_BYTES`)
        reserved but unusable (free bytes in segments that also hold weights), the weights and inputs leave the device
        and come back into fresh segments. Every row gets this, so reserved peaks compare as separate processes' would.
        On an H200, small-h512's 2 GiB budget rows ran out of memory in this shared process with 425 MiB reserved and
        unallocated, and trained in a process of their own. Before the row's engine exists: it identifies parameters by
        their storage."""
        if not self.cuda:
            return False
        _free(self.device)
        fragments = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if fragments <= (_FRAGMENTS_SHARE * cap if cap is not None else _UNCAPPED_FRAGMENTS_BYTES):
            return False
        ids = self.ids.cpu()
        self.model.to("cpu")
        # cuBLAS keeps a workspace per handle and stream from the first matmul on it (32 MiB on an H200), allocated
        # wherever the allocator had room then: in the loss's 500 MiB segment of an earlier row's backward on
        # small-h512, which no empty_cache could return after, so the weights and the optimizer's state came back into
        # it and left 209 MiB of holes under a 2 GiB cap. It is allocated again at the next matmul.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        _free(self.device)
        self.model.to(self.device)
        self.ids = ids.to(self.device)
        return True

    def _prepare(self, mode: Mode, cleanup: contextlib.ExitStack) -> tuple[anchors.StepContext, Any]:
        if mode.checkpoint == "hf":
            self.bench.enable_ac()
            cleanup.callback(self.bench.disable_ac)
        elif mode.checkpoint in ("ours", "ours-elementwise"):
            apply_checkpointing(self.model, "auto", recompute="elementwise" if mode.checkpoint != "ours" else "all")
            cleanup.callback(remove_checkpointing, self.model)
        if mode.anchor == "save_on_cpu":
            return anchors.save_on_cpu(), None
        if mode.anchor == "torchtune":
            return anchors.torchtune(self.model), None
        if mode.anchor == "trl":
            return anchors.trl(self.model), None
        if mode.default:
            # Exactly what a user gets: no argument (the CPU needs its device named: the default is CUDA).
            engine = offload_activations() if self.cuda else offload_activations(compute_device="cpu")
            return (lambda: engine), engine
        if mode.engine is not None:
            kwargs = engine_kwargs(mode, self.tiny)
            if mode.budget is not None:
                kwargs["memory_budget"] = int(budget_bytes(mode, self.rows)[0] or 0)
            engine = offload_activations(
                **kwargs,
                compute_device=None if self.cuda else "cpu",
                measure_copies=self.cuda,
                model=self.model,
            )
            cleanup.callback(engine.close)  # the planner's checkpointing must not leak into the next row
            return (lambda: engine), engine
        return contextlib.nullcontext, None

    def _fresh_start(self, mode: Mode) -> torch.optim.Optimizer:
        """Same weights and a new optimizer (empty state) for every mode."""
        with torch.no_grad():
            for name, param in self.trainable:
                param.copy_(self.initial[name], non_blocking=True)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        _free(self.device, host_cache=mode.group != "anchor")
        params = [p for _, p in self.trainable]
        return torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if self.cuda else {}))

    def _after_failure(self, engine: Any) -> None:
        if engine is not None:
            engine.reset()  # drops host buffers the failed step still referenced

    def _measure(
        self, mode: Mode, row: dict[str, Any], step_context: anchors.StepContext, optimizer: Any, engine: Any
    ) -> None:
        times: list[float] = []
        phases: list[tuple[float, float, float]] = []
        engine_rows: list[dict[str, float]] = []
        # The anchors take 4-7x as long per step: fewer steps keep the whole run within its time budget.
        warmup, steps = (self.anchor_warmup, self.anchor_steps) if mode.group == "anchor" else (self.warmup, self.steps)
        # Rows that plan under a memory budget (the engine makes its planner at its first step, so the mode says):
        plans = engine is not None and (mode.budget is not None or mode.default)
        if plans:
            # the planner's two measuring steps, and its first planned step, which pins the host buffers the plan
            # offloads into (0.4 s per GiB on an H200: 8B LoRA's first planned steps took 1.33-1.52 s, later ones
            # 1.17 s). Other offloading rows pin in their first step, which a warm-up of 2 already covers.
            warmup = max(warmup, PLANNER_WARMUP)
        elif engine is not None:
            # An engine that does not plan may empty the allocator's cache as it installs after each of its first two
            # optimizer steps (what the steps before left cached): the timed steps, and their reserved peak, come after.
            warmup = max(warmup, SETTLED_WARMUP)
        # Per step of a planning row: the plan it ran, the host buffers it pinned, whether the plan was under trial.
        ran: list[tuple[Any, int, bool]] = []
        collections: list[tuple[list[int], list[float]]] = []  # per timed step: per generation, count and ms
        # The most allocated and reserved in any timed step, read after each: a planner made by `offload_activations`
        # owns the peak counters and resets them as each step begins, so one read at the end saw the last step alone.
        peak_alloc = peak_reserved = 0
        index = 0
        while index < warmup + steps:
            if index == warmup and plans and warmup < PLANNER_MAX_WARMUP and _unsettled(ran):
                warmup += 1
            self.step_index = index
            timed = index >= warmup
            if index == warmup and self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                flushes_before = read_counters(self.device).alloc_retries
            clock = _Clock(self.device)
            _sync(self.device)
            start = time.perf_counter()
            with _CollectorClock() as collector:
                clock.mark()
                with step_context():
                    loss = self.bench.loss(self.ids)
                clock.mark()
                loss.backward()
                del loss
                clock.mark()
                if index == 0:
                    row["grad_rel_diff"] = self._compare_grads(mode)
                    if mode.name == "none":
                        row["grad_noise"] = self._grad_noise()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                clock.mark()
                _sync(self.device)
            elapsed = time.perf_counter() - start
            if plans:
                plan = getattr(engine.planner, "plan", None)
                trying = bool(getattr(engine.planner, "trying", False))
                ran.append((plan, engine.collect_stats(wait=False).host_allocations, trying))
            index += 1
            if timed:
                if self.cuda:
                    peak_alloc = max(peak_alloc, torch.cuda.max_memory_allocated(self.device))
                    peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(self.device))
                times.append(elapsed)
                phases.append(clock.phases())
                collections.append((collector.collections, collector.ms))
                if engine is not None:
                    stats = engine.stats
                    values = stats.as_dict()
                    values["d2h_gbps"] = stats.d2h_gbps()
                    values["h2d_gbps"] = stats.h2d_gbps()
                    engine_rows.append(values)
        row["warmup"], row["steps"] = warmup, steps
        if plans:
            # Timed steps that ran a trial or a plan other than the last one (0 where the warm-up covered them).
            # (Compared by what a plan does to a step, not by its estimates, which a re-plan may change alone.)
            keys = [timing_key(plan) if plan is not None else None for plan, _, _ in ran]
            timed_runs = zip(keys[warmup:], ran[warmup:], strict=True)
            row["unsettled_timed_steps"] = sum(trying or key != keys[-1] for key, (_, _, trying) in timed_runs)
        row["step_s"] = statistics.median(times)
        row["step_times_s"] = times
        row["fwd_s"] = statistics.median(p[0] for p in phases)
        row["bwd_s"] = statistics.median(p[1] for p in phases)
        row["opt_s"] = statistics.median(p[2] for p in phases)
        row["tokens_per_s"] = self.workload.tokens / row["step_s"]
        row["gc_collections"] = [c for c, _ in collections]  # per timed step, generations 0, 1, 2
        row["gc_ms"] = [round(sum(ms), 3) for _, ms in collections]  # per timed step, all generations
        if self.cuda:
            row["peak_alloc_gib"] = peak_alloc / GiB
            row["peak_reserved_gib"] = peak_reserved / GiB
            row["allocator"] = allocator_segments()
            # How often the allocator found the device (or the row's cap) full and flushed its cache, per timed step.
            row["alloc_flushes_per_step"] = (read_counters(self.device).alloc_retries - flushes_before) / steps
        if engine_rows:
            row["engine"] = {key: statistics.median(r[key] for r in engine_rows) for key in engine_rows[0]}
        planner = getattr(engine, "planner", None)
        if planner is not None and planner.plan is not None and planner.profile is not None:
            # What the memory-budget planner measured and chose (after the last timed step).
            row["plan"] = dataclasses.asdict(planner.plan)
            row["profile"] = dataclasses.asdict(planner.profile)
            row["forward_peak_gib"] = planner.marks.forward_peak / GiB  # the last step's peak as its backward began
            # The plans timed against each other: blocks checkpointed, GiB offloaded, mean timed step (device ms).
            row["plan_trials"] = [[k, b / GiB, ms, j] for k, b, ms, j in getattr(planner, "timed_plans", [])]
            # ... and each one's timed steps, in the order the plans ran: blocks, GiB, light blocks, device ms per step.
            row["plan_trial_steps"] = [[k, b / GiB, j, ms] for k, b, j, ms in getattr(planner, "trial_steps", [])]
            core = getattr(planner, "core", None)
            # What the planner was told and answered, for replay (lightning_offload/planner/trace.py).
            if core is not None:
                row["trace"] = core.trace.as_dict()

    def _compare_grads(self, mode: Mode) -> float | None:
        """Largest, over trainable tensors, of max|g - g_none| / max|g_none| for the first step's gradients."""
        if mode.name == "none":
            self.reference_grads = {n: self._to_host(p.grad.detach()) for n, p in self.trainable if p.grad is not None}
            return 0.0
        return self._difference_to_reference()

    def _grad_noise(self) -> float | None:
        """``none`` against itself: the first step's forward and backward once more, the same weights and batch.

        Kernels that add in a varying order (atomics in attention's backward, split reductions) make two identical
        bf16 steps differ; on an H200, 8B LoRA's rows differed from ``none`` by 2.1-2.3e-2 whether or not they
        offloaded anything. A row's difference is judged against this, not against a fixed figure alone."""
        self.model.zero_grad(set_to_none=True)
        loss = self.bench.loss(self.ids)
        loss.backward()
        del loss
        return self._difference_to_reference()

    def _difference_to_reference(self) -> float | None:
        if self.reference_grads is None:
            return None
        worst = 0.0
        for name, param in self.trainable:
            ref = self.reference_grads.get(name)
            if ref is None or param.grad is None:
                if (ref is None) != (param.grad is None):
                    return float("inf")  # one run produced a gradient the other did not
                continue
            ref_dev = ref.to(self.device, non_blocking=True).float()
            scale = ref_dev.abs().max().item()
            diff = (param.grad.float() - ref_dev).abs().max().item()
            relative = diff / scale if scale > 0 else diff
            if math.isnan(relative):
                return math.nan  # a NaN on either side: ``max`` would keep the difference found before it
            worst = max(worst, relative)
        return worst


# ---------------------------------------------------------------------------------------------- entry point


def run_workload(
    workload_name: str,
    modes: list[str],
    steps: int,
    warmup: int,
    tiny_run: bool,
    out: Path,
    anchor_steps: int | None = None,
    anchor_warmup: int | None = None,
) -> dict[str, Any]:
    """Run ``modes`` of one workload and write the result to ``out`` after every mode.

    ``none`` runs first (every ratio and gradient comparison is against it), then the baselines, our modes and the
    anchors, in :data:`~benchmarks.workloads.GROUP_ORDER` (budget rows last among ours).
    """
    workload = WORKLOADS[workload_name]
    if tiny_run:
        workload = tiny(workload)
    modes = ordered(modes)
    anchor_steps = steps if anchor_steps is None else anchor_steps
    anchor_warmup = warmup if anchor_warmup is None else anchor_warmup
    anchor_versions = anchors.versions()  # before torchao is hidden, so its version is still reported
    anchors.hide_old_torchao()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    result: dict[str, Any] = {
        "workload": workload.as_dict(),
        "tiny": tiny_run,
        "steps": steps,
        "warmup": warmup,
        "anchor_steps": anchor_steps,
        "anchor_warmup": anchor_warmup,
        "env": environment(device, anchor_versions),
        "rows": [],
    }
    started = time.perf_counter()
    result["link"] = measure_link(device)
    _write(out, result)
    runner = Runner(workload, steps, warmup, tiny_run, anchor_steps, anchor_warmup)
    result["env"]["lora_impl"] = runner.bench.lora
    if os.environ.get(GC_FREEZE_VARIABLE) == "1":
        # An experiment, not a default: every object alive now (model, libraries) leaves the collector's view, so a
        # full collection walks only what the steps create.
        gc.collect()
        gc.freeze()
    result["env"]["gc_frozen"] = gc.get_freeze_count()
    result["setup_s"] = time.perf_counter() - started
    pool_released = False
    for name in modes:
        if MODES[name].group == "anchor" and not pool_released:
            release_host_memory()  # our pinned pool makes way for the anchors' own pinned memory
            pool_released = True
        mode_start = time.perf_counter()
        row = runner.run(MODES[name])
        row["wall_s"] = time.perf_counter() - mode_start
        result["rows"].append(row)
        print(_progress(workload.name, row), flush=True)
        _write(out, result)
    runner.run_capped_references(result["rows"], lambda: _write(out, result))
    release_host_memory()
    result["wall_s"] = time.perf_counter() - started
    _write(out, result)
    return result


def _progress(workload: str, row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"[{workload}] {row['mode']}: {row['status']}"
    peak = row.get("peak_alloc_gib")
    peak_text = f", peak {peak:.1f} GiB" if peak is not None else ""
    return f"[{workload}] {row['mode']}: {row['step_s']:.3f} s{peak_text} ({row['wall_s']:.0f} s wall)"


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--modes", required=True, help="comma-separated mode names")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--anchor-steps", type=int, default=None, help="timed steps of anchor modes (default: --steps)")
    parser.add_argument("--anchor-warmup", type=int, default=None, help="warm-up steps of anchors (default: --warmup)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    anchors.prepare_process()
    # Deprecation notices of the libraries would bury the progress lines in the lead's 12k-character log tail.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    modes = worker_modes(parser, args.modes)
    run_workload(
        args.workload, modes, args.steps, args.warmup, args.tiny, args.out, args.anchor_steps, args.anchor_warmup
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
