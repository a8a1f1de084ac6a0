"""A picture of one training step's memory over time, with offloading and (for comparison) without.

:class:`~lightning_offload.ActivationOffloadCallback` (``memory_picture=True``) records, once per fit, the memory of
one training batch at every module boundary: forward pre/post hooks on each submodule, a gradient hook on each
module output (so backward is sampled module by module too), the Lightning hook boundaries (batch start, before and
after backward, batch end). It then draws allocated memory against time with forward, backward and the optimizer
step marked, and below it the offloaded bytes the host holds and the device bytes whose copies are still in flight,
and writes a PNG into the logger's directory (and an image to TensorBoard when a TensorBoard logger is attached).

The recorded step is slow on purpose: on CUDA every sample synchronizes the device, so that the time stamps follow
the device and each memory figure belongs to its point in the step. Copies then finish sooner than in a normal
step, so the in-flight curve is a lower bound; memory figures are exact. On the CPU (``compute_device="cpu"``),
where CUDA figures do not exist, the process's resident set size stands in for allocated memory.

Only the global-zero process records; the others train as usual.

With ``snapshot=True`` (the callback's ``memory_snapshot=True``) the recorded offloading step is also captured by
the CUDA caching allocator's own history (``torch.cuda.memory._record_memory_history``) and written beside the PNG
as ``offload_memory_snapshot.pickle``, for PyTorch's memory viewer (``torch.cuda.memory._dump_snapshot``'s format:
every allocation and free of the step with its Python stack). Recording starts with a cleared history and is
switched off after the step. On any other device there is no allocator history: nothing is written, with one
warning.
"""

from __future__ import annotations

import inspect
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn

from lightning_offload.device_memory import read_counters
from lightning_offload.picture_drawing import Kind, Trace, draw, save

if TYPE_CHECKING:
    from lightning_offload.engine import OffloadEngine

__all__ = ["PICTURE_OPTION_DOCS", "MemoryPicture"]

# The callback's options for the picture, in the words its docstring (and ``--help``) shows.
PICTURE_OPTION_DOCS = """\
        memory_picture: once per fit, record one training step's memory over time and write it as
            ``offload_memory_picture.png`` into the logger's folder (and as an image to TensorBoard when a
            TensorBoard logger is attached): allocated memory against time with forward, backward and the optimizer
            step marked, the offloaded bytes the host holds and the bytes with a copy in flight. The second training
            batch is recorded (the first warms the host pool up); the recorded step synchronizes the device at every
            sample and so runs slower than the others. Needs matplotlib (checked here).
        memory_picture_compare: with ``memory_picture``, run the batch after the recorded one without offloading
            and draw it too, for comparison. That batch logs what it did (nothing offloaded, its peak without
            offloading) and is left out of the epoch summaries. It needs the memory offloading saves: turn this
            off when the model fits only with offloading. It is skipped with ``mode="off"``, gradient
            accumulation, manual optimization and LBFGS.
        memory_snapshot: with ``memory_picture``, also record the CUDA caching allocator's history over the recorded
            step (``torch.cuda.memory._record_memory_history``) and write it beside the picture as
            ``offload_memory_snapshot.pickle``, for PyTorch's memory viewer: every allocation and free of the step
            with its Python stack. CUDA only: on another device it warns and writes no snapshot.
"""

FILENAME = "offload_memory_picture.png"
SNAPSHOT_FILENAME = "offload_memory_snapshot.pickle"
TAG = "offload/memory_picture"

# The first batch allocates the host pool and gives the engine its forward profile; the step after it is the one
# every later step looks like.
_WARMUP_BATCHES = 1
# Allocator events kept for the snapshot: a training step of a large model makes tens of thousands; each entry with
# its Python stack is a few KiB, so this bounds the file to a few hundred MiB.
_SNAPSHOT_MAX_ENTRIES = 100_000


