"""CPU tests of ``ActivationOffloadCallback`` inside a real ``lightning.pytorch.Trainer``.

With ``compute_device="cpu"`` the engine treats CPU tensors as offloadable (it copies them into separate host
buffers), so every Lightning step shape can be exercised without a GPU. Each test trains a tiny model for two
optimizer steps and compares the parameters bit for bit with a run without the callback; the leak checks look at
the saved-tensor hook stack and at the process-wide CPU host pool.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import gc
import pickle
import warnings
from collections import UserDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

import lightning_offload.datapath as datapath_module
import lightning_offload.engine as engine_module
from lightning_offload import ActivationOffloadCallback, OffloadStats, apply_checkpointing, reporting
from lightning_offload.budget import BudgetPlanner
from lightning_offload.checkpointing import checkpointed_modules
from lightning_offload.device_memory import AllocatorCounters
from lightning_offload.host_pool import pool_for
from lightning_offload.streams import SimulatedStreams
from tests import test_budget as budget_tests
from tests.models import MLP, CheckpointModel, LengthLM, length_tokens

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*train_dataloader yielded None:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*training_step. returned .None.:UserWarning"),
]

CPU = torch.device("cpu")
WIDTH = 32
BATCH = 8


def top_hooks() -> object:
    """The innermost default saved-tensor hooks of this thread, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def cpu_pool_in_use() -> int:
    """Bytes of CPU host-pool buffers handed out and not given back."""
    return pool_for(CPU).in_use_bytes


@pytest.fixture(autouse=True)
def _pool_starts_empty() -> Iterator[None]:
    """Garbage of earlier tests (graphs kept alive by reference cycles) may still hold pooled buffers."""
    if cpu_pool_in_use():
        gc.collect()
    assert cpu_pool_in_use() == 0, "an earlier test left host buffers in use"
    yield
    assert torch.is_grad_enabled(), "grad mode left disabled"


def offload_callback(**kwargs: Any) -> ActivationOffloadCallback:
    """A callback that offloads every eligible CPU tensor (no size threshold, no resident tail).

    Under a ``memory_budget`` it says, as it is made, that no planner can run on the CPU: true in a real run, and
    expected here, where the tests that plan give the planner fake allocator counters (``planner_for_counters``).
    """
    options: dict[str, Any] = {"compute_device": "cpu", "min_tensor_bytes": 0, "resident_tail_bytes": 0}
    options.update(kwargs)
    if options.get("memory_budget", "auto") in (None, "auto"):
        return ActivationOffloadCallback(**options)
    with pytest.warns(UserWarning, match=r"memory_budget is not used: the memory-budget planner needs a CUDA device"):
        return ActivationOffloadCallback(**options)


def batches(n: int, shape: tuple[int, ...] = (BATCH, WIDTH), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def loader(data: list[Any]) -> DataLoader:
    return DataLoader(data, batch_size=None)


# ---------------------------------------------------------------------------------------------- models


class Block(nn.Module):
    """A residual MLP block; many of them in a ModuleList make ``checkpoint="auto"`` pick the list."""

    def __init__(self, dim: int = WIDTH, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.norm(self.fc1(x))))


class BlockStack(nn.Module):
    """Blocks only, and a loss that saves nothing (``sum``): under checkpointing the block inputs are all that
    autograd saves outside the checkpointed regions."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.scale = nn.Linear(WIDTH, WIDTH)  # outside the list: ``auto`` must not checkpoint it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h)
        return self.scale.weight.sum() * 0 + h.sum()


class FailInBackward(torch.autograd.Function):
    """Saves its input (so the engine offloads it) and raises in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


class FailingMLP(MLP):
    """``MLP`` with its first activation routed through ``FailInBackward`` while ``fail`` is set."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.fail:
            h = FailInBackward.apply(h)
        h = torch.relu(self.fc2(self.norm(h)))
        return self.fc3(h).pow(2).mean()


def build_net(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory()


class LitNet(pl.LightningModule):
    """Trains ``net`` (which returns its loss) with SGD; records every forward and every gradient.

    ``forward_log`` holds, per forward in ``training_step``, whether saved-tensor hooks were installed and how many
    bytes the offload engine copied during that forward (when ``offload`` is set and has an engine).
    """

    def __init__(self, factory: Callable[[], nn.Module] = MLP, offload: ActivationOffloadCallback | None = None):
        super().__init__()
        self.net = build_net(factory)
        self.offload = offload
        self.forward_log: list[tuple[bool, int]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def forward_logged(self, batch: torch.Tensor) -> torch.Tensor:
        engine = self.offload.engine if self.offload is not None else None
        before = engine.collect_stats(wait=False).offloaded_bytes if engine is not None else 0
        hooked = top_hooks() is not None
        loss = self.net(batch)
        after = engine.collect_stats(wait=False).offloaded_bytes if engine is not None else 0
        self.forward_log.append((hooked, after - before))
        return loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        return self.forward_logged(batch)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """Listed after the offload callback: what each training batch left behind once it ended."""

    def __init__(self, offload: ActivationOffloadCallback) -> None:
        self.offload = offload
        self.stats: list[OffloadStats] = []
        self.hooks_after_batch: list[bool] = []
        self.in_use_after_batch: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.stats.append(copy.copy(self.offload.stats))
        self.hooks_after_batch.append(top_hooks() is not None)
        self.in_use_after_batch.append(cpu_pool_in_use())


def fit(
    tmp_path: Path,
    module: pl.LightningModule,
    data: list[Any],
    callbacks: list[pl.Callback] | None = None,
    val_data: list[Any] | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 2,
        "logger": CSVLogger(tmp_path),
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=callbacks or [], **kwargs)
    trainer.fit(module, loader(data), loader(val_data) if val_data is not None else None)
    return trainer


def assert_same_training(got: LitNet, want: LitNet) -> None:
    """Bit-for-bit equal parameters and per-step gradients."""
    assert len(got.grads) == len(want.grads) > 0
    for step, (g, w) in enumerate(zip(got.grads, want.grads, strict=True)):
        assert g.keys() == w.keys(), step
        for name in w:
            assert torch.equal(g[name], w[name]), f"step {step} grad {name}: {(g[name] - w[name]).abs().max()}"
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name}: max abs diff {(a - b).abs().max().item()}"


def assert_clean(callback: ActivationOffloadCallback) -> None:
    """After fit: no hooks, nothing held in the host pool, the engine torn down."""
    assert top_hooks() is None, "saved-tensor hooks left installed"
    gc.collect()
    assert cpu_pool_in_use() == 0, "host buffers still held"
    assert callback.engine is None, "engine not torn down"


def run_pair(
    tmp_path: Path,
    make_module: Callable[[ActivationOffloadCallback | None], LitNet],
    data: list[Any],
    callback: ActivationOffloadCallback,
    **trainer_kwargs: Any,
) -> tuple[LitNet, LitNet, Recorder]:
    """Train once without the callback and once with it (plus a ``Recorder``); same data, same trainer args."""
    plain = make_module(None)
    fit(tmp_path / "plain", plain, data, **trainer_kwargs)
    offloaded = make_module(callback)
    recorder = Recorder(callback)
    fit(tmp_path / "offload", offloaded, data, [callback, recorder], **trainer_kwargs)
    return plain, offloaded, recorder


# ---------------------------------------------------------------------------------------------- step shapes


@pytest.mark.parametrize("mode", ["streamed", "sync"])
def test_automatic_optimization(tmp_path: Path, mode: str) -> None:
    callback = offload_callback(mode=mode)
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LitNet(offload=cb), batches(2), callback)
    assert_same_training(offloaded, plain)
    assert len(offloaded.grads) == 2
    assert callback.stats.offloaded_bytes > 0
    assert all(s.offloaded_bytes > 0 for s in recorder.stats)
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert recorder.hooks_after_batch == [False, False]
    assert recorder.in_use_after_batch == [0, 0]
    assert_clean(callback)


def test_gradient_accumulation(tmp_path: Path) -> None:
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(
        tmp_path, lambda cb: LitNet(offload=cb), batches(4), callback, accumulate_grad_batches=2
    )
    assert_same_training(offloaded, plain)
    assert len(offloaded.grads) == 2 and len(offloaded.forward_log) == 4
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert [s.offloaded_bytes > 0 for s in recorder.stats] == [True] * 4
    assert recorder.hooks_after_batch == [False] * 4
    assert recorder.in_use_after_batch == [0] * 4
    assert_clean(callback)


class ManualLit(LitNet):
    """Manual optimization: two forwards and two ``manual_backward`` calls per batch, two optimizers.

    The second forward runs after the first backward, so the hooks must stay installed until the batch ends.
    """

    def __init__(self, offload: ActivationOffloadCallback | None = None) -> None:
        super().__init__(MLP, offload)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        self.manual_backward(self.forward_logged(batch))
        self.manual_backward(self.forward_logged(batch.flip(0) * 0.5))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self) -> Any:
        first = [*self.net.fc1.parameters(), *self.net.norm.parameters()]
        rest = [*self.net.fc2.parameters(), *self.net.fc3.parameters()]
        return torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.05, momentum=0.9)


def test_manual_optimization(tmp_path: Path) -> None:
    callback = offload_callback()
    # Every optimizer.step() counts towards max_steps in manual optimization: two batches, two optimizers each.
    plain, offloaded, recorder = run_pair(tmp_path, ManualLit, batches(2), callback, max_steps=-1, max_epochs=1)
    assert_same_training(offloaded, plain)
    assert len(offloaded.grads) == 4  # two optimizers x two batches
    assert len(offloaded.forward_log) == 4
    # The forward after the first backward of each batch is offloaded too.
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log), offloaded.forward_log
    assert recorder.hooks_after_batch == [False, False]
    assert recorder.in_use_after_batch == [0, 0]
    assert callback.stats.offloaded_bytes > 0
    assert_clean(callback)


class LBFGSLit(LitNet):
    """LBFGS: Lightning's closure re-runs forward and backward several times within one batch."""

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


