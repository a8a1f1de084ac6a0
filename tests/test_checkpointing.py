"""Checkpointing of repeated blocks, and how it composes with the offload engine (CPU)."""

from __future__ import annotations

import copy
import importlib.util
import pickle
import warnings

import pytest
import torch
from torch import nn

from lightning_offload import offload_activations
from lightning_offload.checkpointing import (
    RunCheckpointing,
    apply_checkpointing,
    candidate_blocks,
    checkpointed_modules,
    find_repeated_blocks,
    parse_blocks,
    remove_checkpointing,
    select_blocks,
)
from tests.models import tiny_llama_config

HIDDEN = 32


class Block(nn.Module):
    """A pre-norm transformer block with a causal self-attention and an MLP; takes keyword arguments like HF's."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(0.1)
        self.calls = 0

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0, cache: list | None = None
    ) -> torch.Tensor:
        self.calls += 1
        if cache is not None:
            cache.append(x.shape[1])
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) * (scale / q.shape[-1] ** 0.5)
        if mask is not None:
            att = att.masked_fill(mask, float("-inf"))
        x = x + self.proj(att.softmax(-1) @ v)
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm2(x)))))


class Toy(nn.Module):
    """Embedding, a stack of blocks, a smaller list of norms (a decoy for auto detection) and a mixed head list."""

    def __init__(self, layers: int = 3, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(HIDDEN) for _ in range(layers)])
        self.heads = nn.ModuleList([nn.Linear(HIDDEN, vocab), nn.Sequential(nn.Linear(HIDDEN, vocab))])

    def body(self, h: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)
        for layer in self.layers:
            h = layer(h, mask=mask, scale=1.0, cache=cache)
        return h

    def forward(self, ids: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        h = self.body(self.embed(ids), cache=cache)
        return self.heads[0](self.norms[0](h))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: Toy, ids: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return _grads(model)


@pytest.fixture
def toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def test_find_repeated_blocks_picks_largest_uniform_list(toy: Toy) -> None:
    name, blocks = find_repeated_blocks(toy)
    assert name == "layers"
    assert blocks == list(toy.layers)


def test_find_repeated_blocks_without_candidate_raises() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    with pytest.raises(ValueError, match=r"no nn\.ModuleList whose children all share one class"):
        find_repeated_blocks(model)


def test_auto_finds_a_run_of_same_class_blocks_inside_a_sequential() -> None:
    """``"auto"`` also finds a run of two or more same-class children of an ``nn.Sequential`` (blocks stacked
    between an embedding and a head, say), named as the ``Sequential`` names them; the largest candidate (by
    parameters) wins against ``ModuleList`` s too, and a run of parameterless modules (activations) is no block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), Block(), Block(), Block(), nn.LayerNorm(HIDDEN), nn.ReLU())
    name, blocks = find_repeated_blocks(model)
    assert (name, blocks) == ("", [model[1], model[2], model[3]])
    assert select_blocks(model, "auto") == ["1", "2", "3"]
    x = torch.randn(2, 5, HIDDEN)
    torch.manual_seed(1)  # the same dropout masks in both runs
    model(x).sum().backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    assert apply_checkpointing(model, "auto") == ["1", "2", "3"]
    torch.manual_seed(1)
    model(x).sum().backward()
    assert _grads(model).keys() == plain.keys()
    assert all(torch.equal(_grads(model)[key], plain[key]) for key in plain)
    # Nested: the run inside a submodule's Sequential beats a smaller uniform ModuleList elsewhere.
    nested = nn.Module()
    nested.stack = nn.Sequential(nn.Embedding(10, HIDDEN), Block(), Block())
    nested.norms = nn.ModuleList([nn.LayerNorm(HIDDEN) for _ in range(3)])
    assert select_blocks(nested, "auto") == ["stack.1", "stack.2"]
    # Activations only: no block to checkpoint.
    with pytest.raises(ValueError, match=r"'auto' found no nn\.ModuleList whose children all share one class"):
        select_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU()), "auto")


def test_auto_wraps_decoder_layers(toy: Toy) -> None:
    names = apply_checkpointing(toy)
    assert names == ["layers.0", "layers.1", "layers.2"]
    assert checkpointed_modules(toy) == names


