"""What may leave the device: thresholds, ``no_offload``, the resident tail, budgets, and parameter detection."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_offload import no_offload
from lightning_offload.policy import (
    ParameterStorages,
    backward_running,
    is_parameter_like,
    offload_suppressed,
    parameters_and_buffers,
    plain_dense,
)
from tests.models import assert_same_grads, make_engine, probe, tanh_chain

ROWS, COLS = 16, 64
S = ROWS * COLS * 4  # bytes of one tanh output in the chains below (4 KiB)


def _chain_step(engine: object | None, n: int = 8) -> torch.Tensor:
    """Backward through ``n`` tanh saved outputs of S bytes each; returns the input's grad."""
    x = torch.linspace(-2, 2, ROWS * COLS).reshape(ROWS, COLS).requires_grad_()
    if engine is None:
        tanh_chain(x, n)[-1].sum().backward()
    else:
        with engine:  # type: ignore[attr-defined]
            loss = tanh_chain(x, n)[-1].sum()
        loss.backward()
    assert x.grad is not None
    return x.grad


# ---------------------------------------------------------------------------------------------- min_tensor_bytes


@pytest.mark.parametrize(("threshold", "offloaded"), [(0, 1024 + 16384), (16384, 16384), (16385, 0)])
def test_min_tensor_bytes_threshold(threshold: int, offloaded: int) -> None:
    """Spans below ``min_tensor_bytes`` stay; a span of exactly the threshold leaves."""
    small, big = torch.randn(256), torch.randn(4096)
    engine = make_engine(min_tensor_bytes=threshold)
    restored = probe([small, big], engine)
    assert engine.stats.saved_tensors == 2
    assert engine.stats.offloaded_bytes == offloaded
    assert torch.equal(restored[0], small) and torch.equal(restored[1], big)


def test_min_tensor_bytes_counts_the_copied_span() -> None:
    """The threshold compares the bytes that would be copied: a view covering most of a large storage copies (and
    counts) the whole storage, so it passes a threshold its own bytes would not."""
    storage = torch.randn(4096)  # 16 KiB
    view = storage[:2100]  # 8400 bytes, over half the storage
    engine = make_engine(min_tensor_bytes=10_000)
    (got,) = probe([view], engine)
    assert engine.stats.offloaded_bytes == storage.nbytes
    assert torch.equal(got, view) and got.storage_offset() == 0


# ---------------------------------------------------------------------------------------------- no_offload


def test_no_offload_opt_out_and_nesting() -> None:
    """``no_offload()`` keeps tensors saved inside it; nested blocks keep suppressing until the outermost exits,
    then offloading resumes in the same window."""
    x = torch.randn(ROWS, COLS, requires_grad=True)
    engine = make_engine()
    with engine:
        torch.tanh(x)  # saved, offloaded
        assert engine.stats.offloaded_bytes == S
        with no_offload():
            assert offload_suppressed()
            torch.tanh(x)
            with no_offload():
                torch.tanh(x)
            assert offload_suppressed()
            torch.tanh(x)  # still inside the outer block
        assert not offload_suppressed()
        assert engine.stats.offloaded_bytes == S
        loss = torch.tanh(x).sum()
    assert engine.stats.saved_tensors == 5
    assert engine.stats.offloaded_bytes == 2 * S
    loss.backward()


def test_no_offload_is_per_thread_and_exception_safe() -> None:
    """The opt-out is thread-local and its depth unwinds when the block raises."""
    seen: list[bool] = []
    with no_offload():
        thread = threading.Thread(target=lambda: seen.append(offload_suppressed()))
        thread.start()
        thread.join()
    assert seen == [False]
    with pytest.raises(ValueError), no_offload():
        raise ValueError
    assert not offload_suppressed()