def test_lbfgs_offloads_every_closure_call(tmp_path: Path) -> None:
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LBFGSLit(offload=cb), batches(2), callback)
    assert_same_training(offloaded, plain)
    assert len(plain.forward_log) == len(offloaded.forward_log) > 2  # several closure calls per batch
    assert recorder.hooks_after_batch == [False, False]
    assert recorder.in_use_after_batch == [0, 0]
    assert_clean(callback)
    # Every closure call, not only the first of each batch, runs under the hooks and offloads.
    assert all(hooked for hooked, _ in offloaded.forward_log), offloaded.forward_log
    assert all(nbytes > 0 for _, nbytes in offloaded.forward_log), offloaded.forward_log


class SometimesNoneLit(LitNet):
    """``training_step`` runs forward on every batch but returns None on odd ones (no backward)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = self.forward_logged(batch)
        return None if batch_idx % 2 else loss


def test_training_step_returning_none(tmp_path: Path) -> None:
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(
        tmp_path, lambda cb: SometimesNoneLit(offload=cb), batches(4), callback, max_steps=-1, max_epochs=1
    )
    assert_same_training(offloaded, plain)
    assert len(offloaded.forward_log) == 4
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    # The graphs of the None batches were dropped without backward: their host copies went back to the pool.
    assert recorder.hooks_after_batch == [False] * 4
    assert recorder.in_use_after_batch == [0] * 4
    assert all(s.offloaded_bytes > 0 for s in recorder.stats)
    assert_clean(callback)


def test_bf16_mixed(tmp_path: Path) -> None:
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(
        tmp_path, lambda cb: LitNet(offload=cb), batches(2), callback, precision="bf16-mixed"
    )
    assert_same_training(offloaded, plain)
    assert callback.stats.offloaded_bytes > 0
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert recorder.in_use_after_batch == [0, 0]
    assert_clean(callback)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="precision='16-mixed' needs CUDA (Lightning's fp16 AMP has no CPU backend); this test runs on a GPU",
)
def test_16_mixed_on_cuda(tmp_path: Path) -> None:
    data = batches(2)
    plain = LitNet()
    fit(tmp_path / "plain", plain, data, accelerator="cuda", precision="16-mixed")
    callback = ActivationOffloadCallback(min_tensor_bytes=0, resident_tail_bytes=0)  # compute_device: the GPU
    offloaded = LitNet()
    fit(tmp_path / "offload", offloaded, data, [callback], accelerator="cuda", precision="16-mixed")
    assert_same_training(offloaded, plain)
    assert callback.stats.offloaded_bytes > 0
    assert top_hooks() is None and callback.engine is None


def test_non_reentrant_checkpoint_in_model(tmp_path: Path) -> None:
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LitNet(CheckpointModel, cb), batches(2), callback)
    assert_same_training(offloaded, plain)
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert recorder.in_use_after_batch == [0, 0]
    assert_clean(callback)


def test_checkpoint_auto_offloads_only_block_inputs(tmp_path: Path) -> None:
    callback = offload_callback(checkpoint="auto")
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LitNet(BlockStack, cb), batches(2), callback)
    assert_same_training(offloaded, plain)
    # Only the three block inputs (each BATCH x WIDTH float32: the batch, then each block's output) are saved
    # outside the checkpointed blocks; the blocks' insides are recomputed in backward.
    block_input_bytes = BATCH * WIDTH * 4
    expected = len(offloaded.net.blocks) * block_input_bytes
    assert [s.offloaded_bytes for s in recorder.stats] == [expected, expected]
    assert [nbytes for _, nbytes in offloaded.forward_log] == [expected, expected]
    # Without ``checkpoint`` the same model offloads far more.
    uncheckpointed = offload_callback()
    fit(tmp_path / "nockpt", LitNet(BlockStack, uncheckpointed), batches(2), [uncheckpointed])
    assert uncheckpointed.stats.offloaded_bytes > 3 * expected
    assert_clean(callback)


class RecomputeSpy(pl.Callback):
    """Notes, at every batch, what backward reruns of each block ``checkpoint=`` wrapped."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.seen.append([block.__dict__["forward"].recompute for block in pl_module.net.blocks])


def test_checkpoint_with_elementwise_recompute_trains_as_plain_and_offloads_only_block_inputs(tmp_path: Path) -> None:
    """``recompute="elementwise"``: each block keeps its 128-deep product on the device and recomputes the rest;
    the engine sees (and offloads) the block inputs only, as with whole-block checkpointing, and training is the
    plain one. The wrappers are gone after the fit."""
    callback = offload_callback(checkpoint="auto", recompute="elementwise")
    spy = RecomputeSpy()
    module = LitNet(BlockStack, callback)
    plain = LitNet(BlockStack, None)
    plain.load_state_dict(module.state_dict())
    fit(tmp_path / "plain", plain, batches(2))
    fit(tmp_path / "offloaded", module, batches(2), [callback, spy])
    assert_same_training(module, plain)
    assert spy.seen == [["elementwise"] * 3] * 2
    expected = len(module.net.blocks) * BATCH * WIDTH * 4
    assert [nbytes for _, nbytes in module.forward_log] == [expected, expected]
    assert all("forward" not in block.__dict__ for block in module.net.blocks)
    assert_clean(callback)


def test_recompute_needs_checkpoint_and_one_of_its_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"ActivationOffloadCallback\(checkpoint=None, recompute='elementwise'\): "
        r"recompute applies to the blocks checkpoint= selects; pass checkpoint='auto'",
    ):
        ActivationOffloadCallback(recompute="elementwise")
    with pytest.raises(
        ValueError,
        match=r"ActivationOffloadCallback\(checkpoint='auto', recompute='some'\): "
        r"recompute must be one of 'all', 'elementwise'",
    ):
        ActivationOffloadCallback(checkpoint="auto", recompute="some")


class ConfigureModelLit(LitNet):
    """Builds its network in ``configure_model``, Lightning's hook for large and sharded models.

    Lightning calls callbacks' ``setup`` first, then the module's ``setup``, then ``configure_model``.
    """

    def __init__(self, offload: ActivationOffloadCallback | None = None) -> None:
        super().__init__(BlockStack, offload)
        del self.net

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = build_net(BlockStack)


def test_checkpoint_auto_with_model_built_in_configure_model(tmp_path: Path) -> None:
    callback = offload_callback(checkpoint="auto")
    plain, offloaded, recorder = run_pair(tmp_path, ConfigureModelLit, batches(2), callback)
    assert_same_training(offloaded, plain)
    expected = len(offloaded.net.blocks) * BATCH * WIDTH * 4  # only the block inputs, as above
    assert [s.offloaded_bytes for s in recorder.stats] == [expected, expected]
    assert_clean(callback)


def test_checkpoint_accepts_a_class_and_lists_mixing_classes_and_names(tmp_path: Path) -> None:
    """``checkpoint=`` takes an ``nn.Module`` subclass, or a list mixing classes and names, like
    ``apply_checkpointing``: the blocks are checkpointed, so only their inputs are offloaded."""
    for i, checkpoint in enumerate((Block, ["net.blocks.0", Block])):
        callback = offload_callback(checkpoint=checkpoint)
        plain, offloaded, recorder = run_pair(
            tmp_path / str(i), lambda cb: LitNet(BlockStack, cb), batches(2), callback
        )
        assert_same_training(offloaded, plain)
        expected = len(offloaded.net.blocks) * BATCH * WIDTH * 4  # only the block inputs, as with "auto"
        assert [s.offloaded_bytes for s in recorder.stats] == [expected, expected], checkpoint
        assert_clean(callback)


