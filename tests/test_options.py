"""Option validation: every bad argument is refused up front, with a message naming it and what is allowed."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_offload import ActivationOffloadCallback, OffloadOptions, offload_activations
from lightning_offload.checkpointing import checkpointed_modules, remove_checkpointing
from lightning_offload.fabric import fabric_offload
from lightning_offload.options import MODES, ON_HOST_FULL
from tests.models import top_hooks


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"mode": "fast"}, ValueError, ["mode='fast'", *MODES]),
        ({"mode": None}, ValueError, ["mode=None", *MODES]),
        ({"on_host_full": "x"}, ValueError, ["on_host_full='x'", *ON_HOST_FULL]),
        ({"min_tensor_bytes": -1}, ValueError, ["min_tensor_bytes=-1", ">= 0"]),
        ({"min_tensor_bytes": 1.5}, ValueError, ["min_tensor_bytes=1.5", "an integer"]),
        ({"min_tensor_bytes": True}, ValueError, ["min_tensor_bytes=True"]),
        ({"resident_tail_bytes": None}, ValueError, ["resident_tail_bytes=None", ">= 0"]),
        ({"prefetch_bytes": "1 parsec"}, ValueError, ["prefetch_bytes='1 parsec'", "'512MiB'", "'2GB'"]),
        ({"prefetch_bytes": "-1GiB"}, ValueError, ["prefetch_bytes='-1GiB'", ">= 0"]),
        ({"max_inflight_bytes": -5}, ValueError, ["max_inflight_bytes=-5", "or None"]),
        ({"max_offload_bytes": -1}, ValueError, ["max_offload_bytes=-1", "or None"]),
        ({"host_memory_limit": 2.5}, ValueError, ["host_memory_limit=2.5", "or None"]),
        ({"compute_device": "tpu"}, ValueError, ["compute_device='tpu'", "cuda", "cpu"]),
        ({"compute_device": "meta"}, ValueError, ["compute_device='meta'", "cuda", "cpu"]),
        ({"compute_device": 3.0}, ValueError, ["compute_device=3.0"]),
        ({"measure_copies": "yes"}, TypeError, ["measure_copies='yes'", "True or False"]),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], words: list[str]) -> None:
    """Each bad value raises the stated error, naming the caller, the argument with its value, and what is allowed;
    the same check guards ``OffloadOptions.create`` and ``offload_activations``."""
    for caller, make in (
        ("offload_activations", lambda: offload_activations(**kwargs)),
        ("my_caller", lambda: OffloadOptions.create("my_caller", **kwargs)),
    ):
        with pytest.raises(error) as info:
            make()
        message = str(info.value)
        assert message.startswith(f"{caller}(")
        for word in words:
            assert word in message, (word, message)
    assert top_hooks() is None


@pytest.mark.parametrize(
    ("limit", "min_tensor_bytes", "floor"),
    [
        (0, None, 1 << 20),  # default min_tensor_bytes: the 1 MiB tensor's buffer
        (1024, None, 1 << 20),
        ((1 << 20) - 1, None, 1 << 20),
        (1024, 0, 64 << 10),  # every tensor eligible: the pool's smallest buffer, 64 KiB
        ((64 << 10) - 1, 1, 64 << 10),
        (1 << 20, (1 << 20) + 1, 1152 << 10),  # rounded up to the next size class
    ],
)
def test_host_memory_limit_below_one_buffer_is_refused(limit: int, min_tensor_bytes: int | None, floor: int) -> None:
    """A ``host_memory_limit`` that cannot hold the buffer of the smallest offloadable tensor raises at creation,
    naming the argument, its value and the minimum (offloading would otherwise silently never happen)."""
    kwargs: dict[str, Any] = {"host_memory_limit": limit}
    if min_tensor_bytes is not None:
        kwargs["min_tensor_bytes"] = min_tensor_bytes
    for caller, make in (
        ("offload_activations", lambda: offload_activations(**kwargs)),
        ("my_caller", lambda: OffloadOptions.create("my_caller", **kwargs)),
    ):
        with pytest.raises(ValueError) as info:
            make()
        message = str(info.value)
        assert message.startswith(f"{caller}(host_memory_limit={limit}): ")
        assert f"at least {floor} bytes" in message, message
    # The minimum itself is accepted.
    assert OffloadOptions.create("t", **{**kwargs, "host_memory_limit": floor}).host_memory_limit == floor


def test_unknown_argument_lists_the_allowed_ones() -> None:
    """An unknown keyword raises TypeError naming it and listing every allowed option."""
    with pytest.raises(TypeError) as info:
        OffloadOptions.create("my_caller", mode="sync", prefetch=1)
    message = str(info.value)
    assert "my_caller()" in message and "'prefetch'" in message
    for field in dataclasses.fields(OffloadOptions):
        assert field.name in message
    with pytest.raises(TypeError):
        offload_activations(prefetch=1)  # type: ignore[call-arg]


def test_model_must_be_a_module() -> None:
    """``model=`` that is not a Module raises TypeError naming model."""
    with pytest.raises(TypeError, match=r"model=list"):
        offload_activations(model=[nn.Linear(2, 2)])  # type: ignore[arg-type]


def test_checkpoint_needs_a_model_and_changes_nothing_without_it() -> None:
    """``checkpoint=`` without ``model=`` raises ValueError naming checkpoint, before anything is applied."""
    with pytest.raises(ValueError, match=r"checkpoint='auto'.*model="):
        offload_activations(checkpoint="auto")


def test_recompute_applies_elementwise_and_is_refused_without_checkpoint_or_with_another_value() -> None:
    """``recompute=`` names the argument when refused, and nothing is wrapped then; given with ``checkpoint=``, the
    blocks run with it."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"offload_activations\(recompute='elementwise'\): recompute applies to"):
        offload_activations(model=model, recompute="elementwise")
    with pytest.raises(ValueError, match=r"offload_activations\(recompute='none'\): recompute must be one of"):
        offload_activations(model=model, checkpoint="Linear", recompute="none")
    assert checkpointed_modules(model) == []
    engine = offload_activations(compute_device="cpu", model=model, checkpoint="Linear", recompute="elementwise")
    assert [model[i].__dict__["forward"].recompute for i in range(2)] == ["elementwise", "elementwise"]
    engine.close()
    remove_checkpointing(model)


