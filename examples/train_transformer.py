"""Train a decoder-only transformer with and without activation offloading, and compare their memory.

On a GPU this trains the demo transformer (``examples/demo_model.py``) on synthetic tokens twice, once with
``ActivationOffloadCallback(mode="off")`` (nothing offloaded; the callback only measures) and once with a memory
budget of half that run's peak (``--memory-budget-gib`` to choose), and prints the plan the callback chose, the peak
allocated memory and the median step time of each, and both runs' losses per step side by side. Without a GPU it runs
a short smoke test on the CPU (``compute_device="cpu"``) and prints the GiB offloaded per step instead, since CUDA
peaks do not exist there.

Examples::

    python examples/train_transformer.py                          # GPU if present, else a CPU smoke run
    python examples/train_transformer.py --memory-budget-gib 6    # fit the offloading run into 6 GiB
    python examples/train_transformer.py --checkpoint auto        # offloading plus checkpointing of the blocks
    python examples/train_transformer.py --max-offload-gib 4      # offload only the first 4 GiB of each forward
    python examples/train_transformer.py --memory-picture         # also draw one step's memory over time
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model import DemoTransformer, SyntheticTokens, parameter_count, quiet_lightning

from lightning_offload import ActivationOffloadCallback

GiB = 1 << 30
# GPU sizes: activations (~11 GiB) dominate the weights and AdamW state (~4 GiB), as in long-context fine-tuning.
GPU_SIZES = {"dim": 1024, "layers": 16, "heads": 16, "seq_len": 2048, "batch_size": 8, "vocab_size": 32000}
# CPU smoke sizes: a few seconds per run.
CPU_SIZES = {"dim": 64, "layers": 2, "heads": 4, "seq_len": 128, "batch_size": 4, "vocab_size": 256}


class StepTimer(pl.Callback):
    """Wall time and loss of every training batch, synchronizing the device around it (for the comparison only)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        _sync(pl_module.device)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        _sync(pl_module.device)
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))

    def median(self, warmup: int) -> float:
        times = self.times[warmup:] or self.times
        return statistics.median(times) if times else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU smoke test even when a GPU is present")
    parser.add_argument("--fast", action="store_true", help="fused (non-deterministic) kernels: losses may differ")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (GPU 12, CPU 4)")
    parser.add_argument("--mode", choices=["streamed", "sync"], default="streamed", help="offloading mode")
    parser.add_argument("--checkpoint", default=None, help="also checkpoint blocks: 'auto' or a class name")
    parser.add_argument("--max-offload-gib", type=float, default=None, help="offload at most this much per forward")
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="memory budget of the offloading run, on a GPU only (default: half)",
    )
    parser.add_argument("--memory-picture", action="store_true", help="draw one step's memory into the log folder")
    parser.add_argument("--precision", default=None, help="Trainer precision (GPU default bf16-mixed)")
    parser.add_argument("--log-dir", default="lightning_logs", help="where CSV logs (and the picture) go")
    for name, default in GPU_SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"GPU default {default}")
    return parser.parse_args(argv)