class SetupSpy(pl.Callback):
    """Listed after the offload callback: records the hooks Lightning reached."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.calls.append("setup")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.calls.append("on_fit_start")


@pytest.mark.parametrize("on_cuda_only", [False, True])
def test_checkpoint_name_matching_nothing_fails_at_setup(tmp_path: Path, on_cuda_only: bool) -> None:
    """A ``checkpoint=`` name that matches no module raises in ``setup`` (before the next callback's ``setup``),
    listing the candidate block classes, also when the callback does nothing on this machine (no CUDA)."""
    kwargs: dict[str, Any] = {"checkpoint": ["Block", "DecoderLayer"]}
    callback = ActivationOffloadCallback(**kwargs) if on_cuda_only else offload_callback(**kwargs)
    spy = SetupSpy()
    module = LitNet(BlockStack, callback)
    with pytest.raises(ValueError) as info:
        fit(tmp_path, module, batches(2), [callback, spy])
    message = str(info.value)
    assert message.startswith(
        "ActivationOffloadCallback(checkpoint=['Block', 'DecoderLayer']): 'DecoderLayer' matches no module of LitNet"
    ), message
    assert "candidate block classes: ['Block', 'Linear', 'LayerNorm']" in message, message
    assert spy.calls == []
    assert module.forward_log == []
    assert checkpointed_modules(module) == []
    assert top_hooks() is None


def test_checkpoint_name_matching_nothing_with_configure_model_fails_before_training(tmp_path: Path) -> None:
    """When the blocks are built in ``configure_model`` (after ``setup``), the name is checked as soon as they
    exist: before the first batch, with the candidates listed."""
    callback = offload_callback(checkpoint="DecoderLayer")
    spy = SetupSpy()
    module = ConfigureModelLit(callback)
    with pytest.raises(ValueError, match=r"'DecoderLayer' matches no module.*candidate block classes: \['Block'"):
        fit(tmp_path, module, batches(2), [callback, spy])
    assert spy.calls == ["setup"]
    assert module.forward_log == []
    assert top_hooks() is None


def saved_tensor_count(net: nn.Module, batch: torch.Tensor) -> int:
    """How many tensors autograd saves in one training forward of ``net`` (checkpointed blocks save only inputs)."""
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(batch)
    return count


class FailingStackLit(LitNet):
    """``BlockStack`` whose ``training_step`` raises on batch 1."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.forward_logged(batch)
        if batch_idx == 1:
            raise RuntimeError("training_step failed on purpose")
        return loss


@pytest.mark.parametrize("fails", [False, True])
def test_checkpoint_wrappers_removed_after_fit(tmp_path: Path, fails: bool) -> None:
    """The wrappers ``checkpoint=`` applied are gone after ``fit`` (also one that raised): every block's forward is
    the class's again and saves what it saved before; ``state_dict`` keys are unchanged; wrappers the user applied
    before the fit stay."""
    callback = offload_callback(checkpoint="auto")
    module = (FailingStackLit if fails else LitNet)(BlockStack, callback)
    # The user's own, with elementwise recompute: not the callback's to remove, nor to switch to its recompute.
    apply_checkpointing(module, "net.blocks.0", recompute="elementwise")
    module.train()
    x = batches(1)[0]
    keys = list(module.state_dict())
    saved_before = saved_tensor_count(module.net, x)
    if fails:
        with pytest.raises(RuntimeError, match="failed on purpose"):
            fit(tmp_path, module, batches(3), [callback], max_steps=3)
    else:
        fit(tmp_path, module, batches(2), [callback])
    # Checkpointing ran during the fit: only the three block inputs were offloaded.
    assert module.forward_log[0] == (True, len(module.net.blocks) * BATCH * WIDTH * 4)
    assert checkpointed_modules(module) == ["net.blocks.0"]
    assert module.net.blocks[0].__dict__["forward"].recompute == "elementwise"
    assert all("forward" not in block.__dict__ for block in module.net.blocks[1:])
    assert list(module.state_dict()) == keys
    module.train()
    assert saved_tensor_count(module.net, x) == saved_before
    assert top_hooks() is None


class ValidatingLit(LitNet):
    """Validation inside training: records whether hooks were installed while it ran, and what the engine saw."""

    def __init__(self, offload: ActivationOffloadCallback | None = None) -> None:
        super().__init__(MLP, offload)
        self.val_hooked: list[bool] = []
        self.engine_saved_during_val: list[int] = []

    def _saved(self) -> int:
        engine = self.offload.engine if self.offload is not None else None
        return engine.collect_stats(wait=False).saved_tensors if engine is not None else 0

    def on_validation_start(self) -> None:
        self._saved_at_start = self._saved()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_hooked.append(top_hooks() is not None)
        with torch.enable_grad():  # a graph is built (saved tensors exist) even in validation
            loss = self.net(batch.requires_grad_())
        self.log("val_loss", loss.detach())

    def on_validation_end(self) -> None:
        self.engine_saved_during_val.append(self._saved() - self._saved_at_start)


def test_validation_during_training(tmp_path: Path) -> None:
    callback = offload_callback()
    val = batches(3, seed=1)
    plain, offloaded, _ = run_pair(
        tmp_path,
        ValidatingLit,
        batches(2),
        callback,
        val_data=val,
        val_check_interval=1,
        limit_val_batches=2,
        num_sanity_val_steps=1,
    )
    assert_same_training(offloaded, plain)
    assert len(offloaded.val_hooked) == 1 + 2 * 2  # sanity check, then two batches after each training step
    assert not any(offloaded.val_hooked)
    assert offloaded.engine_saved_during_val and not any(offloaded.engine_saved_during_val)
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert callback.stats.offloaded_bytes > 0
    assert_clean(callback)


def test_dataloader_yielding_none(tmp_path: Path) -> None:
    b = batches(3)
    data = [b[0], None, b[1], b[2]]  # None skips on_train_batch_start and training_step, not on_train_batch_end
    callback = offload_callback()
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LitNet(offload=cb), data, callback)
    assert_same_training(offloaded, plain)
    assert len(offloaded.forward_log) == 2
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert recorder.hooks_after_batch == [False] * 3
    assert recorder.in_use_after_batch == [0] * 3
    assert_clean(callback)


def test_dataloader_yielding_none_reports_nothing_offloaded(tmp_path: Path) -> None:
    """``stats`` is documented as what the latest training batch offloaded; a None batch offloaded nothing."""
    b = batches(2)
    callback = offload_callback()
    module = LitNet(offload=callback)
    recorder = Recorder(callback)
    fit(tmp_path, module, [b[0], None, b[1]], [callback, recorder])
    assert [s.offloaded_bytes > 0 for s in recorder.stats] == [True, False, True]


class SkipRestOfEpochLit(LitNet):
    """``on_train_batch_start`` returns -1 on the second batch of every epoch: the rest of the epoch is skipped
    without ``on_train_batch_end`` (the offload callback's ``on_train_batch_start`` has run by then; callbacks
    run before the module)."""

    def __init__(self, offload: ActivationOffloadCallback | None = None) -> None:
        super().__init__(MLP, offload)
        self.hooked_at_epoch_end: list[bool] = []
        self.skipped = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if batch_idx == 1:
            self.skipped += 1
            return -1
        return None

    def on_train_epoch_end(self) -> None:
        self.hooked_at_epoch_end.append(top_hooks() is not None)


def test_on_train_batch_start_minus_one(tmp_path: Path) -> None:
    callback = offload_callback()
    # Epoch 0: batch 0 steps, batch 1 returns -1; epoch 1: batch 0 steps and max_steps=2 ends the fit.
    plain, offloaded, recorder = run_pair(tmp_path, SkipRestOfEpochLit, batches(3), callback, max_epochs=5)
    assert_same_training(offloaded, plain)
    assert offloaded.skipped == 1 and len(offloaded.forward_log) == 2
    assert offloaded.hooked_at_epoch_end == [False, False]
    assert recorder.hooks_after_batch == [False, False]
    assert all(hooked and nbytes > 0 for hooked, nbytes in offloaded.forward_log)
    assert_clean(callback)


# ---------------------------------------------------------------------------------------------- exceptions


class RaisingLit(LitNet):
    """Raises on batch 1: in ``training_step`` after the forward, or in backward (``FailInBackward``)."""

    def __init__(self, offload: ActivationOffloadCallback | None, where: str) -> None:
        super().__init__(FailingMLP, offload)
        self.where = where

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.net.fail = self.where == "backward" and batch_idx == 1
        loss = self.forward_logged(batch)
        if self.where == "training_step" and batch_idx == 1:
            raise RuntimeError("training_step failed on purpose")
        return loss


@pytest.mark.parametrize("where", ["training_step", "backward"])
def test_exception_leaves_nothing_behind(tmp_path: Path, where: str) -> None:
    callback = offload_callback()
    module = RaisingLit(callback, where)
    with pytest.raises(RuntimeError, match=f"{where} failed on purpose"):
        fit(tmp_path / "raise", module, batches(3), [callback], max_steps=3)
    assert len(module.forward_log) == 2 and all(h and n > 0 for h, n in module.forward_log)
    assert top_hooks() is None, "saved-tensor hooks left installed after the exception"
    # A fresh forward is not packed: tanh saves its output, and without hooks autograd hands back that very
    # storage (an offloaded one would come back from a separate host buffer).
    y = torch.tanh(torch.randn(4, 4, requires_grad=True))
    assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()
    gc.collect()
    assert cpu_pool_in_use() == 0, "host buffers still held after the exception"
    engine = callback.engine  # teardown does not run after an exception; on_exception must have reset it
    if engine is not None:
        assert not engine.installed
        stats = engine.collect_stats(wait=False)
        assert stats.host_bytes_held == 0 and stats.inflight_bytes == 0
    # The same callback trains normally afterwards, bit for bit like a plain run.
    plain = LitNet(FailingMLP)
    fit(tmp_path / "plain", plain, batches(2))
    again = LitNet(FailingMLP, callback)
    fit(tmp_path / "again", again, batches(2), [callback])
    assert_same_training(again, plain)
    assert callback.stats.offloaded_bytes > 0
    assert_clean(callback)


# ---------------------------------------------------------------------------------------------- logging


def metrics_rows(root: Path) -> list[dict[str, str]]:
    (path,) = root.rglob("metrics.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class ConstantMemory:
    """Allocator counters of a device whose memory never moves: lets the memory-budget planner run on the CPU."""

    def total(self) -> int:
        return 64 << 30

    def allocated(self) -> int:
        return 1 << 30

    def peak(self) -> int:
        return 1 << 30

    def reset_peak(self) -> None:
        pass


def test_plan_keys_are_logged_only_for_batches_that_ran_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a memory budget the first two batches measure, and so does the batch after the input's shape changes:
    they ran no plan, so their ``plan_*`` keys are NaN (left out, Lightning logs a key's last value again: the
    previous shape's plan would name a batch that did not run it)."""
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, memory: Any = None, **_: Any) -> Any:
        return planner_for(options, device, transfer, model, ConstantMemory())

    monkeypatch.setattr(engine_module, "planner_for", with_memory)
    callback = offload_callback(memory_budget="8GiB")
    data = batches(3) + batches(2, shape=(2 * BATCH, WIDTH))
    fit(tmp_path, LitNet(offload=callback), data, [callback], max_steps=5)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert len(rows) == 5
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, True, False, True]
    assert [row["offload/plan_checkpoint_blocks"] for row in rows] == ["nan", "nan", "0.0", "nan", "0.0"]
    # A plan that keeps everything is not timed against others.
    assert [row["offload/plan_trial"] for row in rows] == ["nan", "nan", "0.0", "nan", "0.0"]
    assert [row["offload/plan_split"] for row in rows] == ["nan", "nan", "0.0", "nan", "0.0"]  # blocks whole, if any
    assert {row["offload/memory_budget_gib"] for row in rows} == {"8.0"}