def test_valid_options_round_trip() -> None:
    """Good values are kept as given (devices parsed) and the result is immutable."""
    options = OffloadOptions.create(
        "t",
        mode="off",
        compute_device="cpu",
        min_tensor_bytes=0,
        resident_tail_bytes=7,
        max_offload_bytes=None,
        max_inflight_bytes=None,
        prefetch_bytes=1,
        host_memory_limit=64 << 10,
        on_host_full="error",
        measure_copies=True,
    )
    assert options.mode == "off" and options.compute_device == torch.device("cpu")
    assert (options.min_tensor_bytes, options.resident_tail_bytes, options.prefetch_bytes) == (0, 7, 1)
    assert options.max_inflight_bytes is None and options.host_memory_limit == 64 << 10
    assert options.on_host_full == "error" and options.measure_copies is True
    assert options.resolved_device() == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "sync"  # type: ignore[misc]


def test_defaults_are_the_documented_ones() -> None:
    """Defaults: streamed, 1 MiB minimum, 256 MiB resident tail, warn when the host is full, no timing."""
    options = OffloadOptions.create("t")
    assert options.mode == "streamed"
    assert options.min_tensor_bytes == 1 << 20
    assert options.resident_tail_bytes == 256 << 20
    assert options.on_host_full == "warn"
    assert options.max_offload_bytes is None and options.host_memory_limit is None
    assert options.measure_copies is False
    assert options == OffloadOptions()


def test_failed_creation_leaves_no_engine_state() -> None:
    """A rejected argument creates nothing: no hooks installed, and a valid engine created afterwards works."""
    with pytest.raises(ValueError):
        offload_activations(compute_device="cpu", mode="fast")
    assert top_hooks() is None
    engine = offload_activations(compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0)
    x = torch.randn(8, 8, requires_grad=True)
    with engine:
        loss = torch.tanh(x * 1.0).sum()
    loss.backward()
    assert engine.stats.offloaded_bytes == 8 * 8 * 4


