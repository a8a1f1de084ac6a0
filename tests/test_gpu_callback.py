"""GPU tests of the callback inside a real Trainer. Skipped without CUDA; run on the H200."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_offload import ActivationOffloadCallback, reporting
from tests.test_gpu_engine import Net, _deterministic  # noqa: F401  (autouse fixture: deterministic kernels)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class TokenModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(hidden=768, layers=4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(
    tmp_path: Path,
    callbacks: list[pl.Callback],
    precision: str,
    accumulate: int,
    compiled: bool = False,
    module: TokenModule | None = None,
    max_steps: int = 2,
) -> TokenModule:
    torch.manual_seed(0)
    data = torch.randint(0, 4096, (8, 4, 1024))
    module = module or TokenModule()
    if compiled:  # each block on its own, as the README advises
        for block in module.net.blocks:
            block.compile()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=max_steps,
        precision=precision,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, DataLoader(list(data), batch_size=None))
    return module


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_trainer_parameters_equal(tmp_path: Path, precision: str, mode: str) -> None:
    """Two optimizer steps with gradient accumulation give the same parameters as without the callback."""
    plain = _fit(tmp_path / "plain", [], precision, accumulate=2)
    callback = ActivationOffloadCallback(mode=mode, min_tensor_bytes=0, resident_tail_bytes=0, memory_budget=None)
    offloaded = _fit(tmp_path / "off", [callback], precision, accumulate=2)
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    assert callback.stats.offloaded_bytes > 0
    assert callback.engine is None  # torn down
    rows = list(csv.DictReader(open(next((tmp_path / "off").rglob("metrics.csv")))))
    keys = set().union(*(row.keys() for row in rows))
    expected = {
        "offload/peak_allocated_gib",
        "offload/peak_reserved_gib",
        "offload/alloc_flushes",
        "offload/offloaded_gib",
    }
    expected |= {"offload/host_pinned_gib"} | ({"offload/stall_ms"} if mode == "streamed" else set())
    assert expected <= keys


def _flush_the_allocators_cache(device: torch.device) -> int:
    """Make the caching allocator free its cache and retry an allocation once; returns how many flushes its counter
    rose by. Small-pool segments are left cached, then a large allocation is asked for under a memory fraction that
    only leaves room for it once those are freed: only a flush of the whole cache frees another pool's segments. (With
    expandable segments, which the streamed engine switches on, a large request maps 20 MiB pages: 256 MiB of small
    segments leave room for it.)"""
    request = 192 << 20
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # no cached large block may serve the request (emptying is not counted as a flush)
    before = torch.cuda.memory_stats(device)["num_alloc_retries"]
    small = [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(256)]  # 1 MiB each: small pool
    del small
    free_large = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if segment["device"] == device.index and segment["segment_type"] == "large"
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    assert max(free_large, default=0) < request, "a cached block could serve the request without a flush"
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (64 << 20)) / total, device)
    try:
        large = torch.empty(request, dtype=torch.uint8, device=device)
        del large
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return torch.cuda.memory_stats(device)["num_alloc_retries"] - before


class FlushingModule(TokenModule):
    """Its second batch makes the allocator flush its cache (and notes how often it did)."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes: list[int] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.flushes.append(_flush_the_allocators_cache(self.device) if batch_idx == 1 else 0)
        return self.net(batch)


def _fit_three_batches(
    tmp_path: Path,
    module: pl.LightningModule,
    callback: ActivationOffloadCallback,
    log_every_n_steps: int,
    progress_bar: bool = False,
) -> pl.Trainer:
    """Fit ``module`` on three batches of 4 x 1024 tokens with ``callback``, logging to CSV under ``tmp_path``."""
    torch.manual_seed(0)
    data = torch.randint(0, 4096, (3, 4, 1024))
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=3,
        callbacks=[callback],
        logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=log_every_n_steps,
        enable_progress_bar=progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(list(data), batch_size=None))
    return trainer


def test_alloc_flushes_are_the_cache_flushes_of_each_step(tmp_path: Path) -> None:
    """``offload/alloc_flushes`` is, per optimizer step, how often the allocator flushed its cache in it: the flush the
    second step forces, nothing in the others."""
    module = FlushingModule()
    _fit_three_batches(tmp_path, module, ActivationOffloadCallback(memory_budget=None), log_every_n_steps=1)
    assert module.flushes[1] >= 1, "the test could not make the allocator flush its cache"
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = [float(row["offload/alloc_flushes"]) for row in rows if row.get("offload/alloc_flushes")]
    assert logged == [float(n) for n in module.flushes]


def test_logged_figures_are_host_scalars_so_reading_them_never_waits_for_the_device(tmp_path: Path) -> None:
    """The progress bar and ``trainer.callback_metrics`` read every figure after every batch; a figure held on the
    device would make each read wait for the device's queued work, logged batches and batches not logged alike."""
    callback = ActivationOffloadCallback(progress_bar=True)
    trainer = _fit_three_batches(tmp_path, TokenModule(), callback, log_every_n_steps=2, progress_bar=True)
    ours = {key: value for key, value in trainer.callback_metrics.items() if key in reporting._STEP_KEYS}
    assert "offload/peak_allocated_gib" in ours and "offload/plan_peak_gib" in ours, sorted(ours)
    assert {key: value.device.type for key, value in ours.items()} == dict.fromkeys(ours, "cpu")