class OutOfMemoryLit(LitNet):
    """Raises CUDA's out-of-memory error (on the CPU too: it is an exception class) in ``training_step`` at batch 2,
    the first planned one, or in ``validation_step``, which runs after batch 2 (``val_check_interval=3``)."""

    def __init__(self, offload: ActivationOffloadCallback, where: str) -> None:
        super().__init__(offload=offload)
        self.where = where

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if self.where == "training_step" and batch_idx == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised on purpose)")
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.where == "validation_step":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised on purpose)")


@pytest.mark.parametrize("where", ["training_step", "validation_step"])
def test_out_of_memory_is_explained_under_a_budget_only_when_a_training_batch_raised_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """The planner explains an out-of-memory error in terms of the training step it planned; one raised outside a
    training batch (validation here) used none of that plan, and an explanation would blame the wrong step."""
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, memory: Any = None, **_: Any) -> Any:
        return planner_for(options, device, transfer, model, ConstantMemory())

    monkeypatch.setattr(engine_module, "planner_for", with_memory)
    callback = offload_callback(memory_budget="8GiB")
    module = OutOfMemoryLit(callback, where)
    with caplog.at_level("WARNING", logger="lightning_offload"), pytest.raises(torch.cuda.OutOfMemoryError):
        fit(
            tmp_path,
            module,
            batches(4),
            [callback],
            val_data=batches(1),
            max_steps=4,
            val_check_interval=3,
            num_sanity_val_steps=0,
        )
    explained = [r.getMessage() for r in caplog.records if "memory_budget=8.00 GiB: out of memory in" in r.getMessage()]
    if where == "training_step":
        assert len(explained) == 1 and "a planned step" in explained[0]
    else:
        assert explained == []
    assert top_hooks() is None
    engine = callback.engine
    assert engine is not None and not engine.installed
    assert engine.collect_stats(wait=False).host_bytes_held == 0


def test_logged_metrics_respect_log_every_n_steps(tmp_path: Path) -> None:
    callback = offload_callback(measure_copies=True)
    fit(tmp_path, LitNet(offload=callback), batches(4), [callback], max_steps=4, log_every_n_steps=2)
    rows = metrics_rows(tmp_path)
    keys = set().union(*(row.keys() for row in rows))
    assert {"offload/offloaded_gib", "offload/host_pinned_gib"} <= keys
    # CUDA-only metrics are not logged on the CPU: peaks need the CUDA allocator, stall and bandwidth CUDA events.
    cuda_only = {"offload/peak_allocated_gib", "offload/peak_reserved_gib", "offload/alloc_flushes", "offload/stall_ms"}
    cuda_only |= {"offload/d2h_gbps", "offload/h2d_gbps"}
    assert not cuda_only & keys
    logged = [row for row in rows if row.get("offload/offloaded_gib")]
    assert [int(row["step"]) for row in logged] == [1, 3]  # every second of four steps
    for row in logged:
        assert float(row["offload/offloaded_gib"]) > 0
        assert float(row["offload/host_pinned_gib"]) > 0
    assert float(logged[-1]["offload/offloaded_gib"]) == pytest.approx(callback.stats.offloaded_bytes / 2**30)


def fake_cuda_peaks(monkeypatch: pytest.MonkeyPatch, peaks: FakeCudaPeaks) -> None:
    """Make the reporter read ``peaks`` as the CUDA allocator's counters (and so log the CUDA-only figures)."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", peaks.reset)
    monkeypatch.setattr(reporting, "read_counters", peaks.counters)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)


def plan_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the memory-budget planner on the CPU, on ``ConstantMemory``."""
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, memory: Any = None, **_: Any) -> Any:
        return planner_for(options, device, transfer, model, ConstantMemory())

    monkeypatch.setattr(engine_module, "planner_for", with_memory)


def test_a_batch_the_dataloader_skipped_logs_nothing_offloaded_no_peak_and_no_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A None batch runs no step, yet Lightning writes a row under its step, with the last value each key was given:
    the batch before's offloaded bytes, peak, cache flushes and plan must not be logged as this batch's."""
    peaks = FakeCudaPeaks(left_over=0, step_peak=2 << 30, flushes=[1, 1, 1, 1])
    fake_cuda_peaks(monkeypatch, peaks)
    plan_on_cpu(monkeypatch)

    class PeakNet(LitNet):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
            peaks.step()
            return super().training_step(batch, batch_idx)

    callback = offload_callback(memory_budget="8GiB")
    b = batches(4)
    # Batches 0 and 1 measure (the first offloads), 2 and 3 run the plan; a None follows the first and the third.
    data = [b[0], None, b[1], b[2], None, b[3]]
    fit(tmp_path, PeakNet(offload=callback), data, [callback], max_steps=-1, max_epochs=1)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3, 4, 5]
    assert float(rows[0]["offload/offloaded_gib"]) > 0
    assert [float(row["offload/offloaded_gib"]) for row in rows][1::3] == [0.0, 0.0]
    assert [row["offload/peak_allocated_gib"] for row in rows] == ["2.0", "nan", "2.0", "2.0", "nan", "2.0"]
    assert [row["offload/peak_reserved_gib"] for row in rows] == ["2.0", "nan", "2.0", "2.0", "nan", "2.0"]
    assert [row["offload/alloc_flushes"] for row in rows] == ["1.0", "nan", "1.0", "1.0", "nan", "1.0"]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, False, True, False, True]
    assert {row["offload/memory_budget_gib"] for row in rows} == {"8.0"}


def test_first_step_after_on_train_batch_start_minus_one_logs_its_own_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch that returned -1 opened a step that never ran; what the epoch's end did after it (here: a peak of 9
    GiB and 5 cache flushes) belongs to no step, and the next epoch's first step must measure from its own start."""
    peaks = FakeCudaPeaks(left_over=0, step_peak=2 << 30, flushes=[1, 1])
    fake_cuda_peaks(monkeypatch, peaks)

    class PeakNet(SkipRestOfEpochLit):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
            peaks.step()
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            super().on_train_epoch_end()
            peaks.peak, peaks.retries = 9 << 30, peaks.retries + 5  # the epoch's own work on the device

    callback = offload_callback()
    # Epoch 0: batch 0 steps, batch 1 returns -1; epoch 1: batch 0 steps and max_steps=2 ends the fit.
    fit(tmp_path, PeakNet(callback), batches(3), [callback], max_steps=2, max_epochs=5)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/peak_allocated_gib")]
    assert [row["offload/peak_allocated_gib"] for row in rows] == ["2.0", "2.0"]
    assert [row["offload/alloc_flushes"] for row in rows] == ["1.0", "1.0"]