def test_no_offload_grads_exact() -> None:
    """Mixing offloaded and opted-out regions in one forward keeps grads bit-identical."""
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(16, 32), nn.GELU()), nn.Linear(32, 4)
    x = torch.randn(8, 16)

    def step(engine: object | None) -> dict[str, torch.Tensor]:
        body.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        if engine is None:
            loss = head(body(x)).square().sum()
        else:
            with engine:  # type: ignore[attr-defined]
                h = body(x)
                with no_offload():
                    loss = head(h).square().sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in [*body.named_parameters("b"), *head.named_parameters("h")]}

    expected = step(None)
    engine = make_engine()
    assert_same_grads(step(engine), expected)
    # body: x (8x16) and the linear output (8x32, GELU's input); the head's saves stay
    assert engine.stats.offloaded_bytes == 8 * 16 * 4 + 8 * 32 * 4


# ---------------------------------------------------------------------------------------------- resident tail


@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_resident_tail_keeps_the_last_saved_bytes(mode: str) -> None:
    """With a tail of 2.5 tensors' bytes the last three saved tensors (the shortest suffix reaching the tail) stay
    resident; both steps offload the same five, and grads are exact."""
    expected = _chain_step(None)
    engine = make_engine(mode=mode, resident_tail_bytes=int(2.5 * S))
    for _ in range(2):
        assert torch.equal(_chain_step(engine), expected)
        stats = engine.stats
        assert stats.resident_bytes == 3 * S
        assert stats.offloaded_bytes == 5 * S
        assert stats.offloaded_tensors == 5
        assert stats.eligible_bytes == 8 * S


def test_resident_tail_second_step_offloads_at_save_time() -> None:
    """The first forward must wait until ``tail`` bytes follow a tensor before it leaves; from the second forward
    on, the previous forward's size says it will leave, so it is copied as soon as it is saved."""
    engine = make_engine(resident_tail_bytes=int(2.5 * S))
    x = torch.randn(ROWS, COLS, requires_grad=True)
    progress = []
    for _ in range(2):
        with engine:
            h = x
            offloaded_after_each_save = []
            for _ in range(8):
                h = torch.tanh(h)
                offloaded_after_each_save.append(engine.stats.offloaded_bytes)
        h.sum().backward()
        progress.append(offloaded_after_each_save)
    assert progress[0] == [0, 0, 0, S, 2 * S, 3 * S, 4 * S, 5 * S]
    assert progress[1] == [S, 2 * S, 3 * S, 4 * S, 5 * S, 5 * S, 5 * S, 5 * S]


def test_resident_tail_larger_than_forward_offloads_nothing() -> None:
    """A tail larger than everything saved keeps every tensor resident (the default 256 MiB on a small model)."""
    engine = make_engine(resident_tail_bytes=9 * S)
    with pytest.warns(UserWarning, match=r"nothing offloaded, because all .* MiB eligible fell in the resident tail"):
        assert torch.equal(_chain_step(engine), _chain_step(None))
    assert engine.stats.offloaded_bytes == 0
    assert engine.stats.resident_bytes == 8 * S


# ---------------------------------------------------------------------------------------------- budgets


def test_max_offload_bytes_offloads_only_the_start_of_each_forward() -> None:
    """``max_offload_bytes`` lets only the first bytes of each forward leave; the rest stays resident, every step."""
    expected = _chain_step(None)
    engine = make_engine(max_offload_bytes=int(3.5 * S))
    for _ in range(2):
        assert torch.equal(_chain_step(engine), expected)
        assert engine.stats.offloaded_bytes == 3 * S
        assert engine.stats.resident_bytes == 5 * S


@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_max_inflight_bytes_has_no_effect_on_cpu(mode: str) -> None:
    """On CPU every copy completes when it is made, so a 1-byte in-flight bound neither keeps tensors resident nor
    changes what is offloaded."""
    expected = _chain_step(None)
    counts = []
    for cap in (None, 1):
        engine = make_engine(mode=mode, max_inflight_bytes=cap)
        assert torch.equal(_chain_step(engine), expected)
        counts.append((engine.stats.offloaded_bytes, engine.stats.resident_bytes))
    assert counts == [(8 * S, 0), (8 * S, 0)]


