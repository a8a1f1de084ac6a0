"""``lightning_offload.fabric.fabric_offload`` in Fabric training loops, one process and two (CPU, gloo).

Both run ``tests/fabric_script.py``'s loop: a tiny per-token MLP trained for three SGD steps without and then with
offloading, seeded alike. One process runs it in this process; two processes run the script in a subprocess (with
``strategy="ddp"``, ``fabric.launch()`` starts the second rank by running the script again).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DataParallelStrategy
from torch import nn

from lightning_offload import ActivationOffloadCallback, offload_activations
from lightning_offload.checkpointing import checkpointed_modules
from lightning_offload.fabric import fabric_offload
from lightning_offload.options import GiB
from tests import processes
from tests.fabric_script import OFFLOAD_OPTIONS, STEPS, batch_for, train
from tests.models import top_hooks
from tests.tiny_modules import OFFLOAD_ALL

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("fabric_script.py")
TIMEOUT_S = 150
# Variables of an enclosing launcher that would stop Fabric from starting its own processes, or skew them.
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "GLOBAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# The default host limit: 80% of the RAM available when the engine first copies, shared by the local processes.
HOST_SHARE = 0.8


def load(out: Path, name: str) -> Any:
    path = out / name
    assert path.exists(), f"the run wrote no {name}"
    return torch.load(path, weights_only=True) if path.suffix == ".pt" else json.loads(path.read_text())


def assert_same_params(out: Path, rank: int, prefix: str = "") -> None:
    baseline = load(out, f"{prefix}baseline_params_rank{rank}.pt")
    offload = load(out, f"{prefix}offload_params_rank{rank}.pt")
    assert baseline.keys() == offload.keys()
    different = [name for name in baseline if not torch.equal(baseline[name], offload[name])]
    assert not different, f"rank {rank}: parameters differ from the run without offloading: {different}"


def assert_host_limit_split(record: dict[str, Any], processes: int) -> None:
    expected = record["pool_reserved_at_start"] + record["available_at_start"] * HOST_SHARE / processes
    assert record["local_processes"] == processes
    assert record["host_limit"] == pytest.approx(expected, rel=0.05), (
        f"host limit {record['host_limit'] / GiB:.2f} GiB, expected about {expected / GiB:.2f} GiB "
        f"(available {record['available_at_start'] / GiB:.2f} GiB * {HOST_SHARE} / {processes} processes)"
    )


def test_one_process_matches_training_without_offloading(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    train(fabric, tmp_path, offload=False)
    train(fabric, tmp_path, offload=True)
    assert_same_params(tmp_path, 0)
    record = load(tmp_path, "offload_rank0.json")
    assert len(record["offloaded_bytes"]) == STEPS and all(b > 0 for b in record["offloaded_bytes"])
    assert_host_limit_split(record, processes=1)


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
def test_two_processes_match_training_without_offloading_and_split_the_host_limit(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    proc = processes.start([sys.executable, str(SCRIPT), str(tmp_path), "2"], env)
    log, in_time = processes.finish(proc, TIMEOUT_S)
    if not in_time:
        pytest.fail(f"no result within {TIMEOUT_S} s; output:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    records = [load(tmp_path, f"offload_rank{rank}.json") for rank in range(2)]
    assert len({r["pid"] for r in records}) == 2, "the ranks did not run in separate processes"
    for rank, record in enumerate(records):
        assert_same_params(tmp_path, rank)
        assert record["world_size"] == 2
        assert len(record["offloaded_bytes"]) == STEPS and all(b > 0 for b in record["offloaded_bytes"])
        assert_host_limit_split(record, processes=2)
    # Each rank offloaded its own activations (rank 1's sequences are longer), and DDP kept the replicas equal.
    assert records[1]["offloaded_bytes"][0] > records[0]["offloaded_bytes"][0]
    params = [load(tmp_path, f"offload_params_rank{rank}.pt") for rank in range(2)]
    assert all(torch.equal(params[0][name], params[1][name]) for name in params[0])
    # Gradient accumulation under fabric.no_backward_sync, streamed: DDP's reducer runs in the last micro-batch's
    # backward only, while its tensors come back; the result is still the run without offloading, on both ranks.
    for rank in range(2):
        assert_same_params(tmp_path, rank, prefix="accumulate_")
        assert all(b > 0 for b in load(tmp_path, f"accumulate_offload_rank{rank}.json")["offloaded_bytes"])
    accumulated = [load(tmp_path, f"accumulate_offload_params_rank{rank}.pt") for rank in range(2)]
    assert all(torch.equal(accumulated[0][name], accumulated[1][name]) for name in accumulated[0])


def test_checkpoint_applies_to_the_module_fabric_wrapped(tmp_path: Path) -> None:
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    batch = batch_for(0, 0)
    reference = Blocks()
    F.mse_loss(reference(batch), batch).backward()
    module = Blocks()
    model = fabric.setup_module(module)
    off = fabric_offload(fabric, model, checkpoint="auto", **OFFLOAD_OPTIONS)
    assert checkpointed_modules(module) == ["layers.0", "layers.1", "layers.2"]
    with off:
        loss = F.mse_loss(model(batch), batch)
    fabric.backward(loss)
    assert off.stats.offloaded_bytes > 0
    for (name, want), got in zip(reference.named_parameters(), module.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad), name
    off.close()  # the model as it was
    assert checkpointed_modules(module) == []


def test_fabric_recompute_applies_to_the_checkpointed_blocks_and_needs_checkpoint() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(ValueError, match=r"fabric_offload\(recompute='elementwise'\): recompute applies to"):
        fabric_offload(fabric, module, recompute="elementwise", compute_device="cpu")
    fabric_offload(fabric, module, checkpoint="auto", recompute="elementwise", compute_device="cpu")
    assert [layer.__dict__["forward"].recompute for layer in module] == ["elementwise", "elementwise"]


def test_cpu_fabric_without_compute_device_warns_once_and_does_nothing() -> None:
    """Off CUDA ``fabric_offload`` behaves as the callback and ``offload_activations`` do (it raised): one warning
    naming the call, and an engine that offloads nothing, installs no hooks and checkpoints nothing. Bad options and
    selectors still raise, quoting the call."""
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"^fabric_offload\(mode='fast'\)"):
        fabric_offload(fabric, model, mode="fast")
    with pytest.raises(ValueError, match=r"^fabric_offload\(checkpoint='Nope'\): 'Nope' matches no"):
        fabric_offload(fabric, model, checkpoint="Nope")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        off = fabric_offload(fabric, model, checkpoint="Linear", memory_budget="1GiB", min_tensor_bytes=0)
        x = torch.randn(4, 8, requires_grad=True)
        for _ in range(2):
            with off:
                assert top_hooks() is None  # no hooks: nothing to pay for
                loss = model(x).square().sum()
            loss.backward()
    assert [(w.category, str(w.message)) for w in said] == [
        (
            UserWarning,
            "fabric_offload: no CUDA device (Fabric runs on cpu); offloading nothing. Pass compute_device='cpu' to run "
            "the engine on CPU tensors.",
        )
    ]
    assert said[0].filename == __file__  # the user's line, not ours
    assert checkpointed_modules(model) == []
    assert off.stats.offloaded_bytes == 0 and off.stats.saved_tensors == 0
    off.close()


def test_process_count_comes_from_fabric() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"fabric_offload\(local_processes=4\): the process count comes from"):
        fabric_offload(fabric, compute_device="cpu", local_processes=4)
    assert fabric_offload(fabric, compute_device="cpu").local_processes == 1


def test_callback_through_fabric_call_raises_and_names_the_fabric_helper() -> None:
    """``Fabric(callbacks=[...])`` + ``fabric.call`` never runs the callback's ``setup``: it must not do nothing."""
    callback = ActivationOffloadCallback(mode="sync", **OFFLOAD_ALL)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[callback])
    model = fabric.setup_module(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"on_train_batch_start\(trainer=Fabric\).*fabric_offload\(fabric, model\)"):
        fabric.call("on_train_batch_start", fabric, model, torch.zeros(2, 4), 0)


