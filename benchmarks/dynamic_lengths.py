"""Inputs whose length changes every step (padding to each batch's longest) under a memory budget, on one GPU.

Arms: ``none`` (no engine: the pace to match where the model fits), ``input_changed`` (what the callback does:
``input_changed(shape)`` before every step, so each new length is measured once and a length met before runs its own
plan), ``replan_every_change`` (the behaviour before it: ``replan()`` at every change of shape, so every step measures)
and ``fixed`` (every step at the lengths' median: the pace a run of one length reaches). The small-vocab capacity model
under a 6 GiB budget (``BUDGET=auto``: the default budget, under which the model fits); lengths drawn from
``low``-``high`` in steps of ``step`` tokens. Per step: whether it measured, whether a plan was under trial, the host
time to queue forward, GiB offloaded, new host buffers pinned, the plan. With ``CAP=1`` the process is capped at the
budget (``torch.cuda.set_per_process_memory_fraction``) and a step that runs out of memory is counted and skipped. Run
one arm per process (the host pool is the process's)::

    python -m benchmarks.dynamic_lengths out.json input_changed [steps low high step]
    CAP=1 python -m benchmarks.dynamic_lengths out.json replan_every_change 32 8192 16384 2048
    BUDGET=auto python -m benchmarks.dynamic_lengths out.json none 48 8192 16384 512

``LEND=0``: the host pool never serves a request from a larger idle buffer (as before it could). ``LEND_PLANS=0``: a
new input is never lent the plan of a larger one that keeps everything (it measures instead).
"""

import contextlib
import json
import os
import random
import statistics
import sys
import time

import torch

from benchmarks.models import build
from benchmarks.workloads import CAPACITY_MODELS, tiny
from lightning_offload import offload_activations

out, arms = sys.argv[1], sys.argv[2].split(",")
steps, low, high, step = (int(v) for v in sys.argv[3:7]) if len(sys.argv) > 3 else (24, 8192, 16384, 512)
# ``DEVICE=cpu``: the tiny model on the CPU (the loop and its bookkeeping, for tests; no memory counters there).
device = torch.device(os.environ.get("DEVICE", "cuda"))
cuda = device.type == "cuda"
budget = os.environ.get("BUDGET", "6GiB")
capped = os.environ.get("CAP") == "1"
if os.environ.get("LEND") == "0":  # the host pool as it was: no request served by a larger idle buffer
    from lightning_offload.host_pool import HostPool

    HostPool._larger_to_lend = lambda self, cls, limit: None  # type: ignore[method-assign]
if os.environ.get("LEND_PLANS") == "0":  # a new input measures even where a larger one's plan keeps everything
    from lightning_offload.planner.book import InputBook

    InputBook.lend = lambda self, key: None  # type: ignore[method-assign]
if capped and cuda:
    if budget == "auto":
        raise SystemExit("CAP=1 caps the process at the budget: give BUDGET in GiB (e.g. 6GiB)")
    fraction = float(budget.removesuffix("GiB")) * 2**30 / torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction)
