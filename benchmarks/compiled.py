"""Offloading a model compiled with ``torch.compile``: what it saves and costs, whole model against block by block.

A compiled graph hands autograd its saved tensors only as the graph returns (AOTAutograd saves them all at once), so
the saved-tensor hooks see a whole model's activations after its whole forward ran, where eager offloading moves each
one as it is saved. Compiling each decoder layer on its own (``layer.compile()``) hands them over at every layer's
end. This runs the small-vocab capacity model (activations dominate) three ways: ``eager``, ``whole``
(``model.compile()``) and ``blocks`` (every decoder layer compiled), each without the engine and with it offloading
everything eligible (``memory_budget=None``), then under a budget of ``BUDGET_SHARE`` of eager's peak (the planner).
Per arm: peak allocated GiB, median step seconds, GiB offloaded (a budget arm: the engine's warnings, or its error);
per compile mode: whether the gradients with the engine equal those without, bit for bit (same weights, same batch,
deterministic kernels, and whether two runs without it agree). One process::

    python -m benchmarks.compiled out.json [layers seq [hidden]]
    DEVICE=cpu python -m benchmarks.compiled out.json 2 256   # the loop on the CPU (aot_eager; no memory counters)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.models import BenchModel, build
from benchmarks.workloads import CAPACITY_MODELS
from lightning_offload import offload_activations

GiB = float(1 << 30)
BUDGET_SHARE = 0.6
WARMUP, TIMED = 3, 4


def _layers(bench: BenchModel) -> list[torch.nn.Module]:
    blocks = [m for m in bench.module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(blocks, key=len))


def _compile(bench: BenchModel, how: str, backend: str) -> None:
    """Compile ``bench``'s module in place as ``how`` says (``eager``: undo any compiling)."""
    targets = [bench.module, *_layers(bench)]
    for module in targets:
        module._compiled_call_impl = None  # (what nn.Module.compile sets; None runs the module's own forward)
    if how == "whole":
        bench.module.compile(backend=backend)
    elif how == "blocks":
        for layer in _layers(bench):
            layer.compile(backend=backend)


def _grads(bench: BenchModel, ids: torch.Tensor, engine: Any) -> list[torch.Tensor]:
    bench.module.zero_grad(set_to_none=True)
    with engine if engine is not None else contextlib.nullcontext():
        loss = bench.loss(ids)
    loss.backward()
    return [p.grad.detach().clone() for _, p in bench.trainable() if p.grad is not None]


def _run(bench: BenchModel, ids: torch.Tensor, engine: Any, device: torch.device) -> dict[str, Any]:
    optimizer = torch.optim.AdamW([p for _, p in bench.trainable()], lr=1e-6, foreach=False)
    context = engine if engine is not None else contextlib.nullcontext()
    steps, peaks, offloaded, plans = [], [], [], []
    for index in range(WARMUP + TIMED):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if engine is not None:
            engine.input_changed(tuple(ids.shape))
        wall = bench.timed_step(context, optimizer, ids)
        peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0
        plan = getattr(getattr(engine, "planner", None), "plan", None)
        plans.append(None if plan is None else [plan.checkpoint_blocks, round(plan.offload_bytes / GiB, 2)])
        peaks.append(round(peak, 3))
        offloaded.append(round(engine.stats.offloaded_bytes / GiB, 3) if engine is not None else 0.0)
        if index >= WARMUP:
            steps.append(wall)
    del optimizer
    return {
        "median_s": statistics.median(steps),
        "peak_gib": max(peaks[WARMUP:]),
        "offloaded_gib": offloaded[-1],
        "step_peaks_gib": peaks,
        "plans": plans,
    }


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic kernels (no atomics in embedding or attention backward, math attention), for the gradient
    comparisons only: the timed arms run the default kernels (flash attention), as training does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def main(argv: list[str]) -> int:
    out = argv[0]
    layers, seq = (int(v) for v in argv[1:3]) if len(argv) > 2 else (8, 8192)
    device = torch.device(os.environ.get("DEVICE", "cuda"))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (read as cuBLAS starts: deterministic products)
    workload = dataclasses.replace(CAPACITY_MODELS["smallvocab-h1024"], layers=layers, seq=seq)
    if len(argv) > 3:  # a narrower model of the same shape (a CPU check of the loop: a CI machine's cores are slow)
        hidden = int(argv[3])
        workload = dataclasses.replace(
            workload,
            hidden=hidden,
            intermediate=hidden * workload.intermediate // workload.hidden,
            heads=hidden // 64,
            kv_heads=max(1, hidden // 64 * workload.kv_heads // workload.heads),
        )
    torch.manual_seed(0)
    bench = build(workload, device)
    ids = torch.randint(0, workload.vocab, (1, seq), device=device)
    offload: dict[str, Any] = {"memory_budget": None}
    if device.type != "cuda":  # (a small model: nothing would leave past the resident tail)
        offload.update(compute_device="cpu", resident_tail_bytes=0, min_tensor_bytes=0)
    results: dict[str, Any] = {"workload": dataclasses.asdict(workload), "backend": backend, "arms": {}}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for how in ("eager", "whole", "blocks"):
        _compile(bench, how, backend)
        engine = offload_activations(model=bench.module, **offload)
        with _deterministic():
            without = _grads(bench, ids, None)  # (compiles, where it does)
            repeatable = _equal(without, _grads(bench, ids, None))  # else no comparison below can hold
            equal = _equal(without, _grads(bench, ids, engine))
        start = time.perf_counter()
        _grads(bench, ids, None)  # (compiles with the default kernels)
        compile_s = time.perf_counter() - start
        arms = {"none": _run(bench, ids, None, device), "offload": _run(bench, ids, engine, device)}
        engine.close()
        if device.type == "cuda":
            budget = int(BUDGET_SHARE * results["arms"].get("eager", arms)["none"]["peak_gib"] * GiB)
            planned = offload_activations(model=bench.module, memory_budget=budget, plan_trials=False)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    arms["budget"] = {**_run(bench, ids, planned, device), "budget_gib": budget / GiB}
                except Exception as error:
                    arms["budget"] = {"error": repr(error)[:500], "budget_gib": budget / GiB}
            arms["budget"]["warnings"] = [str(w.message)[:300] for w in said if "memory_budget" in str(w.message)]
            planned.close()
        results["arms"][how] = {**arms, "grads_equal": equal, "reference_repeatable": repeatable, "first_s": compile_s}
        for arm, row in arms.items():
            if "error" in row:
                print(f"COMPILED {how:6s} {arm:8s} {row['error']}", flush=True)
                continue
            print(
                f"COMPILED {how:6s} {arm:8s} peak {row['peak_gib']:7.2f} GiB  step {row['median_s'] * 1000:8.1f} ms  "
                f"offloaded {row['offloaded_gib']:6.2f} GiB  grads_equal {equal} (repeatable {repeatable})",
                flush=True,
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(out, "w") as f:  # after each mode: a run cut short keeps the modes it finished
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