def test_a_step_cut_short_by_on_train_batch_start_minus_one_is_not_measured_for_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch that returned -1 began a measuring step that ran nothing: planned from it, the next step's plan
    counted no activations at all. It is dropped, and the next batch measures in its place."""
    plan_on_cpu(monkeypatch)
    callback = offload_callback(memory_budget="8GiB")
    # Every epoch: batch 0 steps, batch 1 returns -1.
    fit(tmp_path, SkipRestOfEpochLit(callback), batches(3), [callback], max_steps=4, max_epochs=5)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, True, True]
    # ConstantMemory holds 1 GiB; a plan measured from steps that ran predicts the activations on top of it.
    assert all(float(row["offload/plan_peak_gib"]) > 1.0 for row in rows[2:])


def test_copy_timings_logged_for_a_step_are_its_own_when_the_step_before_was_not_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy timings finish on the device after their batch ends; a batch not logged does not wait for them. The next
    batch the logger writes must not count them as its own: identical steps log the same stall and bandwidth whether
    or not the step before was logged."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)  # log the figures CUDA events time
    keys = ("offload/stall_ms", "offload/d2h_gbps", "offload/h2d_gbps")

    def logged(every: int) -> dict[int, list[float]]:
        callback = offload_callback(measure_copies=True)
        root = tmp_path / f"every_{every}"
        fit(root, LitNet(offload=callback), batches(4), [callback], max_steps=4, log_every_n_steps=every)
        rows = [row for row in metrics_rows(root) if row.get(keys[0])]
        return {int(row["step"]): [float(row[key]) for key in keys] for row in rows}

    every_step, every_second = logged(1), logged(2)
    assert sorted(every_second) == [1, 3]
    assert every_step[1][1] > 0 and every_step[1][2] > 0
    for step in (1, 3):
        assert every_second[step] == pytest.approx(every_step[step]), step


def test_copy_bandwidth_is_logged_only_for_copies_that_were_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``measure_copies`` times the copies on the copy streams. ``mode="sync"`` copies on the compute stream, untimed,
    and a step that copied nothing moved no bytes: neither may log a bandwidth of 0 GB/s as that step's."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)  # log the figures CUDA events time
    keys = ("offload/d2h_gbps", "offload/h2d_gbps")

    def rows(name: str, **options: Any) -> list[dict[str, str]]:
        callback = offload_callback(measure_copies=True, **options)
        fit(tmp_path / name, LitNet(offload=callback), batches(3), [callback], max_steps=3)
        return [row for row in metrics_rows(tmp_path / name) if row.get("offload/host_pinned_gib")]

    sync = rows("sync", mode="sync")
    assert len(sync) == 3 and float(sync[-1]["offload/offloaded_gib"]) > 0
    assert not [row[key] for row in sync for key in keys if row.get(key)], "sync mode times no copy"
    nothing = rows("nothing", min_tensor_bytes=1 << 40)  # every saved tensor stays: no copy in any step
    assert len(nothing) == 3 and float(nothing[-1]["offload/offloaded_gib"]) == 0
    assert [row[key] for row in nothing for key in keys] == ["nan"] * 6
    streamed = rows("streamed")
    assert all(float(row[key]) > 0 for row in streamed for key in keys)


# ---------------------------------------------------------------------------------------------- configuration


def test_a_fit_whose_forwards_fit_in_the_resident_tail_says_it_offloads_nothing_once_per_fit(tmp_path: Path) -> None:
    """Every forward of this small model saves less than the default ``resident_tail_bytes`` (256 MiB), so nothing
    leaves the device: said once per fit (not per batch), and again in the next fit."""
    callback = offload_callback(resident_tail_bytes="256MiB")
    for run in ("first", "second"):
        module = LitNet(offload=callback)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(tmp_path / run, module, batches(3), [callback], max_steps=3)
        said = [str(w.message) for w in caught if "resident tail" in str(w.message)]
        assert len(said) == 1 and said[0].startswith("lightning_offload: nothing offloaded, because all "), said
        assert callback.stats.eligible_bytes > 0 and callback.stats.offloaded_bytes == 0


def test_cpu_without_compute_device_warns_once_and_does_nothing(tmp_path: Path) -> None:
    data = batches(2)
    plain = LitNet()
    fit(tmp_path / "plain", plain, data)
    callback = ActivationOffloadCallback(min_tensor_bytes=0, resident_tail_bytes=0)
    module = LitNet(offload=callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "offload", module, data, [callback])
    ours = [(w.category, str(w.message)) for w in caught if "ActivationOffloadCallback" in str(w.message)]
    assert ours == [
        (
            UserWarning,
            "ActivationOffloadCallback: no CUDA device (module on cpu); offloading nothing. Pass compute_device='cpu' "
            "to run the engine on CPU tensors.",
        )
    ]
    assert callback.stats == OffloadStats()
    assert module.forward_log == [(False, 0), (False, 0)]
    assert_same_training(module, plain)
    assert_clean(callback)


def test_a_budget_on_the_cpu_is_said_once_as_the_callback_is_made_and_the_fit_says_nothing_more(
    tmp_path: Path,
) -> None:
    """A budget no planner can use (the CPU) is said as the callback is made (``offload_callback`` expects it), not
    at the first batch; the fit then trains offloading, as without a budget, and says nothing more about it."""
    callback = offload_callback(memory_budget="2GiB")
    module = LitNet(offload=callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, module, batches(2), [callback])
    assert not [str(w.message) for w in caught if "memory_budget" in str(w.message)]
    assert callback.stats.offloaded_bytes > 0


def test_two_callbacks_rejected_before_anything_runs(tmp_path: Path) -> None:
    """Two callbacks would stack their hooks (only the innermost runs) and share one checkpoint entry for their plans:
    Lightning refuses the second stateful callback of the class as the Trainer is made."""
    first, second = offload_callback(), offload_callback()
    module = LitNet()
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `ActivationOffloadCallback`"):
        fit(tmp_path, module, batches(2), [first, second])
    assert module.forward_log == []
    assert top_hooks() is None
    assert cpu_pool_in_use() == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"mode": "fast"}, r"mode='fast'"),
        ({"checkpoint": 3}, r"checkpoint=3"),
        ({"checkpoint": ""}, r"checkpoint=''"),
        ({"checkpoint": [Block, 3]}, r"checkpoint=\[<class .*Block'>, 3\]"),
        ({"checkpoint": ["auto", Block]}, r"checkpoint=\['auto'"),
        ({"checkpoint": nn.Linear(2, 2)}, r"checkpoint=Linear"),
        ({"host_memory_limit": 1024}, r"host_memory_limit=1024.*at least 1048576"),
        ({"host_memory_limit": 0}, r"host_memory_limit=0"),
        ({"min_tensor_bytes": -1}, r"min_tensor_bytes=-1"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ActivationOffloadCallback(**kwargs)


class PicklingLit(LitNet):
    """Pickles the callback in the middle of training, while its engine (and the host pool) are live."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.forward_logged(batch)
        assert self.offload is not None and self.offload.engine is not None
        clone = pickle.loads(pickle.dumps(self.offload))
        assert clone.engine is None and clone.options == self.offload.options
        return loss


def test_callback_pickles(tmp_path: Path) -> None:
    callback = offload_callback(checkpoint="auto")
    before = pickle.loads(pickle.dumps(callback))
    assert before.options == callback.options and before.checkpoint == "auto"
    module = PicklingLit(BlockStack, callback)
    fit(tmp_path / "first", module, batches(2), [callback])
    assert callback.stats.offloaded_bytes > 0
    after = pickle.loads(pickle.dumps(callback))
    assert after.engine is None and after.options == callback.options
    # Both copies still work: the one pickled before fit and the one pickled after.
    plain = LitNet(BlockStack)
    fit(tmp_path / "plain", plain, batches(2))
    for name, clone in (("before", before), ("after", after)):
        trained = LitNet(BlockStack, clone)
        fit(tmp_path / name, trained, batches(2), [clone])
        assert_same_training(trained, plain)
        assert clone.stats.offloaded_bytes > 0
    assert_clean(callback)


def big_stack() -> nn.Module:
    """``BlockStack`` with 4 MiB of parameters the forward never uses: the size a pickled model would show."""
    net = BlockStack()
    net.ballast = nn.Linear(1024, 1024)
    return net


def test_pickled_callback_after_fit_does_not_carry_the_model(tmp_path: Path) -> None:
    """After a fit the callback pickles small (Lightning's ``log``/``log_dict`` bound to the module are dropped),
    and the copy trains a second model bit for bit like a plain run."""
    callback = offload_callback(checkpoint="auto")
    module = LitNet(big_stack, callback)
    fit(tmp_path / "first", module, batches(2), [callback])
    assert len(pickle.dumps(module)) > 4 << 20
    assert len(pickle.dumps(callback)) < 64 << 10
    clone = pickle.loads(pickle.dumps(callback))
    plain = LitNet(big_stack)
    fit(tmp_path / "plain", plain, batches(2))
    trained = LitNet(big_stack, clone)
    fit(tmp_path / "second", trained, batches(2), [clone])
    assert_same_training(trained, plain)
    assert clone.stats.offloaded_bytes == len(trained.net.blocks) * BATCH * WIDTH * 4
    assert_clean(clone)


def test_mode_off_counts_without_offloading(tmp_path: Path) -> None:
    callback = offload_callback(mode="off")
    plain, offloaded, recorder = run_pair(tmp_path, lambda cb: LitNet(offload=cb), batches(2), callback)
    assert_same_training(offloaded, plain)
    assert callback.stats.eligible_bytes > 0
    assert callback.stats.offloaded_bytes == 0
    assert all(s.eligible_bytes > 0 and s.offloaded_bytes == 0 for s in recorder.stats)
    assert all(hooked and nbytes == 0 for hooked, nbytes in offloaded.forward_log)
    assert recorder.in_use_after_batch == [0, 0]
    assert_clean(callback)


class FakeCudaPeaks:
    """The CUDA allocator's peak counters, faked: a previous fit left a high peak and cache flushes; each step reaches
    its own peak and makes its own flushes (``flushes``, one number per step)."""

    def __init__(self, left_over: int, step_peak: int, flushes: list[int]) -> None:
        self.peak = left_over
        self.step_peak = step_peak
        self.resets = 0
        self.retries = 7  # flushes before the fit
        self.flushes = list(flushes)

    def reset(self, device: Any = None) -> None:
        self.resets += 1
        self.peak = 0

    def read(self, device: Any = None) -> int:
        return self.peak

    def counters(self, device: Any = None) -> AllocatorCounters:
        return AllocatorCounters(
            allocated=0, peak=self.peak, reserved=0, reserved_peak=self.peak, alloc_retries=self.retries
        )

    def step(self) -> None:
        self.peak = max(self.peak, self.step_peak)
        self.retries += self.flushes.pop(0)


def test_first_logged_peak_and_epoch_max_belong_to_this_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever ran before the fit (model loading, an earlier fit) left its peak and cache flushes in the allocator's
    counters; the first batch's peak, the epoch max and each step's flushes must describe this fit's steps alone."""
    GiB = 1 << 30
    peaks = FakeCudaPeaks(left_over=50 * GiB, step_peak=2 * GiB, flushes=[0, 2, 0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", peaks.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peaks.read)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", peaks.read)
    monkeypatch.setattr(reporting, "read_counters", peaks.counters)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)

    class PeakNet(LitNet):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
            peaks.step()
            return super().training_step(batch, batch_idx)

    callback = offload_callback()
    trainer = fit(tmp_path, PeakNet(offload=callback), batches(3), [callback], max_steps=3)
    logged = [
        float(row["offload/peak_allocated_gib"])
        for row in metrics_rows(tmp_path)
        if row.get("offload/peak_allocated_gib")
    ]
    assert logged == [2.0, 2.0, 2.0]
    assert peaks.resets == 3  # one per optimizer step, the first batch included
    # Cache flushes: each step's own, not those before the fit.
    flushes = [
        float(row["offload/alloc_flushes"]) for row in metrics_rows(tmp_path) if row.get("offload/alloc_flushes")
    ]
    assert flushes == [0.0, 2.0, 0.0]
    assert float(trainer.callback_metrics["offload/peak_allocated_gib_epoch_max"]) == 2.0