def test_select_by_class_name_type_and_qualified_name(toy: Toy) -> None:
    assert apply_checkpointing(toy, "Block") == ["layers.0", "layers.1", "layers.2"]
    remove_checkpointing(toy)
    assert apply_checkpointing(toy, Block) == ["layers.0", "layers.1", "layers.2"]
    remove_checkpointing(toy)
    assert apply_checkpointing(toy, "layers.1") == ["layers.1"]
    remove_checkpointing(toy)
    # A container's name means its children; a sequence is the union, in module order.
    assert apply_checkpointing(toy, ["norms", "layers.2"]) == ["layers.2", "norms.0", "norms.1", "norms.2"]
    remove_checkpointing(toy)
    # Nested selections: the outermost wins.
    assert apply_checkpointing(toy, [Block, nn.Linear]) == ["layers.0", "layers.1", "layers.2", "heads.0", "heads.1.0"]


def test_idempotent(toy: Toy) -> None:
    first = apply_checkpointing(toy)
    wrapper = toy.layers[0].forward
    assert apply_checkpointing(toy) == first
    assert toy.layers[0].forward is wrapper
    assert wrapper.original is None  # the second call did not wrap the wrapper


def test_remove_restores_original(toy: Toy) -> None:
    apply_checkpointing(toy)
    assert remove_checkpointing(toy) == ["layers.0", "layers.1", "layers.2"]
    assert "forward" not in toy.layers[0].__dict__
    assert checkpointed_modules(toy) == []
    assert remove_checkpointing(toy) == []


