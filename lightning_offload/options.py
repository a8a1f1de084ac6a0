"""The options shared by :func:`offload_activations` and :class:`ActivationOffloadCallback`, validated in one place.

Sizes:
    Every byte option (``memory_budget``, ``min_tensor_bytes``, ``resident_tail_bytes``, ``max_offload_bytes``,
    ``max_inflight_bytes``, ``prefetch_bytes``, ``host_memory_limit``) takes an integer byte count or a size string,
    the same in Python, in YAML and on the command line: ``"GB"``, ``"MB"``, ``"KB"``, ``"TB"`` are powers of 10
    (``"2GB"`` is 2000000000 bytes); ``"GiB"``/``"G"``, ``"MiB"``/``"M"``, ``"KiB"``/``"K"``, ``"TiB"``/``"T"``
    powers of 2 (``"2GiB"`` and ``"2G"`` are 2147483648 bytes); ``"B"`` or no unit: bytes. Units are read in any
    case; a decimal needs a unit (``"1.5GiB"``, rounded down to whole bytes). A float (``2.5e9``, ``1.5``) is
    refused: a byte count is an integer.
"""

from __future__ import annotations

import numbers
import re
import warnings
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Literal, get_args

import torch

from lightning_offload.host_pool import size_class
from lightning_offload.units import GiB, MiB

Mode = Literal["streamed", "sync", "off"]
OnHostFull = Literal["warn", "error"]

MODES: tuple[str, ...] = get_args(Mode)
ON_HOST_FULL: tuple[str, ...] = get_args(OnHostFull)

# Below ~1 MiB a PCIe copy is dominated by its fixed cost (launch + event bookkeeping, ~5-10 us), so it moves less
# than half the bytes the link could in that time, and the Python work per tensor in the hooks (~10 us) starts to
# rival the copy itself. Transformer activations are far larger (seq x hidden x 2 bytes = 16 MiB at 4k x 2k), so
# the threshold drops only masks, norms' statistics and other small tensors that free almost nothing.
DEFAULT_MIN_TENSOR_BYTES = 1 * MiB
# Tensors saved last in forward are needed first in backward; offloading them buys a round trip with nothing to
# hide it. 256 MiB is a few hundred microseconds of backward compute for the models this targets.
DEFAULT_RESIDENT_TAIL_BYTES = 256 * MiB
# At most this much fetched back ahead of backward and not yet used: two to three decoder layers of a 1-8B model at
# 4-8k tokens. It bounds the device memory prefetching holds; the link model decides when each copy starts.
DEFAULT_PREFETCH_BYTES = 2 * GiB
# Device -> host copies may lag forward by this much before the compute stream waits for them: ~10 ms of PCIe.
# It bounds the extra device memory that copies in flight hold, so streamed never needs much more than sync.
DEFAULT_MAX_INFLIGHT_BYTES = 512 * MiB