class MemoryPicture:
    """Plans, records and draws the memory picture of one training step (and its comparison step).

    Batch ``_WARMUP_BATCHES`` (counted from the start of the fit) is recorded with offloading; when ``compare`` is
    allowed, the batch after it runs without offloading and is recorded too. The picture is written as soon as the
    last recorded batch ends, or when training ends before that.

    Args:
        compare: also record one step without offloading. It needs the memory the offloading saves, so turn it off
            when the model only fits with offloading.
        snapshot: also record the offloading step's allocator history and write it as
            ``offload_memory_snapshot.pickle`` beside the PNG (CUDA only; elsewhere a warning and no file).
    """

    def __init__(self, compare: bool = True, snapshot: bool = False) -> None:
        self.compare = compare
        self.snapshot = snapshot
        self.path: Path | None = None  # where the PNG went, once written
        self.snapshot_path: Path | None = None  # where the allocator snapshot went, once written
        self._snapshot: dict[str, Any] | None = None  # the recorded step's allocator snapshot, until written
        self._recording_history = False
        self._plan: dict[int, Kind] = {}
        self._traces: list[Trace] = []
        self._trace: Trace | None = None
        self._handles: list[Any] = []
        self._engine: OffloadEngine | None = None
        self._device: torch.device | None = None
        self._t0 = 0.0
        self._batches = 0
        self._next: Kind | None = None
        self._done = True

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Hooks, the engine and the allocator's recording do not cross processes.
        state.update(_handles=[], _engine=None, _trace=None, _next=None, _recording_history=False)
        return state

    # ------------------------------------------------------------------ the callback's hooks

    def on_fit_start(self, record: bool, compare_allowed: bool) -> None:
        """Plan which batches to record, at the start of a fit.

        Args:
            record: this process records (the global-zero process of an offloading fit).
            compare_allowed: a step without offloading may run (the callback says when it may not).
        """
        self.close()
        self._traces = []
        self._trace = None
        self._snapshot = None
        self._batches = 0
        self._plan = {}
        if record:
            self._plan[_WARMUP_BATCHES] = "offloaded"
            if self.compare and compare_allowed:
                self._plan[_WARMUP_BATCHES + 1] = "baseline"
        self._done = not self._plan

    def offload_batch(self) -> bool:
        """Called once per training batch before the engine is entered: ``False`` for the comparison batch."""
        kind = None if self._done else self._plan.get(self._batches)
        self._batches += 1
        self._next = kind
        return kind != "baseline"

    def on_batch_start(self, model: nn.Module, engine: OffloadEngine | None, device: torch.device) -> None:
        """Start recording if this batch is planned (after :meth:`offload_batch`, with the engine entered)."""
        kind, self._next = self._next, None
        if kind is not None:
            self.start(kind, model, engine, device)

    def on_batch_end(self, trainer: Any, title: str = "") -> Path | None:
        """Stop recording the batch; once every planned batch is recorded, write the picture."""
        if self._trace is None:
            return None
        self.stop()
        return self.flush(trainer, title) if self.complete else None

    def flush(self, trainer: Any, title: str = "") -> Path | None:
        """Write what was recorded and not written yet (training ended before the comparison batch)."""
        self.close()
        self._trace = None
        if self._done or not self._traces:
            return None
        return self.write(_log_dir(trainer), list(trainer.loggers), trainer.global_step, title)

    def discard_batch(self) -> None:
        """Drop a recording whose batch never ended (the module's ``on_train_batch_start`` returned -1).

        What was not recorded yet is planned again for the next batches, in the same order.
        """
        self.close()
        lost, self._trace, self._next = self._trace, None, None
        if lost is None or self._done:
            return
        recorded = {trace.kind for trace in self._traces}
        remaining = [kind for _, kind in sorted(self._plan.items()) if kind not in recorded]
        self._plan = {self._batches + offset: kind for offset, kind in enumerate(remaining)}

    # ------------------------------------------------------------------ recording

    def start(self, kind: Kind, model: nn.Module, engine: OffloadEngine | None, device: torch.device) -> None:
        """Start recording a training batch (call after the engine was entered, for ``kind="offloaded"``)."""
        self.close()
        self._device = device
        self._engine = engine if kind == "offloaded" else None
        self._trace = Trace(kind)
        self._sync()
        self._t0 = time.perf_counter()
        self._trace.marks["forward"] = 0.0
        self.sample()
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._on_forward_pre))
            self._handles.append(module.register_forward_hook(self._on_forward))
        if self.snapshot and kind == "offloaded":
            self._start_history(device)

    def mark(self, phase: str) -> None:
        """Note that ``phase`` ("backward", "optimizer") starts now."""
        trace = self._trace
        if trace is None:
            return
        self.sample()
        trace.marks[phase] = trace.t[-1]

    def stop(self) -> None:
        """End the recording of the current batch."""
        trace = self._trace
        if trace is None:
            return
        self.sample()
        trace.marks["end"] = trace.t[-1]
        if self._recording_history:
            self._snapshot = torch.cuda.memory._snapshot(self._device)
        self.close()
        self._traces.append(trace)
        self._trace = None

    @property
    def complete(self) -> bool:
        """Every planned batch was recorded."""
        recorded = {t.kind for t in self._traces}
        return bool(self._plan) and all(kind in recorded for kind in self._plan.values())

    def close(self) -> None:
        """Remove the hooks and stop the allocator's recording (idempotent); gradient hooks sample no more."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self._recording_history:
            self._recording_history = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def sample(self) -> None:
        """Record the memory figures now."""
        trace = self._trace
        if trace is None:
            return
        self._sync()
        now = time.perf_counter() - self._t0
        device = self._device
        if device is not None and device.type == "cuda":
            used = read_counters(device).allocated
        else:
            used = psutil.Process(os.getpid()).memory_info().rss
        held = inflight = offloaded = 0
        engine = self._engine
        if engine is not None:
            stats = engine.collect_stats(wait=False)
            # In flight: device bytes whose device -> host copy has not been retired yet (still held on the device).
            held, offloaded, inflight = stats.host_bytes_held, stats.offloaded_bytes, stats.inflight_bytes
        trace.t.append(now)
        trace.device_bytes.append(used)
        trace.host_held.append(held)
        trace.inflight.append(inflight)
        trace.offloaded.append(offloaded)

    def _start_history(self, device: torch.device) -> None:
        if device.type != "cuda":
            warnings.warn(
                f"MemoryPicture(snapshot=True): the step runs on {device.type!r}; an allocator snapshot exists only "
                "for CUDA, so no offload_memory_snapshot.pickle is written (the memory picture is).",
                UserWarning,
                stacklevel=2,
            )
            return
        options: dict[str, Any] = {"context": "all", "stacks": "python", "max_entries": _SNAPSHOT_MAX_ENTRIES}
        if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
            # The file holds this step's allocations and frees, not those of a recording the user made earlier.
            options["clear_history"] = True
        torch.cuda.memory._record_memory_history("all", **options)
        self._recording_history = True

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        self.sample()

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.sample()
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    # Fires when backward reaches this output: a sample per module in backward too.
                    tensor.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.sample()

    # ------------------------------------------------------------------ drawing

    def write(self, log_dir: str | os.PathLike[str], loggers: list[Any], step: int, title: str = "") -> Path | None:
        """Draw what was recorded, write the PNG into ``log_dir`` and send it to TensorBoard loggers.

        Args:
            log_dir: the folder of the run (the first logger's ``log_dir``, else the trainer's root folder).
            loggers: the trainer's loggers; those whose ``experiment`` has ``add_image`` (TensorBoard) get the image.
            step: the global step to file the image under.
            title: a first line for the figure (e.g. the offloading mode).

        Returns:
            The PNG's path, or ``None`` when nothing was recorded.
        """
        self.close()
        self._done = True
        if not self._traces:
            return None
        if self._snapshot is not None:
            snapshot_path = Path(log_dir) / SNAPSHOT_FILENAME
            snapshot_path.parent.mkdir(parents=True, exist_ok=True)
            with open(snapshot_path, "wb") as handle:
                pickle.dump(self._snapshot, handle)
            self._snapshot = None
            self.snapshot_path = snapshot_path
        cuda = self._device is not None and self._device.type == "cuda"
        path = save(draw(self._traces, title, cuda=cuda), Path(log_dir) / FILENAME, loggers, step, TAG)
        self.path = path
        return path


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (tensor, or tuples / lists / dicts of them, one level of nesting per call)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _log_dir(trainer: Any) -> str:
    """The run's folder as ``Trainer.log_dir`` gives it, without its broadcast (only global zero writes)."""
    loggers = list(getattr(trainer, "loggers", []))
    if loggers:
        first = loggers[0]
        folder = getattr(first, "log_dir", None) or getattr(first, "save_dir", None)
        if folder:
            return str(folder)
    return str(trainer.default_root_dir)
