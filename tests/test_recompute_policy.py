"""Elementwise recompute: which results a block keeps, what that saves, and that gradients do not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from lightning_offload import offload_activations, recompute_policy
from lightning_offload.checkpointing import apply_checkpointing, remove_checkpointing
from lightning_offload.recompute_policy import CHEAP_INNER_DIM, KeptBytes, keep_products
from tests.models import tiny_llama_config

WIDTH, ROWS = 128, 16
aten = torch.ops.aten


class GatedBlock(nn.Module):
    """A norm, a gated MLP and a rank-8 adapter on its output: three products worth keeping (up, gate, down), one
    that is not (the adapter's second factor), and elementwise work in between."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.gate = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.adapter_a = nn.Linear(2 * WIDTH, 8, bias=False)
        self.adapter_b = nn.Linear(8, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        inner = F.silu(self.gate(h)) * self.up(h)
        return x + self.down(inner) + self.adapter_b(self.adapter_a(inner))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_products_are_kept_unless_their_inner_dimension_is_small_and_everything_else_is_recomputed() -> None:
    wide, narrow = torch.zeros(4, CHEAP_INNER_DIM + 1), torch.zeros(4, CHEAP_INNER_DIM)
    assert keep_products(None, aten.mm.default, wide, wide.T) == CheckpointPolicy.MUST_SAVE
    assert keep_products(None, aten.mm.default, narrow, narrow.T) == CheckpointPolicy.PREFER_RECOMPUTE
    bias = torch.zeros(4)
    assert keep_products(None, aten.addmm.default, bias, wide, wide.T) == CheckpointPolicy.MUST_SAVE
    assert keep_products(None, aten.addmm.default, bias, narrow, narrow.T) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_products(None, aten.add.Tensor, wide, wide) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_products(None, aten.silu.default, wide) == CheckpointPolicy.PREFER_RECOMPUTE


def test_kept_bytes_count_the_outputs_of_the_kept_products_of_a_block() -> None:
    block = GatedBlock()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with KeptBytes() as kept:
        block(x)
    # gate and up (2 widths each) and down (1 width); the adapter's first factor is an 8-wide output of a 256-deep
    # product (kept), its second a 128-wide output of an 8-deep one (recomputed).
    assert kept.nbytes == ROWS * (2 * WIDTH + 2 * WIDTH + WIDTH + 8) * 4


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_elementwise_recompute_gives_the_plain_gradients_and_offloads_only_block_inputs() -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(ROWS, WIDTH)
    expected = _grads(model, x)
    names = apply_checkpointing(model, recompute="elementwise")
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    engine = offload_activations(
        mode="sync", memory_budget=None, compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0
    )
    with engine:
        got = _grads(model, x)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    # What the engine saw of the blocks: their inputs only (the products stay with checkpointing, the rest is rebuilt).
    assert 0 < engine.stats.offloaded_bytes <= 4 * ROWS * WIDTH * 4  # three inputs, and the loss's square
    remove_checkpointing(model)


def test_applying_again_switches_what_is_recomputed_and_bad_values_are_refused() -> None:
    model = Stack()
    apply_checkpointing(model, "blocks.1", recompute="elementwise")
    wrapper = model.blocks[1].__dict__["forward"]
    assert wrapper.recompute == "elementwise"
    apply_checkpointing(model, "blocks.1")
    assert model.blocks[1].__dict__["forward"] is wrapper and wrapper.recompute == "all"
    with pytest.raises(ValueError, match=r"apply_checkpointing\(recompute='some'\): recompute must be one of 'all', "):
        apply_checkpointing(model, "blocks.0", recompute="some")
    assert "forward" not in model.blocks[0].__dict__  # nothing half-applied


def test_a_hugging_face_llama_with_elementwise_recompute_keeps_the_plain_gradients() -> None:
    """Random-init Llama (hidden 128, so every projection is worth keeping) with LoRA adapters on every linear layer:
    each decoder layer keeps its projections and attention, recomputes norms, rotary embeddings and the MLP's
    activation, and the gradients are bit-equal to the plain run's."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = tiny_llama_config(hidden_size=128, intermediate_size=384, use_cache=False)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    ids = torch.randint(0, 128, (1, 64))
    layer = model.get_base_model().model.layers[1]
    kept = KeptBytes()
    # Counted over one layer run in full, as the planner counts it: q (1 width), k and v (1/2 each), attention's
    # output (1), o (1), gate and up (3 each), down (1): 11 widths per token, and the softmax's log-sum-exp.

    def start(*_: object) -> None:
        kept.__enter__()

    def stop(*_: object) -> None:
        kept.__exit__(None, None, None)

    handles = [layer.register_forward_pre_hook(start), layer.register_forward_hook(stop)]
    model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    width = 128 * 4
    assert 11 * 64 * width <= kept.nbytes < 12 * 64 * width and not kept.mutated
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    layers = apply_checkpointing(model, recompute="elementwise")
    assert len(layers) == 3
    model(input_ids=ids, labels=ids).loss.backward()
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


class ScalingBlock(GatedBlock):
    """Scales its up projection in place: a kept output written after it was kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(self.norm(x))
        up.mul_(0.5)
        return x + self.down(F.silu(up))


def test_a_block_that_writes_into_a_kept_output_is_noted_and_elementwise_recompute_refuses_it() -> None:
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with KeptBytes() as kept:
        GatedBlock()(x)
    assert not kept.mutated
    block = ScalingBlock()
    with KeptBytes() as kept:
        block(x)
    assert kept.mutated and kept.nbytes > 0
    kept.reset()
    assert (kept.nbytes, kept.mutated) == (0, False)
    # What the planner avoids by planning no light blocks for it: selective checkpointing's own error in backward.
    apply_checkpointing(block, "ScalingBlock", recompute="elementwise")
    with pytest.raises(RuntimeError, match="mutated"):
        block(x).sum().backward()


def test_kept_bytes_notes_no_mutation_when_a_later_tensor_takes_the_memory_of_a_freed_kept_output() -> None:
    """A kept output that an operation saving nothing consumes (a residual addition) is freed within the block, and
    the allocator may hand its memory to a tensor made later (CUDA's caching allocator does so at once; glibc often
    does too). Writing into that tensor in place changes no kept output, and elementwise recompute (which holds the
    kept outputs) runs such a block: the block must not be noted as mutating one. A buffer wrapped twice stands in for
    the allocator, so the address is reused for certain."""
    memory = bytearray(ROWS * WIDTH * 4)
    a, w = torch.randn(ROWS, WIDTH), torch.randn(WIDTH, WIDTH)
    with KeptBytes() as kept:
        product = torch.mm(a, w, out=torch.frombuffer(memory, dtype=torch.float32).view(ROWS, WIDTH))
        address = product.untyped_storage().data_ptr()
        total = a + product
        del product  # the kept output's storage is freed
        later = torch.frombuffer(memory, dtype=torch.float32).view(ROWS, WIDTH)  # a new storage at the same address
        assert later.untyped_storage().data_ptr() == address
        later.copy_(total).relu_()
    assert kept.nbytes == ROWS * WIDTH * 4
    assert not kept.mutated


def test_dropout_in_a_block_with_elementwise_recompute_is_replayed_exactly() -> None:
    """Dropout is elementwise: recomputed in backward with forward's random state, the mask is the same."""

    class DropBlock(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            inner = F.dropout(F.silu(self.gate(h)), 0.3, self.training) * self.up(h)
            return x + self.down(inner) + self.adapter_b(self.adapter_a(inner))

    torch.manual_seed(0)
    model = Stack()
    model.blocks = nn.ModuleList(DropBlock() for _ in range(3))
    x = torch.randn(ROWS, WIDTH)
    torch.manual_seed(1)
    expected = _grads(model, x)
    apply_checkpointing(model, recompute="elementwise")
    torch.manual_seed(1)
    got = _grads(model, x)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def test_attention_that_drops_out_is_recomputed_so_later_dropout_masks_replay_exactly() -> None:
    """A kept result is not computed again in backward, so an attention kernel that draws its own dropout mask (CUDA's
    flash, efficient and cuDNN kernels under ``dropout_p > 0``) would not advance the random state in the recompute:
    every dropout after it in the block (a LoRA adapter's, GPT-2's residual dropout) would draw another mask than in
    forward, and the gradients would be silently wrong. Such a call is recomputed; without dropout it is kept."""
    q = torch.zeros(1, 2, 8, 16)
    kept, recomputed = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_products(None, aten._scaled_dot_product_flash_attention.default, q, q, q, 0.0) == kept
    assert keep_products(None, aten._scaled_dot_product_flash_attention.default, q, q, q, 0.1) == recomputed
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert keep_products(None, efficient, q, q, q, None, True) == kept
    assert keep_products(None, efficient, q, q, q, None, True, 0.1) == recomputed
    assert keep_products(None, efficient, q, q, q, None, True, dropout_p=0.1) == recomputed
    cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert keep_products(None, cpu, q, q, q, 0.0, True) == kept


@torch.library.custom_op("lightning_offload_tests::dropping_product", mutates_args=())
def _dropping_product(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """``x @ w`` with dropout drawn inside one kernel, as a fused attention kernel draws its mask (CPU has none)."""
    return (x @ w) * torch.bernoulli(torch.full((x.shape[0], w.shape[1]), 1 - dropout_p)) / (1 - dropout_p)


@_dropping_product.register_fake
def _(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def _dropping_product_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, w, out = ctx.saved_tensors
    mask = (out != 0).to(grad.dtype) / (1 - ctx.dropout_p)  # dropped where the output is 0 (x and w are positive)
    return (grad * mask) @ w.T, x.T @ (grad * mask), None


def _dropping_product_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output)
    ctx.dropout_p = inputs[2]


_dropping_product.register_autograd(_dropping_product_backward, setup_context=_dropping_product_setup)


def test_a_kept_kernel_that_draws_dropout_does_not_shift_the_masks_recomputed_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end on the CPU: a kernel kept like attention that draws a dropout mask, a dropout after it in the block;
    elementwise recompute gives the plain gradients."""
    op = torch.ops.lightning_offload_tests.dropping_product.default
    monkeypatch.setitem(recompute_policy._product_ops(), op.overloadpacket, 0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter((torch.rand(WIDTH, WIDTH) + 0.1) / WIDTH)  # tanh of the product not saturated

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + F.dropout(torch.tanh(_dropping_product(x, self.w, 0.2)), 0.5)

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](self.blocks[0](x)).square().mean()

    torch.manual_seed(0)
    model = Pair()
    x = torch.rand(ROWS, WIDTH) + 0.1
    torch.manual_seed(1)
    expected = _grads(model, x)
    apply_checkpointing(model, "Block", recompute="elementwise")
    torch.manual_seed(1)
    got = _grads(model, x)
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        assert torch.equal(got[name], grad), name


class DroppingAttentionBlock(nn.Module):
    """Attention that drops out (a fused CUDA kernel draws the mask), then an adapter behind dropout."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.adapter = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        attended = attended.transpose(1, 2).reshape(batch, seq, width)
        return x + self.adapter(F.dropout(attended, 0.3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_elementwise_recompute_replays_the_dropout_masks_after_attention_that_drops_out_on_the_gpu() -> None:
    """On CUDA the attention kernel draws its own dropout mask; kept (not recomputed), it would leave the random state
    behind in the recompute and the adapter's dropout after it would draw another mask: gradients off by the mask, not
    by rounding. Where two plain runs already differ (attention backward kernels may accumulate atomically), the
    checkpointed run may differ by no more than they do."""

    def grads(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.ModuleList(DroppingAttentionBlock() for _ in range(2))).cuda().to(torch.bfloat16)
        blocks = model[0]
        if checkpointed:
            apply_checkpointing(model, "DroppingAttentionBlock", recompute="elementwise")
        x = torch.randn(2, 256, 64, device="cuda", dtype=torch.bfloat16)
        torch.cuda.manual_seed(1)
        blocks[1](blocks[0](x)).float().square().mean().backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters()}

    plain, again, checkpointed = grads(False), grads(False), grads(True)
    for name, grad in plain.items():
        noise = (grad - again[name]).abs().max()
        assert (checkpointed[name] - grad).abs().max() <= noise, (name, noise)