rng = random.Random(0)
drawn = [rng.randrange(low, high + 1, step) for _ in range(steps)]
workload = CAPACITY_MODELS["smallvocab-h1024"]
bench = build(workload if cuda else tiny(workload), device, max_seq=high)
vocab = 256
results = {"lengths": drawn, "budget": budget}
for arm in arms:
    if cuda:
        torch.cuda.empty_cache()
    model = bench.module
    lengths = [int(statistics.median_low(drawn))] * steps if arm == "fixed" else drawn
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    off = None if arm == "none" else offload_activations(model=model, memory_budget=budget, compute_device=device.type)
    measured, trying, times, previous, info, ooms, step_peaks, forward_host = [], [], [], None, [], 0, [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), device=device)
        if off is None:
            pass
        elif arm == "replan_every_change" and previous is not None and n != previous:
            off.replan()
        elif arm != "replan_every_change":
            off.input_changed(tuple(ids.shape))
        previous = n
        if cuda:
            torch.cuda.synchronize()
        start, queued = time.perf_counter(), float("nan")
        try:
            with off if off is not None else contextlib.nullcontext():
                # (No planner on the CPU: the allocator's counters it plans from are CUDA's.)
                measured.append(off is not None and off.planner is not None and off.planner.measuring)
                # Read as the step runs: after it, the planner has chosen the next step's plan (trials may have ended).
                trying.append(off is not None and off.planner is not None and off.planner.trying)
                loss = bench.loss(ids)
            # Host time to queue forward (no sync): where it nears the step's time, the host held the device up
            # (hooks, a synchronization inside forward).
            queued = time.perf_counter() - start
            loss.backward()
            optimizer.step()
        except torch.OutOfMemoryError:
            ooms += 1
            loss = None
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        forward_host.append(queued)
        # One line a step as it ends: a run cut short by a time limit still tells how far it got.
        print(
            f"{arm} step {len(times)} length {n} measuring {measured[-1]} trying {trying[-1]} {times[-1]:.3f} s",
            flush=True,
        )
        # The step's own peaks: the planner resets the counters as each of its steps begins, so the process's
        # maximum read after the last step would be the last step's alone.
        step_peaks.append((torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()) if cuda else (0, 0))
        if off is None:
            info.append({"trying": False, "offload_gib": 0.0, "new_host_buffers": 0, "pinned_gib": 0.0, "plan": None})
            continue
        stats, planner = off.collect_stats(wait=True), off.planner
        plan = planner.plan if planner is not None else None
        info.append(
            {
                "trying": trying[-1],
                "offload_gib": round(stats.offloaded_bytes / 2**30, 2),
                "new_host_buffers": stats.host_allocations,
                "pinned_gib": round(stats.host_pinned_bytes / 2**30, 2),
                "plan": None
                if plan is None
                else [plan.checkpoint_blocks, round(plan.offload_bytes / 2**30, 2), plan.split],
            }
        )
    if off is not None:
        off.close()
    del optimizer
    later = times[4:]
    results[arm] = {
        "lengths": lengths,
        "capped": capped,
        "out_of_memory_steps": ooms,
        "measuring_steps": sum(measured),
        "trial_steps": sum(trying),
        "measured": measured,
        "info": info,
        "step_s": times,
        "forward_host_s": forward_host,
        "total_s": sum(times),
        "median_s_after_4": statistics.median(later),
        "tokens_per_s": sum(lengths) / sum(times),
        "peak_reserved_gib": max(r for r, _ in step_peaks) / 2**30,
        "peak_alloc_gib": max(a for _, a in step_peaks) / 2**30,
        "step_peaks_gib": [[round(r / 2**30, 2), round(a / 2**30, 2)] for r, a in step_peaks],
    }
json.dump(results, open(out, "w"), indent=1)
for arm in arms:
    print(arm)
    r = results[arm]
    for n, m, t, q, i in zip(r["lengths"], r["measured"], r["step_s"], r["forward_host_s"], r["info"], strict=True):
        flags = f"{'M' if m else ' '} {'T' if i['trying'] else ' '}"
        print(
            f"  {n:6d} {flags} {t:6.2f} s (forward queued {q:5.3f}) off {i['offload_gib']:5.2f}"
            f" new {i['new_host_buffers']:3d}"
            f" pinned {i['pinned_gib']:6.2f} plan {i['plan']}"
        )
print(f"lengths {lengths}")
print(f"{'arm':22s} measuring  trial  share  total_s  median_s(>4)  tok/s   reserved/alloc GiB  OOM (capped: {capped})")
for arm in arms:
    r = results[arm]
    print(
        f"{arm:22s} {r['measuring_steps']:9d} {r['trial_steps']:6d}"
        f" {(r['measuring_steps'] + r['trial_steps']) / len(r['lengths']):6.1%}"
        f" {r['total_s']:8.2f} {r['median_s_after_4']:13.3f}"
        f" {r['tokens_per_s']:6.0f}"
        f"  {r['peak_reserved_gib']:.2f}/{r['peak_alloc_gib']:.2f}  {r['out_of_memory_steps']}"
    )