# ---------------------------------------------------------------------------------------------- parameter detection


def test_is_parameter_like_recognises_parameters_views_and_casts() -> None:
    """Parameters, leaves that require grad, their views, and a cast of a weight are parameter-like; activations,
    inputs without grad, and casts of activations are not."""
    w = nn.Parameter(torch.randn(8, 4))
    leaf = torch.randn(3, requires_grad=True)
    act = torch.randn(4, 8) @ w
    assert is_parameter_like(w)
    assert is_parameter_like(leaf)
    assert is_parameter_like(w.t())
    assert is_parameter_like(w[1])
    assert is_parameter_like(w.unsqueeze(0).expand(2, 8, 4))
    assert is_parameter_like(w.to(torch.bfloat16))
    assert is_parameter_like(w.to(torch.bfloat16).t())
    assert not is_parameter_like(act)
    assert not is_parameter_like(act.t())
    assert not is_parameter_like(act.to(torch.bfloat16))
    assert not is_parameter_like(torch.randn(3))


def test_is_parameter_like_recognises_frozen_parameters_and_their_views() -> None:
    """A frozen parameter (LoRA's base weights) and its views are leaves that do not require grad: still parameter-
    like, through their type and their base, while a leaf tensor made in forward without grad is not."""
    frozen = nn.Parameter(torch.randn(8, 4), requires_grad=False)
    assert is_parameter_like(frozen)
    assert is_parameter_like(frozen.t())
    assert is_parameter_like(frozen[1:3])
    with torch.no_grad():
        assert is_parameter_like(frozen.view(4, 8))
        made = torch.randn(8, 4) * 2
    assert not is_parameter_like(made)
    assert not is_parameter_like(made.t())


def test_is_parameter_like_cast_of_transposed_weight() -> None:
    """Autocast casts a matmul's operands as given, so ``h @ w.t()`` (tied embeddings, hand-written output
    projections) saves a bf16 cast of the *transposed* weight. That cast is parameter-like too."""
    w = nn.Parameter(torch.randn(8, 4))
    assert is_parameter_like(w.t().to(torch.bfloat16))
    assert is_parameter_like(w[:, :2].to(torch.bfloat16))


def test_autocast_matmul_with_transposed_weight_offloads_only_the_activation() -> None:
    """End to end: under bf16 autocast, ``h @ w.t()`` saves bf16 h (an activation: offloaded) and a bf16
    copy of ``w.t()`` (a cast of a parameter: must stay). Offloaded bytes are h's only, counted by hand."""
    w = nn.Parameter(torch.randn(16, 8))
    x0 = torch.randn(4, 8, requires_grad=True)
    engine = make_engine()
    with engine, torch.autocast("cpu", dtype=torch.bfloat16):
        h = x0 * 2.0  # fp32 activation, saved by nobody
        y = h @ w.t()  # saves bf16(h) and bf16(w.t())
    assert engine.stats.saved_tensors == 2
    assert engine.stats.offloaded_bytes == 4 * 8 * 2
    y.float().sum().backward()


def test_parameter_storages_by_live_storage_identity() -> None:
    """ParameterStorages matches every tensor sharing a parameter's or buffer's storage (views, detached aliases) and
    nothing else, and it is replaced, not extended, by ``update``."""
    layer = nn.BatchNorm1d(4)
    params = ParameterStorages([*layer.parameters(), *layer.buffers()])
    from torch.multiprocessing.reductions import StorageWeakRef

    def key(t: torch.Tensor) -> int:
        return StorageWeakRef(t.untyped_storage()).cdata

    assert len(params) == 5  # weight, bias, running_mean, running_var, num_batches_tracked
    assert key(layer.weight.detach()[1:]) in params
    assert key(layer.running_mean.view(2, 2)) in params
    assert key(layer.weight.detach().clone()) not in params
    params.update([layer.weight])
    assert len(params) == 1 and key(layer.running_mean) not in params