@dataclass(frozen=True)
class OffloadOptions:
    """Validated offloading options: the one place where every option is documented.

    :func:`~lightning_offload.offload_activations` and :class:`~lightning_offload.ActivationOffloadCallback` take
    these (and a few of their own); invalid values raise at construction, naming the argument and what is allowed.

    Attributes:
        mode: ``"streamed"`` overlaps copies with compute on two copy streams and prefetches in backward;
            ``"sync"`` copies on the compute stream when a tensor is saved and when backward needs it (simple, for
            debugging); ``"off"`` offloads nothing and only counts what would be offloaded.
        memory_budget: the most device memory a training step may use, a size such as ``"40GiB"`` (see
            ``min_tensor_bytes`` for the units); a planner measures the first two steps (under a budget given here
            they offload everything, the most frugal way to run) and then runs each step on the cheapest plan that
            stays within it: keep what fits (the hooks are not even installed), offload the earliest tensors (their
            copies hide behind compute), recompute the elementwise operations of some repeated blocks (their matrix
            products kept), checkpoint the fewest blocks needed, checkpoint all and offload the rest, and last
            checkpoint every block by its parts (one part rebuilt at a time in backward; their inputs offloaded).
            Blocks the model or the user already checkpoints are left as they are (plans then only offload). A new
            input shape is measured once, and one met before runs its own plan again (the callback notices; a loop
            with ``offload_activations`` or ``fabric_offload`` calls ``input_changed()``).
            ``"auto"``: what the process may use of the device's memory (under its memory fraction, where set)
            less a margin, so a model that fits pays nothing and one that does not is made to fit. ``None``: no
            planning; offload every eligible tensor (within ``max_offload_bytes``).
            Planning needs ``mode="streamed"`` and a CUDA device; ``max_offload_bytes`` or ``checkpoint=`` given
            by hand switch it off (they are the manual overrides).
        compute_device: the device whose tensors are offloaded. ``None``: the current CUDA device (for the callback:
            the module's device). ``"cpu"`` treats CPU tensors as offloadable (copied to separate host buffers, on
            simulated copy streams in ``"streamed"`` mode) so the bookkeeping runs without a GPU.
        min_tensor_bytes: storage spans smaller than this stay on the device (default 1 MiB: smaller copies are
            dominated by fixed costs and free almost nothing). This and every byte option below take a size:
            ``"GB"``/``"MB"``/``"KB"`` are powers of 10, ``"GiB"``/``"G"``, ``"MiB"``/``"M"``, ``"KiB"``/``"K"``
            powers of 2, or an integer byte count.
        resident_tail_bytes: a tensor leaves the device only once this many bytes were saved after it in the same
            forward, so the last tensors of forward (logits, loss), needed first by backward, stay.
        max_offload_bytes: offload at most the first this-many bytes of each forward (the earliest tensors hide
            their copies best); the rest stays on the device. ``None``: no limit. The manual knob that trades memory
            for time: about ``link bandwidth x forward time`` bytes move for free.
        max_inflight_bytes: device -> host copies may lag forward by this many bytes; beyond it the compute stream
            waits for the oldest copy (a device-side wait), so memory held by copies in flight stays bounded.
            ``None``: 512 MiB when everything eligible is offloaded; with a byte limit (``max_offload_bytes`` or a
            plan) the link model decides when each source is let go.
        prefetch_bytes: the most bytes fetched back ahead of backward and not yet used (device memory that
            prefetching may hold). When each copy starts comes from a model of the link: forward's measured pace
            against the link's bandwidth, chained in the order backward needs the copies.
        host_memory_limit: the most host memory the pool may hold (at least one buffer for a tensor of
            ``min_tensor_bytes``). ``None``: 80% of the RAM available at first use, divided by the processes on
            this machine.
        on_host_full: when the limit (or the machine's free RAM) is reached: ``"warn"`` keeps further tensors on
            the device and warns once; ``"error"`` raises :class:`~lightning_offload.HostMemoryFull`.
        measure_copies: time every copy on the copy streams (``stats.d2h_ms``/``h2d_ms``; ``mode="streamed"``:
            ``"sync"`` copies untimed); costs two events per copy.
        plan_trials: under a memory budget, time the few plans worth comparing for four steps each (the cheapest
            by the planner's model, the cheapest without copies, one between) and keep the fastest: the model prices
            recompute and the link, not the host's cost per saved tensor or the allocator near a hard cap. Each step
            of a trial waits for the one before it (a host sync). ``False``: run the model's cheapest plan.
    """

    mode: Mode = "streamed"
    memory_budget: int | str | None = "auto"
    compute_device: torch.device | None = None
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES
    resident_tail_bytes: int = DEFAULT_RESIDENT_TAIL_BYTES
    max_offload_bytes: int | None = None
    max_inflight_bytes: int | None = None
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    host_memory_limit: int | None = None
    on_host_full: OnHostFull = "warn"
    measure_copies: bool = False
    plan_trials: bool = True

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in signature order."""
        return [f.name for f in fields(cls)]

    @property
    def plans(self) -> bool:
        """Whether a memory-budget planner decides what each step offloads and checkpoints."""
        return self.mode == "streamed" and self.memory_budget is not None and self.max_offload_bytes is None

    def budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``None`` for ``"auto"``: the device decides, and without planning)."""
        return self.memory_budget if isinstance(self.memory_budget, int) else None

    def __post_init__(self) -> None:
        # Built directly rather than through ``create`` (which quotes its caller): validated all the same, and the
        # budget and device parsed, so a size such as "40GiB" is not kept as a string (``budget_bytes`` would read it
        # as "auto"). ``create`` and ``dataclasses.replace`` come through here too, with values already valid.
        values = _validated("OffloadOptions", {f.name: getattr(self, f.name) for f in fields(self)})
        for name in _NORMALIZED:
            object.__setattr__(self, name, values[name])

    @classmethod
    def create(cls, caller: str, **kwargs: Any) -> OffloadOptions:
        """Validate ``kwargs`` and return the options; ``caller`` names the call in error messages. (A budget they
        leave unused is said by the entry points, which know more: :func:`warn_unused_budget`.)"""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{caller}() got unexpected argument(s) {unknown}; allowed: {sorted(known)}")
        return cls(**_validated(caller, kwargs))

    def resolved_device(self) -> torch.device | None:
        """The compute device: the option if given, else the current CUDA device; ``None`` without CUDA.

        CPU tensors are offloaded only when ``compute_device="cpu"`` is asked for explicitly (a test mode).
        """
        if self.compute_device is not None:
            return self.compute_device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None