def test_memory_picture_comparison_is_skipped_under_manual_optimization_and_lbfgs_from_the_first_fit(
    tmp_path: Path,
) -> None:
    """The comparison batch (run without offloading) is documented as skipped under manual optimization and LBFGS,
    where a batch is not one whole optimizer step. That is known only once the optimizers exist: the first fit of a
    callback must skip it as well as later ones, and a later plain fit on the same callback must compare again."""
    callback = offload_callback(mode="sync", memory_picture=True)
    recorder = Recorder(callback)
    fit(tmp_path / "manual", ManualLit(callback), batches(3), [callback, recorder], max_steps=-1, max_epochs=1)
    assert callback._picture is not None
    assert [trace.kind for trace in callback._picture._traces] == ["offloaded"]
    assert [s.offloaded_bytes > 0 for s in recorder.stats] == [True] * 3

    callback = offload_callback(mode="sync", memory_picture=True)
    fit(tmp_path / "lbfgs", LBFGSLit(offload=callback), batches(3), [callback], max_steps=3)
    assert callback._picture is not None
    assert [trace.kind for trace in callback._picture._traces] == ["offloaded"]
    # The same callback, in a fit whose batches are whole optimizer steps: the comparison runs.
    fit(tmp_path / "plain", LitNet(offload=callback), batches(3), [callback], max_steps=3)
    assert [trace.kind for trace in callback._picture._traces] == ["offloaded", "baseline"]
    assert_clean(callback)


@dataclasses.dataclass
class DataclassBatch:
    """A batch as a dataclass (Lightning moves its tensors to the device like any collection)."""

    x: torch.Tensor


class MappingBatch(UserDict):
    """A batch as a ``Mapping`` that is no ``dict`` (as Hugging Face's ``BatchEncoding``, a ``UserDict``)."""


class CollectionLit(LitNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return self.forward_logged(batch["x"] if isinstance(batch, MappingBatch) else batch.x)


@pytest.mark.parametrize("wrap", [MappingBatch, DataclassBatch], ids=["mapping", "dataclass"])
def test_a_new_input_shape_inside_any_batch_collection_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrap: Callable[..., Any]
) -> None:
    """A batch whose tensors change shape is measured again, whatever collection holds them: a ``Mapping`` that is no
    ``dict`` (a tokenizer's ``BatchEncoding``) or a dataclass as well as a plain tensor, tuple or dict."""
    plan_on_cpu(monkeypatch)
    callback = offload_callback(memory_budget="8GiB")
    data = [wrap(x=x) for x in batches(3) + batches(2, shape=(2 * BATCH, WIDTH))]
    fit(tmp_path, CollectionLit(offload=callback), data, [callback], max_steps=5)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, True, False, True]


def test_input_lengths_that_come_back_run_their_own_plans_without_measuring_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches whose shape alternates (lengths padded per batch, or buckets): each shape is measured once, then runs
    its own plan whenever it comes back. Before, every change of shape measured again, so such a run measured (and ran
    the most frugal step there is) at every batch."""
    plan_on_cpu(monkeypatch)
    callback = offload_callback(memory_budget="8GiB")
    small, large = batches(1), batches(1, shape=(2 * BATCH, WIDTH))
    data = [small[0], small[0], large[0], small[0], large[0], small[0], large[0]]
    fit(tmp_path, CollectionLit(offload=callback), [MappingBatch(x=x) for x in data], [callback], max_steps=7)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, False, True, True, True, True]


def test_a_smaller_batch_after_one_that_kept_everything_runs_its_plan_without_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a budget the model fits, the plan keeps everything: a later batch no larger in any dimension (a shorter
    padded length, a last smaller batch) runs that plan at once and logs it, instead of a measuring step (NaN plan
    figures); a larger one measures."""
    plan_on_cpu(monkeypatch)
    callback = offload_callback(memory_budget="8GiB")
    small, large = batches(1), batches(1, shape=(2 * BATCH, WIDTH))
    larger = batches(1, shape=(4 * BATCH, WIDTH))
    data = [large[0], large[0], small[0], small[0], larger[0], large[0]]
    fit(tmp_path, CollectionLit(offload=callback), [MappingBatch(x=x) for x in data], [callback], max_steps=6)
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, True, True, False, True]
    assert all(row["offload/plan_offload_gib"] in ("nan", "0.0") for row in rows)


class PeakMemory(ConstantMemory):
    """Allocator counters whose peak a test raises: 1 GiB unless a batch says otherwise."""

    def __init__(self) -> None:
        self._peak = 1 << 30

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = 1 << 30

    def reach(self, nbytes: int) -> None:
        self._peak = max(self._peak, nbytes)


class ComparedLit(LitNet):
    """The memory picture's comparison batch (run without offloading) peaks at 20 GiB; every batch notes the
    planner's profile peak as it runs."""

    def __init__(self, offload: ActivationOffloadCallback, memory: PeakMemory) -> None:
        super().__init__(offload=offload)
        self.memory = memory
        self.profile_peaks: list[int | None] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        engine = self.offload.engine
        assert engine is not None and engine.planner is not None
        profile = engine.planner.profile
        self.profile_peaks.append(profile.peak if profile is not None else None)
        if self.offload._pictures.plain:
            self.memory.reach(20 << 30)
        return super().training_step(batch, batch_idx)


def test_the_memory_pictures_comparison_batch_is_not_measured_as_the_planners_step_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison batch runs without the engine, so the planner's step before it (the second measuring step) was
    closed only as the batch after it began, and read the comparison's peak (no offloading) as its own: a profile
    20 GiB too heavy, and plans far more frugal than needed. The step now ends as the comparison batch begins; and
    the comparison batch logs no plan (it logged the plan chosen as it began, which it did not run)."""
    memory = PeakMemory()
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, _: Any = None, **__: Any) -> Any:
        return planner_for(options, device, transfer, model, memory)

    monkeypatch.setattr(engine_module, "planner_for", with_memory)
    callback = offload_callback(memory_budget="8GiB", memory_picture=True)
    model = ComparedLit(callback, memory)
    fit(tmp_path, model, batches(5), [callback], max_steps=5)
    assert callback._picture is not None
    assert [trace.kind for trace in callback._picture._traces] == ["offloaded", "baseline"]  # batches 1 and 2
    measured = [peak for peak in model.profile_peaks if peak is not None]
    assert measured and max(measured) < 2 << 30, model.profile_peaks
    # Nor did the comparison batch run the plan chosen as it began: its plan keys are NaN.
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")]
    assert [row["offload/plan_peak_gib"] != "nan" for row in rows] == [False, False, False, True, True]


VALIDATION_MS = 10_000.0  # simulated device time of one validation run: far more than any training step
# Two measuring steps, three plans under trial of four steps each, and the kept plan's first two.
TRIAL_FIT_STEPS = 16


class SimulatedLit(pl.LightningModule):
    """Trains the budget tests' ``Stack``, whose compute takes simulated time, under the memory-budget planner; its
    validation takes ``VALIDATION_MS`` of that time and allocates ``validation_bytes`` for a moment (the allocator's
    peak counter keeps them)."""

    def __init__(
        self, net: budget_tests.Stack, memory: budget_tests.FakeMemory, offload: ActivationOffloadCallback
    ) -> None:
        super().__init__()
        self.net, self.memory, self.offload = net, memory, offload
        self.validation_bytes = 0
        self.engine: engine_module.OffloadEngine | None = None  # kept past the fit's teardown, which lets go of it

    def on_fit_start(self) -> None:
        self.engine = self.offload.engine
        self.memory.engine = self.engine  # the counters read what the engine keeps on the device

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        assert self.net.sim is not None
        self.net.sim.advance(VALIDATION_MS)
        self.memory.base += self.validation_bytes
        self.memory.allocated()  # the peak counter notes validation's allocation ...
        self.memory.base -= self.validation_bytes  # ... which is gone as validation ends

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def planner_for_counters(memory: Any) -> Callable[..., Any]:
    """The engine's ``planner_for`` made to plan from ``memory``, a test's counters, with ``on_plan`` set (so the
    callback leaves the planner resetting the peak every step)."""
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, _: Any = None, **__: Any) -> Any:
        planner = planner_for(options, device, transfer, model, memory)
        if planner is not None:  # (the counters' own engine, which counts a step's bytes, plans nothing)
            planner.on_plan = lambda text: None
        return planner

    return with_memory


def fit_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, validate: bool, validation_peak: int = 0, trials: bool = True
) -> BudgetPlanner:
    """Fit ``SimulatedLit`` under the memory-budget planner (the budget tests' setup: weights on the device, a budget of
    six times the activations): with ``trials``, long enough for the planner to time its plans against each other,
    else two measuring steps and two planned. With ``validate``, a validation batch runs after every training batch
    (and one before the first, the sanity check), allocating ``validation_peak`` times the activations. Returns the
    planner."""
    x = torch.randn(budget_tests.BATCH, budget_tests.WIDTH)
    act, net, memory = budget_tests.weights_on_the_device(x)
    assert net.sim is not None
    sim = net.sim
    with_memory = planner_for_counters(memory)

    callback = offload_callback(
        memory_budget=6 * act, plan_trials=trials, max_inflight_bytes=64 * 1024, prefetch_bytes=64 * 1024
    )
    module = SimulatedLit(net, memory, callback)
    module.validation_bytes = validation_peak * act
    steps = TRIAL_FIT_STEPS if trials else 4
    validation: dict[str, Any] = {"val_check_interval": 1, "limit_val_batches": 1 if validate else 0}
    with monkeypatch.context() as patch:
        patch.setattr(datapath_module, "SimulatedStreams", lambda: sim)  # the engine's link runs on the model's clock
        patch.setattr(engine_module, "planner_for", with_memory)
        fit(tmp_path, module, [x] * steps, [callback], val_data=[x], max_steps=steps, **validation)
    assert module.engine is not None and module.engine.planner is not None
    return module.engine.planner


def test_validation_inside_fit_is_not_timed_as_the_training_step_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plans under trial are timed from one step's start to the next's, and the planner's step stayed open until the
    next training batch began: validation between two batches (here 10 s of simulated time, on steps of tens of ms)
    counted as the step before it, so a plan whose timed steps were followed by validation read slower and the trials
    could keep a worse one; and the step after validation counted from a mark set before it. The step now ends as
    validation starts: the trials time what they time without validation, and keep the same plan."""
    plain = fit_planned(tmp_path / "plain", monkeypatch, validate=False)
    validated = fit_planned(tmp_path / "validated", monkeypatch, validate=True)
    assert plain.trial_steps and not plain.trying  # the trials ran to their end
    steps = [ms for _, _, _, timed in validated.trial_steps for ms in timed]
    assert steps and max(steps) < VALIDATION_MS, validated.trial_steps
    assert validated.trial_steps == plain.trial_steps
    assert validated.plan == plain.plan


