"""Capacity under a hard memory cap: the longest sequence each mode trains (``python -m benchmarks --capacity``).

One worker process per (model, cap): ``torch.cuda.set_per_process_memory_fraction(cap / total)`` is set once,
before the model is built, so the cap bounds everything the process reserves, weights included. In it, each mode
searches (:mod:`benchmarks.search`) the longest batch-1 sequence, in steps of 2048 tokens, that trains
``--steps`` (3) steps without running out of memory, and records tokens/s there.

Probes of one search run in the same process, one after the other, after ``torch.cuda.empty_cache()``: building
the model again for every probe would cost more than most probes (10-30 s for 8B) and would not change what fits,
because an OOM inside a step leaves nothing behind once the step's frames are gone and the optimizer, gradients
and the engine's buffers are dropped (which each probe does). That is checked rather than assumed: after a failed
probe the allocated bytes must be back at what they were before it; if they are not (an anchor's hooks holding
tensors, say), the worker saves its state and exits with :data:`RESTART_CODE`, and the parent starts a fresh
process that continues the same search from the saved bracket.

Without CUDA (``--tiny`` on a CPU) nothing can run out of memory, so whether a probe "fits" is decided by a
memory formula of the mode (:func:`simulated_peak_bytes`) against the cap scaled down by :data:`TINY_CAP_SCALE`;
the training steps still run for real (and are timed). Such results say ``"simulated": true`` and the report says
they are not measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks import anchors, models, search
from benchmarks.worker import allocator_segments
from benchmarks.workloads import CAPACITY_MODELS, CAPACITY_STEP, MODES, Mode, Workload, tiny, worker_modes

GiB = 1 << 30
MiB = 1 << 20
RESTART_CODE = 3
# After a failed probe, allocated memory may exceed what it was before by this much (allocator rounding) before
# the process counts as polluted and is restarted.
LEAK_TOLERANCE_BYTES = 64 * MiB
# --tiny: caps in GiB become this many times smaller, and the sequence grows in smaller steps up to a shorter
# maximum, so the simulated capacities of the tiny models land in a range a CPU trains in seconds.
TINY_CAP_SCALE = 8192
TINY_STEP = 128
TINY_MAX_SEQ = 2048


# ---------------------------------------------------------------------------------------------- simulation (CPU)


def simulated_peak_bytes(workload: Workload, mode: str, seq: int, trainable_params: int, params: int) -> float:
    """Peak device bytes of ``mode`` at ``seq`` by formula (bf16), for the CPU's stand-in of an OOM.

    Per token and decoder layer ~(12 h + 4 h_kv + 8 f) x 1.18 bytes are saved; checkpointing keeps 2 h per layer
    plus one layer's worth during its recompute; whole-model offloaders keep about two layers' worth; the logits
    cost ~10 bytes per vocabulary entry (bf16, fp32 copy, fp32 gradient). Weights, gradients and AdamW state
    (bf16) are fixed.
    """
    h, f, kv = workload.hidden, workload.intermediate, workload.hidden * workload.kv_heads // workload.heads
    layer = (12 * h + 4 * kv + 8 * f) * 1.18
    logits = 10 * workload.vocab
    per_token = {
        "none": workload.layers * layer,
        "ac": workload.layers * 2 * h + layer,
        "ours-budget": 2 * h + layer,
    }.get(mode, 2 * layer)
    return 2 * params + 6 * trainable_params + seq * (per_token + logits)


# ---------------------------------------------------------------------------------------------- the worker


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_budget_available() -> bool:
    from benchmarks.worker import memory_budget_available as available

    return available()


class CapacityWorker:
    """Searches the capacity of every mode of one model under one cap, in this process.

    Args:
        workload: the model (its ``batch`` is 1; its ``seq`` is ignored).
        cap_gib: the cap, GiB of device memory (``--tiny`` on a CPU: scaled by :data:`TINY_CAP_SCALE`).
        steps: training steps per probe.
        step: the sequence grows in multiples of this.
        max_seq: the longest sequence tried.
        tiny_run: shrink the model (``--tiny``).
    """

    def __init__(self, workload: Workload, cap_gib: float, steps: int, step: int, max_seq: int, tiny_run: bool) -> None:
        self.workload = tiny(workload) if tiny_run else workload
        self.steps = steps
        self.step = step
        self.max_seq = max_seq
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.simulated = not self.cuda
        self.cap_bytes = cap_gib * GiB / (TINY_CAP_SCALE if self.simulated else 1)
        if self.cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            # Before anything is allocated: the cap bounds the whole process, weights included.
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / total), self.device)
        torch.manual_seed(0)
        self.bench = models.build(self.workload, self.device, max_seq=max_seq)
        self.params = sum(p.numel() for p in self.bench.module.parameters())
        self.trainable_params = sum(p.numel() for _, p in self.bench.trainable())
        self.generator = torch.Generator().manual_seed(1234)
        _free(self.device)
        self.baseline_bytes = float(torch.cuda.memory_reserved(self.device)) if self.cuda else None
        self.leaked_bytes = 0.0

    # ---------------------------------------------------------------- one mode

    @contextlib.contextmanager
    def mode_context(self, mode: Mode) -> Iterator[tuple[Callable[[], Any], Any]]:
        """Set the mode up for a whole search (engine pool and anchors reused across probes), tear down after."""
        from benchmarks.worker import _hooks_restored

        with contextlib.ExitStack() as stack:
            stack.enter_context(_hooks_restored(self.bench.module))
            if mode.checkpoint == "hf":
                self.bench.enable_ac()
                stack.callback(self.bench.disable_ac)
            engine = None
            if mode.anchor == "save_on_cpu":
                context = anchors.save_on_cpu()
            elif mode.anchor == "torchtune":
                context = anchors.torchtune(self.bench.module)
            elif mode.anchor == "trl":
                context = anchors.trl(self.bench.module)
            elif mode.budget == "cap":
                from lightning_offload import offload_activations

                engine = offload_activations(
                    memory_budget=int(self.cap_bytes),
                    compute_device=None if self.cuda else "cpu",
                    model=self.bench.module,
                )
                context = lambda: engine  # noqa: E731
                stack.callback(engine.close)  # the planner's checkpointing must not reach the next mode
            else:
                context = contextlib.nullcontext
            yield context, engine

    def probe(self, mode: Mode, context: Callable[[], Any], engine: Any, seq: int) -> search.Probe:
        """Train ``steps`` steps at ``seq`` tokens; report whether it fitted, its peak and its step time."""
        started = time.perf_counter()
        if self.simulated:
            peak = simulated_peak_bytes(self.workload, mode.name, seq, self.trainable_params, self.params)
            if peak > self.cap_bytes:
                return search.Probe(seq, False, wall_s=time.perf_counter() - started, note="simulated OOM")
        _free(self.device)
        if engine is not None:
            # A new sequence length: the memory-budget planner must measure it (the callback does this by itself when
            # the input's shape changes; the context manager is told). Without it, probes after the first ran on the
            # plan of a shorter sequence (results before 2026-12-01 second session: ours-budget 4096 tokens). Two
            # measuring steps: each probe's optimizer is new, and allocates its state in its first step.
            engine.replan(measuring_steps=2)
        allocated_before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        ids = torch.randint(0, self.workload.vocab, (1, seq), generator=self.generator).to(self.device)
        params = [p for _, p in self.bench.trainable()]
        optimizer = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if self.cuda else {}))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        times: list[float] = []
        settled: list[float] = []  # ours: steps that ran the plan kept (not measuring, not under trial)
        peaks = [0.0, 0.0]  # reserved, allocated: the most of any step (a planner resets the counters at each)
        note = ""
        try:
            for index in range(self.steps):
                times.append(self.bench.timed_step(context(), optimizer, ids))
                if self.cuda:
                    peaks[0] = max(peaks[0], float(torch.cuda.max_memory_reserved(self.device)))
                    peaks[1] = max(peaks[1], float(torch.cuda.max_memory_allocated(self.device)))
                planner = getattr(engine, "planner", None)
                if planner is not None and index >= 2 and not planner.trying:
                    settled.append(times[-1])
        except torch.cuda.OutOfMemoryError:
            note = "OOM"
        except RuntimeError as err:
            # Pinned host memory running out (an anchor's or ours) surfaces as a plain RuntimeError.
            if "out of memory" not in str(err).lower():
                raise
            note = f"OOM: {str(err).splitlines()[0][:200]}"
        finally:
            del optimizer
            self.bench.module.zero_grad(set_to_none=True)
        fits = not note
        if not fits and engine is not None:
            engine.reset()  # drops host buffers the failed step still referenced
        del ids
        _free(self.device)
        result = search.Probe(seq, fits, wall_s=time.perf_counter() - started, note=note)
        planner = getattr(engine, "planner", None)
        if planner is not None and planner.plan is not None and planner.profile is not None:
            # Chosen from this length's measuring steps (the profile is dropped at every new length).
            result.plan = asdict(planner.plan)
        if fits:
            # After the first step (allocations, warm-up); ours: the plan kept after its measuring steps and trials
            # (when the probe ran that long).
            result.step_s = statistics.median(settled or times[2 if engine is not None else 1 :] or times)
            if self.cuda:
                result.peak_bytes, result.peak_alloc_bytes = peaks
            else:
                result.peak_bytes = simulated_peak_bytes(
                    self.workload, mode.name, seq, self.trainable_params, self.params
                )
        elif self.cuda:
            self.leaked_bytes = max(0.0, float(torch.cuda.memory_allocated(self.device) - allocated_before))
        return result


def run_worker(
    model: str,
    cap_gib: float,
    modes: list[str],
    steps: int,
    step: int,
    max_seq: int,
    tiny_run: bool,
    out: Path,
    deadline_at: float,
    starts: dict[str, int] | None = None,
) -> int:
    """Search every mode of ``model`` under ``cap_gib``; rewrite ``out`` after every probe.

    A state already in ``out`` (a previous worker for the same model and cap that exited to be restarted) is
    continued: finished searches are kept, the unfinished one goes on from its bracket.

    Returns:
        0, or :data:`RESTART_CODE` when a failed probe left memory behind and the rest needs a fresh process.
    """
    from benchmarks.worker import environment

    starts = starts or {}
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    result.setdefault("model", (tiny(CAPACITY_MODELS[model]) if tiny_run else CAPACITY_MODELS[model]).as_dict())
    result.update(cap_gib=cap_gib, tiny=tiny_run, steps=steps, step=step, max_seq=max_seq)
    result.setdefault("searches", [])
    result["restarts"] = result.get("restarts", -1) + 1
    done = {s["mode"]: s for s in result["searches"]}
    anchor_versions = anchors.versions()
    anchors.hide_old_torchao()
    started = time.perf_counter()
    try:
        worker = CapacityWorker(CAPACITY_MODELS[model], cap_gib, steps, step, max_seq, tiny_run)
    except torch.cuda.OutOfMemoryError:
        result["error"] = f"the model does not fit under {cap_gib} GiB"
        _write(out, result)
        return 0
    device = worker.device
    result["env"] = environment(device, anchor_versions)
    result["env"]["lora_impl"] = worker.bench.lora
    result["simulated"] = worker.simulated
    result["cap_bytes"] = worker.cap_bytes
    result["baseline_gib"] = worker.baseline_bytes / GiB if worker.baseline_bytes is not None else None
    result["setup_s"] = time.perf_counter() - started
    _write(out, result)
    for name in modes:
        entry = done.get(name)
        if entry is not None and entry.get("status") != "running":
            continue
        if entry is None:
            entry = {"mode": name, "status": "running"}
            result["searches"].append(entry)
        label = f"[{model} @ {cap_gib} GiB] {name}"
        restart = _search_mode(worker, MODES[name], entry, lambda: _write(out, result), label, deadline_at, starts)
        _write(out, result)
        if restart:  # the next probe would run in a process a failed probe polluted
            return RESTART_CODE
    result["wall_s"] = result.get("wall_s", 0.0) + time.perf_counter() - started
    _write(out, result)
    return 0


def _search_mode(
    worker: CapacityWorker,
    mode: Mode,
    entry: dict[str, Any],
    save: Callable[[], None],
    label: str,
    deadline_at: float,
    starts: dict[str, int],
) -> bool:
    """Search one mode's capacity into ``entry`` (continuing the bracket it holds); ``True``: restart the process."""
    status = _unavailable(mode, worker)
    if status:
        entry.clear()
        entry.update(mode=mode.name, status=status)
        print(f"{label}: {status}", flush=True)
        return False
    state = (
        search.SearchState.from_dict(entry) if entry.get("probes") else search.SearchState(worker.step, worker.max_seq)
    )
    polluted = False

    def on_probe(current: search.SearchState) -> None:
        entry.update(current.as_dict())
        probe = current.probes[-1]
        peak = f", peak reserved {probe.peak_bytes / GiB:.2f} GiB" if probe.peak_bytes else ""
        verdict = "fits" if probe.fits else f"no ({probe.note})"
        print(f"{label} seq {probe.seq}: {verdict}{peak}, {probe.wall_s:.1f} s", flush=True)
        save()

    try:
        with worker.mode_context(mode) as (context, engine):

            def probe(seq: int) -> search.Probe:
                nonlocal polluted
                if polluted:
                    raise _Restart
                # Saved first: if the process dies in this probe (pinned host memory exhausted, the kernel's OOM
                # killer), the parent counts it as not fitting and continues in a fresh process.
                entry["pending"] = seq
                save()
                outcome = worker.probe(mode, context, engine, seq)
                entry.pop("pending", None)
                if not outcome.fits and worker.leaked_bytes > LEAK_TOLERANCE_BYTES:
                    outcome.note += f"; {worker.leaked_bytes / MiB:.0f} MiB left allocated: fresh process"
                    polluted = True
                return outcome

            search.run_search(
                probe,
                state,
                start=max(worker.step, starts.get(mode.name, 0) + worker.step),
                cap_bytes=worker.cap_bytes,
                baseline_bytes=worker.baseline_bytes,
                time_left=lambda: deadline_at - time.time(),
                on_probe=on_probe,
            )
    except anchors.AnchorUnavailable as err:
        entry.clear()
        entry.update(mode=mode.name, status=f"not available: {err}"[:500])
        print(f"{label}: {entry['status']}", flush=True)
        return False
    except _Restart:
        entry.update(state.as_dict(), status="running")
        return True
    except Exception as err:
        traceback.print_exc()
        entry.update(state.as_dict(), status=f"error: {type(err).__name__}: {err}"[:500])
        return False
    entry.update(state.as_dict(), status="ok" if state.complete else f"incomplete: {state.stopped}")
    if worker.cuda:
        entry["allocator"] = allocator_segments()
    _finish(entry, state)
    return polluted