# Options ``_validated`` returns in another form than given: parsed (a size string, a device) or made plain ``int``s.
_NORMALIZED = (
    "memory_budget",
    "compute_device",
    "min_tensor_bytes",
    "resident_tail_bytes",
    "prefetch_bytes",
    "max_offload_bytes",
    "max_inflight_bytes",
    "host_memory_limit",
)


def no_cuda_message(caller: str, where: str) -> str:
    """What each entry point says, once, where there is no CUDA device to offload from (``where`` says why): it then
    offloads nothing, and ``compute_device="cpu"`` is the explicit opt-in to run the engine on CPU tensors."""
    return (
        f"{caller}: no CUDA device ({where}); offloading nothing. Pass compute_device='cpu' to run the engine on CPU "
        "tensors."
    )


def warn_unused_budget(
    caller: str, options: OffloadOptions, memory_budget: Any, checkpoint: Any = None, stacklevel: int = 3
) -> None:
    """Say, once and as the call is made, that a ``memory_budget`` the user gave (not the default ``"auto"``) is not
    used because no planner can run: the mode does not plan, a manual override (``max_offload_bytes``,
    ``checkpoint``) switches it off, or the compute device is the CPU. One reason, the first of these, is said.

    Args:
        caller: the entry point, quoted.
        options: the validated options.
        memory_budget: the budget as the user gave it (quoted as given).
        checkpoint: the entry point's ``checkpoint`` argument.
        stacklevel: as ``warnings.warn``'s, counted from this function (3: the caller of the entry point).
    """
    if memory_budget is None or memory_budget == "auto":
        return
    overrides = "the memory-budget planner needs mode='streamed' and no manual override (max_offload_bytes=, "
    overrides += "checkpoint=). Pass one or the other."
    if options.mode != "streamed":
        given, why = f"mode={options.mode!r}", overrides
    elif options.max_offload_bytes is not None:
        given, why = f"max_offload_bytes={options.max_offload_bytes}", overrides
    elif checkpoint is not None:
        given, why = f"checkpoint={checkpoint!r}", overrides
    elif options.compute_device is not None and options.compute_device.type == "cpu":
        given = "compute_device='cpu'"
        why = (
            "the memory-budget planner needs a CUDA device (it reads CUDA's allocator counters). Leave memory_budget "
            "out on the CPU."
        )
    else:
        return
    warnings.warn(
        f"{caller}(memory_budget={memory_budget!r}, {given}): memory_budget is not used: {why}",
        UserWarning,
        stacklevel=stacklevel,
    )


def _validated(caller: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (option names only) checked, with ``memory_budget`` and ``compute_device`` parsed; raises naming
    ``caller``, the argument and what is allowed."""
    kwargs = dict(kwargs)
    mode = kwargs.get("mode", "streamed")
    if mode not in MODES:
        raise ValueError(f"{caller}(mode={mode!r}): mode must be one of {list(MODES)}")
    on_host_full = kwargs.get("on_host_full", "warn")
    if on_host_full not in ON_HOST_FULL:
        raise ValueError(f"{caller}(on_host_full={on_host_full!r}): on_host_full must be one of {list(ON_HOST_FULL)}")
    for name in ("min_tensor_bytes", "resident_tail_bytes", "prefetch_bytes"):
        if name in kwargs:
            kwargs[name] = parse_bytes(caller, name, kwargs[name], allow_none=False)
    if kwargs.get("max_offload_bytes") == "auto":
        raise ValueError(
            f"{caller}(max_offload_bytes='auto'): 'auto' was retired (it offloaded far more than hides); pass "
            "memory_budget= (bytes or a string such as '40GiB') to let the planner choose, or a byte count"
        )
    if "memory_budget" in kwargs:
        kwargs["memory_budget"] = parse_budget(caller, kwargs["memory_budget"])
    for name in ("max_offload_bytes", "max_inflight_bytes", "host_memory_limit"):
        if name in kwargs:
            kwargs[name] = parse_bytes(caller, name, kwargs[name], allow_none=True)
    _check_host_limit(caller, kwargs.get("host_memory_limit"), kwargs.get("min_tensor_bytes", DEFAULT_MIN_TENSOR_BYTES))
    for name in ("measure_copies", "plan_trials"):
        flag = kwargs.get(name, False)
        if not isinstance(flag, bool):
            raise TypeError(f"{caller}({name}={flag!r}): {name} must be True or False")
    kwargs["compute_device"] = _parse_device(caller, kwargs.get("compute_device"))
    return kwargs


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 1 << 10, "m": 1 << 20})
_UNITS.update({"g": 1 << 30, "t": 1 << 40})
_SIZE = re.compile(r"\s*([0-9]+)(\.[0-9]+)?\s*([a-zA-Z]*)\s*")


def _size_strings(examples: str = "'512MiB', '2GiB' or '2GB'") -> str:
    """The size strings every byte option's error allows (the units in full are in the module's docstring)."""
    return f"a size string such as {examples} (GB = 10**9 bytes, GiB = G = 2**30)"


def size_in_bytes(value: Any) -> int | None:
    """``value`` (an integer of any type but bool, or a size string) in bytes; ``None`` where it is neither."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if not isinstance(value, str):
        return None  # a float among them: 2.5e9 may be exact, 1.5 cannot be a byte count
    match = _SIZE.fullmatch(value)
    if match is None or match.group(3).lower() not in _UNITS:
        return None
    unit = _UNITS[match.group(3).lower()]
    if match.group(2) and unit == 1:
        return None  # bytes come whole: "1.5" (GiB meant?) would otherwise be 1 byte
    # Digits and unit multiplied exactly: through a float, 400 digits overflow, and 1.1 GB loses a byte.
    return int(Fraction(match.group(1) + (match.group(2) or "")) * unit)


