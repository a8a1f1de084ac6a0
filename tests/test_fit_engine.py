"""The engine as a Lightning fit drives it (``fit_engine``): built for the module's device (none off CUDA, said once),
its hooks kept to the batch's end where forward may run again, installed with the planner's notices routed, and left
as an epoch ends or the fit fails."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_offload.engine as engine_module
from lightning_offload import ActivationOffloadCallback
from lightning_offload.fit_engine import (
    announce_planning,
    end_epoch,
    end_on_exception,
    engine_for_fit,
    install_for_batch,
    leaves_after_backward,
    say_floor_over,
)
from lightning_offload.options import OffloadOptions
from tests.test_callback import ConstantMemory, LitNet, batches, fit, offload_callback


class Module(nn.Module):
    """A stand-in for a LightningModule: its device and optimization kind."""

    def __init__(self, automatic_optimization: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.automatic_optimization = automatic_optimization

    @property
    def device(self) -> torch.device:
        return self.layer.weight.device


class Calls:
    """Records the calls made on it, in order; each named method returns ``None``."""

    def __init__(self, *names: str) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in names:
            setattr(self, name, lambda *args, name=name: self.calls.append((name, args)))


def test_a_module_off_cuda_without_a_compute_device_gets_no_engine_and_a_warning_at_the_callers_line() -> None:
    options = OffloadOptions.create("test")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine_for_fit(options, Module(), 1, by_hand=False) is None  # type: ignore[arg-type]
    assert len(caught) == 1
    assert "ActivationOffloadCallback: no CUDA device (module on cpu); offloading nothing" in str(caught[0].message)
    assert caught[0].filename == __file__  # (in a fit: the callback's ``setup``)


@pytest.mark.parametrize("by_hand", [False, True])
def test_the_engine_runs_on_the_options_device_one_process_per_device_without_a_budget_where_checkpointed_by_hand(
    by_hand: bool,
) -> None:
    options = OffloadOptions.create("test", compute_device="cpu", memory_budget="8GiB")
    built = engine_for_fit(options, Module(), 0, by_hand=by_hand)  # type: ignore[arg-type]
    assert built is not None
    engine, device = built
    assert device == torch.device("cpu") and engine.options.compute_device == device
    assert engine.local_processes == 1  # (at least one)
    assert engine.options.memory_budget == (None if by_hand else 8 << 30)
    assert options.memory_budget == 8 << 30  # the callback's own options are left as they are


def test_hooks_stay_to_the_batchs_end_under_manual_optimization_or_lbfgs() -> None:
    params = [nn.Parameter(torch.zeros(1))]
    sgd, lbfgs = torch.optim.SGD(params, lr=0.1), torch.optim.LBFGS(params)
    assert leaves_after_backward(SimpleNamespace(optimizers=[sgd]), Module())  # type: ignore[arg-type]
    assert not leaves_after_backward(SimpleNamespace(optimizers=[sgd, lbfgs]), Module())  # type: ignore[arg-type]
    assert not leaves_after_backward(SimpleNamespace(optimizers=[sgd]), Module(False))  # type: ignore[arg-type]


class CudaModule(Module):
    """A module that says it is on CUDA (nothing runs on it)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_planning_is_announced_only_where_an_engine_plans_on_cuda(caplog: pytest.LogCaptureFixture) -> None:
    planning, fixed = (SimpleNamespace(options=SimpleNamespace(plans=plans)) for plans in (True, False))
    with caplog.at_level("INFO"):
        for engine, module in [(None, CudaModule()), (fixed, CudaModule()), (planning, Module())]:
            announce_planning(engine, module, "8GiB")  # type: ignore[arg-type]
        assert "measuring the first batch" not in caplog.text
        announce_planning(planning, CudaModule(), "8GiB")  # type: ignore[arg-type]
    assert "ActivationOffloadCallback: memory_budget='8GiB'; measuring the first batch to plan" in caplog.text


def test_installing_routes_the_planners_notices_once_and_leaves_peaks_to_the_reporter() -> None:
    engine, reporter = Calls("install"), Calls("before_install")
    engine.planner = SimpleNamespace(on_plan=None, owns_peaks=True)  # type: ignore[attr-defined]
    trainer = object()
    install_for_batch(engine, reporter, trainer)  # type: ignore[arg-type]
    assert reporter.calls == [("before_install", (trainer, engine))] and engine.calls == [("install", ())]
    assert engine.planner.owns_peaks is False and callable(engine.planner.on_plan)  # type: ignore[attr-defined]
    own = engine.planner.on_plan = lambda text: None  # type: ignore[attr-defined]
    engine.planner.owns_peaks = True  # type: ignore[attr-defined]
    install_for_batch(engine, reporter, trainer)  # type: ignore[arg-type]
    assert engine.planner.on_plan is own and engine.planner.owns_peaks is True  # type: ignore[attr-defined]


def test_an_epoch_end_drops_only_a_step_that_ran_nothing() -> None:
    ran, empty = Calls("uninstall", "reset"), Calls("uninstall", "reset")
    end_epoch(ran, ran_nothing=False)  # type: ignore[arg-type]
    end_epoch(empty, ran_nothing=True)  # type: ignore[arg-type]
    assert ran.calls == [("uninstall", ())] and empty.calls == [("uninstall", ()), ("reset", ())]