def test_both_signatures_take_every_option_with_its_default() -> None:
    """``OffloadOptions`` is the one home of the options: the context manager and the callback take each of its
    fields, with the same default (``compute_device``'s string form aside), and nothing else under an option's name."""
    import dataclasses
    import inspect

    from lightning_offload import ActivationOffloadCallback, offload_activations

    for call in (offload_activations, ActivationOffloadCallback.__init__):
        parameters = inspect.signature(call).parameters
        for field in dataclasses.fields(OffloadOptions):
            assert field.name in parameters, f"{call.__qualname__} lacks {field.name}"
            assert parameters[field.name].default == field.default, (call.__qualname__, field.name)


@pytest.mark.parametrize("value", ["0.4", "0.5B", "0.9 b"])
def test_memory_budget_rejects_a_size_that_rounds_to_zero_bytes_naming_the_argument(value: str) -> None:
    """A size string below one byte is a budget of 0 bytes, which no step fits: refused like ``0`` itself."""
    with pytest.raises(ValueError, match=rf"offload_activations\(memory_budget='{value}'\): memory_budget must be"):
        offload_activations(memory_budget=value)


@pytest.mark.parametrize("value", ["1.5", "1.5 B"])
def test_memory_budget_rejects_a_fraction_of_a_byte_count_naming_the_argument(value: str) -> None:
    """ "1.5" without a unit (GiB meant?) was a budget of 1 byte."""
    with pytest.raises(ValueError, match=r"offload_activations\(memory_budget='.*'\): memory_budget must be 'auto'"):
        offload_activations(memory_budget=value)


def test_memory_budget_takes_any_integer_type_and_exact_decimal_sizes() -> None:
    """A numpy integer is a byte count like an int; a decimal size is multiplied exactly (1.1 GB is 1100000000)."""
    import numpy as np

    assert OffloadOptions.create("t", memory_budget=np.int64(1 << 30)).memory_budget == 1 << 30
    assert OffloadOptions.create("t", memory_budget="1.1GB").memory_budget == 1_100_000_000
    assert OffloadOptions.create("t", memory_budget="0.4kb").memory_budget == 400
    # 400 digits went through a float and raised OverflowError; read exactly, they are a (very large) byte count.
    assert OffloadOptions.create("t", memory_budget="9" * 400).memory_budget == int("9" * 400)


@pytest.mark.parametrize("value", [0, -1])
def test_local_processes_rejects_a_count_below_one_naming_the_argument(value: int) -> None:
    """``local_processes=0`` or a negative count was accepted and silently replaced (by ``LOCAL_WORLD_SIZE`` or 1)."""
    with pytest.raises(ValueError, match=rf"offload_activations\(local_processes={value}\): expected a positive int"):
        offload_activations(compute_device="cpu", local_processes=value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"mode": "fast"}, ["mode='fast'", *MODES]),
        ({"memory_budget": "40 parsecs"}, ["memory_budget='40 parsecs'", "'40GiB'"]),
        ({"min_tensor_bytes": -1}, ["min_tensor_bytes=-1", ">= 0"]),
        ({"compute_device": "tpu"}, ["compute_device='tpu'", "cpu"]),
    ],
)
def test_direct_construction_validates_like_create(kwargs: dict[str, Any], words: list[str]) -> None:
    """``OffloadOptions(...)`` itself refuses bad values, as its docstring says, naming the argument."""
    with pytest.raises(ValueError) as info:
        OffloadOptions(**kwargs)
    message = str(info.value)
    assert message.startswith("OffloadOptions(")
    for word in words:
        assert word in message, (word, message)


def test_direct_construction_parses_a_memory_budget_size() -> None:
    """``OffloadOptions(memory_budget="40GiB")`` plans under 40 GiB (the string was kept, and read as "auto")."""
    options = OffloadOptions(memory_budget="40GiB", compute_device="cpu")  # type: ignore[arg-type]
    assert options.budget_bytes() == 40 << 30 and options.compute_device == torch.device("cpu")