def test_checkpoint_by_hand_switches_the_planner_off_as_in_offload_activations() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    assert fabric_offload(fabric, module, checkpoint="auto", compute_device="cpu").options.memory_budget is None
    assert offload_activations(model=module, checkpoint="auto", compute_device="cpu").options.memory_budget is None


@pytest.mark.parametrize(
    ("options", "error", "start"),
    [
        ({"mode": "fast"}, ValueError, "fabric_offload(mode='fast'): mode must be one of"),
        ({"memory_budget": "-3GiB"}, ValueError, "fabric_offload(memory_budget='-3GiB'): memory_budget must be"),
        ({"compute_device": "tpu"}, ValueError, "fabric_offload(compute_device='tpu'): expected"),
        ({"prefetch": 1}, TypeError, "fabric_offload() got unexpected argument(s) ['prefetch']; allowed:"),
        ({"checkpoint": "Nope"}, ValueError, "fabric_offload(checkpoint='Nope'): 'Nope' matches no module"),
        ({"checkpoint": 3}, ValueError, "fabric_offload(checkpoint=3): checkpoint must be"),
        ({"optimizer": "adam"}, TypeError, "fabric_offload(optimizer=str): optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_fabric_offload_errors_quote_fabric_offload_and_wrap_nothing(
    options: dict[str, Any], error: type[Exception], start: str
) -> None:
    """A bad option raises quoting ``fabric_offload``, the call the user made (not ``offload_activations`` or
    ``apply_checkpointing``, which it uses), and no block is checkpointed."""
    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(error) as info:
        fabric_offload(fabric, module, **{"compute_device": "cpu", "checkpoint": "Linear", **options})
    assert str(info.value).startswith(start), str(info.value)
    assert checkpointed_modules(module) == []


@pytest.mark.parametrize(("fabric", "model"), [(None, None), (nn.Linear(2, 2), None), ("fabric", [nn.Linear(2, 2)])])
def test_fabric_offload_refuses_what_is_not_a_fabric_or_a_module_naming_the_argument(fabric: Any, model: Any) -> None:
    """A model passed in Fabric's place (or ``None``) raises TypeError naming ``fabric``, not an AttributeError from
    inside; a model that is not a module names ``model``."""
    if fabric == "fabric":
        fabric = Fabric(accelerator="cpu", devices=1)
        match = r"^fabric_offload\(model=list\): model must be a torch.nn.Module or None"
    else:
        match = rf"^fabric_offload\(fabric={type(fabric).__name__}\): fabric must be a lightning.fabric.Fabric"
    with pytest.raises(TypeError, match=match):
        fabric_offload(fabric, model, compute_device="cpu")


@pytest.mark.parametrize(
    ("options", "override"),
    [
        ({"mode": "sync"}, "mode='sync'"),
        ({"max_offload_bytes": 1024}, "max_offload_bytes=1024"),
        ({"checkpoint": "auto"}, "checkpoint='auto'"),
    ],
)
def test_a_budget_fabric_offload_cannot_use_is_one_warning_quoting_fabric_offload(
    options: dict[str, Any], override: str
) -> None:
    """A ``memory_budget`` beside a manual override or a mode that does not plan goes unused: said once, quoting the
    call the user made (not ``offload_activations``, which it uses), pointing at the user's line; the default budget
    says nothing."""
    fabric = Fabric(accelerator="cpu", devices=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        fabric_offload(fabric, module, compute_device="cpu", memory_budget="1GiB", **options)
    unused = [w for w in caught if "memory_budget is not used" in str(w.message)]
    assert [str(w.message).split(":")[0] for w in unused] == [f"fabric_offload(memory_budget='1GiB', {override})"]
    assert unused[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric_offload(fabric, nn.ModuleList(nn.Linear(2, 2) for _ in range(2)), compute_device="cpu", **options)


@pytest.mark.parametrize("compute_device", ["cpu", "cuda:0", torch.device("cuda", 0)])
def test_a_compute_device_other_than_fabrics_cuda_device_is_refused(compute_device: Any) -> None:
    """On rank 1 of a CUDA Fabric (``cuda:1``), ``compute_device="cuda:0"`` (copied from single-GPU code) or
    ``"cpu"`` would offload nothing on that rank, without a word: its activations are on ``cuda:1``."""
    fabric = SimpleNamespace(device=torch.device("cuda", 1), strategy=SimpleNamespace(num_processes=2))
    with pytest.raises(ValueError) as info:
        fabric_offload(fabric, nn.Linear(2, 2), compute_device=compute_device)
    assert str(info.value).startswith(
        f"fabric_offload(compute_device={compute_device!r}): Fabric runs this process on 'cuda:1'"
    ), str(info.value)


def test_data_parallel_over_several_devices_is_refused() -> None:
    """``strategy="dp"`` runs each replica's forward in a thread of its own; saved-tensor hooks are per thread, so
    the engine entered in the loop's thread would see none of the activations and offload nothing, silently."""
    dp = DataParallelStrategy(parallel_devices=[torch.device("cpu"), torch.device("cpu")])
    fabric = SimpleNamespace(device=dp.root_device, strategy=dp)
    with pytest.raises(ValueError, match=r"^fabric_offload\(fabric\): Fabric's strategy 'dp' \(DataParallelStrategy"):
        fabric_offload(fabric, nn.Linear(2, 2), compute_device="cpu")
    # On one device ``DataParallel`` calls the module in the caller's thread: the hooks see its activations.
    one = DataParallelStrategy(parallel_devices=[torch.device("cpu")])
    assert fabric_offload(SimpleNamespace(device=one.root_device, strategy=one), compute_device="cpu") is not None