def test_blocks_compiled_one_by_one_train_as_without_the_callback_and_are_offloaded(tmp_path: Path) -> None:
    """A module whose blocks are compiled (inductor) one by one: offloading everything eligible gives the parameters
    of the same fit without the callback, bit for bit; under the default budget the callback warns that it cannot
    plan a compiled model, offloads nothing, and trains the same."""
    torch._dynamo.reset()
    try:
        plain = _fit(tmp_path / "plain", [], "bf16-mixed", accumulate=1, compiled=True)
        everything = ActivationOffloadCallback(min_tensor_bytes=0, resident_tail_bytes=0, memory_budget=None)
        offloaded = _fit(tmp_path / "off", [everything], "bf16-mixed", accumulate=1, compiled=True)
        default = ActivationOffloadCallback()
        with pytest.warns(UserWarning, match=r"memory_budget='auto': the model is compiled"):
            unplanned = _fit(tmp_path / "default", [default], "bf16-mixed", accumulate=1, compiled=True)
    finally:
        torch._dynamo.reset()
    assert everything.stats.offloaded_bytes > 0 and default.stats.offloaded_bytes == 0
    for a, b, c in zip(plain.parameters(), offloaded.parameters(), unplanned.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_second_fit_runs_the_first_fits_plans_without_measuring(tmp_path: Path) -> None:
    """One callback, two fits of the same module: the second runs the plans the first measured (kept at teardown),
    and the callback's state_dict carries them for a resumed fit."""
    callback = ActivationOffloadCallback()
    kinds: list[list[str]] = []

    class Kinds(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert callback.engine is not None and callback.engine.planner is not None
            kinds.append([r.kind for r in callback.engine.planner.observations])

    torch.manual_seed(0)
    data = torch.randint(0, 4096, (8, 4, 1024))
    module = TokenModule()
    for fit in range(2):
        trainer = pl.Trainer(
            accelerator="cuda",
            devices=1,
            max_steps=4,
            callbacks=[callback, Kinds()],
            logger=pl.loggers.CSVLogger(tmp_path / str(fit)),
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(list(data), batch_size=None))
    assert kinds[0][:2] == ["measuring", "measuring"], kinds
    assert kinds[1] and "measuring" not in kinds[1], kinds
    assert callback.state_dict()["plans"]["plans"]["inputs"]


@pytest.mark.parametrize("room", [0.6, 8.0])
def test_a_budget_below_weights_gradients_and_optimizer_state_is_said_before_the_first_batch(
    tmp_path: Path, room: float, caplog: pytest.LogCaptureFixture
) -> None:
    """With AdamW, the weights, their gradients and both moments are four times the weights before any activation: a
    budget of 0.6 of that is said to fit no plan before the first batch runs; a budget of 8x says nothing."""
    module = TokenModule()
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    seen: list[bool] = []

    class SeenBefore(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
            seen.append(any("before any activation" in r.getMessage() for r in caplog.records))

    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=1,
        callbacks=[ActivationOffloadCallback(memory_budget=int(room * 4 * weights)), SeenBefore()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    with caplog.at_level("WARNING", logger="lightning_offload"):
        trainer.fit(module, DataLoader(list(torch.randint(0, 4096, (2, 4, 256))), batch_size=None))
    assert seen == [room < 1], seen
    said = [r.getMessage() for r in caplog.records if "before any activation" in r.getMessage()]
    assert len(said) == (room < 1)
    if said:
        assert "of AdamW's state to come" in said[0] and "No plan can keep the step within the budget" in said[0]


class FailsOnce(TokenModule):
    """CUDA's own out-of-memory error in the middle of the backward of the batch at ``at`` (global step), once."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.failed, self.runs = at, False, 0
        total = torch.cuda.get_device_properties(0).total_memory
        self.net.blocks[2].up.weight.register_hook(lambda grad: self._fail(total))

    def _fail(self, total: int) -> None:
        if self.global_step == self.at and not self.failed:
            self.failed = True
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # raises

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.runs += 1
        return super().training_step(batch, batch_idx)


def test_a_batch_that_ran_out_of_memory_mid_backward_runs_again_and_the_fit_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A planned batch (the fourth) meets CUDA's own out-of-memory error mid-backward, copies in flight: the batch
    runs again under the planner's correction and the fit ends with the parameters of a fit without the callback,
    bit for bit."""
    modules = []
    for callbacks in ([], [ActivationOffloadCallback(memory_budget="auto")]):
        module = FailsOnce(at=3 if callbacks else -1)
        with caplog.at_level("WARNING", logger="lightning_offload"):
            modules.append(_fit(tmp_path / str(len(modules)), callbacks, "32-true", 1, module=module, max_steps=6))
    plain, offloaded = modules
    assert offloaded.failed and offloaded.runs == plain.runs + 1 == 7
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sum("running it again under" in r.getMessage() for r in caplog.records) == 1
