"""The benchmark's workloads and modes, the default mode list of each workload, and the capacity models.

Workloads are random-init Llama shapes trained at a fixed batch and sequence; capacity models
(:data:`CAPACITY_MODELS`) are trained at batch 1 and the longest sequence that fits under a memory cap.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import asdict, dataclass, field, replace
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    """A random-init Llama shape and how it is trained.

    Attributes:
        name: the workload's name in results.
        hidden: hidden size.
        layers: decoder layers.
        intermediate: MLP width.
        heads: attention heads.
        kv_heads: key/value heads (grouped-query attention).
        vocab: vocabulary size.
        tied: tie the LM head to the embedding.
        batch: sequences per step.
        seq: tokens per sequence.
        lora: ``True``: LoRA r16 on all linear layers, base frozen; ``False``: full fine-tuning with AdamW.
        modes: the modes run when ``--modes`` is not given.
    """

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    batch: int
    seq: int
    lora: bool
    modes: tuple[str, ...] = field(default=())

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Mode:
    """One way of running the training step.

    Attributes:
        name: the row's name.
        group: ``"baseline"`` (no offloading), ``"anchor"`` (other projects' offloaders) or ``"ours"``.
        checkpoint: ``None``, ``"hf"`` (``gradient_checkpointing_enable``), ``"ours"`` (``apply_checkpointing``) or
            ``"ours-elementwise"`` (``apply_checkpointing(recompute="elementwise")``).
        anchor: ``None``, ``"save_on_cpu"``, ``"torchtune"`` or ``"trl"``.
        engine: ``offload_activations`` keyword arguments (``None``: no engine). Byte values are scaled down in
            ``--tiny`` runs.
        sweep: ``True`` for the points of our time-versus-memory curve.
        needs_cuda: skipped on a machine without CUDA.
        default: ``offload_activations()`` with no arguments at all (the row that says what a user gets).
        budget: ``offload_activations(memory_budget=B)`` under a hard cap of B bytes: a fraction of `none`'s peak
            (``0.9``), ``"floor"`` (the least peak of our hand-tuned rows that checkpoint and offload, plus 10%),
            GiB as a string (``"8gib"``) or ``"cap"`` (the capacity run's cap). ``None``: no budget.
    """

    name: str
    group: str
    checkpoint: str | None = None
    anchor: str | None = None
    engine: dict[str, Any] | None = None
    sweep: bool = False
    needs_cuda: bool = False
    default: bool = False
    budget: float | str | None = None


def _modes() -> dict[str, Mode]:
    modes = [
        Mode("none", "baseline"),
        Mode("ac", "baseline", checkpoint="hf"),
        Mode("ac-ours", "baseline", checkpoint="ours"),
        # Selective checkpointing: every block keeps its matrix products and attention, recomputes the rest.
        Mode("sac", "baseline", checkpoint="ours-elementwise"),
        Mode("save_on_cpu", "anchor", anchor="save_on_cpu", needs_cuda=True),
        Mode("torchtune", "anchor", anchor="torchtune", needs_cuda=True),
        Mode("trl", "anchor", anchor="trl", needs_cuda=True),
        Mode("off", "ours", engine={"mode": "off"}),
        Mode("sync", "ours", engine={"mode": "sync"}),
        Mode("streamed", "ours", engine={"mode": "streamed"}, sweep=True),
        # Everything eligible leaves the device: the step should run at the copy bound (P1).
        Mode("streamed-all", "ours", engine={"mode": "streamed", "resident_tail_bytes": 0}, sweep=True),
        Mode("ac+offload", "ours", checkpoint="ours", engine={"mode": "streamed"}),
        Mode("sac+offload", "ours", checkpoint="ours-elementwise", engine={"mode": "streamed"}),
    ]
    # The knob that trades memory for time: only the first N bytes of each forward leave the device.
    for gib in (1, 2, 3, 4, 6, 8, 12, 16, 24):
        modes.append(
            Mode(f"budget-{gib}G", "ours", engine={"mode": "streamed", "max_offload_bytes": gib * GiB}, sweep=True)
        )
    # What a user gets without choosing anything, and the planner under a memory budget (`memory_budget`, when the
    # engine has it). Budget rows run last among ours: their budgets come from `none`'s and `ac+offload`'s peaks.
    modes.append(Mode("ours-default", "ours", engine={}, default=True))
    for fraction in BUDGET_FRACTIONS:
        modes.append(Mode(f"ours-budget-{fraction}x", "ours", engine={}, budget=fraction, needs_cuda=True))
    modes.append(Mode("ours-budget-floor", "ours", engine={}, budget="floor", needs_cuda=True))
    for gib in ABSOLUTE_BUDGETS_GIB:
        modes.append(Mode(f"ours-budget-{gib}gib", "ours", engine={}, budget=f"{gib}gib", needs_cuda=True))
    modes.append(Mode("ours-budget", "ours", engine={}, budget="cap"))  # capacity runs only
    return {m.name: m for m in modes}


# Budgets of the `ours-budget-<f>x` rows, as fractions of `none`'s peak allocated memory. 0.95x is the third budget
# of a model whose floor lies close to `none`'s peak (small-h512's loss transient: floor 0.89x), and on the others a
# budget just short of what the model needs, where the plan should cost little.
BUDGET_FRACTIONS = (0.95, 0.9, 0.7, 0.5)
BUDGET_MODES = (*(f"ours-budget-{f}x" for f in BUDGET_FRACTIONS), "ours-budget-floor")
# Budgets in GiB, for a workload measured at a capacity run's cap (`ours-budget-8gib`), where it has such a row.
ABSOLUTE_BUDGETS_GIB = (8,)
ABSOLUTE_BUDGET_MODES = tuple(f"ours-budget-{g}gib" for g in ABSOLUTE_BUDGETS_GIB)
# The floor budget: the least peak among our rows that checkpoint and offload, with this much room.
FLOOR_HEADROOM = 1.10


MODES: dict[str, Mode] = _modes()

_BASELINES = ("none", "ac", "ac-ours", "sac")
_ANCHORS = ("save_on_cpu", "torchtune", "trl")
_SWEEP_1B_S4K = ("budget-1G", "budget-2G", "budget-3G", "budget-4G", "budget-8G")
# Rows run in this order of groups: our engine's host pool (up to ~85 GiB pinned for the 8B workload) is released
# before the anchors, which pin as much again through torch's host allocator; both at once would not fit in the
# host RAM of a 128 GiB machine. An anchor that takes the process down then loses only the rows after it.
GROUP_ORDER = ("baseline", "ours", "anchor")


def ordered(modes: list[str] | tuple[str, ...]) -> list[str]:
    """``modes`` without duplicates, ``none`` first, then by :data:`GROUP_ORDER` (stable within a group).

    The default (`ours-default`) runs right after `none`: a user adds it to a model that fits and keeps the allocator
    as it was (fixed segments, unless configured), while a process in which an offloading row ran has expandable
    segments for good (on an H200 that alone moved small-h512's step by up to 1.3x). (Where `none` does not fit the
    device's own budget, the default offloads and the baselines after it inherit expandable segments: no workload here
    does.) Budget rows come last among ours: their budgets are computed from the peaks of `none` and `ac+offload`.
    """
    unique = list(dict.fromkeys(["none", *modes]))
    return sorted(
        unique,
        key=lambda name: (
            name != "none",
            not MODES[name].default,
            GROUP_ORDER.index(MODES[name].group),
            MODES[name].budget is not None,
        ),
    )


# Mode lists sized for ~8 minutes of H200 time in all (see benchmarks/NOTES.md): the full sweep and ``sync`` (a
# debugging mode, copy-bound by design) only where a step is short; the long workloads get the core rows and the
# curve point that matters most there.
_LLAMA1B = {"hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8, "vocab": 128256}
# Activation-dominated: with 256 token ids the logits are negligible (the capacity runs' small-vocab model).
_SMALLVOCAB = {"hidden": 1024, "layers": 24, "intermediate": 4096, "heads": 16, "kv_heads": 4, "vocab": 256}
# (`auto`, max_offload_bytes="auto", is gone: it offloaded far more than hides and the engine retires it; the
# planner rows below replace it.)
_OURS = ("off", "streamed", "streamed-all", "ac+offload")
_PLANNER = ("ours-default", *BUDGET_MODES)
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "llama1b-s4k",
            **_LLAMA1B,
            tied=True,
            batch=2,
            seq=4096,
            lora=False,
            modes=(*_BASELINES, *_OURS, "sync", *_SWEEP_1B_S4K, *_PLANNER, *_ANCHORS),
        ),
        Workload(
            "llama1b-s16k",
            **_LLAMA1B,
            tied=True,
            batch=1,
            seq=16384,
            lora=False,
            modes=(*_BASELINES, *_OURS, "budget-4G", "budget-8G", "budget-12G", *_PLANNER, *_ANCHORS),
        ),
        Workload(
            "llama8b-lora-s8k",
            hidden=4096,
            layers=32,
            intermediate=14336,
            heads=32,
            kv_heads=8,
            vocab=128256,
            tied=False,
            batch=1,
            seq=8192,
            lora=True,
            # ~1 s per plain step and ~3-5 s offloaded: no `off` (P4 judges it on the other workloads) and no `trl`
            # anchor (the 8B LoRA rows are compared with the save_on_cpu and torchtune anchors).
            modes=(
                *_BASELINES,
                "streamed",
                "streamed-all",
                "ac+offload",
                "budget-8G",
                "budget-16G",
                "budget-24G",
                *_PLANNER,
                "save_on_cpu",
                "torchtune",
            ),
        ),
        # The small-vocab capacity model at a length AC trains under 8 GiB (49152 tokens on an H200): our step time
        # there under the same cap, against AC's (B3's "at <= 1.10x AC's step time where both fit").
        Workload(
            "smallvocab-s48k",
            **_SMALLVOCAB,
            tied=False,
            batch=1,
            seq=49152,
            lora=False,
            modes=(*_BASELINES, "ac+offload", *_PLANNER, *ABSOLUTE_BUDGET_MODES),
        ),
        # P4, "do no harm": a model too small for offloading to pay off must not get slower or bigger.
        Workload(
            "small-h512",
            hidden=512,
            layers=4,
            intermediate=2048,
            heads=8,
            kv_heads=8,
            vocab=32000,
            tied=False,
            batch=4,
            seq=1024,
            lora=False,
            modes=("none", "off", "streamed", "ac+offload", *_PLANNER),
        ),
    )
}


# Capacity runs: batch 1, the sequence grows in steps of CAPACITY_STEP until a hard memory cap is hit.
CAPACITY_STEP = 2048
CAPACITY_MODES = ("none", "ac", "save_on_cpu", "torchtune", "trl", "ours-budget")
CAPACITY_MODELS: dict[str, Workload] = {
    w.name: w
    for w in (
        replace(WORKLOADS["llama1b-s4k"], name="llama1b", batch=1, seq=CAPACITY_STEP, modes=CAPACITY_MODES),
        replace(WORKLOADS["llama8b-lora-s8k"], name="llama8b-lora", seq=CAPACITY_STEP, modes=CAPACITY_MODES),
        # Activation-dominated: with 256 token ids the logits are negligible, so what limits the sequence is what
        # the decoder layers save (~54 KB per token per layer in bf16) against each layer's input (2 KB) under AC.
        Workload(
            "smallvocab-h1024",
            **_SMALLVOCAB,
            tied=False,
            batch=1,
            seq=CAPACITY_STEP,
            lora=False,
            modes=CAPACITY_MODES,
        ),
    )
}

# Caps (GiB) and the longest sequence searched, per capacity model. The Llama models get 24/40/80 GiB. The small-vocab
# model saves ~1.3 MB per token without checkpointing but only ~0.13 MB with it (estimates), so at 24 GiB AC alone
# would train ~170k tokens (tens of seconds per step: attention is quadratic), past what a 10-minute call can search;
# at 6/8/12 GiB AC should fit ~27k/44k/77k tokens, and 1.5x that (the target for ours) stays under the maximum.
DEFAULT_CAPS_GIB = (24.0, 40.0, 80.0)
DEFAULT_MAX_SEQ = 131072
CAPACITY_CAPS_GIB: dict[str, tuple[float, ...]] = {"smallvocab-h1024": (6.0, 8.0, 12.0)}
CAPACITY_MAX_SEQ: dict[str, int] = {"smallvocab-h1024": 196608}

# ``--tiny`` divides every byte knob by this, so the tiny tensors (kilobytes) meet the same decisions.
TINY_BYTE_SCALE = 1024
# A shrunken workload's name: ``tiny-llama8b-lora-s8k`` is a 64-wide, 2-layer model with that workload's structure
# and modes, and its rows must not pass for the 8B model's.
TINY_PREFIX = "tiny-"


def tiny(workload: Workload) -> Workload:
    """A shrunken copy of ``workload`` that runs on a CPU in seconds (same structure, same modes).

    Args:
        workload: The full-size workload (or capacity model).

    Returns:
        The copy, named ``tiny-<name>``: hidden 64, 2 layers, a 512-token vocabulary, 128 tokens per sequence, at
        most 2 sequences per step.
    """
    return replace(
        workload,
        name=TINY_PREFIX + workload.name,
        hidden=64,
        layers=2,
        intermediate=128,
        heads=4,
        kv_heads=2 if workload.kv_heads < workload.heads else 4,
        vocab=512,
        batch=min(workload.batch, 2),
        seq=128,
    )


def planner_available() -> bool:
    """Whether the engine takes ``memory_budget`` (the planner)."""
    from lightning_offload import offload_activations

    return "memory_budget" in inspect.signature(offload_activations).parameters


# What the hand-tuned rows pass as `memory_budget` where the engine has one: no planning, so they keep measuring
# exactly the knobs they name (the engine's default, "auto", would let the planner decide instead).
NO_PLANNING = None


def engine_kwargs(mode: Mode, tiny_run: bool) -> dict[str, Any]:
    """The mode's ``offload_activations`` arguments; in ``--tiny`` runs byte values shrink with the model."""
    kwargs = dict(mode.engine or {})
    if mode.default or mode.budget is not None:
        return kwargs  # the default row takes no knobs; budget rows get only `memory_budget`, added by the runner
    if planner_available():
        kwargs["memory_budget"] = NO_PLANNING
    if tiny_run:
        for key in ("resident_tail_bytes", "max_inflight_bytes", "max_offload_bytes"):
            if isinstance(kwargs.get(key), int) and kwargs[key]:  # None and 0 keep their meaning
                kwargs[key] = max(1, kwargs[key] // TINY_BYTE_SCALE)
        kwargs.setdefault("min_tensor_bytes", 1024)
        kwargs.setdefault("resident_tail_bytes", 256 * MiB // TINY_BYTE_SCALE)
    return kwargs


def worker_modes(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The ``--modes`` of a worker process, checked against :data:`MODES` (a usage error names the unknown ones)."""
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {text!r}: unknown {unknown}; known: {sorted(MODES)}")
    return modes


def full_name(name: str) -> str:
    """The full-size workload (or capacity model) a name stands for: ``tiny-small-h512`` -> ``small-h512``."""
    return name.removeprefix(TINY_PREFIX)