def parse_bytes(caller: str, name: str, value: Any, allow_none: bool) -> int | None:
    """``value`` in bytes: an integer (numpy's too, not a bool) or a size string such as ``"512MiB"`` (see the module's
    docstring for the units), or ``None`` where allowed; raises naming ``caller``, the argument and what is allowed.
    """
    if value is None and allow_none:
        return None
    size = size_in_bytes(value)
    if size is None or size < 0:
        allowed = f"an integer byte count >= 0 or {_size_strings()}" + (", or None" if allow_none else "")
        raise ValueError(f"{caller}({name}={value!r}): {name} must be {allowed}")
    return size


def parse_budget(caller: str, value: Any) -> int | str | None:
    """``memory_budget`` as bytes, ``"auto"`` or ``None``; sizes as for every byte option (``"40GiB"``, ``"80GB"``)."""
    if value is None or value == "auto":
        return value
    size = size_in_bytes(value)
    # No step fits a budget of 0 bytes ("0", or a fraction of a byte such as "0.0001kb").
    if size is None or size <= 0:
        raise ValueError(
            f"{caller}(memory_budget={value!r}): memory_budget must be 'auto', None, an integer byte count > 0 or "
            + _size_strings("'40GiB', '512MiB' or '2GB'")
        )
    return size


def _host_limit_floor(min_tensor_bytes: int) -> int:
    """The smallest useful ``host_memory_limit``: one pool buffer for a tensor of ``min_tensor_bytes``.

    The pool hands out buffers by size class (never below 64 KiB), so a smaller limit could not hold even the
    smallest tensor that is eligible for offloading, and offloading would silently never happen.
    """
    return size_class(min_tensor_bytes)


def _check_host_limit(caller: str, limit: int | None, min_tensor_bytes: int) -> None:
    if limit is None:
        return
    floor = _host_limit_floor(min_tensor_bytes)
    if limit < floor:
        raise ValueError(
            f"{caller}(host_memory_limit={limit}): host_memory_limit must be None or at least {floor} bytes, the "
            f"pool buffer for the smallest tensor that is offloaded (min_tensor_bytes={min_tensor_bytes}); a smaller "
            "limit holds no buffer at all and nothing would be offloaded"
        )


def _parse_device(caller: str, value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{caller}(compute_device={value!r}): expected 'cuda', 'cuda:N', 'cpu' or None") from err
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{caller}(compute_device={value!r}): expected 'cuda', 'cuda:N', 'cpu' or None")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{caller}(compute_device={value!r}): CUDA is not available on this machine; use compute_device=None "
            "(offload on CUDA when present) or 'cpu' (exercise the engine on CPU tensors)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        # "cpu:0" names the one CPU, but kept with its index it equals no CPU tensor's device (torch gives them none),
        # and nothing would be offloaded.
        device = torch.device("cpu")
    return device


def option_docs(indent: int) -> str:
    """The ``Attributes`` section of :class:`OffloadOptions`, re-indented by ``indent`` spaces: the one text of the
    options, which the callback's docstring (and so its ``--help``) embeds as ``Args``."""
    doc = OffloadOptions.__doc__ or ""
    lines = doc.split("Attributes:\n", 1)[1].splitlines()
    body = [line for line in lines if line.strip()]
    base = min(len(line) - len(line.lstrip()) for line in body)
    return "\n".join(" " * indent + line[base:] for line in body)
