"""The engine end to end on CPU: gradients bit for bit, exact restores, and the ways offloaders have broken before.

With ``compute_device="cpu"`` CPU tensors count as offloadable and move into separate pooled host buffers, so
every byte that backward reads went through a copy; any bookkeeping error shows up as a wrong gradient.
"""

from __future__ import annotations

import gc
import re
import shutil
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from lightning_offload import HostMemoryFull, OffloadEngine, OffloadOptions, copies, no_offload, offload_activations
from lightning_offload.checkpointing import checkpointed_modules
from lightning_offload.copies import StorageCopy
from lightning_offload.host_pool import HostPool
from tests.models import (
    CASES,
    Case,
    CheckpointModel,
    LengthLM,
    Probe,
    assert_inplace_error_or_exact_grad,
    assert_same_grads,
    build,
    length_tokens,
    make_engine,
    probe,
    sgd_update_recorded,
    tanh_chain,
    top_hooks,
    train_step,
)

# Tests whose forwards fall (in some cases on purpose) within the resident tail: the engine says it offloaded nothing.
TAIL_EXPECTED = "ignore:lightning_offload. nothing offloaded, because all:UserWarning"  # (a colon splits the spec)

MODES = ["sync", "streamed"]


def maybe(engine: OffloadEngine | None) -> AbstractContextManager[object]:
    """The engine as a context manager, or nothing (the reference run)."""
    return engine if engine is not None else nullcontext()


# ------------------------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("mode", [*MODES, "off"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_grads_bit_equal_and_steady_state(case: Case, mode: str) -> None:
    """Offloading every eligible tensor leaves fp32 grads bit-identical, twice with one engine (steady state).

    ``off`` must give the same grads while moving nothing; the other modes must really move bytes, and the
    second step must reuse the pool (no new host buffers).
    """
    model = build(case)
    batch = case.make_batch()
    expected = train_step(model, batch)
    engine = make_engine(mode=mode)
    offloaded = []
    for step in range(2):
        assert_same_grads(train_step(model, batch, engine), expected)
        stats = engine.stats
        assert stats.saved_tensors > 0
        assert stats.eligible_bytes > 0
        offloaded.append(stats.offloaded_bytes)
        if mode == "off":
            assert stats.offloaded_bytes == 0
            assert stats.offloaded_tensors == 0
            assert stats.host_allocations == 0
        else:
            assert stats.offloaded_bytes > 0
            assert stats.offloaded_tensors > 0
            assert stats.resident_bytes == 0  # no tail, no limit: everything eligible left
            assert stats.offloaded_bytes == stats.eligible_bytes
            fetched = stats.prefetched_bytes + stats.fetched_on_demand_bytes
            if mode == "sync":
                assert stats.fetched_on_demand_bytes == stats.offloaded_bytes  # every byte fetched when needed
            else:
                assert stats.prefetched_bytes > 0  # simulated copy streams: the way back runs ahead of need
                assert fetched <= stats.offloaded_bytes  # a copy still in flight is used in place, not fetched
            if step == 1:
                assert stats.host_allocations == 0
    assert offloaded[0] == offloaded[1]


@pytest.mark.parametrize("mode", MODES)
def test_saved_values_come_back_bit_exact(mode: str) -> None:
    """Every saved tensor, whatever its dtype, comes back with the bytes it had when saved."""
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(7, 5, generator=g),
        torch.randn(64, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (33,), generator=g),
        torch.rand(17, generator=g) > 0.5,
        torch.randn(6, 3, dtype=torch.float64, generator=g),
        torch.randn(4, 4, dtype=torch.complex64, generator=g),
    ]
    expected = [t.clone() for t in tensors]
    engine = make_engine(mode=mode)
    restored = probe(tensors, engine)
    assert engine.stats.offloaded_tensors == len(tensors)
    for got, want in zip(restored, expected, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


@pytest.mark.filterwarnings(TAIL_EXPECTED)
@pytest.mark.parametrize("where", ["offloaded", "resident_tail", "below_min_tensor_bytes", "no_offload"])
def test_inplace_change_after_save_never_silently_used(where: str) -> None:
    """Plain autograd raises when a saved tensor is modified in place before backward; saved-tensor hooks switch
    that check off. Under the engine backward must then either raise the same error or use the values as they
    were when saved (the true gradient), whichever way the tensor was kept: never the modified values."""
    x = torch.randn(64, requires_grad=True)
    (torch.tanh(x) * 2.0).sum().backward()
    true_grad = x.grad.clone()
    x.grad = None
    h = torch.tanh(x)
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()  # what plain autograd does

    options: dict[str, Any] = {
        "offloaded": {},
        "resident_tail": {"resident_tail_bytes": 1 << 20},
        "below_min_tensor_bytes": {"min_tensor_bytes": 1 << 20},
        "no_offload": {},
    }[where]
    engine = make_engine(**options)
    with engine, no_offload() if where == "no_offload" else nullcontext():
        h = torch.tanh(x)  # saves h
        h.mul_(2.0)
        loss = h.sum()
    assert engine.stats.saved_tensors == 1
    assert (engine.stats.offloaded_bytes > 0) == (where == "offloaded")
    x.grad = None
    assert_inplace_error_or_exact_grad(loss, x, true_grad)


# ------------------------------------------------------------------------------------------ restored geometry and dedup


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.size()), t.stride(), t.storage_offset(), t.dtype


@pytest.mark.parametrize("mode", MODES)
def test_restored_views_keep_size_stride_and_offset(mode: str) -> None:
    """Transposes, strided slices, offset views, expands, permutes and dtype views are rebuilt with the
    exact size, stride, storage offset and dtype they were saved with, and the same values."""
    base = torch.randn(6, 8, 10)
    other = torch.randn(5, 12)
    tensors = [
        other.t(),  # transpose
        other[:, ::2],  # stride 2 on the last dim
        other[1:],  # storage offset > 0, uses most of the storage
        torch.randn(1, 12).expand(9, 12),  # stride 0
        base.permute(2, 0, 1),
        base[:, 1:, ::3],  # offset + steps on two dims
        base.view(torch.int32),  # same storage, another dtype
        base.transpose(0, 2)[1:],
    ]
    expected = [(t.clone(), _geometry(t)) for t in tensors]
    engine = make_engine(mode=mode)
    restored = probe(tensors, engine)
    assert engine.stats.offloaded_bytes > 0
    for got, (values, geometry) in zip(restored, expected, strict=True):
        assert _geometry(got) == geometry
        assert torch.equal(got, values)