def test_validations_peak_inside_fit_is_not_read_as_the_training_steps_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner read a step's peak as the next training batch began, after the validation between them: a
    validation that allocates more than a training step (here 20 times the activations, past the budget) made the
    measured profile that heavy, or corrected the plans towards memory. The step now ends as validation starts: the
    profile's peaks are what they are without validation, uncorrected."""
    plain = fit_planned(tmp_path / "plain", monkeypatch, validate=False, trials=False)
    validated = fit_planned(tmp_path / "validated", monkeypatch, validate=True, validation_peak=20, trials=False)
    measured, want = validated.profile, plain.profile
    assert measured is not None and want is not None and measured.correction == 0
    # Peaks aside, two fields may differ. The host memory plans may pin is read from what the machine has free then.
    # And validation closed the fit's last step, which the plain fit never closes: a planned step's faster pace
    # lowers the profile's.
    other = {"host_bytes": want.host_bytes, "forward_ms": want.forward_ms, "backward_ms": want.backward_ms}
    assert dataclasses.replace(measured, **other) == want


def test_host_memory_is_released_when_training_stops_on_an_exception(tmp_path: Path) -> None:
    """Lightning calls no ``teardown`` after an exception: the fit is over all the same, and the pinned buffers the
    pool kept for the next step (gigabytes on a GPU) are let go, as at a fit's normal end."""
    callback = offload_callback()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fit(tmp_path, OutOfMemoryLit(callback, "training_step"), batches(4), [callback], max_steps=4)
    gc.collect()
    pool = pool_for(CPU)
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == 0


class InputPeaks:
    """The CUDA allocator's counters, faked, and read by both the reporter (as CUDA's) and the memory-budget planner:
    1 GiB allocated, and each training batch reaches the peak its input's length gives it."""

    def __init__(self) -> None:
        self.peak_bytes = 1 << 30

    def reset(self, device: Any = None) -> None:
        self.peak_bytes = 1 << 30

    def counters(self, device: Any = None) -> AllocatorCounters:
        return AllocatorCounters(
            allocated=1 << 30, peak=self.peak_bytes, reserved=1 << 30, reserved_peak=self.peak_bytes, alloc_retries=0
        )

    def total(self) -> int:
        return 64 << 30

    def allocated(self) -> int:
        return 1 << 30

    def peak(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.reset()


class PeakByLengthLit(LitNet):
    """A batch of ``2 * BATCH`` rows peaks at 6 GiB, one of ``BATCH`` rows at 2 GiB; every batch notes its length,
    whether the planner measured it and the profile it ran on."""

    def __init__(self, offload: ActivationOffloadCallback, peaks: InputPeaks) -> None:
        super().__init__(offload=offload)
        self.peaks = peaks
        self.seen: list[tuple[int, bool, Any]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        engine = self.offload.engine if self.offload is not None else None
        assert engine is not None and engine.planner is not None
        self.seen.append((len(batch), engine.planner.measuring, engine.planner.profile))
        self.peaks.peak_bytes = max(self.peaks.peak_bytes, (6 if len(batch) > BATCH else 2) << 30)
        return super().training_step(batch, batch_idx)


def test_under_gradient_accumulation_each_inputs_plan_learns_from_its_own_batches_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under gradient accumulation a window's batches may have inputs of different lengths, each planned on its own
    profile. The peak counters were reset once per optimizer step, so a short batch after a long one in the same window
    read the long one's peak as its own: measured 3x too heavy here (and, planned, corrected towards memory until its
    plan was as frugal as the long input's). Each batch's peak is now its own for the planner, and the logged peak is
    still the optimizer step's: the highest of its batches."""
    peaks = InputPeaks()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", peaks.reset)
    monkeypatch.setattr(reporting, "read_counters", peaks.counters)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, memory: Any = None, **_: Any) -> Any:
        return planner_for(options, device, transfer, model, peaks)

    monkeypatch.setattr(engine_module, "planner_for", with_memory)
    callback = offload_callback(memory_budget="8GiB")
    long, short = batches(1, shape=(2 * BATCH, WIDTH))[0], batches(1)[0]
    module = PeakByLengthLit(callback, peaks)
    fit(tmp_path, module, [long, short] * 5, [callback], max_steps=5, accumulate_grad_batches=2)
    planned = {(length, profile.peak, profile.correction) for length, measured, profile in module.seen if not measured}
    assert planned == {(2 * BATCH, 6 << 30, 0), (BATCH, 2 << 30, 0)}
    rows = [row for row in metrics_rows(tmp_path) if row.get("offload/peak_allocated_gib")]
    assert [row["offload/peak_allocated_gib"] for row in rows] == ["6.0"] * 5


class LengthLit(LitNet):
    """Trains ``net``, a :class:`~tests.models.LengthLM`, on token batches whose length changes; records every step's
    gradients and the weights after each batch. With ``memory`` (the counters the planner reads), it names each batch's
    input to them, and notes, per batch, the planner's plan (``None`` while measuring), the modules checkpointed and
    the host pool's lent bytes as forward ended."""

    def __init__(self, net: nn.Module, offload: ActivationOffloadCallback | None = None, memory: Any = None) -> None:
        super().__init__(lambda: net, offload)
        self.memory = memory
        self.weights: list[dict[str, torch.Tensor]] = []
        self.plans: list[Any] = []
        self.wrapped: list[list[str]] = []
        self.lent: list[int] = []

    def on_train_start(self) -> None:
        torch.manual_seed(100)  # dropout's masks: the same in every fit

    def on_fit_start(self) -> None:
        if self.memory is not None:
            assert self.offload is not None
            self.memory.engine = self.offload.engine  # the counters read what the engine keeps on the device

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.memory is not None:  # (after the callback's hook: the step before was counted on its own input)
            self.memory.unhooked_input = batch

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch)
        if self.offload is not None:
            engine = self.offload.engine
            assert engine is not None and engine.planner is not None
            self.plans.append(None if engine.planner.measuring else engine.planner.plan)
            self.wrapped.append(checkpointed_modules(self.net))
            self.lent.append(pool_for(CPU).lent_bytes)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights.append({n: p.detach().clone() for n, p in self.named_parameters()})


@pytest.mark.parametrize(("accumulate", "lag"), [(1, 3), (2, None)], ids=["lag3", "accumulate2-lag-none"])
def test_lengths_that_change_and_come_back_train_as_without_the_callback_under_plans_that_recompute_and_offload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulate: int, lag: Any
) -> None:
    """Through the callback, a DataLoader whose batches change length and come back (48, 32, 48, 16, ...), under a
    budget: each length is measured once and then runs its own kept plan, which checkpoints blocks, recomputes the
    elementwise operations of others and offloads part of what is saved, on simulated copy streams; a shorter length's
    copies go to host buffers a longer one left idle (lent). Every step's gradients, the weights after each step and
    at the end are bit-for-bit those of the same fit without the callback, dropout's masks included."""
    lengths = budget_tests.LENGTHS
    data = [length_tokens(length) for length in lengths]
    act = budget_tests.lm_activation_bytes(length_tokens(max(lengths)))
    sim = SimulatedStreams(lag=lag, bytes_per_ms=float(16 << 10))  # a slow link: recompute pays
    net = LengthLM(sim, dropout=0.1)
    memory = budget_tests.LengthMemory(base=4 * act, transient=act // 2)
    memory.unhooked_model = net
    with_memory = planner_for_counters(memory)

    callback = offload_callback(
        memory_budget=int(4.8 * act), plan_trials=False, max_inflight_bytes=64 << 10, prefetch_bytes=64 << 10
    )
    module = LengthLit(net, callback, memory)
    steps = len(lengths) // accumulate
    with monkeypatch.context() as patch:
        patch.setattr(datapath_module, "SimulatedStreams", lambda: sim)  # the engine's link runs on the model's clock
        patch.setattr(engine_module, "planner_for", with_memory)
        fit(tmp_path / "offload", module, data, [callback], max_steps=steps, accumulate_grad_batches=accumulate)
    plain = LengthLit(LengthLM(dropout=0.1))
    fit(tmp_path / "plain", plain, data, max_steps=steps, accumulate_grad_batches=accumulate)
    assert_same_training(module, plain)
    assert len(module.weights) == len(plain.weights) == len(lengths)
    for step, (got, want) in enumerate(zip(module.weights, plain.weights, strict=True)):
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step} (length {lengths[step]}): {name}"
    planned = [(length, plan) for length, plan in zip(lengths, module.plans, strict=True) if plan is not None]
    assert {length for length, _ in planned} == set(lengths)  # every length came back to its plan
    ran = [(plan, wrapped) for plan, wrapped in zip(module.plans, module.wrapped, strict=True) if plan is not None]
    assert any(plan.offload_bytes for plan, _ in ran), "no planned step offloaded"
    assert any(plan.checkpoint_blocks and wrapped for plan, wrapped in ran), "no planned step checkpointed"
    assert any(plan.light_blocks for plan, _ in ran), "no planned step recomputed elementwise operations"
    assert max(module.lent) > 0, "no host buffer was lent"
    assert checkpointed_modules(net) == []  # the fit's end took the planner's wrappers off
    assert_clean(callback)


