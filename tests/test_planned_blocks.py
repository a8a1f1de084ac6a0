"""The memory-budget planner's view of a model's repeated blocks: which run checkpointed, and what a watched forward
saved per block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_offload import offload_activations, policy
from lightning_offload.checkpointing import apply_checkpointing, checkpointed_modules
from lightning_offload.planned_blocks import PlannedBlocks
from lightning_offload.weight_casts import WeightCasts
from tests.models import Mix, tiny_llama_config

WIDTH, BATCH = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    """Four blocks of ``block`` (a class), summed."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_checkpoints_the_last_blocks_and_leaves_the_model_as_it_was() -> None:
    model = Stack()
    blocks = PlannedBlocks(model)
    assert len(blocks) == 4
    blocks.checkpoint_last(3)
    assert checkpointed_modules(model) == ["blocks.1", "blocks.2", "blocks.3"]
    blocks.checkpoint_last(1)
    assert checkpointed_modules(model) == ["blocks.3"]
    blocks.remove()
    assert checkpointed_modules(model) == [] and blocks.checkpointed == []
    assert len(PlannedBlocks(None)) == len(PlannedBlocks(nn.Linear(2, 2))) == 0


def test_sizes_of_a_watched_forward_measure_full_and_checkpointed_blocks() -> None:
    """Block 0 runs in full (its input, and tanh's output four times as wide: 5 widths of floats per row); the
    others checkpointed save their input only (1 width). A recompute in backward does not count again."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(3)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    blocks.watch(lambda: engine.collect_stats(wait=False).eligible_bytes)
    with engine:
        loss = model(x * 2)  # not a leaf: its bytes count like any other block's input
    loss.backward()
    blocks.unwatch()
    row = BATCH * WIDTH * 4
    sizes = blocks.sizes()
    assert (sizes.count, sizes.checkpointed, sizes.block_bytes, sizes.input_bytes) == (4, 3, 5 * row, row)
    assert blocks.compute_ms() == 0.0  # no clock: not timed
    blocks.remove()


def test_all_but_one_leaves_the_second_block_in_full() -> None:
    """The first block's input often needs no gradient (a frozen embedding under LoRA), so it saves less than a
    typical block: the one block a frugal measuring step runs in full is the second."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_all_but_one()
    assert checkpointed_modules(model) == ["blocks.0", "blocks.2", "blocks.3"]
    blocks.checkpoint_last(0)
    assert checkpointed_modules(model) == []
    single = nn.Sequential(nn.ModuleList([Block()]))
    lone = PlannedBlocks(single)
    lone.checkpoint_all_but_one()
    assert checkpointed_modules(single) == []  # one block: it runs in full


def test_a_block_saves_what_the_typical_blocks_run_in_full_saved_not_the_first() -> None:
    """Every block in full, the first with a frozen first layer fed a tensor that needs no gradient (as under LoRA):
    the first saves less (tanh's output only, 4 widths), so the average is of the others (5 widths)."""
    model = Stack()
    model.blocks[0].up.requires_grad_(False)
    blocks = PlannedBlocks(model)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    blocks.watch(lambda: engine.collect_stats(wait=False).eligible_bytes)
    with engine:
        loss = model(torch.randn(BATCH, WIDTH))
    loss.backward()
    blocks.unwatch()
    row = BATCH * WIDTH * 4
    assert [end - start for start, end, _ in blocks._marks.values()] == [4 * row, 5 * row, 5 * row, 5 * row]
    sizes = blocks.sizes()
    assert (sizes.count, sizes.checkpointed, sizes.block_bytes, sizes.input_bytes) == (4, 0, 5 * row, row)
    blocks.remove()