def test_parameter_storages_follow_a_storage_swapped_under_the_same_parameter() -> None:
    """FSDP-like code gives a parameter a new storage between steps: ``update`` with the same tensors then matches the
    new storage and no longer the old one; with nothing changed, the set (and its references) stay as they are."""
    layer = nn.Linear(4, 4)
    params = ParameterStorages([layer.weight, layer.bias])
    old = layer.weight.detach()
    refs = params._refs
    params.update([layer.weight, layer.bias])
    assert params._refs is refs  # the same storages: nothing re-made
    with torch.no_grad():
        layer.weight.data = torch.zeros(4, 4)
    params.update([layer.weight, layer.bias])
    assert layer.weight.untyped_storage()._cdata in params
    assert old.untyped_storage()._cdata not in params and len(params) == 2


def test_engine_follows_a_storage_swapped_under_a_parameter() -> None:
    """``.data = ...`` on a parameter between steps: the next step's parameter set holds the new storage, not the old
    one."""
    model = nn.Linear(64, 64)
    engine = make_engine(model=model)
    with engine:
        pass
    assert model.weight.untyped_storage()._cdata in engine._path.params
    old = model.weight.detach()
    with torch.no_grad():
        model.weight.data = torch.zeros(64, 64)
    with engine:
        pass
    assert model.weight.untyped_storage()._cdata in engine._path.params
    assert old.untyped_storage()._cdata not in engine._path.params


def test_parameters_can_still_be_swapped_after_an_engine_step() -> None:
    """``torch.utils.swap_tensors`` (what ``Module.to`` uses for DTensor parameters under FSDP2, and for every parameter
    with ``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses a tensor that has a Python weak
    reference: the engine must hold none on the model's parameters and buffers once a step is over (swapping during a
    step is torch's own error: backward would run on the swapped tensors)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    engine = make_engine(model=model)
    for _ in range(2):
        with engine:
            loss = model(torch.randn(4, 8)).sum()
        loss.backward()
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.randn(8, 8)))
    torch.utils.swap_tensors(model[0].bias, nn.Parameter(torch.randn(8)))
    torch.utils.swap_tensors(model[1].running_mean, torch.zeros(8))
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert model[0].weight.dtype == torch.float64


def test_parameters_and_buffers_lists_each_tensor_once_in_one_walk() -> None:
    """Tied weights, a block registered twice and every module's buffers: each tensor once, as the model's own
    ``parameters()`` and ``buffers()`` list them together."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Embedding(10, 4), shared, nn.BatchNorm1d(4), shared, nn.Linear(4, 10))
    model[4].weight = model[0].weight  # tied
    found = parameters_and_buffers(model)
    expected = [*model.parameters(), *model.buffers()]
    assert len(found) == len(expected) == 9
    assert {id(t) for t in found} == {id(t) for t in expected}


def test_plain_dense_and_backward_running() -> None:
    """Only plain strided tensors may be offloaded; ``backward_running`` is true exactly inside backward."""
    assert plain_dense(torch.randn(2))
    assert not plain_dense(nn.Parameter(torch.randn(2)))
    assert not plain_dense(torch.randn(2, 2).to_sparse())
    assert not plain_dense(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]))
    assert not backward_running()
    seen: list[bool] = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            seen.append(backward_running())
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append(backward_running())
            return grad

    Spy.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


def test_sparse_saved_tensor_is_not_offloaded() -> None:
    """A sparse tensor saved for backward is handed back untouched (plain strided tensors only)."""
    sparse = torch.randn(4, 4).to_sparse()
    dense = torch.randn(4, 4)
    engine = make_engine()
    restored = probe([sparse, dense], engine)
    assert engine.stats.offloaded_bytes == dense.nbytes
    assert restored[0].is_sparse and torch.equal(restored[0].to_dense(), sparse.to_dense())
