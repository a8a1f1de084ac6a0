"""The floor no plan changes: weights, gradients and optimizer state, counted before the first step."""

from __future__ import annotations

import pytest
import torch

from lightning_offload.planner import words
from lightning_offload.resting_floor import resting_floor, state_per_weight, step_temporaries

CPU = torch.device("cpu")
GIB, MIB = 1 << 30, 1 << 20


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))  # 544 + 264 weights
    model[1].requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("make", "per_weight"),
    [
        (lambda p: torch.optim.AdamW(p), 2),
        (lambda p: torch.optim.Adam(p, amsgrad=True), 3),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3),
        (lambda p: torch.optim.Adagrad(p), 1),
        (lambda p: torch.optim.LBFGS(p), 0),  # not known: counted as keeping nothing, so the floor stays a lower bound
    ],
)
def test_state_per_weight_by_kind(make, per_weight: int) -> None:
    optimizer = make(_model().parameters())
    assert state_per_weight(optimizer, optimizer.param_groups[0]) == per_weight


@pytest.mark.parametrize(
    ("make", "device", "temporaries"),
    [
        (lambda p: torch.optim.AdamW(p), "cuda", 1),  # multi-tensor by default on CUDA: every square root at once
        (lambda p: torch.optim.AdamW(p), "cpu", 0),  # single-tensor by default on the CPU
        (lambda p: torch.optim.Adam(p, foreach=True), "cpu", 1),
        (lambda p: torch.optim.AdamW(p, foreach=False), "cuda", 0),
        (lambda p: torch.optim.AdamW(p, fused=True), "cuda", 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "cuda", 0),
    ],
)
def test_step_temporaries_by_kind_and_implementation(make, device: str, temporaries: int) -> None:
    optimizer = make(_model().parameters())
    assert step_temporaries(optimizer, optimizer.param_groups[0], torch.device(device)) == temporaries


def test_the_floor_counts_what_the_first_step_allocates_for_trainable_weights_once() -> None:
    model = _model()
    trainable = 544 * 4
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    floor = resting_floor(1000, CPU, [optimizer], model.parameters())  # the model's weights again: counted once
    assert (floor.allocated, floor.gradients, floor.state) == (1000, trainable, 2 * trainable)
    assert floor.total == 1000 + 3 * trainable and floor.optimizers == ("AdamW",) and floor.transient == 0
    multi_tensor = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
    floor = resting_floor(1000, CPU, [multi_tensor])
    assert (floor.state, floor.transient, floor.total) == (2 * trainable, trainable, 1000 + 4 * trainable)


def test_what_exists_already_is_not_counted_again() -> None:
    model = _model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    assert resting_floor(0, CPU, [optimizer]).total == 0


def test_without_an_optimizer_only_gradients_count_and_other_devices_not_at_all() -> None:
    model = _model()
    floor = resting_floor(0, CPU, (), model.parameters())
    assert (floor.gradients, floor.state, floor.optimizers) == (544 * 4, 0, ())
    assert resting_floor(0, torch.device("cuda", 0), (), model.parameters()).total == 0


def test_the_message_says_what_the_floor_holds_and_what_to_do() -> None:
    gib = 1 << 30
    text = words.resting_floor_over(10 * gib, 4 * gib, 4 * gib, 8 * gib, ("AdamW",))
    assert text.startswith("memory_budget=10.00 GiB: before any activation, a training step holds at least 16.00 GiB")
    assert "4.00 GiB of gradients and 8.00 GiB of AdamW's state to come" in text
    assert "No plan can keep the step within the budget" in text
    assert "8.00 GiB of gradients to come" in words.resting_floor_over(gib, 0, 8 * gib, 0, ())
    with_step = words.resting_floor_over(10 * gib, 4 * gib, 4 * gib, 8 * gib, ("AdamW",), 4 * gib)
    assert "holds at least 20.00 GiB" in with_step and ", and 4.00 GiB its step allocates for a moment." in with_step


def test_a_wrong_optimizer_is_refused_naming_the_call_and_the_argument() -> None:
    from lightning_offload import offload_activations

    with pytest.raises(TypeError, match=r"^offload_activations\(optimizer=list\): optimizer must be a torch\.optim"):
        offload_activations(compute_device="cpu", optimizer=[])


def test_an_engine_given_its_optimizer_says_before_the_first_step_that_the_floor_passes_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On the CPU's counters (a fake allocator holding 1 GiB of weights): with AdamW over a model of 1 MiB of weights
    the floor is the 1 GiB plus 3 MiB to come, said as the engine first installs under a budget below that, and not
    under one above it. Without the optimizer nothing is said."""
    from lightning_offload.engine import OffloadEngine
    from lightning_offload.options import OffloadOptions
    from lightning_offload.streams import SimulatedStreams
    from tests.test_budget import FakeMemory

    model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB of float32 weights
    said = []
    for budget, optimizer in ((GIB + 2 * MIB, True), (GIB + 4 * MIB, True), (GIB + 2 * MIB, False)):
        options = OffloadOptions.create("test", memory_budget=budget, compute_device="cpu", min_tensor_bytes=0)
        memory = FakeMemory(base=GIB, transient=0)
        optimizers = [torch.optim.AdamW(model.parameters())] if optimizer else []
        engine = OffloadEngine(options, model=model, streams=SimulatedStreams(), memory=memory, optimizers=optimizers)
        memory.engine = engine
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightning_offload"), engine:
            model(torch.randn(4, 512)).sum().backward()
        said.append([r.getMessage() for r in caplog.records if "before any activation" in r.getMessage()])
        engine.close()
    assert [len(s) for s in said] == [1, 0, 0]
    assert "1.00 GiB allocated now (the weights), 0.00 GiB of gradients and 0.00 GiB of AdamW's state" in said[0][0]