def test_remove_keeps_a_previous_instance_forward(toy: Toy) -> None:
    layer = toy.layers[0]
    calls = []

    def patched(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return Block.forward(layer, *args, **kwargs)

    layer.forward = patched
    apply_checkpointing(toy, "layers.0")
    toy(torch.randint(0, 50, (1, 4))).sum().backward()
    assert calls == [1, 1]  # forward, then the recompute in backward
    remove_checkpointing(toy)
    assert layer.forward is patched


@pytest.mark.parametrize(
    "blocks",
    ["", "NoSuchBlock", 3, None, [], ["auto"], [Block, 1], nn.Linear(2, 2), int],
)
def test_bad_blocks_argument(toy: Toy, blocks: object) -> None:
    with pytest.raises(ValueError, match=r"apply_checkpointing\(blocks=") as info:
        apply_checkpointing(toy, blocks)  # type: ignore[arg-type]
    assert "'auto'" in str(info.value) and "nn.Module subclass" in str(info.value)


def test_unmatched_name_lists_the_candidate_block_classes(toy: Toy) -> None:
    """A name that matches nothing raises naming the call and the name, and lists the classes that look like blocks
    (the model's own first), so the user can pick one."""
    with pytest.raises(ValueError) as info:
        apply_checkpointing(toy, ["Block", "DecoderLayer"])
    message = str(info.value)
    assert message.startswith("apply_checkpointing(blocks=['Block', 'DecoderLayer']): 'DecoderLayer' matches no")
    assert "candidate block classes: ['Block', 'LayerNorm', 'Linear', 'Dropout']" in message, message
    assert checkpointed_modules(toy) == []  # the valid name was not applied either


def test_auto_without_repeated_list_lists_the_candidates() -> None:
    """``"auto"`` on a model without a uniform ``ModuleList`` names the call and lists the candidate classes."""
    model = nn.Sequential(Block(), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    with pytest.raises(ValueError) as info:
        apply_checkpointing(model, "auto")
    message = str(info.value)
    assert message.startswith("apply_checkpointing(blocks='auto'): 'auto' found no nn.ModuleList"), message
    assert "candidate block classes: ['Block', 'LayerNorm', 'Linear', 'ReLU']" in message, message


def test_candidate_blocks_are_list_children_and_repeated_classes(toy: Toy) -> None:
    """Candidates: children of lists and sequentials and classes with several instances, never the containers."""
    assert candidate_blocks(toy) == ["Block", "LayerNorm", "Linear", "Dropout"]
    assert candidate_blocks(nn.Linear(2, 2)) == []


def test_select_blocks_names_the_call_and_changes_nothing(toy: Toy) -> None:
    """``select_blocks`` returns what ``apply_checkpointing`` would wrap without wrapping; errors quote ``call``."""
    assert select_blocks(toy, [Block, "norms"]) == ["layers.0", "layers.1", "layers.2", "norms.0", "norms.1", "norms.2"]
    assert checkpointed_modules(toy) == []
    with pytest.raises(ValueError, match=r"^Caller\(checkpoint='Nope'\): 'Nope' matches no module"):
        select_blocks(toy, "Nope", call="Caller(checkpoint='Nope')")
    with pytest.raises(ValueError, match=r"^Caller\(checkpoint=3\): checkpoint must be"):
        parse_blocks(3, call="Caller(checkpoint=3)")


def test_remove_only_the_named_modules(toy: Toy) -> None:
    """``remove_checkpointing(model, names)`` restores those modules and leaves other wrapped ones wrapped;
    unknown or unwrapped names are skipped."""
    apply_checkpointing(toy)
    assert remove_checkpointing(toy, ["layers.1", "layers.9", "embed"]) == ["layers.1"]
    assert checkpointed_modules(toy) == ["layers.0", "layers.2"]


@pytest.mark.parametrize("names", ["layers.1", "10"])
def test_remove_refuses_a_single_name_string_naming_the_argument(toy: Toy, names: str) -> None:
    """A bare string is not read as its characters (``"layers.1"`` restored nothing, ``"10"`` restored layers 1 and
    0): it raises naming ``names`` and the allowed form, and every module stays wrapped."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(11)])
    for target in (toy, model):
        apply_checkpointing(target, "Block" if target is toy else "Linear")
        wrapped = checkpointed_modules(target)
        with pytest.raises(TypeError, match=rf"^remove_checkpointing\(names='{names}'\): names must be"):
            remove_checkpointing(target, names)
        assert checkpointed_modules(target) == wrapped


@pytest.mark.parametrize("call", ["apply_checkpointing", "remove_checkpointing", "find_repeated_blocks"])
@pytest.mark.parametrize("model", [None, [nn.Linear(2, 2)]])
def test_a_model_that_is_not_a_module_is_refused_naming_the_argument(call: str, model: object) -> None:
    """``model=None`` (or a list of layers) raises TypeError naming ``model``, not an AttributeError from inside."""
    function = {
        "apply_checkpointing": apply_checkpointing,
        "remove_checkpointing": remove_checkpointing,
        "find_repeated_blocks": find_repeated_blocks,
    }[call]
    with pytest.raises(TypeError, match=rf"^{call}\(model={type(model).__name__}\): model must be a torch.nn.Module"):
        function(model)  # type: ignore[arg-type]


def test_run_checkpointing_applies_and_removes_a_selection_of_the_root_module(toy: Toy) -> None:
    """The callback's ``checkpoint=`` selecting the model itself (by its class) wraps it, as ``apply_checkpointing``
    does, instead of raising about ``apply_checkpointing(blocks=[''])``, a call the user never made."""
    run = RunCheckpointing("Toy", "ActivationOffloadCallback(checkpoint='Toy')")
    run.check(toy)
    run.apply(toy)
    assert checkpointed_modules(toy) == [""]
    run.remove(toy)
    assert checkpointed_modules(toy) == []


def test_gradients_bit_identical_with_and_without_checkpointing(toy: Toy) -> None:
    ids = torch.randint(0, 50, (2, 16))
    reference = _step(toy, ids)
    apply_checkpointing(toy)
    calls_before = toy.layers[0].calls
    checkpointed = _step(toy, ids)
    assert toy.layers[0].calls == calls_before + 2  # forward and recompute: checkpointing really ran
    assert reference.keys() == checkpointed.keys()
    for name, grad in reference.items():
        assert torch.equal(grad, checkpointed[name]), name


def test_eval_and_no_grad_untouched(toy: Toy) -> None:
    apply_checkpointing(toy)
    ids = torch.randint(0, 50, (1, 8))
    toy.eval()
    before = toy.layers[0].calls
    out = toy(ids)
    out.sum().backward()
    assert toy.layers[0].calls == before + 1  # no recompute in backward: not checkpointed in eval mode
    assert out.grad_fn is not None
    toy.train()
    with torch.no_grad():
        out = toy(ids)
    assert out.grad_fn is None


def test_cache_kwarg_dropped_under_checkpointing(toy: Toy) -> None:
    apply_checkpointing(toy)
    cache: list = []
    with pytest.warns(UserWarning, match="cache is disabled"):
        toy(torch.randint(0, 50, (1, 4)), cache=cache).sum().backward()
    assert cache == []
    toy.eval()
    toy(torch.randint(0, 50, (1, 4)), cache=cache)
    assert cache == [4, 4, 4]  # eval mode keeps the caller's cache


def test_cache_warning_comes_from_rank_zero_only(toy: Toy, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_offload import checkpointed_forward

    apply_checkpointing(toy)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    checkpointed_forward._warn_cache_once.cache_clear()  # it warns once per process: start from "not yet"
    try:
        for rank, warns in ((1, False), (0, True)):
            monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
            checkpointed_forward._warn_cache_once.cache_clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                toy(torch.randint(0, 50, (1, 4)), cache=[]).sum().backward()
            assert any("cache is disabled" in str(w.message) for w in caught) == warns, f"rank {rank}"
    finally:
        checkpointed_forward._warn_cache_once.cache_clear()


def test_deepcopy_and_pickle_keep_their_own_module(toy: Toy) -> None:
    apply_checkpointing(toy)
    clone = copy.deepcopy(toy)
    assert clone.layers[0].forward.module is clone.layers[0]
    restored = pickle.loads(pickle.dumps(toy))
    assert restored.layers[1].forward.module is restored.layers[1]
    ids = torch.randint(0, 50, (1, 4))
    before = clone.layers[0].calls
    clone(ids).sum().backward()
    assert clone.layers[0].calls == before + 2  # the copy checkpoints its own layer
    restored(ids).sum().backward()


def test_outer_offloading_sees_exactly_the_block_inputs(toy: Toy) -> None:
    """Non-reentrant checkpointing saves each block's inputs outside its own hooks: those reach the engine.

    Everything saved inside a block is held by the checkpoint's hooks (and recomputed), so the engine offloads
    exactly one hidden state per block, and the gradients are the same as without offloading or checkpointing.
    """
    ids = torch.randint(0, 50, (2, 16))
    h0 = toy.embed(ids).detach()  # the body's input: not a leaf that needs grad, so it is eligible too

    def run(engine: object | None) -> dict[str, torch.Tensor]:
        toy.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if engine is None:
            out = toy.body(h0)
        else:
            with engine:  # type: ignore[attr-defined]
                out = toy.body(h0)
        out.square().mean().backward()
        return _grads(toy)

    reference = run(None)
    apply_checkpointing(toy)
    engine = offload_activations(compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0, model=toy)
    offloaded = run(engine)
    for name, grad in reference.items():
        assert torch.equal(grad, offloaded[name]), name
    stats = engine.stats
    block_input_bytes = len(toy.layers) * h0.nbytes
    assert stats.offloaded_bytes == block_input_bytes
    assert stats.eligible_bytes == block_input_bytes

    # Without checkpointing the same engine sees every activation inside the blocks: many times more.
    remove_checkpointing(toy)
    run(engine)
    assert engine.stats.offloaded_bytes > 5 * block_input_bytes


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hf_llama_layers_with_kwargs() -> None:
    """HF decoder layers take position embeddings, masks and cache arguments as keywords."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 24))

    def step() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return _grads(model)

    reference = step()
    assert apply_checkpointing(model) == ["model.layers.0", "model.layers.1"]
    checkpointed = step()
    for name, grad in reference.items():
        assert torch.equal(grad, checkpointed[name]), name
    engine = offload_activations(compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0, model=model)
    model.zero_grad(set_to_none=True)
    with engine:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    for name, grad in reference.items():
        assert torch.equal(grad, model.get_parameter(name).grad), name
    assert engine.stats.offloaded_bytes > 0


def test_an_activation_passed_by_keyword_is_saved_where_the_offload_engine_sees_it() -> None:
    """Hugging Face calls a decoder layer's attention with ``hidden_states=...``: checkpointed, that activation is saved
    as an input (an enclosing engine offloads it) rather than held by reference on the device; a keyword tensor that
    needs no gradient (the mask) stays by reference. Gradients are the plain ones."""
    torch.manual_seed(0)
    plain, wrapped = Block(), Block()
    wrapped.load_state_dict(plain.state_dict())
    plain.drop.p = wrapped.drop.p = 0.0
    x = torch.randn(2, 6, HIDDEN)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    (plain(x=x * 2, mask=mask) ** 2).sum().backward()
    apply_checkpointing(wrapped, Block)
    engine = offload_activations(mode="off", memory_budget=None, compute_device="cpu", min_tensor_bytes=0)
    leaf = x.clone().requires_grad_()
    with engine:
        h = leaf * 2  # an activation, as a previous layer's output (a product by a number saves nothing)
        out = wrapped(x=h, mask=mask)
    (out**2).sum().backward()
    assert engine.stats.eligible_bytes == h.numel() * h.element_size()  # the input alone, not the mask
    for name, param in wrapped.named_parameters():
        assert torch.equal(param.grad, dict(plain.named_parameters())[name].grad), name
    remove_checkpointing(wrapped)


class NormBlock(nn.Module):
    """A block whose forward updates buffers: a BatchNorm's running statistics, and a step count it reassigns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1  # a new tensor, not an in-place update
        return x + self.bn(self.lin(x)).relu()


@pytest.mark.parametrize("recompute", ["all", "elementwise"])
def test_recompute_does_not_update_buffers_a_second_time(recompute: str) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.ModuleList([NormBlock() for _ in range(2)]))
    model = copy.deepcopy(reference)
    apply_checkpointing(model, recompute=recompute)
    x = torch.randn(4, 8)
    for net in (reference, model):
        for _ in range(2):
            h = x
            for block in net[0]:
                h = block(h)
            h.sum().backward()
    assert reference[0][0].bn.num_batches_tracked.item() == 2
    for (name, expected), (_, got) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(expected, got), name
    for (name, expected), (_, got) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(expected.grad, got.grad), name


def test_wrap_blocks_refuses_unknown_names_and_recompute_values_wrapping_nothing(toy: Toy) -> None:
    from lightning_offload.checkpointing import wrap_blocks

    with pytest.raises(ValueError, match=r"wrap_blocks\(names=.*'nope'.*\): .*qualified names of modules of Toy"):
        wrap_blocks(toy, ["layers.0", "nope"])
    with pytest.raises(ValueError, match=r"wrap_blocks\(recompute='some'\): recompute must be one of 'all', 'elem"):
        wrap_blocks(toy, ["layers.0"], "some")
    assert checkpointed_modules(toy) == []


class KeywordPart(nn.Module):
    """An attention part as a decoder layer calls it: ``part(hidden_states=...)``, keywords only, with a LoRA-like
    trainable branch behind dropout beside a frozen projection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.adapter = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.frozen(hidden_states) + self.adapter(self.dropout(hidden_states))


class FrozenEmbeddingParts(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width).requires_grad_(False)
        self.parts = nn.ModuleList(KeywordPart(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)  # needs no gradient: the first part's only input does not either
        for part in self.parts:
            hidden = part(hidden_states=hidden)
        return hidden.square().mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dropout_recomputes_its_forward_masks_on_the_gpu_for_a_block_called_with_keywords_alone() -> None:
    """Checkpointing restores the random state only of devices its tensor inputs are on. A block called with keyword
    arguments alone, none needing a gradient (the first attention part under LoRA, its embedding frozen), passes no
    tensor in: the recompute drew other dropout masks on the GPU and the adapter's gradients were silently wrong."""

    def grads(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = FrozenEmbeddingParts().cuda()
        if checkpointed:
            apply_checkpointing(model, "parts")
        x = torch.randn(8, 64, device="cuda")
        torch.cuda.manual_seed(1)
        model(x).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and "parts.0.adapter.weight" in plain
    for name, grad in plain.items():
        assert torch.equal(grad, checkpointed[name]), name