class _Restart(Exception):
    """A failed probe left memory allocated: the search continues in a fresh process."""


def _count_crash_as_no_fit(path: Path, code: int) -> bool:
    """After a worker died inside a probe, record that probe as not fitting; ``True`` if there was one.

    A process that dies while training at some length (the kernel killing it when pinned host memory runs out,
    typically) did not train at that length: for the capacity of this machine, that length does not fit.
    """
    if not path.exists():
        return False
    result = json.loads(path.read_text())
    for entry in result.get("searches", []):
        seq = entry.pop("pending", None)
        if seq is None:
            continue
        note = f"the worker died in this probe (exit code {code}): counted as not fitting"
        entry.setdefault("probes", []).append(asdict(search.Probe(seq, False, note=note)))
        entry.setdefault("step", result.get("step"))
        entry.setdefault("max_seq", result.get("max_seq"))
        _write(path, result)
        print(f"[{result['model']['name']} @ {result.get('cap_gib')} GiB] {entry['mode']} seq {seq}: {note}")
        return True
    return False


def _unavailable(mode: Mode, worker: CapacityWorker) -> str:
    if mode.budget == "cap" and not memory_budget_available():
        return "not measured: memory_budget not available"
    if mode.needs_cuda and not worker.cuda:
        return "skipped: needs CUDA"
    return ""