def test_a_selector_that_matches_nothing_quotes_offload_activations() -> None:
    """``offload_activations(checkpoint=...)`` quotes itself, not ``apply_checkpointing(blocks=...)``, which the
    user never called; nothing is wrapped."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError) as info:
        offload_activations(model=model, checkpoint=["Linear", "Block"])
    assert str(info.value).startswith("offload_activations(checkpoint=['Linear', 'Block']): 'Block' matches no")
    with pytest.raises(ValueError, match=r"^offload_activations\(checkpoint=3\): checkpoint must be"):
        offload_activations(model=model, checkpoint=3)
    assert checkpointed_modules(model) == []


@pytest.mark.parametrize(
    ("kwargs", "override"),
    [
        ({"mode": "sync"}, "mode='sync'"),
        ({"mode": "off"}, "mode='off'"),
        ({"max_offload_bytes": 1024}, "max_offload_bytes=1024"),
    ],
)
def test_a_budget_given_beside_a_manual_override_is_a_warning_naming_both(kwargs: dict, override: str) -> None:
    """The planner needs ``mode="streamed"`` and no manual override; a budget given with one went unused without a
    word. The default ``"auto"`` says nothing (the user asked for no budget)."""
    with pytest.warns(
        UserWarning, match=rf"offload_activations\(memory_budget='40GiB', {override}\): memory_budget is not used"
    ):
        offload_activations(memory_budget="40GiB", compute_device="cpu", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload_activations(compute_device="cpu", **kwargs)


def test_a_budget_given_beside_checkpoint_is_a_warning_naming_both() -> None:
    model = nn.Sequential(nn.ModuleList(nn.Linear(4, 4) for _ in range(3)))
    with pytest.warns(
        UserWarning, match=r"offload_activations\(memory_budget='1GiB', checkpoint='auto'\): memory_budget"
    ):
        engine = offload_activations(compute_device="cpu", model=model, checkpoint="auto", memory_budget="1GiB")
    engine.close()
    with pytest.warns(UserWarning, match=r"ActivationOffloadCallback\(memory_budget='1GiB', checkpoint='auto'\)"):
        ActivationOffloadCallback(checkpoint="auto", memory_budget="1GiB")
    # With a mode that does not plan either: one warning, the mode's.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ActivationOffloadCallback(checkpoint="auto", memory_budget="1GiB", mode="sync")
    calls = [str(w.message).split(":")[0] for w in said]
    assert calls == ["ActivationOffloadCallback(memory_budget='1GiB', mode='sync')"]


BYTE_OPTIONS = (
    "memory_budget",
    "min_tensor_bytes",
    "resident_tail_bytes",
    "max_offload_bytes",
    "max_inflight_bytes",
    "prefetch_bytes",
    "host_memory_limit",
)


def test_byte_options_are_every_option_that_counts_bytes() -> None:
    """The list the size tests below walk is the options' own: a new byte option cannot miss them."""
    names = [f.name for f in dataclasses.fields(OffloadOptions)]
    assert sorted(name for name in names if name.endswith("_bytes") or "memory" in name) == sorted(BYTE_OPTIONS)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("2GiB", 2 << 30),
        ("2G", 2 << 30),
        ("3MB", 3 * 10**6),
        ("3MiB", 3 << 20),
        ("3 M", 3 << 20),
        ("4096KB", 4096 * 10**3),
        ("4096KiB", 4 << 20),
        ("4096k", 4 << 20),
        ("1.5GiB", 3 << 29),
        ("2097152", 2 << 20),
        ("2097152B", 2 << 20),
    ],
)
def test_every_byte_option_takes_the_same_size_strings(size: str, expected: int) -> None:
    """Every byte option reads the same sizes: ``"GB"``, ``"MB"``, ``"KB"`` are powers of 10, ``"GiB"``/``"G"``,
    ``"MiB"``/``"M"``, ``"KiB"``/``"K"`` powers of 2 (only ``memory_budget`` took sizes; the others took ints only).
    So do the entry points, which keep the parsed byte count."""
    for name in BYTE_OPTIONS:
        assert getattr(OffloadOptions.create("t", **{name: size}), name) == expected, name
        assert getattr(OffloadOptions(**{name: size}), name) == expected, name  # type: ignore[arg-type]
        assert getattr(ActivationOffloadCallback(**{name: size}).options, name) == expected, name
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "offload_activations.*memory_budget is not used")  # on the CPU
            engine = offload_activations(**{"compute_device": "cpu", "memory_budget": None, name: size})
        assert getattr(engine.options, name) == expected, name


@pytest.mark.parametrize("value", [2.5e9, 1.5, 1024.0, "1.5", "2.5e9", "1e9"])
def test_a_float_byte_count_is_refused_asking_for_an_integer(value: Any) -> None:
    """A float is no byte count (``2.5e9`` may be exact, ``1.5`` cannot be; was it meant in GiB?): every byte option
    refuses it, as a number or as a string, naming the argument and the allowed forms."""
    for name in BYTE_OPTIONS:
        with pytest.raises(ValueError) as info:
            offload_activations(**{name: value})
        message = str(info.value)
        assert message.startswith(f"offload_activations({name}={value!r}): {name} must be"), message
        assert "an integer" in message and "'512MiB'" in message and "'2GB'" in message, message