def test_after_last_block_fires_once_per_forward_never_in_a_recompute() -> None:
    """The callback marks where forward reaches the head; a checkpointed last block's recompute in backward is not a
    forward, and removing the planner's blocks removes the hook."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(2)
    calls = []
    blocks.after_last_block(lambda: calls.append(torch.is_grad_enabled()))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    model(x).backward()
    assert calls == [True]
    model(x).backward()
    assert len(calls) == 2
    blocks.after_last_block(None)
    model(x).backward()
    assert len(calls) == 2
    blocks.after_last_block(lambda: calls.append(False))
    blocks.remove()
    model(x).backward()
    assert len(calls) == 2 and not model.blocks[-1]._forward_hooks


class PartsBlock(nn.Module):
    """Two parts (as a decoder layer's attention and MLP) with residual additions between them, and a scale of its
    own (not a part: a parameter, not a module)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Mix(WIDTH, 4)
        self.second = Mix(WIDTH, 4)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.first(x)
        return x + self.second(x) * self.scale


def parts_stack() -> Stack:
    """Four ``PartsBlock`` blocks, the same weights at every call."""
    torch.manual_seed(0)
    return Stack(PartsBlock)


def test_blocks_checkpointed_by_their_parts_wrap_each_part_and_come_off_again() -> None:
    model = parts_stack()
    blocks = PlannedBlocks(model)
    assert blocks.splittable
    blocks.checkpoint_last(2, split=True)
    assert checkpointed_modules(model) == ["blocks.2.first", "blocks.2.second", "blocks.3.first", "blocks.3.second"]
    assert blocks.checkpointed == ["blocks.2", "blocks.3"] and blocks.split
    blocks.checkpoint_last(2)  # the same blocks, whole
    assert checkpointed_modules(model) == ["blocks.2", "blocks.3"] and not blocks.split
    blocks.checkpoint_all_but_one(split=True)
    assert checkpointed_modules(model) == [f"blocks.{i}.{p}" for i in (0, 2, 3) for p in ("first", "second")]
    blocks.remove()
    assert checkpointed_modules(model) == [] and blocks.checkpointed == [] and not blocks.split


def test_a_module_the_blocks_share_is_no_part_and_blocks_by_parts_keep_the_plain_gradients() -> None:
    """One module held by every block (shared weights) has no qualified name under each block, and its wrapper would
    checkpoint every block's call of it: it is no part, and blocks by their parts checkpoint their own parts only."""
    shared = Mix(WIDTH, 4)

    class SharingBlock(PartsBlock):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.shared(x)

    torch.manual_seed(0)
    model = Stack(SharingBlock)
    x = torch.randn(BATCH, WIDTH)
    model(x).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    blocks = PlannedBlocks(model)
    assert [name for name, _ in blocks.parts[1]] == ["blocks.1.first", "blocks.1.second"]
    model.zero_grad(set_to_none=True)
    blocks.checkpoint_last(2, split=True)
    assert checkpointed_modules(model) == ["blocks.2.first", "blocks.2.second", "blocks.3.first", "blocks.3.second"]
    model(x).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
    blocks.remove()
    assert checkpointed_modules(model) == []


def test_blocks_without_parts_worth_checkpointing_are_checkpointed_whole() -> None:
    """Plain linear layers save only their input: a block made of them (``Block``) has no parts, and asking for parts
    checkpoints it whole."""
    model = Stack()
    blocks = PlannedBlocks(model)
    assert not blocks.splittable
    blocks.checkpoint_last(2, split=True)
    assert checkpointed_modules(model) == ["blocks.2", "blocks.3"] and not blocks.split
    blocks.remove()


def test_sizes_measure_the_parts_of_the_block_run_in_full_and_what_blocks_by_parts_save() -> None:
    """The second block in full: each part saves its input and tanh's output (1 + 4 widths; ``down`` saves that same
    output), the block's own product saves ``second``'s output (1 width; the scale is a weight). The others by parts
    save each part's input and that output (3 widths); their gradients equal the plain model's."""
    reference = parts_stack()
    x = torch.randn(BATCH, WIDTH)
    reference(x).backward()
    model = parts_stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_all_but_one(split=True)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    blocks.watch(lambda: engine.collect_stats(wait=False).eligible_bytes)
    with engine:
        loss = model(x)
    loss.backward()
    blocks.unwatch()
    row = BATCH * WIDTH * 4
    sizes = blocks.sizes()
    assert (sizes.count, sizes.checkpointed, sizes.split) == (4, 3, True)
    assert (sizes.block_bytes, sizes.part_bytes, sizes.input_bytes, sizes.first_input_bytes) == (
        11 * row,
        5 * row,
        3 * row,
        row,
    )
    assert sizes.cut_bytes == 3 * sizes.input_bytes
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(expected.grad, got.grad), name
    blocks.remove()


def test_a_hugging_face_decoder_layer_checkpointed_by_its_parts_saves_each_parts_input() -> None:
    """A random-init Hugging Face Llama: its decoder layers' parts are the attention, the MLP and both norms; by parts
    a block saves each part's input (four hidden-wide tensors per token, the attention's given by keyword), less than
    the block in full and more than whole-checkpointed, the largest part in full less than the block; gradients
    are the plain model's either way."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    ids = torch.randint(0, 128, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    blocks = PlannedBlocks(model)
    assert [name.rsplit(".", 1)[1] for name, _ in blocks.parts[1]] == [
        "self_attn",
        "mlp",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    per_token = {}
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        blocks.checkpoint_all_but_one(split=split)
        engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
        blocks.watch(lambda engine=engine: engine.collect_stats(wait=False).eligible_bytes)
        with engine:
            # use_cache=False as a training loop passes it: a checkpointed block would drop the cache (and warn).
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        blocks.unwatch()
        per_token[split] = blocks.sizes()
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, expected[name]), name
    blocks.remove()
    width = 64 * 4 * 32  # one hidden-wide fp32 tensor of the 32 tokens
    whole, parts = per_token[False], per_token[True]
    assert (whole.input_bytes, parts.input_bytes, parts.first_input_bytes) == (width, 4 * width, width)
    assert parts.split and not whole.split
    assert parts.input_bytes < parts.part_bytes < parts.block_bytes


def test_a_lora_decoder_layer_by_its_parts_offloads_and_keeps_the_plain_gradients() -> None:
    """LoRA adapters on every linear layer of a random-init Hugging Face Llama (frozen base, the first block's input
    needing no gradient): blocks by their parts, every saved tensor offloaded, give the adapters' plain gradients."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(tiny_llama_config(use_cache=False)),
        peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # adapters that change the output, so every gradient is non-zero
    ids = torch.randint(0, 128, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    blocks = PlannedBlocks(model)
    assert blocks.splittable
    model.zero_grad(set_to_none=True)
    blocks.checkpoint_all_but_one(split=True)
    engine = offload_activations(
        mode="sync", memory_budget=None, compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0
    )
    with engine:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert engine.stats.offloaded_bytes > 0
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    blocks.remove()


def test_a_block_called_with_keywords_only_has_its_input_measured_and_offloaded() -> None:
    """Some models call their layers with ``hidden_states=...``: the input a whole-checkpointed block saves (and the
    engine offloads) is that activation, not the mask passed beside it."""

    class KeywordStack(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(x.shape[-1])
            for block in self.blocks:
                x = block(x=x) * mask
            return x.sum()

    model = KeywordStack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(3)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    blocks.watch(lambda: engine.collect_stats(wait=False).eligible_bytes)
    with engine:
        loss = model(torch.randn(BATCH, WIDTH, requires_grad=True) * 2)
    loss.backward()
    blocks.unwatch()
    row = BATCH * WIDTH * 4
    sizes = blocks.sizes()
    assert (sizes.checkpointed, sizes.input_bytes, sizes.first_input_bytes) == (3, row, row)
    blocks.remove()


def test_light_blocks_run_before_the_checkpointed_ones_with_elementwise_recompute() -> None:
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(1, light=2)
    assert checkpointed_modules(model) == ["blocks.1", "blocks.2", "blocks.3"]
    recompute = {name: model.get_submodule(name).__dict__["forward"].recompute for name in checkpointed_modules(model)}
    assert recompute == {"blocks.1": "elementwise", "blocks.2": "elementwise", "blocks.3": "all"}
    assert blocks.light == ["blocks.1", "blocks.2"] and blocks.checkpointed == ["blocks.3"]
    blocks.checkpoint_last(2)
    recompute = {name: model.get_submodule(name).__dict__["forward"].recompute for name in checkpointed_modules(model)}
    assert recompute == {"blocks.2": "all", "blocks.3": "all"} and blocks.light == []
    blocks.checkpoint_last(0, light=9)  # more than there are: all of them
    assert blocks.light == [f"blocks.{i}" for i in range(4)]
    blocks.remove()
    assert checkpointed_modules(model) == []


def test_sizes_count_what_the_second_block_would_keep_under_elementwise_recompute() -> None:
    """The block run in full is counted as it runs: of its two products, ``down`` (1 width, 128 deep) is what it would
    keep; ``up`` is only 32 deep, cheap to redo. Blocks checkpointed, or a recompute in backward, add nothing; a
    forward where the second block is checkpointed measures nothing."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_all_but_one()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    blocks.watch(lambda: 0)
    model(x).backward()
    blocks.unwatch()
    assert blocks.sizes().kept_bytes == BATCH * WIDTH * 4
    blocks.checkpoint_last(4)
    blocks.watch(lambda: 0)
    model(x).backward()
    blocks.unwatch()
    assert blocks.sizes().kept_bytes == 0
    blocks.remove()


class ScalingBlock(Block):
    """Writes into its down projection's output in place (128 deep: a product elementwise recompute would keep)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.tanh(self.up(x)))
        out.mul_(0.5)
        return x + out


def test_a_block_that_writes_into_a_product_in_place_measures_no_kept_bytes() -> None:
    """Such a block cannot run with elementwise recompute (backward would raise), so the planner gets no light blocks
    from it: its kept bytes read 0."""
    model = Stack(ScalingBlock)
    blocks = PlannedBlocks(model)
    blocks.checkpoint_all_but_one()
    blocks.watch(lambda: 0)
    model(torch.randn(BATCH, WIDTH, requires_grad=True)).backward()
    blocks.unwatch()
    assert blocks.sizes().kept_bytes == 0
    blocks.remove()


def test_blocks_the_user_checkpoints_are_left_to_the_user() -> None:
    """Blocks already checkpointed (by ``apply_checkpointing``, here one of them with elementwise recompute) are the
    user's: the planner manages no block then, and never switches or removes the user's wrappers."""
    model = Stack()
    apply_checkpointing(model, "blocks.2", recompute="elementwise")
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(3)
    assert len(blocks) == 0 and blocks.checkpointed == []
    assert checkpointed_modules(model) == ["blocks.2"]
    assert model.blocks[2].__dict__["forward"].recompute == "elementwise"
    blocks.remove()
    assert checkpointed_modules(model) == ["blocks.2"]


def test_blocks_whose_parts_the_user_checkpoints_are_left_to_the_user() -> None:
    """The user checkpoints a part of every block (a decoder layer's MLP, with elementwise recompute): the planner,
    checkpointing blocks by their parts or whole and then removed, never switches nor removes the user's wrappers."""
    model = parts_stack()
    apply_checkpointing(model, [f"blocks.{i}.second" for i in range(4)], recompute="elementwise")
    user = checkpointed_modules(model)
    blocks = PlannedBlocks(model)
    for split in (True, False):
        blocks.checkpoint_last(3, split=split)
        assert checkpointed_modules(model) == user
        assert all(block.second.__dict__["forward"].recompute == "elementwise" for block in model.blocks)
    blocks.remove()
    assert checkpointed_modules(model) == user


def test_a_model_that_checkpoints_itself_is_left_to_it_even_when_it_starts_later() -> None:
    """Hugging Face's ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing`` on the model (or its
    layers); switched on after the planner checkpointed blocks, the planner takes its own wrappers off at its next
    measuring step."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_last(2)
    assert checkpointed_modules(model) == ["blocks.2", "blocks.3"]
    model.gradient_checkpointing = True
    blocks.watch(lambda: 0)
    blocks.unwatch()
    assert len(blocks) == 0 and checkpointed_modules(model) == []
    model.gradient_checkpointing = False


@pytest.mark.parametrize("cache", [False, True])
def test_sizes_count_the_weight_casts_a_block_run_in_full_saves(cache: bool) -> None:
    """Under bf16 autocast each product saves a bfloat16 cast of its weight: the block run in full saved both of its
    matrices' casts (2 bytes a weight), each once; the checkpointed blocks saved none (their recompute casts again).
    Whether autocast's cache was on is noted: with it, every block's casts live until autocast exits."""
    model = Stack()
    blocks = PlannedBlocks(model)
    blocks.checkpoint_all_but_one()
    casts, params, saved = WeightCasts(), policy.ParameterStorages(model.parameters()), [0]
    casts.start(counting=True)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        casts.saw(tensor, torch.device("cpu"), params)
        saved[0] += 0 if policy.is_parameter_like(tensor) else tensor.untyped_storage().nbytes()
        return tensor

    blocks.watch(lambda: saved[0], lambda: casts.nbytes)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with (
        torch.autocast("cpu", torch.bfloat16, cache_enabled=cache),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss = model(x)
    loss.backward()
    blocks.unwatch()
    sizes = blocks.sizes()
    assert sizes.cast_bytes == 2 * 2 * (4 * WIDTH * WIDTH) and casts.nbytes == sizes.cast_bytes
    assert sizes.casts_cached is cache
    blocks.remove()


def test_weight_casts_count_nothing_unless_counting_and_never_a_weight_itself() -> None:
    layer = nn.Linear(WIDTH, WIDTH)
    params, casts = policy.ParameterStorages(layer.parameters()), WeightCasts()
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        cast = layer.weight.to(torch.bfloat16)
    casts.saw(layer.weight, torch.device("cpu"), params)
    casts.saw(layer.weight.t(), torch.device("cpu"), params)
    casts.saw(torch.randn(4, 4), torch.device("cpu"), params)  # an activation
    assert casts.nbytes == 0
    casts.saw(cast, torch.device("cpu"), params)
    casts.saw(cast.t(), torch.device("cpu"), params)  # a view of the same cast: counted once
    assert casts.nbytes == WIDTH * WIDTH * 2
    casts.saw(cast, torch.device("meta"), params)  # another device
    casts.start(counting=False)
    assert casts.nbytes == 0 and not casts.counting