def _finish(entry: dict[str, Any], state: search.SearchState) -> None:
    """Tokens/s and peaks at the longest sequence that fitted."""
    best = state.best_probe()
    if best is None:
        return
    entry["step_s"] = best.step_s
    entry["tokens_per_s"] = best.seq / best.step_s if best.step_s else None
    entry["peak_reserved_gib"] = best.peak_bytes / GiB if best.peak_bytes is not None else None
    entry["peak_alloc_gib"] = best.peak_alloc_bytes / GiB if best.peak_alloc_bytes is not None else None


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- the parent's side

MAX_RESTARTS = 3
_KILL_MARGIN_S = 10.0  # the parent kills a worker this long before the deadline, to write the report in time
_STOP_MARGIN_S = 25.0  # workers stop starting probes this long before it
_MIN_WORKER_S = 45.0  # less time than this left: the next (model, cap) is skipped (a model build alone takes ~20 s)


def drive(
    models_: list[str],
    caps: dict[str, list[float]],
    modes: list[str],
    steps: int,
    step: int,
    max_seq: dict[str, int],
    tiny_run: bool,
    scratch: Path,
    deadline_at: float,
    env: dict[str, str],
    first: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Run one worker per (model, cap), each model's caps ascending; return their results (partial ones included).

    ``first`` names where a mode's search starts at a model's smallest cap (its first probe), in place of ``step``.

    A mode's longest sequence at one cap is where its search starts at the next (more memory never fits less), so
    the larger caps skip the growth phase. A worker that exits with :data:`RESTART_CODE` is started again on the
    same file, up to :data:`MAX_RESTARTS` times.
    """
    import subprocess

    results = []
    for model in models_:
        # a worker starts one step above what it is given: one below the first probe asked for
        longest: dict[str, int] = {mode: max(0, seq - step) for mode, seq in (first or {}).items()}
        for cap in sorted(caps[model]):
            path = scratch / f"{model}.{cap:g}.json"
            base = (tiny(CAPACITY_MODELS[model]) if tiny_run else CAPACITY_MODELS[model]).as_dict()
            error = None
            for _ in range(MAX_RESTARTS + 1):
                left = deadline_at - time.time()
                if left < _MIN_WORKER_S:
                    error = "skipped: deadline" if not path.exists() else "stopped: deadline"
                    break
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.capacity",
                    f"--model={model}",
                    f"--cap-gib={cap:g}",
                    f"--modes={','.join(modes)}",
                    f"--steps={steps}",
                    f"--step={step}",
                    f"--max-seq={max_seq[model]}",
                    f"--out={path}",
                    f"--deadline-at={deadline_at - _STOP_MARGIN_S}",
                    f"--starts={json.dumps(longest)}",
                ] + (["--tiny"] if tiny_run else [])
                print(f"=== capacity {model} @ {cap:g} GiB", flush=True)
                try:
                    code = subprocess.run(command, env=env, timeout=left - _KILL_MARGIN_S, check=False).returncode
                except subprocess.TimeoutExpired:
                    error = "worker killed at the deadline"
                    break
                if code == RESTART_CODE:
                    continue
                if code != 0 and _count_crash_as_no_fit(path, code):
                    continue
                if code != 0:
                    error = f"worker exited with code {code}"
                break
            result = json.loads(path.read_text()) if path.exists() else {"model": base, "cap_gib": cap, "searches": []}
            result.setdefault("cap_gib", cap)
            for entry in result.get("searches", []):
                entry.pop("pending", None)  # a probe cut off by the deadline: no answer either way
                if entry.get("status") == "running":
                    entry["status"] = f"incomplete: {error or 'restarts exhausted'}"
                if entry.get("longest"):
                    longest[entry["mode"]] = max(longest.get(entry["mode"], 0), entry["longest"])
            if error:
                result["error"] = error
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(CAPACITY_MODELS))
    parser.add_argument("--cap-gib", type=float, required=True)
    parser.add_argument("--modes", required=True, help="comma-separated mode names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step", type=int, default=CAPACITY_STEP)
    parser.add_argument("--max-seq", type=int, required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write (and to continue from)")
    parser.add_argument("--deadline-at", type=float, required=True, help="wall-clock time (epoch s) to stop by")
    parser.add_argument("--starts", default="{}", help="JSON {mode: longest at a smaller cap}: searches start above")
    args = parser.parse_args(argv)
    anchors.prepare_process()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    modes = worker_modes(parser, args.modes)
    return run_worker(
        args.model,
        args.cap_gib,
        modes,
        args.steps,
        args.step,
        args.max_seq,
        args.tiny,
        args.out,
        args.deadline_at,
        json.loads(args.starts),
    )


if __name__ == "__main__":
    sys.exit(main())