def unplanned_on_the_cpu(call: str) -> str:
    return (
        f"{call}(memory_budget='2GiB', compute_device='cpu'): memory_budget is not used: the memory-budget planner "
        "needs a CUDA device (it reads CUDA's allocator counters). Leave memory_budget out on the CPU."
    )


def test_a_budget_given_where_no_planner_can_run_is_said_at_construction_once() -> None:
    """On the CPU no planner can run: a budget the user gave is said to go unused as each entry point is called,
    quoting the call and pointing at the user's line, once (it was said at the first batch, attributed to a Lightning
    file, claiming that every eligible activation is offloaded, which the resident tail made false). Running says
    nothing more; the default ``"auto"`` says nothing at all."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    fabric = Fabric(accelerator="cpu", devices=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = offload_activations(
            compute_device="cpu", model=model, memory_budget="2GiB", min_tensor_bytes=0, resident_tail_bytes=0
        )
        ActivationOffloadCallback(compute_device="cpu", memory_budget="2GiB")
        fabric_offload(fabric, model, compute_device="cpu", memory_budget="2GiB")
        for _ in range(2):
            with engine:
                loss = model(x).sum()
            loss.backward()
    calls = ("offload_activations", "ActivationOffloadCallback", "fabric_offload")
    assert [str(w.message) for w in said] == [unplanned_on_the_cpu(call) for call in calls]
    assert {w.filename for w in said} == {__file__}
    assert engine.planner is None and engine.stats.offloaded_bytes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = offload_activations(compute_device="cpu", model=model, min_tensor_bytes=0, resident_tail_bytes=0)
        ActivationOffloadCallback(compute_device="cpu")
        fabric_offload(fabric, model, compute_device="cpu")
        with engine:
            loss = model(x).sum()
        loss.backward()


def test_byte_options_take_any_integer_type_and_keep_plain_ints() -> None:
    """A numpy integer (a size computed with numpy) was refused as "not a byte count" by every byte option but
    ``memory_budget``; they take it and keep a plain ``int``."""
    import numpy as np

    names = ("min_tensor_bytes", "resident_tail_bytes", "prefetch_bytes", "max_offload_bytes", "max_inflight_bytes")
    values = {name: np.int64(1 << 20) for name in names} | {"host_memory_limit": np.int64(1 << 30)}
    for options in (OffloadOptions.create("t", **values), OffloadOptions(**values)):  # type: ignore[arg-type]
        for name, value in values.items():
            assert getattr(options, name) == int(value) and type(getattr(options, name)) is int, name


def test_local_processes_takes_any_integer_type_and_keeps_a_plain_int() -> None:
    """``local_processes=np.int64(2)`` (a count computed with numpy) was refused as "expected a positive int", while
    every byte option takes numpy integers; it is taken and kept as a plain ``int``."""
    import numpy as np

    engine = offload_activations(compute_device="cpu", local_processes=np.int64(2))
    assert engine.local_processes == 2 and type(engine.local_processes) is int
    with pytest.raises(TypeError, match=r"offload_activations\(local_processes=True\): expected a positive int"):
        offload_activations(compute_device="cpu", local_processes=True)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), "cpu:1"])
def test_compute_device_cpu_with_an_index_offloads_cpu_tensors(device: Any) -> None:
    """``compute_device="cpu:0"`` was accepted and kept with its index, which no CPU tensor's device has (torch gives
    CPU tensors none): nothing was ever offloaded, silently. Any CPU spelling is the CPU."""
    engine = offload_activations(compute_device=device, memory_budget=None, min_tensor_bytes=0, resident_tail_bytes=0)
    assert engine.options.compute_device == torch.device("cpu")
    x = torch.randn(8, 8, requires_grad=True)
    with engine:
        loss = torch.tanh(x * 1.0).sum()
    loss.backward()
    assert engine.stats.offloaded_bytes == 8 * 8 * 4
    assert ActivationOffloadCallback(compute_device=device).options.compute_device == torch.device("cpu")