@pytest.mark.parametrize("mode", MODES)
def test_tensors_kept_on_the_device_come_back_without_a_byte_view_of_their_storage(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor that stays is handed back as itself (same storage, geometry and values) and its copy never makes the
    flat byte view offloading needs; a second view of the same storage is rebuilt from that view, made once then.
    Offloaded copies make theirs."""
    made: list[StorageCopy] = []
    byte_view = StorageCopy.src

    def counted(copy: StorageCopy) -> torch.Tensor | None:
        if copy._src is copies._UNMADE:
            made.append(copy)
        return byte_view.fget(copy)  # type: ignore[misc]

    monkeypatch.setattr(StorageCopy, "src", property(counted, byte_view.fset))
    qkv = torch.randn(2, 10, 48)
    alone = torch.randn(8, 8)
    tensors = [alone, qkv, *qkv.chunk(3, dim=-1)]  # the chunks are later views of qkv's storage
    expected = [(t.clone(), _geometry(t), t.data_ptr()) for t in tensors]
    restored = probe(tensors, make_engine(mode=mode, max_offload_bytes=0))
    for got, (values, geometry, address) in zip(restored, expected, strict=True):
        assert _geometry(got) == geometry and got.data_ptr() == address
        assert torch.equal(got, values)
    assert len(made) == 1 and made[0].nbytes == qkv.untyped_storage().nbytes()  # for the chunks, once
    made.clear()
    engine = make_engine(mode=mode)
    restored = probe([alone, qkv], engine)
    assert engine.stats.offloaded_bytes > 0 and len(made) == 2
    assert all(torch.equal(got, want) for got, (want, _, _) in zip(restored, expected, strict=False))


class _RebindsWhatItSaved(torch.autograd.Function):
    """Uses its saved tensor in backward, then rebinds it (``.data = ...``, which bumps no version): code that frees
    an activation early does this."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return weight * x.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (saved,) = ctx.saved_tensors
        out = grad * saved.sum()
        saved.data = torch.zeros(1)
        return out, None


@pytest.mark.parametrize("mode", MODES)
def test_backward_code_rebinding_a_kept_tensor_leaves_other_views_of_its_storage_intact(mode: str) -> None:
    """What backward is handed for a tensor that stayed is an alias of its own: rebinding it does not move the bytes a
    later view of the same storage is rebuilt from (a slice saved by another op, unpacked afterwards)."""
    x = torch.randn(4, 8)
    weight = torch.ones((), requires_grad=True)
    other = torch.ones(2, 8, requires_grad=True)
    engine = make_engine(mode=mode, max_offload_bytes=0)
    with engine:
        first = _RebindsWhatItSaved.apply(weight, x)  # saves x: its copy's first view
        second = (other * x[:2]).sum()  # saves x[:2]: another view of the same storage
    torch.autograd.grad(first, weight, retain_graph=True)
    second.backward()
    assert torch.equal(other.grad, x[:2])


@pytest.mark.filterwarnings(TAIL_EXPECTED)
@pytest.mark.parametrize("kind", ["conj", "neg"])
@pytest.mark.parametrize("tail", [0, 1 << 30])
def test_conjugate_and_negative_views_keep_their_bit(kind: str, tail: int) -> None:
    """A complex tensor's lazy conjugate (or negative) view saved for backward stays on the device with its bit:
    rebuilt from raw bytes it would lose it, and the gradient through it would be wrong."""

    def grad_of_weight(engine: OffloadEngine | None) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(64, dtype=torch.complex64, requires_grad=True)
        weight = torch.randn(64, dtype=torch.complex64, requires_grad=True)
        with engine if engine is not None else nullcontext():
            h = x * 2
            lazy = h.conj() if kind == "conj" else torch._neg_view(h)
            (lazy * weight).abs().sum().backward()
        return weight.grad

    engine = make_engine(resident_tail_bytes=tail)
    assert torch.equal(grad_of_weight(engine), grad_of_weight(None))


@pytest.mark.parametrize("mode", MODES)
def test_small_slice_of_large_storage(mode: str) -> None:
    """For a tensor using under half of its storage: only its span is copied; size, stride, dtype and
    values are exact and the offset keeps its alignment modulo 512 bytes (what kernels pick code paths by)."""
    storage = torch.randn(64, 256)  # 64 KiB
    piece = storage[40:44, 3:200]  # starts at a byte offset that is not a multiple of 512
    want = piece.clone()
    engine = make_engine(mode=mode)
    (got,) = probe([piece], engine)
    assert engine.stats.offloaded_bytes < storage.untyped_storage().nbytes()
    start = piece.storage_offset() * 4
    end = start + ((4 - 1) * 256 + 197) * 4
    assert engine.stats.offloaded_bytes == end - (start - start % 512)
    assert got.size() == piece.size() and got.stride() == piece.stride() and got.dtype == piece.dtype
    assert (got.storage_offset() * 4) % 512 == start % 512
    assert torch.equal(got, want)


def test_dedup_qkv_of_one_projection_copied_once() -> None:
    """Q, k and v chunked from one projection share a storage: its bytes are offloaded once, and each of the three
    views (and their per-head transposes) comes back exactly."""
    qkv = torch.randn(2, 10, 3 * 16)
    q, k, v = qkv.chunk(3, dim=-1)
    heads = [t.reshape(2, 10, 4, 4).transpose(1, 2) for t in (q, k, v)]
    tensors = [q, k, v, *heads]
    expected = [(t.clone(), _geometry(t)) for t in tensors]
    engine = make_engine()
    restored = probe(tensors, engine)
    stats = engine.stats
    assert stats.offloaded_bytes == qkv.untyped_storage().nbytes()
    assert stats.eligible_bytes == qkv.untyped_storage().nbytes()
    assert stats.offloaded_tensors == len(tensors)
    for got, (values, geometry) in zip(restored, expected, strict=True):
        assert _geometry(got) == geometry
        assert torch.equal(got, values)


def test_dedup_in_attention_block() -> None:
    """In a real attention forward, q/k/v saved by SDPA share one offloaded copy of the qkv projection."""
    qkv_proj = nn.Linear(16, 48)
    x = torch.randn(2, 10, 16)
    engine = make_engine()
    with engine:
        q, k, v = (t.reshape(2, 10, 4, 4).transpose(1, 2) for t in qkv_proj(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
    saved_qkv = engine.stats.offloaded_bytes
    y.sum().backward()
    # x (2*10*16*4 B) plus the attention's own outputs; the qkv storage counts once, not three times.
    qkv_bytes = 2 * 10 * 48 * 4
    assert x.nbytes + qkv_bytes <= saved_qkv < x.nbytes + 2 * qkv_bytes


class SaveUnread(torch.autograd.Function):
    """Saves its input but never reads it back (like a backward formula whose grad is not needed)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_same_storage_new_version_gets_new_copy() -> None:
    """A storage saved, then legally modified in place, then saved again is copied twice: the second save must not
    be served from the first (stale) copy."""
    x = torch.randn(32, requires_grad=True)
    anchor = torch.zeros((), requires_grad=True)
    log: list[torch.Tensor] = []
    engine = make_engine()
    with engine:
        h = x * 1.0
        first = SaveUnread.apply(h)  # saves h at version 0
        h.add_(1.0)
        out = Probe.apply(anchor, log, h)  # saves h at version 1
    assert engine.stats.offloaded_bytes == 2 * 32 * 4
    (first.sum() + out).backward()
    assert torch.equal(log[0], x.detach() + 1.0)


def _unsafe_chunks_loss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss over two chunks of one storage that ``unsafe_chunk`` gives a version counter each (as PyTorch's GRU cell
    does on the CPU), each changed in place and saved at version 1: the second after the first was saved. Returns the
    loss and the second chunk."""
    first, second = (x * 1.0).unsafe_chunk(2, dim=1)
    first.sigmoid_()  # saves its result
    second.sigmoid_()
    return first.sum() + 2 * second.sum(), second


@pytest.mark.filterwarnings(TAIL_EXPECTED)
@pytest.mark.parametrize("tail", [0, 1 << 30])
@pytest.mark.parametrize("mode", MODES)
def test_tensors_of_one_storage_with_their_own_version_counters_never_share_a_copy(mode: str, tail: int) -> None:
    """Equal versions of two counters say nothing about the bytes: the second chunk, saved at the version the first
    was saved at but changed after the first's copy was taken, must not be served from that copy (a wrong gradient);
    and changed in place after forward, it must raise as in plain autograd, though the first chunk's counter never
    moved (one copy checked only the first's)."""
    x = torch.randn(4, 8, requires_grad=True)
    loss, second = _unsafe_chunks_loss(x)
    loss.backward()
    expected, x.grad = x.grad, None
    loss, second = _unsafe_chunks_loss(x)
    with torch.no_grad():
        second.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # what plain autograd does

    engine = make_engine(mode=mode, resident_tail_bytes=tail)
    with engine:
        loss, second = _unsafe_chunks_loss(x)
    loss.backward()
    assert torch.equal(x.grad, expected)
    x.grad = None
    with engine:
        loss, second = _unsafe_chunks_loss(x)
    with torch.no_grad():
        second.mul_(2)
    assert_inplace_error_or_exact_grad(loss, x, expected)


class _GruLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x * 1.0)
        return out.square().sum()


@pytest.mark.parametrize("mode", MODES)
def test_a_gru_gives_the_gradients_it_gives_without_offloading(mode: str) -> None:
    """PyTorch's GRU on the CPU saves chunks of one gate storage that ``unsafe_chunk`` gave counters of their own."""
    torch.manual_seed(0)
    model = _GruLoss()
    x = torch.randn(2, 5, 8)
    expected = train_step(model, x)
    assert_same_grads(train_step(model, x, make_engine(mode=mode)), expected)


# ----------------------------------------------------------------------------------- only tensors of the compute device


def test_tensors_off_the_compute_device_are_never_offloaded() -> None:
    """With compute_device="cpu", tensors saved on another device (meta here) are handed back to autograd
    untouched, while CPU tensors saved in the same window are offloaded."""
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    xm = torch.randn(4, 8, device="meta")
    xc = torch.randn(4, 8, requires_grad=True)
    engine = make_engine()
    anchor = torch.zeros((), requires_grad=True)
    log: list[torch.Tensor] = []
    with engine:
        hm = torch.tanh(xm @ w)
        meta_loss = hm.sum()
        meta_saved = engine.stats.saved_tensors
        assert meta_saved >= 2
        assert engine.stats.eligible_bytes == 0
        assert engine.stats.offloaded_bytes == 0
        out = Probe.apply(anchor, log, hm.detach())
        cpu_loss = torch.tanh(xc * 1.0).sum()
    assert engine.stats.offloaded_bytes == 4 * 8 * 4  # the tanh output on the CPU only
    meta_loss.backward()
    out.backward()
    cpu_loss.backward()
    assert log[0] is not None and log[0].device.type == "meta"
    assert w.grad is not None and w.grad.device.type == "meta"


NO_CUDA = (
    "no CUDA device (CUDA is not available); offloading nothing. Pass compute_device='cpu' to run the engine on CPU "
    "tensors."
)


TAIL_SAID = re.compile(
    r"lightning_offload: nothing offloaded, because all (\S+) MiB eligible fell in the resident tail: a forward saved "
    r"less than resident_tail_bytes \((\S+) MiB\), the bytes backward needs first, which stay on the device\. "
    r"Lower resident_tail_bytes \(to '16MiB', say, or 0\) to offload a forward this small\."
)


def tail_steps(engine: OffloadEngine, steps: int, n: int = 4) -> list[str]:
    """``steps`` steps of a tanh chain (``n`` saved 16 KiB tensors each) in ``engine``; the warnings said."""
    x = torch.randn(64, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(steps):
            with engine:
                loss = tanh_chain(x * 1.0, n)[-1].sum()
            loss.backward()
    return [str(w.message) for w in said]


def test_a_forward_within_the_resident_tail_is_said_to_offload_nothing_once_per_engine() -> None:
    """A whole forward saved less than ``resident_tail_bytes`` (256 MiB by default): nothing left the device while
    offloading was asked for, and nothing said so. Said once per engine (a plain loop's context), with the eligible
    bytes and the tail; a new engine says it again. Not said where something left, where the tail is lowered, or in
    ``mode="off"``."""
    engine = offload_activations(compute_device="cpu", memory_budget=None, min_tensor_bytes=0)
    said = tail_steps(engine, 3)
    assert len(said) == 1, said
    match = TAIL_SAID.fullmatch(said[0])
    assert match is not None, said[0]
    assert float(match.group(1)) == pytest.approx(4 * 64 * 64 * 4 / (1 << 20), rel=1e-2)  # tanh outputs (x*1.0 too)
    assert match.group(2) == "256"
    assert engine.stats.offloaded_bytes == 0
    assert len(tail_steps(offload_activations(compute_device="cpu", memory_budget=None, min_tensor_bytes=0), 2)) == 1
    for quiet in (
        offload_activations(compute_device="cpu", memory_budget=None, min_tensor_bytes=0, resident_tail_bytes=0),
        offload_activations(compute_device="cpu", mode="off", min_tensor_bytes=0),
        offload_activations(compute_device="cpu", memory_budget=None, min_tensor_bytes=0, resident_tail_bytes="32KiB"),
    ):
        assert tail_steps(quiet, 2) == [], quiet.options
        assert quiet.options.mode == "off" or quiet.stats.offloaded_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_default_device_on_a_cpu_only_machine() -> None:
    """Without CUDA, ``compute_device=None`` offloads nothing (CPU tensors are never offloaded unless
    ``compute_device="cpu"`` asks for it): ``offload_activations`` says so once, as it is called (a RuntimeWarning
    at the first step before), naming itself like the callback and ``fabric_offload``; it installs no hooks,
    checkpoints nothing and says nothing else (not of a budget either), and gradients are unchanged."""
    assert OffloadOptions.create("test").resolved_device() is None
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = offload_activations(
            model=model, checkpoint="auto", memory_budget="1GiB", min_tensor_bytes=0, resident_tail_bytes=0
        )
        x = torch.randn(16, 16, requires_grad=True)
        for _ in range(2):
            with engine:
                assert top_hooks() is None
                loss = torch.tanh(model(x)).sum()
            loss.backward()
    assert [(w.category, str(w.message)) for w in said] == [(UserWarning, f"offload_activations: {NO_CUDA}")]
    assert said[0].filename == __file__
    assert checkpointed_modules(model) == []
    reference = x.detach().clone().requires_grad_()
    torch.tanh(model(reference)).sum().backward()
    assert torch.equal(x.grad, 2 * reference.grad)  # two steps, each as without the engine
    assert engine.stats.offloaded_bytes == 0 and engine.stats.eligible_bytes == 0
    with pytest.raises(ValueError, match=r"^offload_activations\(checkpoint='Nope'\): 'Nope' matches no"):
        offload_activations(model=model, checkpoint="Nope")  # checked off CUDA too


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_engine_made_directly_without_cuda_says_so_once_naming_itself() -> None:
    engine = OffloadEngine(OffloadOptions(min_tensor_bytes=0, resident_tail_bytes=0))
    x = torch.randn(16, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            with engine:
                loss = torch.tanh(x * 1.0).sum()
            loss.backward()
    assert [(w.category, str(w.message)) for w in said] == [(UserWarning, f"OffloadEngine: {NO_CUDA}")]
    assert engine.stats.offloaded_bytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_compute_device_without_cuda_fails_clearly() -> None:
    """Compute_device="cuda" on a machine without CUDA fails with an error naming compute_device (at creation or
    on entering), not with torch's internal assertion, and leaves no hooks installed."""
    with pytest.raises((ValueError, RuntimeError)) as info:
        engine = offload_activations(compute_device="cuda")
        with engine:
            pass
    assert "compute_device" in str(info.value)
    assert top_hooks() is None


# ------------------------------------------------------------------------------------------------------ parameters stay


class ParamModel(nn.Module):
    """Saves a weight transpose, an autocast weight cast and a buffer next to three activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(16, 32))
        self.w2 = nn.Parameter(torch.randn(8, 16))
        self.register_buffer("scale", torch.randn(16))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0 * 2.0  # saves nothing (scalar multiply)
        h = x @ self.w.t()  # saves x (activation, 4x32 fp32) and w.t() (parameter view)
        a = torch.tanh(h)  # saves a (activation, 4x16 fp32)
        out = a * self.scale  # saves the buffer
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = F.linear(a, self.w2)  # saves bf16 a (activation, 4x16 bf16) and the bf16 cast of w2, transposed
        return out.sum() + z.float().sum()


@pytest.mark.parametrize("mode", MODES)
def test_parameters_views_casts_and_buffers_stay(mode: str) -> None:
    """Parameters, ``weight.t()``, autocast casts of weights and (with ``model=``) buffers are never
    offloaded; the offloaded bytes are exactly the activations', counted by hand. Without ``model=`` the buffer,
    which nothing else identifies, is offloaded, so the count really depends on the rule."""
    x0 = torch.randn(4, 32, requires_grad=True)
    activations = 4 * 32 * 4 + 4 * 16 * 4 + 4 * 16 * 2
    model = ParamModel()
    model(x0).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for with_model, want in ((True, activations), (False, activations + 16 * 4)):
        engine = make_engine(mode=mode, model=model if with_model else None)
        model.zero_grad(set_to_none=True)
        with engine:
            loss = model(x0)
        stats = engine.stats
        assert stats.saved_tensors == 6
        assert stats.offloaded_bytes == want
        assert stats.eligible_bytes == want
        loss.backward()
        assert_same_grads({n: p.grad for n, p in model.named_parameters()}, expected)


def test_parameter_saved_directly_and_through_views() -> None:
    """A parameter saved as itself and through ``.t()``, ``[i]`` and ``expand`` is never offloaded, even
    without ``model=``; a detached alias of it is recognised by storage once ``model=`` is given."""
    layer = nn.Linear(8, 8, bias=False)
    w = layer.weight
    engine = make_engine()
    restored = probe([w, w.t(), w[2], w.unsqueeze(0).expand(3, 8, 8)], engine)
    assert engine.stats.saved_tensors == 4
    assert engine.stats.offloaded_bytes == 0
    assert all(t.data_ptr() == w.data_ptr() + t.storage_offset() * 4 for t in restored)
    engine = make_engine(model=layer)
    probe([w.detach(), w.detach().t()], engine)
    assert engine.stats.saved_tensors == 2
    assert engine.stats.offloaded_bytes == 0


# --------------------------------------------------------------------- several forwards, discarded graphs, retain_graph


@pytest.mark.parametrize("mode", MODES)
def test_several_forwards_before_one_backward(mode: str) -> None:
    """Two forwards (in one window, and in two windows) before a single backward give the reference grads."""
    case = CASES[1]  # transformer with SDPA
    model = build(case)
    batch = case.make_batch()
    other = torch.roll(batch, 1, dims=-1)
    model(batch).add(model(other)).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine = make_engine(mode=mode)

    model.zero_grad(set_to_none=True)
    with engine:
        loss = model(batch) + model(other)
    loss.backward()
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, expected)

    model.zero_grad(set_to_none=True)
    with engine:
        first = model(batch)
    with engine:
        second = model(other)
    assert engine.stats.offloaded_bytes > 0
    (first + second).backward()
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, expected)


def test_discarded_forward_does_not_disturb_next_step() -> None:
    """A forward whose graph never gets a backward, followed by a normal step, gives the reference grads,
    and the step's stats are those of a clean step (nothing from the discarded forward is counted in them)."""
    case = CASES[0]
    model = build(case)
    batch = case.make_batch()
    expected = train_step(model, batch)
    tail = 2048  # keeps the last saved tensors resident, so resident_bytes is non-zero
    clean = make_engine(resident_tail_bytes=tail)
    assert_same_grads(train_step(model, batch, clean), expected)
    engine = make_engine(resident_tail_bytes=tail)
    with engine:
        model(batch)  # graph dropped at once
    assert_same_grads(train_step(model, batch, engine), expected)
    assert clean.stats.resident_bytes > 0
    assert engine.stats.resident_bytes == clean.stats.resident_bytes
    assert engine.stats.offloaded_bytes == clean.stats.offloaded_bytes


@pytest.mark.parametrize("threshold", ["min_tensor_bytes", "no_offload"])
def test_discarded_graph_is_freed(threshold: str) -> None:
    """The graph of a forward that never gets a backward is freed once dropped, including saved
    outputs the engine chose not to offload (below min_tensor_bytes, or under no_offload). A saved output handed
    back to autograd as the very same tensor forms a cycle tensor -> grad_fn -> saved tensor that no gc frees."""
    x = torch.randn(256, requires_grad=True)
    if threshold == "min_tensor_bytes":
        engine = make_engine(min_tensor_bytes=1 << 20)
        with engine:
            y = torch.tanh(x * 1.0)  # tanh saves its own output
    else:
        engine = make_engine()
        with engine, no_offload():
            y = torch.tanh(x * 1.0)
    assert engine.stats.saved_tensors == 1
    ref = StorageWeakRef(y.untyped_storage())
    del y
    gc.collect()
    assert ref.expired(), "the dropped forward's saved output is still alive"


@pytest.mark.filterwarnings(TAIL_EXPECTED)
@pytest.mark.parametrize(("mode", "tail"), [("off", 0), ("sync", 1 << 20), ("streamed", 1 << 20)])
def test_a_saved_tensor_whose_graph_is_dropped_in_forward_is_freed_at_once(mode: str, tail: int) -> None:
    """A saved tensor whose graph is dropped while forward goes on (a metric computed with grad enabled) is freed as
    it is without offloading: not held to the end of forward by ``mode="off"``'s count, nor by the resident tail
    while it waits for its fate (and then copied out for nothing)."""
    engine = make_engine(mode=mode, resident_tail_bytes=tail)
    x = torch.randn(256, requires_grad=True)
    with engine:
        h = torch.exp(x * 1.0)  # exp saves its output: kept by the graph of ``loss``
        dropped = torch.tanh(h * 2.0)  # tanh saves its output; this graph piece is dropped below
        ref = StorageWeakRef(dropped.untyped_storage())
        del dropped
        assert ref.expired(), "a saved tensor whose graph was dropped is still held"
        loss = h.sum()
    loss.backward()
    assert torch.equal(x.grad, torch.exp(x.detach()))
    assert engine.stats.offloaded_bytes == 0


@pytest.mark.parametrize("mode", MODES)
def test_retain_graph_backward_twice(mode: str) -> None:
    """``backward(retain_graph=True)`` twice reads every offloaded tensor twice and gives the same grads
    both times (the second backward's grads equal the first's, accumulated)."""
    case = CASES[3]  # views: many views share one copy
    model = build(case)
    batch = case.make_batch()
    loss = model(batch)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    twice = {n: p.grad.clone() for n, p in model.named_parameters()}

    engine = make_engine(mode=mode)
    model.zero_grad(set_to_none=True)
    with engine:
        loss = model(batch)
    loss.backward(retain_graph=True)
    assert_same_grads({n: p.grad.clone() for n, p in model.named_parameters()}, once)
    loss.backward()
    assert_same_grads({n: p.grad.clone() for n, p in model.named_parameters()}, twice)
    stats = engine.stats
    if mode == "sync":
        assert stats.fetched_on_demand_bytes == 2 * stats.offloaded_bytes > 0
    else:  # the first backward prefetched; the second found nothing queued and fetched every copy again
        assert stats.prefetched_bytes > 0
        assert stats.fetched_on_demand_bytes >= stats.offloaded_bytes > 0


# -------------------------------------------------------------------------------------- exceptions leave nothing behind


def test_exception_uninstalls_hooks_and_releases_host_memory(cpu_pool: HostPool) -> None:
    """An exception inside the block removes the hooks (a later forward outside is not offloaded) and
    returns every host buffer of the failed step, even while its graph is still referenced."""
    held_before = cpu_pool.in_use_bytes
    engine = make_engine()
    x = torch.randn(64, 64, requires_grad=True)
    partial: list[torch.Tensor] = []
    with pytest.raises(ValueError, match="boom"), engine:
        partial.append(torch.tanh(torch.tanh(x * 1.0)))
        assert cpu_pool.in_use_bytes > held_before
        raise ValueError("boom")
    assert top_hooks() is None
    assert not engine.installed
    assert cpu_pool.in_use_bytes == held_before
    saved = engine.stats.saved_tensors
    torch.tanh(x * 2.0).sum().backward()  # outside the block: no pack call
    assert engine.stats.saved_tensors == saved
    assert partial  # the failed step's graph is still referenced here


def test_reset_releases_host_memory(cpu_pool: HostPool) -> None:
    """``reset()`` after a step that will not get its backward gives every host buffer back."""
    held_before = cpu_pool.in_use_bytes
    engine = make_engine()
    x = torch.randn(64, 64, requires_grad=True)
    with engine:
        loss = torch.tanh(torch.tanh(x * 1.0)).sum()
    assert cpu_pool.in_use_bytes > held_before
    engine.reset()
    assert cpu_pool.in_use_bytes == held_before
    assert engine.stats.host_bytes_held == held_before
    with pytest.raises(RuntimeError, match="released"):
        loss.backward()


def test_unpacking_a_dropped_tensor_raises_clearly() -> None:
    """Backward through a graph whose step raised is an explicit RuntimeError, not a read of reused
    memory."""
    engine = make_engine()
    x = torch.randn(32, 32, requires_grad=True)
    partial: list[torch.Tensor] = []
    with pytest.raises(KeyError), engine:
        partial.append(torch.tanh(x * 1.0))
        raise KeyError("fail")
    with pytest.raises(RuntimeError, match="raised an exception"):
        partial[0].sum().backward()


def test_engine_works_after_a_failed_step() -> None:
    """After a step raised, the same engine runs the next step with reference grads and steady pool."""
    case = CASES[0]
    model = build(case)
    batch = case.make_batch()
    expected = train_step(model, batch)
    engine = make_engine()
    train_step(model, batch, engine)
    with pytest.raises(ZeroDivisionError), engine:
        model(batch)
        _ = 1 / 0
    assert_same_grads(train_step(model, batch, engine), expected)
    assert engine.stats.host_allocations == 0
    assert engine.stats.offloaded_bytes > 0


def test_exception_keeps_an_earlier_windows_graph() -> None:
    """A window that raised drops only its own state; a graph saved by an earlier, successful window
    (gradient accumulation across windows) still backpropagates to the reference grads."""
    x = torch.randn(32, 32, requires_grad=True)
    torch.tanh(torch.tanh(x * 1.0)).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    engine = make_engine()
    with engine:
        loss = torch.tanh(torch.tanh(x * 1.0)).sum()
    with pytest.raises(ValueError), engine:
        torch.tanh(x * 3.0)
        raise ValueError("second micro-batch failed")
    loss.backward()
    assert torch.equal(x.grad, expected)


# -------------------------------------------------------------------------------------- storage identity, not addresses


class SaveInput(torch.autograd.Function):
    """Saves its input; backward returns ``grad * input`` so the gradient shows which bytes came back."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return grad * a


def test_freed_address_reused_by_a_new_tensor() -> None:
    """A saved tensor whose memory is freed (only its offloaded copy remains) and a new tensor allocated
    at possibly the same address are two storages: each gets its own copy and its own values back."""
    x = torch.randn(1024, requires_grad=True)
    engine = make_engine()
    ptrs = []
    with engine:
        outs = []
        for scale in (2.0, 3.0, 5.0):
            t = x * scale
            ptrs.append(t.data_ptr())
            outs.append(SaveInput.apply(t))
            del t  # only the host copy holds its bytes now; the allocator may hand the address out again
        loss = sum(o.sum() for o in outs)
    assert engine.stats.offloaded_bytes == 3 * 1024 * 4
    assert engine.stats.offloaded_tensors == 3
    loss.backward()
    got = x.grad.clone()
    x.grad = None
    sum(SaveInput.apply(x * scale).sum() for scale in (2.0, 3.0, 5.0)).backward()
    assert torch.equal(got, x.grad)


def test_storage_identity_reused_after_graph_freed() -> None:
    """Within one window, graphs are dropped until a new storage reuses the identity (StorageWeakRef key)
    of one saved before; the new tensor must still get its own copy with its own values."""
    x = torch.randn(256, requires_grad=True)
    engine = make_engine()
    seen: set[int] = set()
    kept: torch.Tensor | None = None
    with engine:
        for i in range(200):
            scale = float(i + 1)
            t = x * scale
            out = SaveInput.apply(t)
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key in seen:
                kept = out
                break
            seen.add(key)
            del out, t
    assert kept is not None, "the allocator never reused a storage; the scenario was not exercised"
    kept.sum().backward()
    got = x.grad.clone()
    x.grad = None
    SaveInput.apply(x * scale).sum().backward()
    assert torch.equal(got, x.grad)


# --------------------------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_region_only_its_inputs_reach_us(mode: str) -> None:
    """Inside a non-reentrant checkpoint the checkpoint's hooks win; only the region's input reaches the
    engine, so the offloaded bytes equal that input's bytes (and grads stay exact)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    x0 = torch.randn(16, 32, requires_grad=True)

    def run(engine: OffloadEngine | None, use_checkpoint: bool) -> tuple[dict[str, torch.Tensor], int]:
        block.zero_grad(set_to_none=True)
        x0.grad = None
        with maybe(engine):
            h = x0 * 2.0  # not saved by anyone but the checkpoint
            out = checkpoint(block, h, use_reentrant=False) if use_checkpoint else block(h)
            loss = out.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        grads["x0"] = x0.grad.clone()
        return grads, h.nbytes

    expected, _ = run(None, True)
    engine = make_engine(mode=mode)
    grads, region_input_bytes = run(engine, True)
    assert_same_grads(grads, expected)
    assert engine.stats.offloaded_bytes == region_input_bytes
    assert engine.stats.offloaded_tensors == 1
    run(engine, False)
    assert engine.stats.offloaded_bytes > region_input_bytes  # without checkpointing the block's tensors come too


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_model_grads(mode: str) -> None:
    """A model mixing plain layers with a checkpointed block offloads the region input and the plain
    layers' activations, and its grads are exact."""
    model = CheckpointModel()
    batch = torch.randn(8, 32)
    expected = train_step(model, batch)
    engine = make_engine(mode=mode)
    assert_same_grads(train_step(model, batch, engine), expected)
    # pre: x (8x32); tanh output (region input, 8x32); post: relu output (8x32) and post's output for square
    assert engine.stats.offloaded_bytes == 4 * 8 * 32 * 4


@pytest.mark.filterwarnings(TAIL_EXPECTED)
def test_close_takes_off_the_checkpointing_its_call_applied_and_a_later_step_puts_it_back() -> None:
    """``offload_activations(checkpoint=...)`` wraps the model's blocks; ``close()`` leaves the model as it was (a
    block the user checkpointed before stays checkpointed), and entering the engine again checkpoints them again: the
    second step offloads only the blocks' inputs again, with the gradients of the model without the engine."""
    from lightning_offload import apply_checkpointing
    from lightning_offload.checkpointing import checkpointed_modules

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

    torch.manual_seed(0)
    model = Blocks()
    apply_checkpointing(model, ["layers.2"])  # the user's own
    batch = torch.randn(64, 32)
    expected = train_step(model, batch)
    engine = offload_activations(mode="sync", compute_device="cpu", model=model, checkpoint="auto", min_tensor_bytes=1)
    assert checkpointed_modules(model) == ["layers.0", "layers.1", "layers.2"]
    assert_same_grads(train_step(model, batch, engine), expected)
    offloaded = engine.stats.offloaded_bytes
    engine.close()
    assert checkpointed_modules(model) == ["layers.2"]
    assert_same_grads(train_step(model, batch, engine), expected)
    assert checkpointed_modules(model) == ["layers.0", "layers.1", "layers.2"]
    assert engine.stats.offloaded_bytes == offloaded
    engine.close()
    assert checkpointed_modules(model) == ["layers.2"]


class _ThreeBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_close_gives_a_block_the_user_checkpointed_its_own_recompute_back() -> None:
    """``checkpoint=..., recompute="elementwise"`` switches a block the user checkpointed with ``recompute="all"`` to
    elementwise recompute while the engine is in use; ``close()`` leaves the model as it was: that block recomputes
    everything again (and entering the engine again switches it again)."""
    from lightning_offload import apply_checkpointing

    model = _ThreeBlocks()
    apply_checkpointing(model, ["layers.2"])  # the user's own, recompute="all"
    engine = offload_activations(
        mode="sync", compute_device="cpu", model=model, checkpoint="auto", recompute="elementwise"
    )
    assert model.layers[2].forward.recompute == "elementwise"
    engine.close()
    assert model.layers[2].forward.recompute == "all"
    with engine:
        model(torch.randn(4, 32)).backward()
    assert [layer.forward.recompute for layer in model.layers] == ["elementwise"] * 3
    engine.close()
    assert model.layers[2].forward.recompute == "all"


def test_close_keeps_the_checkpointing_the_user_applied_after_an_earlier_close() -> None:
    """Blocks the user checkpoints after ``close()`` are theirs: entering the engine again and closing it once more
    leaves them checkpointed, as the user left them."""
    from lightning_offload import apply_checkpointing
    from lightning_offload.checkpointing import checkpointed_modules

    model = _ThreeBlocks()
    engine = offload_activations(mode="sync", compute_device="cpu", model=model, checkpoint="auto")
    engine.close()
    assert checkpointed_modules(model) == []
    apply_checkpointing(model, ["layers.0"])  # now the user's
    with engine:
        model(torch.randn(4, 32)).backward()
    assert checkpointed_modules(model) == ["layers.0", "layers.1", "layers.2"]
    engine.close()
    assert checkpointed_modules(model) == ["layers.0"]
    assert model.layers[0].forward.recompute == "all"


# ---------------------------------------------------------------------------------------- tensors saved during backward


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_saves_stay_resident(mode: str) -> None:
    """Tensors saved while backward runs (``autograd.grad(create_graph=True)``) reach the hooks but are
    not offloaded; the second-order grads equal the reference."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def second_order(engine: OffloadEngine | None) -> torch.Tensor:
        w.grad = None
        with maybe(engine):
            y = torch.tanh(x @ w).pow(3).sum()
            if engine is not None:
                saved, offloaded = engine.stats.saved_tensors, engine.stats.offloaded_bytes
                assert offloaded > 0
            (g,) = torch.autograd.grad(y, w, create_graph=True)
            if engine is not None:
                assert engine.stats.saved_tensors > saved  # backward saved tensors through our hooks
                assert engine.stats.offloaded_bytes == offloaded
            g.square().sum().backward()
        return w.grad.clone()

    expected = second_order(None)
    assert torch.equal(second_order(make_engine(mode=mode)), expected)


def test_reentrant_checkpoint_recompute_not_offloaded() -> None:
    """A reentrant checkpoint recomputes its region during backward; with backward inside the block those
    saves reach the engine and stay on the device. Only the region input (saved in forward) is offloaded."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    x0 = torch.randn(4, 16, requires_grad=True)

    def run(engine: OffloadEngine | None) -> dict[str, torch.Tensor]:
        block.zero_grad(set_to_none=True)
        with maybe(engine):
            h = x0 * 2.0
            loss = checkpoint(block, h, use_reentrant=True).sum()
            if engine is not None:
                assert engine.stats.offloaded_bytes == h.nbytes
                saved = engine.stats.saved_tensors
            loss.backward()
            if engine is not None:
                assert engine.stats.saved_tensors > saved  # the recompute's saves came through our hooks
                assert engine.stats.offloaded_bytes == h.nbytes
        return {n: p.grad.clone() for n, p in block.named_parameters()}

    expected = run(None)
    assert_same_grads(run(make_engine()), expected)


# -------------------------------------------------------------------------------------------------------- torch.compile


def _compiled_grads(
    compiled: nn.Module, model: nn.Module, x: torch.Tensor, engine: OffloadEngine | None
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with maybe(engine):
        loss = compiled(x).square().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_compiled(backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    x = torch.randn(8, 32)
    eager = _compiled_grads(model, model, x, None)
    compiled = torch.compile(model, backend=backend)
    without = _compiled_grads(compiled, model, x, None)
    engine = make_engine()
    for _ in range(2):
        with_offload = _compiled_grads(compiled, model, x, engine)
        assert engine.stats.offloaded_bytes > 0  # the hooks ran on the compiled module's saved tensors
        assert_same_grads(with_offload, without)
    for name, grad in eager.items():
        torch.testing.assert_close(with_offload[name], grad, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_compiled_module_aot_eager() -> None:
    """A module compiled with AOTAutograd (aot_eager backend) runs the hooks on its saved tensors at run
    time; grads with offloading equal the compiled grads without it, bit for bit."""
    _check_compiled("aot_eager")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_compiled_module_inductor() -> None:
    """The same with the inductor backend (generated C++ kernels; slow on a cold cache)."""
    _check_compiled("inductor")


@pytest.mark.parametrize(("budget", "said"), [("auto", "'auto'"), ("1GiB", "1.00 GiB")])
@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_a_compiled_model_is_not_planned_and_the_warning_says_what_runs_instead(
    budget: str, said: str, how: str
) -> None:
    """The memory-budget planner watches and checkpoints a model's blocks with hooks and wrappers that a compiled
    module may never run: for a model compiled whole or block by block, the engine warns and runs unplanned. Under the
    default budget it offloads nothing; under a budget given, everything eligible; the gradients are the compiled
    model's without the engine."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)))
    for module in [model] if how == "whole" else list(model):
        module.compile(backend="aot_eager")
    x = torch.randn(64, 32)
    try:
        expected = _compiled_grads(model, model, x, None)
        # (A budget given on the CPU is said to go unused as the call is made; the CPU stands in for CUDA here.)
        unused = pytest.warns(UserWarning, match="memory_budget is not used") if budget != "auto" else nullcontext()
        with unused:
            engine = offload_activations(
                compute_device="cpu", model=model, memory_budget=budget, min_tensor_bytes=0, resident_tail_bytes=0
            )
        # Offloading a model compiled whole (under a budget given: no longer "off") is also said to lower little.
        across = (
            pytest.warns(UserWarning, match=r"is compiled \(torch.compile\) across several blocks")
            if how == "whole" and budget != "auto"
            else nullcontext()
        )
        with across, pytest.warns(UserWarning, match=rf"memory_budget={said}: the model is compiled \(torch.compile: "):
            got = _compiled_grads(model, model, x, engine)
        assert_same_grads(got, expected)
        assert engine.planner is None and engine.options.memory_budget is None
        if budget == "auto":
            assert engine.options.mode == "off" and engine.stats.offloaded_bytes == 0
        else:
            assert engine.options.mode == "streamed" and engine.stats.offloaded_bytes > 0
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            assert_same_grads(_compiled_grads(model, model, x, engine), expected)
        assert not [w for w in later if "the model is compiled" in str(w.message)]  # said once
    finally:
        torch._dynamo.reset()


def test_the_compiled_model_warnings_point_at_the_line_that_entered_the_engine() -> None:
    """Both warnings about a compiled model name the user's ``with`` line, not a line of the engine."""
    torch._dynamo.reset()
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)))
    model.compile(backend="eager")
    try:
        for budget, said in (("auto", "the model is compiled"), (None, "across several blocks")):
            engine = offload_activations(compute_device="cpu", model=model, memory_budget=budget)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with engine:
                    model(torch.randn(2, 8)).sum().backward()
            (warning,) = [w for w in caught if said in str(w.message)]
            assert warning.filename == __file__, said
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("how", ["whole", "child", "blocks"])
def test_offloading_a_model_compiled_across_its_blocks_warns_that_it_can_hardly_lower_the_peak(how: str) -> None:
    """A graph compiled over several blocks hands its saved tensors over only as it returns: offloading them cannot
    lower the peak inside it, and the engine says so (once), naming the compiled module; blocks compiled one by one
    are offloaded block by block, without a warning."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.body:
                x = layer(x)
            return x

    torch._dynamo.reset()
    model = nn.Sequential(Net())
    if how == "whole":
        model.compile(backend="eager")
    elif how == "child":
        model[0] = torch.compile(model[0], backend="eager")
    else:
        for layer in model[0].body:
            layer.compile(backend="eager")
    engine = offload_activations(compute_device="cpu", model=model, memory_budget=None)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in range(2):
                with engine:
                    model(torch.randn(4, 32)).sum().backward()
    finally:
        torch._dynamo.reset()
    across = [str(w.message) for w in said if "across several blocks" in str(w.message)]
    if how == "blocks":
        assert across == []
    else:
        assert len(across) == 1
        assert across[0].startswith("lightning_offload: " + ("'Sequential'" if how == "whole" else "'0'"))
        assert "Compile each block instead" in across[0]


def test_a_model_never_compiled_is_planned_as_before() -> None:
    from lightning_offload.planned_blocks import compiled_modules

    model = nn.Sequential(nn.Linear(2, 2))
    assert compiled_modules(model) == []
    model.compile(backend="eager")
    assert compiled_modules(model) == [""]
    holder = nn.Sequential(torch.compile(nn.Linear(2, 2), backend="eager"))
    assert compiled_modules(holder) == ["0"]
    # As Lightning runs ``Trainer.fit(torch.compile(module))``: the instance's ``forward`` compiled.
    lit = nn.Sequential(nn.Linear(2, 2))
    lit.forward = torch.compile(lit.forward, backend="eager")  # type: ignore[method-assign]
    assert compiled_modules(lit) == [""]


# ------------------------------------------------------------------------------------------------- host memory runs out


def _chain_loss(x: torch.Tensor, n: int = 10) -> torch.Tensor:
    return tanh_chain(x, n)[-1].sum()


def test_host_full_error_names_the_limit(cpu_pool: HostPool) -> None:
    """With ``on_host_full="error"`` a full pool raises HostMemoryFull naming host_memory_limit and the
    numbers; the failed window leaves no hooks and no held buffers."""
    held = cpu_pool.in_use_bytes
    limit = cpu_pool.reserved_bytes + (64 << 10)  # room for exactly one smallest-class buffer
    engine = make_engine(host_memory_limit=limit, on_host_full="error")
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB per saved tensor
    with pytest.raises(HostMemoryFull) as info:
        with engine:
            _chain_loss(x)
    err = info.value
    assert err.limit == limit and err.needed == 64 << 10 and err.held == limit
    assert "host_memory_limit" in str(err)
    assert top_hooks() is None
    assert cpu_pool.in_use_bytes == held


def test_host_full_message_shows_small_numbers() -> None:
    """The HostMemoryFull message renders its numbers readably at any scale (a 1 MiB limit must not read
    as 0.00)."""
    err = HostMemoryFull(needed=128 << 10, held=1 << 20, limit=1 << 20, available=8 << 30)
    match = re.search(r"host_memory_limit=([0-9.]+)", str(err))
    assert match is not None
    assert float(match.group(1)) > 0, str(err)


@pytest.mark.parametrize("mode", MODES)
def test_host_full_warns_once_and_keeps_tensors(cpu_pool: HostPool, mode: str) -> None:
    """With ``on_host_full="warn"`` exactly one RuntimeWarning is emitted however many tensors do not
    fit; those stay resident (``resident_bytes > 0``) and grads are exact."""
    x = torch.randn(64, 64, requires_grad=True)
    _chain_loss(x).backward()
    expected = x.grad.clone()
    x.grad = None
    limit = cpu_pool.reserved_bytes + 3 * (64 << 10)  # three buffers fit, seven tensors do not
    engine = make_engine(mode=mode, host_memory_limit=limit, on_host_full="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with engine:
            loss = _chain_loss(x)
        loss.backward()
    host_full = [w for w in caught if issubclass(w.category, RuntimeWarning) and "host_memory_limit" in str(w.message)]
    assert len(host_full) == 1
    message = str(host_full[0].message)
    assert "stay on the device" in message and "pass on_host_full='warn'" not in message  # the CPU: "device"
    assert engine.stats.offloaded_bytes == 3 * 64 * 64 * 4
    assert engine.stats.resident_bytes == 7 * 64 * 64 * 4
    assert torch.equal(x.grad, expected)


# ----------------------------------------------------------------------------------------------------- engine lifecycle


def test_engine_cannot_be_entered_twice_at_once() -> None:
    """Entering an active engine again raises a clear error; the outer window keeps offloading, and afterwards
    nothing stays installed."""
    engine = make_engine()
    x = torch.randn(16, 16, requires_grad=True)
    with engine:
        hooks = top_hooks()
        with pytest.raises(RuntimeError, match="already active"), engine:
            pass
        assert engine.installed and top_hooks() == hooks
        loss = torch.tanh(x * 1.0).sum()
    assert engine.stats.offloaded_bytes == 16 * 16 * 4
    assert top_hooks() is None
    loss.backward()


def test_engine_cannot_be_entered_twice_in_a_step_whose_plan_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a memory-budget plan that keeps everything no hooks are installed, yet the engine is active: entering it
    again raises as it does otherwise, and begins no second planner step inside the first."""
    from tests.test_budget import BATCH, WIDTH, GiB, MiB, planned_stack, run_steps

    _, model, _, engine = planned_stack(3 * GiB, base=GiB, transient=MiB)
    x = torch.randn(BATCH, WIDTH)
    assert run_steps(engine, model, x, 3)[-1]["hooked"] is False  # the plan keeps everything
    planner = engine.planner
    assert planner is not None
    begun: list[object] = []
    begin_step = planner.begin_step
    monkeypatch.setattr(planner, "begin_step", lambda *args: begun.append(args) or begin_step(*args))
    with engine:
        assert not engine.installed
        with pytest.raises(RuntimeError, match="already active"), engine:
            pass
        loss = model(x)
    assert len(begun) == 1
    loss.backward()


@pytest.mark.parametrize("planned", [False, True], ids=["no_planner", "planner"])
@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_replan_refuses_a_step_count_that_is_not_a_positive_int(planned: bool, steps: Any) -> None:
    """``replan(measuring_steps=...)`` takes a positive int: anything else raises naming the argument, with or without
    a memory-budget planner (without one it would otherwise be accepted and ignored), and changes nothing."""
    if planned:
        from tests.test_budget import GiB, MiB, planned_stack

        engine = planned_stack(3 * GiB, base=GiB, transient=MiB)[3]
        with engine:  # the device (and the planner) are resolved at the first step
            pass
        assert engine.planner is not None
    else:
        engine = make_engine()
    with pytest.raises(ValueError, match=re.escape(f"replan(measuring_steps={steps!r}): expected an int")):
        engine.replan(measuring_steps=steps)


def test_engine_reusable_across_many_steps(cpu_pool: HostPool) -> None:
    """One engine entered step after step keeps exact grads, allocates host buffers only in the first step, and
    holds no host memory between steps."""
    case = CASES[2]
    model = build(case)
    batch = case.make_batch()
    expected = train_step(model, batch)
    held = cpu_pool.in_use_bytes
    engine = make_engine(mode="streamed")
    for step in range(4):
        assert_same_grads(train_step(model, batch, engine), expected)
        assert (engine.stats.host_allocations > 0) == (step == 0)
        assert engine.stats.host_bytes_held == held
        assert engine.stats.host_pinned_bytes >= engine.stats.offloaded_bytes


def test_off_mode_counts_what_sync_would_offload() -> None:
    """``mode="off"`` offloads nothing and "only counts what would be offloaded": its eligible_bytes equal the
    eligible (and offloaded) bytes of the same forward in sync mode, shared storages counted once."""
    qkv = nn.Linear(16, 48)
    x = torch.randn(2, 10, 16)
    counts = {}
    for mode in ("off", "sync"):
        engine = make_engine(mode=mode)
        with engine:
            q, k, v = qkv(x).chunk(3, dim=-1)
            loss = (q * k * v).sum()
        loss.backward()
        counts[mode] = engine.stats.eligible_bytes
        if mode == "sync":
            assert engine.stats.offloaded_bytes == counts["sync"]
    assert counts["off"] == counts["sync"]


def test_view_that_outlives_its_backward_keeps_its_values() -> None:
    """A restored tensor may be aliased by a view that outlives its backward node; later steps reuse the
    host buffers, and the escaped view must keep its values (the engine never frees or reuses what it handed out)."""
    escaped: list[torch.Tensor] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            y = x * 2
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            (y,) = ctx.saved_tensors
            escaped.append(y[1:])  # a view of the restored tensor, kept past backward
            return grad * 2

    engine = offload_activations(compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with engine:
        Keep.apply(x).sum().backward()
    assert engine.stats.offloaded_bytes > 0
    kept = escaped[0].clone()
    for _ in range(3):  # the same pool buffers are handed out again and overwritten
        with engine:
            Keep.apply(torch.randn(64, 64, requires_grad=True)).sum().backward()
    assert torch.equal(escaped[0], kept)


def test_end_step_is_refused_inside_the_block_and_harmless_outside() -> None:
    """Ending a step early is for the space between two blocks (a batch run without the engine follows); inside the
    block the step is still saving tensors."""
    engine = offload_activations(compute_device="cpu", memory_budget=None)
    engine.end_step()  # before any step, and without a planner: nothing to end
    with engine, pytest.raises(RuntimeError, match=r"end_step\(\) inside the engine's block"):
        engine.end_step()
    engine.end_step()


@pytest.mark.parametrize("mode", ["sync", "streamed"])
def test_two_engines_in_one_process_report_their_own_host_figures(mode: str) -> None:
    """Engines of one process (two models in one loop) share the process's host pool; each one's held bytes and new
    buffers are its own (engine A's counted engine B's step, taken while A's graph was alive)."""
    net = nn.Linear(1129, 1129)
    x = torch.randn(37, 1129, requires_grad=True)  # sizes no earlier test pooled: every buffer here is new
    options = {"compute_device": "cpu", "memory_budget": None, "min_tensor_bytes": 0, "resident_tail_bytes": 0}
    a, b = offload_activations(mode=mode, **options), offload_activations(mode=mode, **options)
    with a:
        loss_a = torch.tanh(net(x)).sum()
    with b:
        loss_b = torch.tanh(net(x)).sum()
    stats_a, stats_b = a.collect_stats(wait=True), b.collect_stats(wait=True)
    assert stats_a.offloaded_bytes > 0 and stats_a.offloaded_bytes == stats_b.offloaded_bytes
    assert stats_a.host_allocations == stats_b.host_allocations > 0
    assert stats_a.host_bytes_held == stats_b.host_bytes_held >= stats_a.offloaded_bytes
    (loss_a + loss_b).backward()
    assert a.collect_stats(wait=True).host_bytes_held == 0 and b.collect_stats(wait=True).host_bytes_held == 0


# ------------------------------------------------------------------------------------------ lengths that change


LENGTHS = [48, 32, 48, 16, 32, 48, 16, 32]


def train_lengths(model: nn.Module, engine: OffloadEngine | None, pool: HostPool) -> dict[str, list[Any]]:
    """SGD on :func:`~tests.models.length_tokens` batches of ``LENGTHS`` (4 rows each), named to ``engine`` by their
    shape when given, the random generator seeded once first (dropout's masks): per step, the gradients, the weights
    after the update, the host pool's lent bytes as forward ended and the host buffers the step allocated."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(100)
    out: dict[str, list[Any]] = {"grads": [], "weights": [], "lent": [], "allocations": []}
    for length in LENGTHS:
        tokens = length_tokens(length, batch=4)
        optimizer.zero_grad(set_to_none=True)
        if engine is not None:
            engine.input_changed(tuple(tokens.shape))
        with maybe(engine):
            loss = model(tokens)
            out["lent"].append(pool.lent_bytes)
        loss.backward()
        if engine is not None:
            out["allocations"].append(engine.stats.host_allocations)
        sgd_update_recorded(model, optimizer, out)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("checkpoint", "recompute"), [(None, "all"), ("auto", "all"), ("auto", "elementwise")], ids=["none", "all", "elem"]
)
def test_lengths_that_change_and_come_back_train_as_without_the_engine(
    mode: str, checkpoint: str | None, recompute: str, cpu_pool: HostPool
) -> None:
    """Batches whose sequence length changes and comes back (48, 32, 48, 16, ...) through one engine: everything
    eligible offloaded, or only the blocks' inputs with the blocks checkpointed (recomputed whole, or only their
    elementwise operations). A shorter length's copies go to idle host buffers of a longer one (lent, up to twice its
    size class), and are read back from them. Every step's gradients, and the weights after each SGD update, are
    bit-for-bit those of plain training, dropout's masks included."""
    model = LengthLM(dim=128, dropout=0.1)
    engine = make_engine(mode=mode, model=model, checkpoint=checkpoint, recompute=recompute)
    got = train_lengths(model, engine, cpu_pool)
    want = train_lengths(LengthLM(dim=128, dropout=0.1), None, cpu_pool)
    for step, length in enumerate(LENGTHS):
        assert_same_grads(got["grads"][step], want["grads"][step])
        for name, weight in want["weights"][step].items():
            assert torch.equal(got["weights"][step][name], weight), f"step {step} (length {length}): {name}"
    assert max(got["lent"]) > 0, "no host buffer was lent"
    if checkpoint is not None:  # the blocks' inputs of every shorter length fit the longest one's idle buffers
        assert got["allocations"][0] > 0 and got["allocations"][1:] == [0] * (len(LENGTHS) - 1)