def run(
    args: argparse.Namespace, sizes: dict[str, int], steps: int, gpu: bool, offload: bool, budget_gib: float = 0.0
) -> tuple[dict[str, float], StepTimer]:
    """One fit; returns the callback's epoch summaries and the per-step times and losses."""
    pl.seed_everything(0, verbose=False)
    model = DemoTransformer(
        vocab_size=sizes["vocab_size"],
        dim=sizes["dim"],
        layers=sizes["layers"],
        heads=sizes["heads"],
        max_seq_len=sizes["seq_len"],
    )
    data = SyntheticTokens(
        vocab_size=sizes["vocab_size"],
        seq_len=sizes["seq_len"] + 1,
        batch_size=sizes["batch_size"],
        num_samples=sizes["batch_size"] * steps,
    )
    options: dict[str, Any] = {"mode": args.mode if offload else "off", "checkpoint": args.checkpoint}
    if args.max_offload_gib is not None:
        options["max_offload_bytes"] = int(args.max_offload_gib * GiB)
    elif offload and gpu:
        options["memory_budget"] = int(budget_gib * GiB)
    if not gpu:
        # The smoke model's activations are tiny: offload everything above 16 KiB, with no resident tail (no budget:
        # the CPU has no allocator counters to plan with).
        options.update(compute_device="cpu", min_tensor_bytes=16 << 10, resident_tail_bytes=0, memory_budget=None)
    if offload and args.memory_picture:
        options.update(memory_picture=True)
    callback = ActivationOffloadCallback(**options)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1,
        precision=args.precision or ("bf16-mixed" if gpu else "32-true"),
        logger=CSVLogger(args.log_dir, name="train_transformer_offload" if offload else "train_transformer_plain"),
        callbacks=[callback, timer],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=data)
    summaries = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("offload/")}
    if callback._picture is not None and callback._picture.path is not None:
        print(f"memory picture: {callback._picture.path}")
    return summaries, timer


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run both trainings and print the comparison; returns each run's epoch summaries."""
    args = parse_args(argv)
    quiet_lightning()
    gpu = torch.cuda.is_available() and not args.cpu
    if gpu and not args.fast:
        deterministic_kernels()
    sizes = dict(GPU_SIZES if gpu else CPU_SIZES)
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    steps = args.steps or (12 if gpu else 4)
    where = torch.cuda.get_device_name() if gpu else "CPU (smoke run: compute_device='cpu')"
    probe = DemoTransformer(sizes["vocab_size"], sizes["dim"], sizes["layers"], sizes["heads"], sizes["seq_len"])
    print(
        f"{where}: decoder-only transformer, {parameter_count(probe)} parameters, dim {sizes['dim']}, "
        f"{sizes['layers']} layers, batch {sizes['batch_size']} x {sizes['seq_len']} tokens, {steps} steps"
    )
    del probe
    results: dict[str, dict[str, float]] = {}
    timers: dict[str, StepTimer] = {}
    results["without offloading"], timers["without offloading"] = run(args, sizes, steps, gpu, False)
    # The question a user asks: make it fit in less memory. Without a budget given, ask for half the plain peak.
    plain_peak = results["without offloading"].get("offload/peak_allocated_gib_epoch_max", 0.0)
    budget = args.memory_budget_gib or plain_peak / 2
    label = f"offloading ({args.mode})"
    if gpu and args.max_offload_gib is None:
        print(
            f"memory_budget={budget:.2f} GiB (half the plain peak of {plain_peak:.2f} GiB unless --memory-budget-gib)"
        )
        _show_plans()
    results[label], timers[label] = run(args, sizes, steps, gpu, True, budget)
    times = {label: timer.median(warmup=2) for label, timer in timers.items()}
    print()
    if gpu:
        print(f"{'':24s} {'peak allocated':>15s} {'step time':>10s} {'offloaded/step':>15s}")
        for label, summary in results.items():
            peak = summary.get("offload/peak_allocated_gib_epoch_max", float("nan"))
            offloaded = summary.get("offload/offloaded_gib_epoch_mean", 0.0)
            print(f"{label:24s} {peak:12.2f} GiB {times[label]:8.3f} s {offloaded:11.2f} GiB")
        base, off = (results[k].get("offload/peak_allocated_gib_epoch_max") for k in results)
        if base and off:
            print(f"\npeak memory {off:.2f} GiB instead of {base:.2f} GiB ({1 - off / base:.0%} less)")
    else:
        print("CUDA peaks do not exist on the CPU; the offloaded bytes per step show that the engine ran.")
        for label, summary in results.items():
            offloaded = summary.get("offload/offloaded_gib_epoch_mean", 0.0)
            print(f"{label:24s} offloaded {offloaded:.4f} GiB per step, step time {times[label]:.3f} s")
    print_losses(timers)
    return results


def deterministic_kernels() -> None:
    """Kernels that give the same bits every run, so the two runs' losses can be compared digit for digit.

    cuBLAS with a fixed workspace, deterministic index kernels, and the math attention kernel (the fused ones
    accumulate with atomics). Slower, and attention then saves its probabilities: ``--fast`` skips this.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def _show_plans() -> None:
    """Print the planner's plan lines (logged at INFO on the ``lightning_offload`` logger)."""
    logger = logging.getLogger("lightning_offload")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("plan: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def print_losses(timers: dict[str, StepTimer]) -> None:
    """The two runs' losses per step, side by side: offloading must not change a single step."""
    (plain_label, plain), (off_label, off) = timers.items()
    print(f"\n{'step':>4s} {'loss ' + plain_label:>28s} {'loss ' + off_label:>28s}")
    for step, (a, b) in enumerate(zip(plain.losses, off.losses, strict=True)):
        print(f"{step:4d} {a:28.6f} {b:28.6f}")
    same = [f"{a:.6f}" for a in plain.losses] == [f"{b:.6f}" for b in off.losses]
    print(f"losses equal to the printed precision: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