def test_a_failure_inside_a_batch_is_the_engines_to_explain_and_one_outside_is_only_dropped() -> None:
    inside, outside, error = Calls("failed", "reset"), Calls("failed", "reset"), RuntimeError("out of memory")
    end_on_exception(inside, error, in_batch=True)  # type: ignore[arg-type]
    end_on_exception(outside, error, in_batch=False)  # type: ignore[arg-type]
    assert inside.calls == [("failed", (error,))] and outside.calls == [("reset", ())]


def test_a_floor_over_the_budget_is_said_once_with_its_parts_and_nothing_below_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """AdamW over a 544-weight layer (float32): weights allocated, their gradients and both moments to come are
    4 x 2176 bytes; a budget below that is said (the logger's WARNING), one at it is not."""
    layer = nn.Linear(16, 32)
    optimizer = torch.optim.AdamW(layer.parameters())
    weights = 544 * 4
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="lightning_offload"):
        assert not say_floor_over(4 * weights, weights, cpu, [optimizer], layer.parameters())
        assert not caplog.records
        assert say_floor_over(4 * weights - 1, weights, cpu, [optimizer], layer.parameters())
    [record] = caplog.records
    assert record.getMessage().startswith("ActivationOffloadCallback: memory_budget=0.00 GiB: before any activation")
    assert "of AdamW's state to come" in record.getMessage()


class OutOfMemoryOnce(LitNet):
    """Runs out of memory the first time batch ``at`` runs: in its forward (``training_step``, the hooks installed) or
    after its backward (``on_after_backward``, the hooks gone); counts the forwards."""

    def __init__(self, offload: ActivationOffloadCallback | None, where: str, at: int = 2) -> None:
        super().__init__(offload=offload)
        self.where, self.at, self.forwards, self.failed, self.batch = where, at, 0, False, -1

    def _fail_once(self, where: str) -> None:
        if self.where == where and self.batch == self.at and not self.failed:
            self.failed = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB. GPU 0")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        self.forwards, self.batch = self.forwards + 1, batch_idx
        loss = super().training_step(batch, batch_idx)
        self._fail_once("training_step")
        return loss

    def on_after_backward(self) -> None:
        self._fail_once("backward")


def planned_on_constant_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    planner_for = engine_module.planner_for

    def with_memory(options: Any, device: Any, transfer: Any, model: Any, memory: Any = None, **_: Any) -> Any:
        return planner_for(options, device, transfer, model, ConstantMemory())

    monkeypatch.setattr(engine_module, "planner_for", with_memory)


@pytest.mark.parametrize("where", ["training_step", "backward"])
def test_a_batch_that_ran_out_of_memory_runs_again_under_a_more_frugal_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A planned batch runs out of memory (a request as large as the budget): the planner corrects its plan to its
    most frugal, and the batch runs again within the same optimizer step, so the fit goes on. The weights end as a
    fit without offloading and without the failure leaves them, bit for bit; the module's ``optimizer_step`` is its
    own again after the fit."""
    planned_on_constant_memory(monkeypatch)
    torch.manual_seed(0)
    callback = offload_callback(memory_budget="8GiB")
    module = OutOfMemoryOnce(callback, where)
    torch.manual_seed(0)
    plain = LitNet()
    with caplog.at_level("WARNING", logger="lightning_offload"):
        trainer = fit(tmp_path, module, batches(4), [callback], max_steps=4)
    fit(tmp_path / "plain", plain, batches(4), max_steps=4)
    assert module.failed and module.forwards == 5 and trainer.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), plain.parameters(), strict=True))
    said = [r.getMessage() for r in caplog.records]
    assert sum("the step ran out of memory (a request of" in text for text in said) == 1
    assert not any("does not train at this input size" in text for text in said)
    assert "optimizer_step" not in module.__dict__ and "training_step" not in module.__dict__


@pytest.mark.parametrize("where", ["training_step", "backward"])
def test_under_gradient_accumulation_only_a_forward_that_ran_out_of_memory_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Lightning's closure clears the gradients only at a window's first batch, and a backward adds to them as it goes:
    the second batch of a window (batch 5) runs its ``training_step`` again where its forward ran out of memory, and
    the fit ends with the weights of a plain fit with the same accumulation, bit for bit (the first batch's gradients
    kept); where its backward ran out, the error ends the fit, as without the callback."""
    planned_on_constant_memory(monkeypatch)
    callback = offload_callback(memory_budget="8GiB")
    torch.manual_seed(0)
    module = OutOfMemoryOnce(callback, where, at=5)
    if where == "backward":
        with pytest.raises(torch.cuda.OutOfMemoryError):
            fit(tmp_path, module, batches(8), [callback], max_steps=4, accumulate_grad_batches=2)
        assert module.forwards == 6  # batch 5 ran once
    else:
        fit(tmp_path, module, batches(8), [callback], max_steps=4, accumulate_grad_batches=2)
        torch.manual_seed(0)
        plain = LitNet()
        fit(tmp_path / "plain", plain, batches(8), max_steps=4, accumulate_grad_batches=2)
        assert module.failed and module.forwards == 9
        assert all(torch.equal(a, b) for a, b in zip(module.parameters(), plain.parameters(), strict=True))
    assert "optimizer_step" not in module.__dict__ and "training_step" not in module.__dict__