class StopAtStep(pl.Callback):
    """Listed after the offload callback: notes each batch's offloaded GiB by step, and stops training as
    ``global_step`` reaches ``step``, after the callback's own hook (as ``Trainer(max_time=...)``'s timer does)."""

    def __init__(self, offload: ActivationOffloadCallback, step: int) -> None:
        self.offload, self.step = offload, step
        self.seen: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen[trainer.global_step - 1] = self.offload.stats.offloaded_bytes / 2**30
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_row_lightning_writes_after_a_later_hook_stops_training_holds_that_batch_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``log_every_n_steps`` > 1 the callback logs only the batches the logger writes, as it learns in its own
    ``on_train_batch_end``. A hook that runs after it (``Trainer(max_time=...)``'s timer, the module's own hook) may
    stop training there, and Lightning then writes that batch's row all the same: it must hold that batch's offloaded
    bytes, peak and plan, not those of the last batch logged, and no copy timing it did not wait for."""
    peaks = FakeCudaPeaks(left_over=0, step_peak=0, flushes=[0] * 8)
    fake_cuda_peaks(monkeypatch, peaks)
    plan_on_cpu(monkeypatch)
    seen: dict[int, tuple[float, float]] = {}

    class PeakNet(LitNet):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
            peaks.step_peak = (batch_idx + 1) << 30  # each batch its own peak
            peaks.step()
            return super().training_step(batch, batch_idx)

    class StopAfter(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            engine = callback.engine
            assert engine is not None and engine.planner is not None
            plan = engine.planner.plan if not engine.planner.measuring else None
            seen[trainer.global_step - 1] = (callback.stats.offloaded_bytes / 2**30, plan.peak / 2**30 if plan else -1)
            if trainer.global_step == 6:
                trainer.should_stop = True

    callback = offload_callback(memory_budget="8GiB", measure_copies=True)
    # The first two batches measure, the third runs the plan (keeping everything); the fourth, twice as large, measures
    # (offloading) and the rest run the first plan again.
    data = [torch.randn(BATCH * size, WIDTH) for size in (1, 1, 1, 2, 1, 1, 1, 1)]
    fit(
        tmp_path,
        PeakNet(offload=callback),
        data,
        [callback, StopAfter()],
        max_steps=-1,
        max_epochs=1,
        log_every_n_steps=4,
    )
    rows = {int(row["step"]): row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")}
    assert sorted(rows) == [3, 5]  # the logged step, and the one a later hook stopped at
    late = rows[5]
    assert float(late["offload/offloaded_gib"]) == pytest.approx(seen[5][0])
    assert seen[3][0] > 0 and seen[5][0] == 0
    assert late["offload/peak_allocated_gib"] == "6.0"
    assert late["offload/peak_reserved_gib"] == "6.0"
    assert seen[5][1] > 0 and float(late["offload/plan_peak_gib"]) == pytest.approx(seen[5][1], rel=1e-6)
    # Copy timings finish on the device after the batch; not waited for, they are left out rather than guessed.
    for key in ("offload/stall_ms", "offload/d2h_gbps", "offload/h2d_gbps"):
        assert rows[3][key] != "" and late[key] == "", key


def test_a_row_written_after_a_later_hook_stops_training_early_in_an_epoch_holds_that_batch_figures(
    tmp_path: Path,
) -> None:
    """Lightning clears what each key holds as an epoch ends; a later hook stopping training at the next epoch's first
    batch, which the logger would not write, still gets that batch's figures in its row."""
    callback = offload_callback()
    stop = StopAtStep(callback, 5)  # the second epoch's first batch
    seen = stop.seen
    data = [torch.randn(BATCH * size, WIDTH) for size in (1, 1, 1, 1)]
    data[0] = torch.randn(BATCH * 3, WIDTH)  # each epoch's first batch offloads more than the others
    fit(
        tmp_path,
        LitNet(offload=callback),
        data,
        [callback, stop],
        max_steps=-1,
        max_epochs=3,
        log_every_n_steps=3,
    )
    rows = {int(row["step"]): row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")}
    assert sorted(rows) == [2, 4]
    assert float(rows[4]["offload/offloaded_gib"]) == pytest.approx(seen[4])
    assert seen[4] > seen[2]


def test_logged_figures_keep_their_precision_under_a_half_default_dtype(tmp_path: Path) -> None:
    """With ``torch.set_default_dtype(torch.bfloat16)`` (a model built in bf16), Lightning stores a logged float as
    float32 at least; a figure handed to it as a tensor of the default dtype would be rounded to bf16's three digits,
    in a logged row and in a late row alike (a later hook stops training at a batch the logger would not write)."""
    callback = offload_callback()
    stop = StopAtStep(callback, 5)
    seen = stop.seen
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        module = LitNet(offload=callback)
        data = [torch.randn(BATCH * 3, WIDTH) for _ in range(6)]
        fit(tmp_path, module, data, [callback, stop], max_steps=6, log_every_n_steps=3)
    finally:
        torch.set_default_dtype(default)
    rows = {int(row["step"]): row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")}
    assert sorted(rows) == [2, 4]
    for step, row in rows.items():
        # bf16 keeps about three significant digits, float32 about seven
        assert float(row["offload/offloaded_gib"]) == pytest.approx(seen[step], rel=1e-6), step


@pytest.mark.parametrize("before", ["batch not logged", "skipped batch logged"])
def test_copy_timings_are_left_out_of_a_row_written_because_training_stopped_during_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str
) -> None:
    """A batch the logger would not write does not wait, as it begins, for the copy timings the batch before left
    running: they are read into its own figures. Stopped during the batch (here by its ``training_step``; a hook that
    runs before the callback's ``on_train_batch_end`` does the same), its row is written after all, and the callback
    logs it: its copy timings would be two batches' together. They are left out, as in a late row (not the values a
    batch logged before gave them either: here a skipped batch's none); the rest stays."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(reporting, "peak_device", lambda device: CPU)  # log the figures CUDA events time
    keys = ("offload/stall_ms", "offload/d2h_gbps", "offload/h2d_gbps")
    data: list[torch.Tensor | None] = list(batches(6))
    stop = 4
    if before == "skipped batch logged":
        data[2], stop = None, 3  # logged at step 2 (waiting for nothing): batch 1's timings are still unread

    class StopDuring(LitNet):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
            if batch_idx == stop:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    callback = offload_callback(measure_copies=True)
    fit(tmp_path, StopDuring(offload=callback), data, [callback], max_steps=6, log_every_n_steps=3)
    rows = {int(row["step"]): row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")}
    assert sorted(rows) == [2, stop]  # the logged step; a step after one not waited for, stopped during its batch
    assert all(rows[2][key] != "" for key in keys)
    assert [rows[stop][key] for key in keys] == ["", "", ""]
    assert float(rows[stop]["offload/offloaded_gib"]) == pytest.approx(callback.stats.offloaded_bytes / 2**30)
    assert callback.stats.offloaded_bytes > 0


def test_a_row_written_late_before_the_first_logged_batch_holds_that_batch_figures(tmp_path: Path) -> None:
    """A later hook stopping training before the logger wrote any batch (``log_every_n_steps`` not reached yet, as
    ``Trainer(max_time=...)`` may) makes Lightning write that batch's row: it holds the batch's figures, not none."""
    callback = offload_callback()
    stop = StopAtStep(callback, 3)
    seen = stop.seen
    data = [torch.randn(BATCH * size, WIDTH) for size in (1, 1, 3, 1)]  # the stopped batch offloads the most
    fit(tmp_path, LitNet(offload=callback), data, [callback, stop], max_steps=-1, log_every_n_steps=10)
    rows = {int(row["step"]): row for row in metrics_rows(tmp_path) if row.get("offload/host_pinned_gib")}
    assert sorted(rows) == [2]
    assert float(rows[2]["offload/offloaded_gib"]) == pytest.approx(seen[2])
    assert seen[2] > seen[0]


def test_a_compiled_module_under_the_default_budget_is_not_planned_offloads_nothing_and_trains_as_without(
    tmp_path: Path,
) -> None:
    """A module whose network is compiled (``torch.compile``) cannot be planned: under the default budget the callback
    warns, offloads nothing, and the fit's gradients are those of the same fit without the callback."""
    torch._dynamo.reset()
    try:
        callback = offload_callback()
        module = LitNet(BlockStack, offload=callback)
        module.net.compile(backend="eager")
        with pytest.warns(UserWarning, match=r"memory_budget='auto': the model is compiled .*Nothing is offloaded"):
            fit(tmp_path / "offload", module, batches(2), [callback])
        plain = LitNet(BlockStack)
        plain.net.compile(backend="eager")
        fit(tmp_path / "plain", plain, batches(2))
    finally:
        torch._dynamo.reset()
    assert [offloaded for _, offloaded in module.forward_log] == [0, 0]
    assert_same_training(module, plain)
